"""microbench.sessions: a P/D arm replayed at one of several loads."""

from __future__ import annotations

from types import SimpleNamespace

from microbench.sessions import __main__ as sessions


def test_a_pd_arm_at_a_load_sends_its_mode_under_a_tag_of_that_load(monkeypatch):
    """The replay of an arm at one of several loads is labelled "pd-layerwise at
    2/min"; P's mode is the arm's, and the transfer ids carry the label without
    spaces (P's timelines are read back by that prefix). The label once went to
    the mode table, and every request of the arm failed with a KeyError."""
    monkeypatch.setattr(sessions, "engine_id", lambda url: "p-engine")
    p = SimpleNamespace(url="http://p:8000", bootstrap_url="http://p:8998")
    of = sessions.pd_prefill("pd-layerwise", "pd-layerwise-at-2min", p, None)
    url, p_params, d_params = of(3)
    assert url == "http://p:8000"
    assert p_params["mooncake_mode"] == sessions.PD_MODES["pd-layerwise"]
    assert p_params["transfer_id"] == d_params["transfer_id"]
    assert p_params["transfer_id"].startswith("pd-layerwise-at-2min-3-")
    assert " " not in p_params["transfer_id"]
