"""A patch the user drops during a rebase is "dropped", not "already upstream".

Same synthetic 0.19.0 as test_rebase.py: 0001 conflicts, 0004 becomes empty
on a clean replay (git drops it: already upstream). Whatever the user does
with 0001 to get rid of it (``build.py rebase --skip``, ``git rebase --skip``
by hand, a resolution that leaves nothing), the summary lists it apart.
"""

from __future__ import annotations

from test_rebase import (
    NAMES,
    ROLL,
    ROLL_TREE,
    _roll_git,
    publish,
    rolled,  # noqa: F401 (the fixture)
    v19_files,
)
from test_rebase_semantic import (
    DUPLICATE,
    WORKER,
    upstream_has_requests,
    v19,
)
from test_rebase_semantic import project as worker_project  # noqa: F401
from test_rebase_semantic import series as worker_series

UPSTREAM = "dropped as already upstream: 0004-config-fix.patch"


def summary(out: str) -> dict[str, str]:
    """The final summary's lines about dropped patches, by kind."""
    lines = [ln.strip() for ln in out.splitlines()]
    return {
        "upstream": next((ln for ln in lines if "already upstream:" in ln), ""),
        "user": next((ln for ln in lines if ln.startswith("dropped by you:")), ""),
    }


def test_a_patch_resolved_to_nothing_is_dropped_not_upstream(rolled) -> None:  # noqa: F811
    project = rolled
    publish(project, v19_files(conflict=True))
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    engine = project.root / ROLL_TREE / "vllm/engine.py"
    text = engine.read_text()
    ours_gone = (
        text.split("<<<<<<<")[0]
        + "engine line 2 upstream\n"
        + text.split(">>>>>>>")[1].split("\n", 1)[1]
    )
    engine.write_text(ours_gone)
    _roll_git(project, "add", "vllm/engine.py")
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    found = summary(r.out)
    assert UPSTREAM in found["upstream"] and NAMES[0] not in found["upstream"]
    assert NAMES[0] in found["user"] and "0004" not in found["user"]


def test_rebase_skip_drops_the_patch_it_stopped_at(rolled) -> None:  # noqa: F811
    project = rolled
    publish(project, v19_files(conflict=True))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1 and "rebase --skip" in r.out, r.text
    r = project.run("rebase", "--skip")
    assert r.code == 0, r.text
    assert f"patch {NAMES[0]}" in r.out and "skipped" in r.out
    found = summary(r.out)
    assert NAMES[0] in found["user"] and NAMES[0] not in found["upstream"]
    assert UPSTREAM in found["upstream"]
    assert (project.root / ROLL / "series").read_text().split() == NAMES[1:3]
    r = project.run("rebase", "--skip")  # nothing under way any more
    assert r.code == 2 and "no rebase" in r.err


def test_a_patch_skipped_with_git_by_hand_is_dropped_not_upstream(rolled) -> None:  # noqa: F811
    project = rolled
    publish(project, v19_files(conflict=True))
    assert project.run("rebase", "--onto", "0.19.0").code == 1
    _roll_git(project, "-c", "core.editor=true", "rebase", "--skip")
    r = project.run("rebase", "--continue")
    assert r.code == 0, r.text
    found = summary(r.out)
    assert NAMES[0] in found["user"] and NAMES[0] not in found["upstream"]
    assert UPSTREAM in found["upstream"]


def test_rebase_skip_at_a_flagged_step_drops_it(worker_project) -> None:  # noqa: F811
    project = worker_project
    worker_series(project, DUPLICATE)
    publish(project, v19(upstream_has_requests(WORKER)))
    r = project.run("rebase", "--onto", "0.19.0")
    assert r.code == 1 and "rebase --skip" in r.out, r.text
    r = project.run("rebase", "--skip")
    assert r.code == 0, r.text
    found = summary(r.out)
    assert DUPLICATE in found["user"] and not found["upstream"]
    assert (project.root / ROLL / "series").read_text().split() == []
    merged = (project.root / ROLL_TREE / "vllm/worker.py").read_text()
    assert merged.count("def has_requests") == 1  # upstream's, ours gone
