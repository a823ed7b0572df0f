"""Quiet long runs: the step/log functions of scripts/setup.sh (which main.sh and
test.sh source) and microbench.common.run_logged (the benchmarks' engine probes
in a child process whose output goes to a log file)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from microbench.common import run_logged

ROOT = Path(__file__).resolve().parents[3]
SETUP = ROOT / "scripts" / "setup.sh"


def bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``script`` in bash after sourcing scripts/setup.sh (its functions only), with
    logs under tmp_path and no verbose setting inherited."""
    full = {k: v for k, v in os.environ.items() if k not in ("VMP_VERBOSE", "VMP_LOG")}
    full.update(VMP_LOG_DIR=str(tmp_path / "logs"), **env)
    return subprocess.run(
        ["bash", "-c", f". {SETUP}\n{script}"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def only_log(tmp_path: Path) -> Path:
    [log] = (tmp_path / "logs").iterdir()
    return log


def test_a_step_is_one_line_and_its_output_goes_to_the_log_named_once(tmp_path):
    r = bash(
        'vmp_log_open demo\nvmp_run "saying hello" echo hello-from-the-step\n'
        'vmp_run "saying bye" echo bye',
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    log = only_log(tmp_path)
    lines = r.stdout.splitlines()
    assert lines[0] == f"[demo] log: {log} (-v shows it here)" and len(lines) == 3
    assert re.fullmatch(r"\[demo\] saying hello \.\.\. \d+s", lines[1]), lines
    assert re.fullmatch(r"\[demo\] saying bye \.\.\. \d+s", lines[2]), lines
    assert r.stderr == ""
    assert "hello-from-the-step" in log.read_text() and "bye" in log.read_text()


def test_a_failed_step_is_named_with_the_log_and_its_tail_and_the_script_stops(
    tmp_path,
):
    r = bash(
        "vmp_log_open demo\n"
        'vmp_run "building the thing" bash -c \'for i in $(seq 1 40); do echo out-$i; done;'
        " echo err-line >&2; exit 7'\n"
        "echo after-the-failure",
        tmp_path,
    )
    assert r.returncode == 7
    log = only_log(tmp_path)
    assert re.search(
        r"\[demo\] building the thing \.\.\. FAILED after \d+s \(exit 7\)", r.stdout
    )
    assert "after-the-failure" not in r.stdout
    assert "[demo] step failed: building the thing" in r.stderr
    assert f"[demo] log: {log}; its last lines:" in r.stderr
    tail = [ln.strip() for ln in r.stderr.splitlines() if ln.startswith("    ")]
    assert len(tail) == 30 and tail[-1] == "err-line" and tail[0] == "out-12"


def test_a_step_function_stops_at_its_first_failing_command(tmp_path):
    r = bash(
        "vmp_log_open demo\n"
        "f() { echo first; false; echo never-run; }\n"
        'vmp_run "two things" f',
        tmp_path,
    )
    assert r.returncode == 1
    text = only_log(tmp_path).read_text()
    assert "first" in text and "never-run" not in text


def test_verbose_shows_the_output_too(tmp_path):
    r = bash(
        'vmp_log_open demo\nvmp_run "saying hello" echo hello-from-the-step',
        tmp_path,
        VMP_VERBOSE="1",
    )
    assert r.returncode == 0
    assert "hello-from-the-step" in r.stdout and re.search(
        r"\[demo\] saying hello: done in \d+s", r.stdout
    )
    assert "hello-from-the-step" in only_log(tmp_path).read_text()


def test_a_script_called_by_another_writes_to_the_callers_log_without_naming_it(
    tmp_path,
):
    inner = '. "$1"; vmp_log_open setup; vmp_run inner echo in-inner'
    r = bash(f"vmp_log_open main\nbash -c '{inner}' inner {SETUP}", tmp_path)
    assert r.returncode == 0, r.stderr
    log = only_log(tmp_path)
    assert log.name.startswith("main-")
    lines = r.stdout.splitlines()
    assert lines[0] == f"[main] log: {log} (-v shows it here)" and len(lines) == 2
    # whole seconds of bash's SECONDS: a step that crosses a second's edge shows 1s
    assert re.fullmatch(r"\[setup\] inner \.\.\. \d+s", lines[1]), lines
    assert "in-inner" in log.read_text()


def test_durations_read_as_seconds_minutes_hours(tmp_path):
    r = bash("for s in 9 161 3720; do vmp_duration $s; echo; done", tmp_path)
    assert r.stdout.split() == ["9s", "2m41s", "1h02m"]


@pytest.mark.parametrize(
    "args", [["--bogus"], ["--device", "tpu"], ["--vllm", "0.99.0"]]
)
def test_setup_refuses_unknown_options_before_doing_anything(args, tmp_path):
    r = subprocess.run(
        ["bash", str(SETUP), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "VMP_LOG_DIR": str(tmp_path / "logs")},
    )
    assert r.returncode == 2 and "setup.sh:" in r.stderr
    assert not (tmp_path / "logs").exists()


CHILD = textwrap.dedent("""\
    import argparse, json, os, sys
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--result")
    a = ap.parse_args()
    print("python-stdout-line", flush=True)
    os.write(2, b"I1123 12:00:00.000000 1 transfer_metadata.cpp:616] removeSegmentDesc\\n")
    if a.what == "fail":
        sys.exit(3)
    json.dump({"gb_per_s": 1.5}, open(a.result, "w"))
""")


@pytest.fixture
def child_module(tmp_path, monkeypatch):
    (tmp_path / "noisy_probe.py").write_text(CHILD)
    monkeypatch.setenv(
        "PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    monkeypatch.delenv("VMP_VERBOSE", raising=False)
    return "noisy_probe"


def test_a_logged_child_keeps_its_fd_output_off_the_terminal(
    child_module, tmp_path, capfd
):
    log = tmp_path / "probe" / "engine-probe.log"
    assert run_logged(child_module, ["ok"], log, timeout=60) == {"gb_per_s": 1.5}
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    text = log.read_text()
    assert "python-stdout-line" in text and "removeSegmentDesc" in text
    assert text.startswith(f"# {sys.executable} -m noisy_probe ok --result ")


def test_a_failed_logged_child_raises_naming_its_log_and_tail(child_module, tmp_path):
    log = tmp_path / "engine-probe.log"
    with pytest.raises(
        RuntimeError, match=r"noisy_probe fail failed \(exit 3; log: "
    ) as e:
        run_logged(child_module, ["fail"], log, timeout=60)
    assert str(log) in str(e.value) and "removeSegmentDesc" in str(e.value)


def test_verbose_shows_a_logged_childs_output_as_well(
    child_module, tmp_path, capfd, monkeypatch
):
    monkeypatch.setenv("VMP_VERBOSE", "1")
    log = tmp_path / "engine-probe.log"
    assert run_logged(child_module, ["ok"], log, timeout=60) == {"gb_per_s": 1.5}
    _, err = capfd.readouterr()
    assert "python-stdout-line" in err and "removeSegmentDesc" in err
    assert "removeSegmentDesc" in log.read_text()
