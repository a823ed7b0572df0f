"""scripts/test.sh's per-release runs, in a stand-in project: its set-up, series
selection and build.py are small scripts that record what ran."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def stand_in_project(
    tmp_path: Path,
    setup_status: int,
    checked_only: dict[str, str] | None = None,
    beside_integration: str = "",
    rolls: str = "",
    beside_unit: str = "",
    once: str | None = None,
) -> Path:
    """A project with the real scripts/test.sh, a scripts/setup.sh that defines the
    real output functions when sourced and, run, records "setup <release> <args>"
    (a roll's after half a second) and exits ``setup_status``; the pinned release 1.0
    (and ``rolls``, space-separated; ``checked_only`` rolls; ``beside_integration``: the
    tests run beside the integration tests; ``beside_unit``: the tests run
    beside the unit tests; ``once``: the tests a roll does not run, else
    ``beside_integration``), and a build.py that records each call's arguments."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    (root / "harness").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", root / "scripts" / "test.sh")
    venv_bin = root / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    # this interpreter with its packages (ruff, pytest), as a virtualenv's would be
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv_bin / "python").chmod(0o755)
    (root / "scripts" / "setup.sh").write_text(
        textwrap.dedent(
            f"""\
            #!/usr/bin/env bash
            if [ "${{BASH_SOURCE[0]}}" != "$0" ]; then . {ROOT / "scripts" / "setup.sh"}; return 0; fi
            release="${{VMP_VLLM:-1.0}}"
            if [ "$release" != 1.0 ] && [ "$*" != --system-only ]; then sleep 0.5; fi
            echo "setup $release $*" | sed 's/ *$//' >> {root / "ran"}
            exit {setup_status}
            """
        )
    )
    (root / "scripts" / "setup.sh").chmod(0o755)
    (root / "harness" / "__init__.py").write_text("")
    (root / "ruff.toml").write_text('exclude = ["*"]\n')  # the lint steps pass
    (root / "harness" / "runtime_env.py").write_text(
        "def preload_libs():\n    return []\n"
    )
    (root / "harness" / "vllm_series.py").write_text(
        textwrap.dedent(
            f"""\
            import sys
            if sys.argv[1:] == ["releases"]:
                print("VMP_PINNED=1.0 VMP_ROLLS='{rolls}' VMP_ONCE='{beside_integration if once is None else once}'")
                print("VMP_BESIDE_INTEGRATION='{beside_integration}'")
                print("VMP_BESIDE_UNIT='{beside_unit}'")
                print("VMP_CHECKED_ONLY='{" ".join((checked_only or {}).values())}'")
            else:
                print("VMP_PATCHES=patches VMP_DEFAULT_VENV={root / "venv"}")
            """
        )
    )
    (root / "build.py").write_text(
        "import sys\n"
        f"open({str(root / 'ran')!r}, 'a').write("
        "'build.py ' + ' '.join(sys.argv[1:]) + '\\n')\n"
    )
    return root


def run_tests(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # test.sh's own selection of a release stays out (scripts/test.sh sets VMP_VLLM
    # for the pytest that runs this)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VMP_VERBOSE", "VMP_LOG", "VMP_VLLM")
    }
    env.update(VMP_LOG_DIR=str(tmp_path / "logs"), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(root / "scripts" / "test.sh")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_release_whose_setup_failed_is_not_checked_and_fails_the_run(tmp_path):
    root = stand_in_project(tmp_path, setup_status=3)
    r = run_tests(root, tmp_path)
    assert r.returncode != 0, r.stdout
    assert (root / "ran").read_text().splitlines() == [
        "setup 1.0 --system-only",
        "setup 1.0",
    ], r.stdout
    assert "[test] FAILED: 1.0" in r.stdout, r.stdout + r.stderr


def test_a_checked_only_roll_has_its_sdist_fetched_before_its_check(tmp_path):
    """On a fresh machine nothing else fetches such a roll's sdist (no set-up runs
    for it), and build.py check refuses to run without it."""
    # the pinned release's set-up fails: the checked-only roll is checked all the same
    root = stand_in_project(tmp_path, setup_status=3, checked_only={"2.0": "rolls/2.0"})
    run_tests(root, tmp_path)
    calls = (root / "ran").read_text().splitlines()
    assert "build.py --patches rolls/2.0 check" in calls, calls
    assert calls.index("build.py --patches rolls/2.0 fetch") < calls.index(
        "build.py --patches rolls/2.0 check"
    ), calls
    # then verified against its neighbour (releases.toml's `against`)
    assert calls.index("build.py --patches rolls/2.0 check") < calls.index(
        "build.py --patches rolls/2.0 range-diff --expected"
    ), calls


def engine_test(root: Path, passes: bool) -> str:
    """An engine-only test of the stand-in project that records that it ran."""
    (root / "tests" / "integration").mkdir(parents=True)  # where they live
    (root / "tests" / "integration" / "test_engine.py").write_text(
        "def test_engine():\n"
        f"    open({str(root / 'ran')!r}, 'a').write('engine test\\n')\n"
        f"    assert {passes}\n"
    )
    return "tests/integration/test_engine.py"


def meets(ran_file: Path) -> str:
    """A stand-in test's ``meet(me, other)``: records ``me`` and waits (15 s at
    most, else it fails "ran alone") until ``other`` ran too."""
    return textwrap.dedent(
        f"""\
        import time
        from pathlib import Path
        def meet(me, other):
            ran = Path({str(ran_file)!r})
            with ran.open("a") as f:
                f.write(me + "\\n")
            deadline = time.monotonic() + 15
            while other not in ran.read_text().splitlines():
                assert time.monotonic() < deadline, "ran alone"
                time.sleep(0.05)
        """
    )


def test_the_tests_beside_the_integration_tests_run_beside_the_pinned_releases(
    tmp_path,
):
    """VMP_BESIDE_INTEGRATION's tests start with the first release's integration
    tests (the pinned one's), not after them: each here waits until the other ran."""
    root = stand_in_project(
        tmp_path, setup_status=0, beside_integration="tests/integration/test_engine.py"
    )
    ran_file = root / "ran"
    (root / "tests" / "integration").mkdir(parents=True)
    (root / "tests" / "integration" / "test_engine.py").write_text(
        meets(ran_file) + "def test_engine():\n    meet('engine', 'integration')\n"
    )
    (root / "tests" / "integration" / "test_other.py").write_text(
        meets(ran_file) + "def test_other():\n    meet('integration', 'engine')\n"
    )
    r = run_tests(root, tmp_path)
    ran = [
        line
        for line in ran_file.read_text().splitlines()
        if not line.startswith(("build.py", "setup"))
    ]
    assert sorted(ran) == ["engine", "integration"], r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_tests_beside_the_integration_tests_run_once_and_count(tmp_path):
    """They run in the background (the pinned release's run ignores them), and the
    run waits for them: one that fails fails the run, with its report shown."""
    for passes in (True, False):
        base = tmp_path / str(passes)
        base.mkdir()
        root = stand_in_project(
            base, setup_status=0, beside_integration="tests/integration/test_engine.py"
        )
        engine_test(root, passes)
        r = run_tests(root, base)
        ran = (root / "ran").read_text().splitlines()
        assert ran.count("engine test") == 1, r.stdout + r.stderr
        assert "test_engine.py" in r.stdout, r.stdout
        if passes:
            assert r.returncode == 0, r.stdout + r.stderr
        else:
            assert r.returncode != 0, r.stdout
            assert "FAILED: the tests beside the integration tests" in r.stdout, (
                r.stdout
            )


def test_a_rolls_setup_runs_beside_the_pinned_ones_and_ends_before_any_test(tmp_path):
    """After the system packages (one apt at a time), the roll's set-up runs in the
    background; no test starts before it ended. Then both releases' tests but the
    integration tests run at once (each waits here until the other's started), then
    the integration tests, the pinned release's first."""
    root = stand_in_project(tmp_path, setup_status=0, rolls="2.0")
    ran_file = root / "ran"
    for folder in ("unit", "upstream", "integration"):  # what a roll's run names
        (root / "tests" / folder).mkdir(parents=True)
    (root / "tests" / "unit" / "test_one.py").write_text(
        textwrap.dedent(
            f"""\
            import os, time
            from pathlib import Path
            def test_one():
                ran, me = Path({str(ran_file)!r}), os.environ["VMP_VLLM"]
                with ran.open("a") as f:
                    f.write(f"unit {{me}}\\n")
                other = {{"1.0": "2.0", "2.0": "1.0"}}[me]
                deadline = time.monotonic() + 15
                while f"unit {{other}}" not in ran.read_text():
                    assert time.monotonic() < deadline, "ran alone"
                    time.sleep(0.05)
            """
        )
    )
    (root / "tests" / "integration" / "test_two.py").write_text(
        "import os\n"
        "def test_two():\n"
        f"    open({str(ran_file)!r}, 'a').write("
        "'integration ' + os.environ['VMP_VLLM'] + '\\n')\n"
    )
    r = run_tests(root, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = ran_file.read_text().splitlines()
    assert ran[0] == "setup 1.0 --system-only", ran
    # the roll's set-up (half a second) started before the pinned one's and ended
    # after it; its own run set it up again (a no-op once done), before any test
    ran = [line for line in ran if not line.startswith("build.py")]
    assert ran[1:4] == ["setup 1.0", "setup 2.0", "setup 2.0"], ran
    assert sorted(ran[4:6]) == ["unit 1.0", "unit 2.0"], ran
    assert ran[6:] == ["integration 1.0", "integration 2.0"], ran
    assert "vLLM 2.0: set-up in the background ended" in r.stdout, r.stdout


def test_the_tests_that_wait_run_once_beside_the_unit_tests_and_count(tmp_path):
    """VMP_BESIDE_UNIT's integration tests run while the unit tests run (each waits
    here until the other started), once: the pinned release's integration run
    ignores them. One that fails fails the run, with its report shown."""
    for passes in (True, False):
        base = tmp_path / str(passes)
        base.mkdir()
        root = stand_in_project(
            base, setup_status=0, beside_unit="tests/integration/test_waits.py"
        )
        ran_file = root / "ran"
        (root / "tests" / "integration").mkdir(parents=True)
        (root / "tests" / "unit").mkdir()
        meets_code = meets(ran_file)
        (root / "tests" / "unit" / "test_one.py").write_text(
            meets_code + "def test_one():\n    meet('unit', 'waits')\n"
        )
        (root / "tests" / "integration" / "test_waits.py").write_text(
            meets_code
            + f"def test_waits():\n    meet('waits', 'unit')\n    assert {passes}\n"
        )
        (root / "tests" / "integration" / "test_other.py").write_text(
            "def test_other():\n"
            f"    open({str(ran_file)!r}, 'a').write('integration\\n')\n"
        )
        r = run_tests(root, base)
        ran = [
            line
            for line in ran_file.read_text().splitlines()
            if not line.startswith(("build.py", "setup"))
        ]
        assert sorted(ran[:2]) == ["unit", "waits"], r.stdout + r.stderr
        assert ran[2:] == ["integration"], ran
        assert "test_waits.py" in r.stdout, r.stdout
        if passes:
            assert r.returncode == 0, r.stdout + r.stderr
        else:
            assert r.returncode != 0, r.stdout
            assert (
                "FAILED: 1.0 (integration tests beside the unit tests)" in r.stdout
            ), r.stdout


def test_a_roll_runs_beside_its_unit_tests_those_of_them_it_runs_at_all(tmp_path):
    """VMP_BESIDE_UNIT's tests run beside each release's unit tests, a roll's those
    not run once (VMP_ONCE); no integration run repeats them."""
    root = stand_in_project(
        tmp_path,
        setup_status=0,
        rolls="2.0",
        beside_unit="tests/integration/test_start.py tests/integration/test_cut.py",
        once="tests/integration/test_cut.py",
    )
    ran_file = root / "ran"
    for folder in ("unit", "upstream", "integration"):  # what a roll's run names
        (root / "tests" / folder).mkdir(parents=True)
    for name in ("start", "cut", "other"):
        (root / "tests" / "integration" / f"test_{name}.py").write_text(
            "import os\n"
            f"def test_{name}():\n"
            f"    open({str(ran_file)!r}, 'a').write("
            f"'{name} ' + os.environ['VMP_VLLM'] + '\\n')\n"
        )
    r = run_tests(root, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = [
        line
        for line in ran_file.read_text().splitlines()
        if not line.startswith(("build.py", "setup"))
    ]
    assert sorted(ran) == [
        "cut 1.0",
        "other 1.0",
        "other 2.0",
        "start 1.0",
        "start 2.0",
    ]
    # beside the unit tests: before every integration run
    assert sorted(ran[:3]) == ["cut 1.0", "start 1.0", "start 2.0"], ran
