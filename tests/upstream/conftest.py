"""tests/upstream: upstream vLLM's own unit tests, run offline (run_upstream.py)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "upstream: runs upstream vLLM's own unit tests for the areas our patches touch "
        "(tests/upstream/run_upstream.py; a few minutes); deselect with -m 'not upstream'",
    )
