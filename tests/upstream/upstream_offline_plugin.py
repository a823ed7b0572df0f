"""pytest plugin that run_upstream.py loads (``-p upstream_offline_plugin``) into
the upstream vLLM test run. It does four things:

1. Platform detection. vLLM picks its platform from
   ``importlib.metadata.version("vllm")`` ("+cpu" means the CPU platform). The
   source tree ships a ``vllm.egg-info`` whose version has no "+cpu" suffix,
   and pytest puts the tree's root at the front of sys.path (tests/ is a
   package) before it imports the test modules: from then on the metadata
   lookup finds the tree's egg-info, vLLM detects no platform and loads the
   AVX-512 kernel library, which dies with SIGILL on an AVX2-only machine. This
   plugin is imported before pytest touches sys.path (PYTHONSAFEPATH=1 keeps
   the cwd off it too, also in the subprocesses vLLM starts), resolves
   ``current_platform`` once from the installed distribution, and vLLM caches it.

2. Deselection. ``UPSTREAM_DESELECT`` names a JSON file ``{key: reason}``; a
   test whose node id, or node id without its ``[params]``, equals a key is
   deselected (pytest's ``pytest_deselected`` hook, so pytest counts it as
   deselected, never as passed) and recorded with its reason.

3. Results. ``UPSTREAM_REPORT`` names a JSON-lines file that gets one line per
   test outcome, deselection and collection error, flushed as it happens (so a
   crash of the process still leaves what ran). run_upstream.py reads it.

4. Teardown. Upstream's autouse ``cleanup_fixture`` runs
   ``cleanup_dist_env_and_memory()`` after every test unless the test carries
   upstream's ``skip_global_cleanup`` marker; its full ``gc.collect()`` over a
   process holding torch and vLLM costs about 0.45 s a test on a 2-core machine,
   most of the run's time. The selected tests (tests/upstream/run_upstream.py)
   build schedulers, KV cache managers and connectors on the CPU with no
   distributed group or device memory to release, so every collected test gets
   the marker, as upstream's own CPU scheduler tests have it
   (tests/v1/simple_kv_offload/test_scheduler.py). ``UPSTREAM_FULL_CLEANUP=1``
   (run_upstream.py --full-cleanup) leaves upstream's cleanup on, to compare.

It also refuses to run unless HF_HUB_OFFLINE=1, so a test can never fetch
from the hub what a stand-in should provide.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version

import pytest

if os.environ.get("HF_HUB_OFFLINE") != "1":
    raise RuntimeError("upstream_offline_plugin: HF_HUB_OFFLINE=1 is required")

_installed = version("vllm")

from vllm.platforms import current_platform  # noqa: E402

_device = current_platform.device_type
if "+cpu" in _installed and _device != "cpu":
    raise RuntimeError(
        f"vLLM {_installed} is a CPU build but the platform resolved to {_device!r}"
    )

_report_path = os.environ.get("UPSTREAM_REPORT")
_report = open(_report_path, "a", encoding="utf-8") if _report_path else None  # noqa: SIM115
_deselect: dict[str, str] = {}
if os.environ.get("UPSTREAM_DESELECT"):
    with open(os.environ["UPSTREAM_DESELECT"], encoding="utf-8") as f:
        _deselect = json.load(f)

# nodeid -> accumulated record; emitted at teardown
_pending: dict[str, dict] = {}


def _emit(record: dict) -> None:
    if _report is not None:
        _report.write(json.dumps(record) + "\n")
        _report.flush()


def _short(longrepr) -> str:
    if longrepr is None:
        return ""
    if (
        isinstance(longrepr, tuple) and len(longrepr) == 3
    ):  # skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    errorstring = getattr(longrepr, "errorstring", None)  # e.g. fixture not found
    if errorstring:
        return errorstring.strip().splitlines()[0][:300]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.strip().splitlines()[0][:300]
    text = str(longrepr).strip().splitlines()
    return (text[-1] if text else "")[:300]


def pytest_report_header(config):
    return (
        f"upstream_offline_plugin: vllm {_installed}, platform {_device!r}, "
        f"HF_HOME={os.environ.get('HF_HOME')}, {len(_deselect)} deselect entries"
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("UPSTREAM_FULL_CLEANUP") != "1":
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)
    if not _deselect:
        return
    keep, dropped = [], []
    for item in items:
        key = item.nodeid if item.nodeid in _deselect else item.nodeid.split("[", 1)[0]
        if key in _deselect:
            dropped.append(item)
            _emit(
                {
                    "kind": "deselected",
                    "nodeid": item.nodeid,
                    "key": key,
                    "reason": _deselect[key],
                }
            )
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collectreport(report):
    if report.failed:
        _emit(
            {
                "kind": "collect_error",
                "nodeid": report.nodeid,
                "reason": _short(report.longrepr),
            }
        )


def pytest_runtest_logstart(nodeid, location):
    _emit({"kind": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    rec = _pending.setdefault(
        report.nodeid,
        {
            "kind": "test",
            "nodeid": report.nodeid,
            "outcome": None,
            "reason": "",
            "duration": 0.0,
        },
    )
    rec["duration"] += report.duration
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            rec["outcome"] = (
                "xfailed"
                if report.skipped
                else ("failed" if report.failed else "xpassed")
            )
            rec["reason"] = report.wasxfail or _short(report.longrepr)
        else:
            rec["outcome"] = report.outcome  # passed / failed / skipped
            if not report.passed:
                rec["reason"] = _short(report.longrepr)
    elif report.failed:  # setup or teardown error
        if rec["outcome"] != "failed":
            rec["outcome"] = "error"
            rec["reason"] = f"{report.when}: {_short(report.longrepr)}"
    elif report.skipped and report.when == "setup":
        rec["outcome"] = "xfailed" if xfail else "skipped"
        rec["reason"] = report.wasxfail if xfail else _short(report.longrepr)
    if report.when == "teardown":
        _emit(_pending.pop(report.nodeid))


def pytest_sessionfinish(session, exitstatus):
    for rec in _pending.values():  # e.g. interrupted mid-test
        rec["outcome"] = rec["outcome"] or "error"
        rec["reason"] = rec["reason"] or "no teardown report (interrupted?)"
        _emit(rec)
    _pending.clear()
    _emit(
        {
            "kind": "session",
            "exitstatus": int(exitstatus),
            "platform": _device,
            "vllm": _installed,
        }
    )
