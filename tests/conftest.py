"""Project-wide pytest configuration: markers and the repo root on sys.path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "integration: starts real vLLM instances with the real Mooncake engine (slow)"
    )
