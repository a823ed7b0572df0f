"""gitrepo: the git mechanics rebase asks for, on tiny local histories."""

from __future__ import annotations

from pathlib import Path

from patchset.gitrepo import GitRepo


def repo_with(tmp_path: Path, *commits: dict[str, str]) -> tuple[GitRepo, list[str]]:
    """A clone-like repository (``r/.git``) whose commits write the given files,
    oldest first; their ids."""
    repo = GitRepo(tmp_path / "r" / ".git", tmp_path / "r")
    repo.work_tree.mkdir()
    repo.init()
    ids = []
    for i, files in enumerate(commits):
        for path, text in files.items():
            (repo.work_tree / path).write_text(text)
        repo.add_all()
        ids.append(repo.commit(f"commit {i}", ("A", "a@example.com")))
    return repo, ids


def test_a_rebase_can_pause_after_each_commit(tmp_path) -> None:
    repo, (base, one, two) = repo_with(
        tmp_path, {"f": "a\n\n\n\nb\n"}, {"f": "a1\n\n\n\nb\n"}, {"f": "a1\n\n\n\nb1\n"}
    )
    repo.set_branch("series", two)
    repo.set_branch("upstream", base)
    repo.reset_hard(base)
    (repo.work_tree / "g").write_text("upstream\n")
    repo.add_all()
    onto = repo.commit("upstream", ("U", "u@example.com"))
    assert repo.rebase_onto(onto, base, "series", pause_after_each=True) is False
    assert repo.rebase_paused() and repo.subject("HEAD") == "commit 1"
    assert repo.rebase_continue() is False
    assert repo.rebase_paused() and repo.subject("HEAD") == "commit 2"
    assert repo.rebase_continue() is True
    assert not repo.rebase_in_progress()
    assert repo.first_parent_commits(onto, "series") != [one, two]  # replayed on onto
    assert len(repo.first_parent_commits(onto, "series")) == 2
