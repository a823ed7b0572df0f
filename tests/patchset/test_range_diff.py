"""build.py range-diff: a rolled series against the pinned one, patch by patch.

Two synthetic series, written straight to patches/ and rolls/0.19.0/: one
patch only moved (other line numbers and context), one changed, one dropped,
one new, one whose header changed.
"""

from __future__ import annotations

import json

import pytest
from conftest import UPSTREAM_FILES, numbered, patch_text, replace_line, udiff

ROLL = "rolls/0.19.0"
ENGINE = UPSTREAM_FILES["vllm/engine.py"]
CONFIG = UPSTREAM_FILES["vllm/config.py"]
MOVED_ENGINE = numbered("upstream added", 4) + replace_line(
    ENGINE, "engine line 1\n", "engine line one\n"
)


def engine_patch(base: str) -> str:
    diff = udiff(
        "vllm/engine.py",
        base,
        replace_line(base, "engine line 10\n", "engine line 10 ours\n"),
    )
    return patch_text("Engine ten", diff)


def config_patch(
    ours: str, status: str = "Upstream-Status: Pending", subject: str = "Config twenty"
) -> str:
    new = replace_line(CONFIG, "config line 20\n", f"config line 20 {ours}\n")
    return patch_text(subject, udiff("vllm/config.py", CONFIG, new), status=status)


def write_series(folder, patches: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in patches.items():
        (folder / name).write_text(text)
    (folder / "series").write_text("".join(f"{n}\n" for n in patches))


@pytest.fixture
def two_series(project):
    pinned = project.root / "patches"
    write_series(
        pinned,
        {
            "0001-engine-ten.patch": engine_patch(ENGINE),
            "0002-config-twenty.patch": config_patch("ours"),
            "0003-config-thirty.patch": patch_text(
                "Config thirty",
                udiff(
                    "vllm/config.py",
                    CONFIG,
                    replace_line(CONFIG, "config line 30\n", "config line 30 ours\n"),
                ),
            ),
            "0004-status.patch": config_patch("status", subject="Status"),
        },
    )
    roll = project.root / ROLL
    manifest = (pinned / "upstream.toml").read_text().replace("0.18.1", "0.19.0")
    roll.mkdir(parents=True)
    (roll / "upstream.toml").write_text(manifest)
    write_series(
        roll,
        {
            "0001-engine-ten.patch": engine_patch(MOVED_ENGINE),  # same change
            "0002-config-twenty.patch": config_patch("OURS"),  # changed
            "0004-status.patch": config_patch(
                "status",
                "Upstream-Status: Submitted [vllm-project/vllm#4321]",
                subject="Status",
            ),
            "0005-new.patch": patch_text(
                "Engine five",
                udiff(
                    "vllm/engine.py",
                    ENGINE,
                    replace_line(ENGINE, "engine line 5\n", "engine line 5 ours\n"),
                ),
            ),
        },
    )
    return project


def test_range_diff_shows_each_patch_as_same_changed_dropped_or_new(
    two_series,
) -> None:
    r = two_series.run("range-diff", "--patches", ROLL)
    assert r.code == 0, r.text
    marks = ("=", "!", "<", ">")
    rows = [line for line in r.out.splitlines() if line[:1] in marks]
    lines = [line.strip() for line in r.out.splitlines()]
    same, config, dropped, status, new = rows
    assert same.startswith("= 1: 0001-engine-ten.patch")  # only lines moved
    assert config.startswith("! 2: 0002-config-twenty.patch")
    assert dropped.startswith("< 3: 0003-config-thirty.patch")
    assert dropped.endswith("(only in patches)")
    assert status.startswith("! 4: 0004-status.patch")
    assert new.startswith("> -") and "4: 0005-new.patch" in new
    assert new.endswith(f"(only in {ROLL})")
    # the interdiff: what the roll changed in the patch, as a diff of the diff
    assert "-+config line 20 ours" in lines and "++config line 20 OURS" in lines
    assert "-Upstream-Status: Pending" in lines
    assert "+Upstream-Status: Submitted [vllm-project/vllm#4321]" in lines
    assert not any("engine line 10" in line for line in lines)
    assert "1 same, 2 changed, 1 only in patches, 1 only in rolls/0.19.0" in r.out


def test_range_diff_json_and_the_global_patches_option(two_series) -> None:
    r = two_series.run("--patches", ROLL, "range-diff", "--json")
    assert r.code == 0, r.text
    data = json.loads(r.out)
    got = {
        (e["pinned"] or {}).get("name") or e["roll"]["name"]: e["status"]
        for e in data["patches"]
    }
    assert got == {
        "0001-engine-ten.patch": "same",
        "0002-config-twenty.patch": "changed",
        "0003-config-thirty.patch": "only in pinned",
        "0004-status.patch": "changed",
        "0005-new.patch": "only in roll",
    }
    changed = next(e for e in data["patches"] if e["status"] == "changed")
    assert "++config line 20 OURS" in changed["interdiff"]


def test_range_diff_takes_the_only_roll_by_default(two_series) -> None:
    r = two_series.run("range-diff")
    assert r.code == 0, r.text
    assert f"{ROLL} (vllm 0.19.0) against patches (vllm 0.18.1)" in r.out
    (two_series.root / "rolls" / "0.20.0").mkdir()
    (two_series.root / "rolls" / "0.20.0" / "upstream.toml").write_text("")
    r = two_series.run("range-diff")
    assert r.code == 2 and "--patches rolls/" in r.err


def test_expected_deltas_fail_once_either_series_changes(two_series) -> None:
    """--expected: the roll's deltas against the release releases.toml names as its
    `against` are the reviewed ones (rolls/V/range-diff.expected), or exit 1 showing
    what changed; with no such file, exit 2 saying how to write it."""
    root = two_series.root
    pinned_toml = root / "patches" / "upstream.toml"
    version = pinned_toml.read_text().split('version = "')[1].split('"')[0]
    (root / "releases.toml").write_text(
        f'[release."{version}"]\npinned = true\nstatus = "tested"\n'
        'patches = "patches"\nrequirements = "requirements"\nvenv = ".venv"\n'
        f'[release."0.19.0"]\nstatus = "checked"\npatches = "{ROLL}"\n'
        f'against = "{version}"\n'
    )
    r = two_series.run("--patches", ROLL, "range-diff", "--expected")
    assert r.code == 2 and "range-diff.expected does not exist" in r.err, r.text
    now = two_series.run("--patches", ROLL, "range-diff").out
    (root / ROLL / "range-diff.expected").write_text(now)
    r = two_series.run("--patches", ROLL, "range-diff", "--expected")
    assert r.code == 0 and "the expected deltas" in r.out, r.text
    # --json would report without comparing: refused
    r = two_series.run("--patches", ROLL, "range-diff", "--expected", "--json")
    assert r.code == 2 and "leave out --json" in r.err, r.text
    # the neighbour's patch changes (a fix edited into one series only)
    pinned_patch = root / "patches" / "0001-engine-ten.patch"
    pinned_patch.write_text(
        pinned_patch.read_text().replace("engine line 10 ours", "engine line 10 fixed")
    )
    r = two_series.run("--patches", ROLL, "range-diff", "--expected")
    assert r.code == 1, r.text
    assert "+! 1: 0001-engine-ten.patch" in r.out, r.out
    assert "not the expected ones" in r.out, r.out
