"""Git mechanics for a work tree whose git dir lives elsewhere.

Everything here should be project agnostic: no knowledge of vLLM, of patch
headers or of the series. Callers pass in names (tags, paths, messages).

The git dir is kept OUTSIDE the work tree (``git --git-dir=X --work-tree=Y``)
so the tree itself holds no ``.git``: tools that look for one (setuptools-scm,
editors) see a plain source tree.

Every git call is hermetic: the user's global and system git config are not
read (``GIT_CONFIG_GLOBAL=/dev/null``, ``GIT_CONFIG_NOSYSTEM=1``) so settings
such as ``diff.noprefix`` or ``format.signOff`` cannot change what is
committed or exported, and the committer identity and all dates are fixed so
the same inputs always give the same commit ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import git

from .errors import PatchsetError

FIXED_DATE = "2000-01-01T00:00:00+00:00"
COMMITTER = ("patchset", "patchset@localhost")
# Arguments per git invocation when passing many paths.
_PATH_CHUNK = 400


class GitError(PatchsetError):
    """A git command failed; the message shows the command and its stderr."""


@dataclass(frozen=True)
class StatusEntry:
    """One line of ``git status --porcelain``: code is the two-letter XY."""

    code: str
    path: str

    @property
    def untracked(self) -> bool:
        return self.code == "??"


# rebase --continue/--skip/--abort never open an editor
_NO_EDITOR = {"GIT_EDITOR": "true", "GIT_SEQUENCE_EDITOR": "true"}

# A sequence editor (run by sh with the to-do file as $1): a ``break`` after every pick.
_PAUSE_AFTER_EACH_PICK = (
    'f() { awk \'{ print } /^(p|pick) / { print "break" }\' "$1" > "$1.tmp" '
    '&& mv "$1.tmp" "$1"; }; f'
)

MIN_GIT = (2, 32)  # GIT_CONFIG_GLOBAL (hermetic config), init --initial-branch


def git_version() -> tuple[int, ...]:
    """The installed git version; PatchsetError when git is missing or too old."""
    try:
        version = git.Git().version_info
    except git.exc.GitCommandNotFound as exc:
        raise PatchsetError(
            "git is not installed or not on PATH; install git (e.g. "
            "`apt-get install git`) and run again"
        ) from exc
    if version[:2] < MIN_GIT:
        have = ".".join(map(str, version))
        need = ".".join(map(str, MIN_GIT))
        raise PatchsetError(f"git {have} is too old: build.py needs git >= {need}")
    return version


class GitRepo:
    """A work tree driven through a separate git dir."""

    def __init__(self, git_dir: Path, work_tree: Path) -> None:
        self.git_dir = Path(git_dir).absolute()
        self.work_tree = Path(work_tree).absolute()
        self._git = git.Git(str(self.work_tree) if self.work_tree.is_dir() else None)
        self._git.update_environment(
            GIT_CONFIG_GLOBAL=os.devnull,
            GIT_CONFIG_NOSYSTEM="1",
            GIT_TERMINAL_PROMPT="0",
            GIT_COMMITTER_NAME=COMMITTER[0],
            GIT_COMMITTER_EMAIL=COMMITTER[1],
            GIT_COMMITTER_DATE=FIXED_DATE,
            GIT_AUTHOR_DATE=FIXED_DATE,
        )

    # -- low level --------------------------------------------------------

    def _cmd(self, args: list[str]) -> list[str]:
        return [
            "git",
            f"--git-dir={self.git_dir}",
            f"--work-tree={self.work_tree}",
            "-c",
            "core.quotePath=false",
            *args,
        ]

    def run(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Run git and return stdout as text (trailing newline stripped).

        With ``timeout`` (seconds) git is killed when it runs longer, which
        fails like any other git error.
        """
        try:
            return self._git.execute(
                self._cmd(list(args)), env=env, kill_after_timeout=timeout
            )
        except git.exc.GitCommandNotFound as exc:
            raise PatchsetError("git is not installed or not on PATH") from exc
        except git.exc.GitCommandError as exc:
            raise GitError(
                f"git {' '.join(args[:3])} failed in {self.work_tree} "
                f"(git dir {self.git_dir}):\n{_stderr(exc)}"
            ) from exc

    def run_bytes(self, *args: str) -> bytes:
        """Run git and return stdout as exact bytes."""
        try:
            return self._git.execute(
                self._cmd(list(args)),
                stdout_as_string=False,
                strip_newline_in_stdout=False,
            )
        except git.exc.GitCommandError as exc:
            raise GitError(
                f"git {' '.join(args[:3])} failed in {self.work_tree}:\n{_stderr(exc)}"
            ) from exc

    def _ok(self, *args: str) -> bool:
        """Run git; True on exit 0, False on a non-zero exit."""
        try:
            self._git.execute(self._cmd(list(args)))
            return True
        except git.exc.GitCommandError:
            return False

    # -- setup ------------------------------------------------------------

    def exists(self) -> bool:
        return (self.git_dir / "HEAD").is_file()

    def init(self, *, branch: str = "main") -> None:
        """Create the git dir; core.worktree is relative so the pair can move."""
        self.git_dir.parent.mkdir(parents=True, exist_ok=True)
        self.run("init", "-q", f"--initial-branch={branch}")
        rel = os.path.relpath(self.work_tree, self.git_dir)
        self.run("config", "core.worktree", rel)

    def write_exclude(self, patterns: list[str], comment: str = "") -> None:
        """Write ignore patterns to ``info/exclude`` (never inside the tree)."""
        path = self.git_dir / "info" / "exclude"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# {line}".rstrip() for line in comment.splitlines()]
        path.write_text("\n".join([*lines, *patterns]) + "\n", encoding="utf-8")

    # -- reading ----------------------------------------------------------

    def rev_parse(self, rev: str) -> str | None:
        """The commit id of rev, or None when it does not resolve."""
        try:
            out = self._git.execute(
                self._cmd(["rev-parse", "--verify", "-q", f"{rev}^{{commit}}"])
            )
        except git.exc.GitCommandError:
            return None
        return out.strip() or None

    def head(self) -> str | None:
        return self.rev_parse("HEAD")

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        return self._ok("merge-base", "--is-ancestor", ancestor, descendant)

    def first_parent_commits(self, base: str, head: str = "HEAD") -> list[str]:
        """Commits in base..head following first parents, oldest first."""
        out = self.run("rev-list", "--first-parent", "--reverse", f"{base}..{head}")
        return out.split()

    def messages(self, base: str, head: str = "HEAD") -> dict[str, str]:
        """Raw commit messages of base..head, by commit id."""
        out = self.run("log", "--format=%H%x00%B%x00", f"{base}..{head}")
        parts = out.split("\0")
        return {
            parts[i].strip(): parts[i + 1]
            for i in range(0, len(parts) - 1, 2)
            if parts[i].strip()
        }

    def parent_count(self, commit: str) -> int:
        return len(self.run("rev-list", "--parents", "-n", "1", commit).split()) - 1

    def subject(self, commit: str) -> str:
        return self.run("log", "-1", "--format=%s", commit)

    def message(self, commit: str) -> str:
        """The raw commit message of one commit."""
        return self.run("log", "-1", "--format=%B", commit)

    def changed_files(self, commit: str) -> list[str]:
        """Paths a commit changes relative to its first parent."""
        out = self.run(
            "diff-tree",
            "--root",
            "--no-commit-id",
            "-r",
            "--name-only",
            "-z",
            "--no-renames",
            commit,
        )
        return [p for p in out.split("\0") if p]

    def tracked_files(self, rev: str, under: str | None = None) -> list[str]:
        args = ["ls-tree", "-r", "-z", "--name-only", "--full-tree", rev]
        if under:
            args += ["--", under]
        return [p for p in self.run(*args).split("\0") if p]

    def file_at(self, rev: str, path: str) -> bytes | None:
        """Content of path at rev, or None when it does not exist there."""
        if not self._ok("cat-file", "-e", f"{rev}:{path}"):
            return None
        return self.run_bytes("cat-file", "blob", f"{rev}:{path}")

    def status(self) -> list[StatusEntry]:
        """Uncommitted changes, including untracked (but not ignored) files."""
        out = self.run(
            "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"
        )
        entries = []
        for item in out.split("\0"):
            if len(item) > 3:
                entries.append(StatusEntry(item[:2], item[3:]))
        return entries

    def untracked_not_excluded(self) -> list[str]:
        """Untracked files that ``info/exclude`` does not match: after ``add -A``,
        those the tree's own ``.gitignore`` files kept out."""
        exclude = self.git_dir / "info" / "exclude"
        out = self.run("ls-files", "-z", "--others", f"--exclude-from={exclude}")
        return [p for p in out.split("\0") if p]

    def format_patch(self, commit: str, exclude: list[str] = ()) -> bytes:
        """One commit as a mail-style patch, deterministic and ``-p1``.

        The paths in ``exclude`` are left out of the diff; a commit that only
        touches excluded paths gives empty output.
        """
        pathspec = [":(top)"] + [f":(top,exclude,literal){p}" for p in exclude]
        return self.run_bytes(
            "format-patch",
            "--stdout",
            "--keep-subject",
            "--no-stat",
            "--no-signature",
            "--zero-commit",
            "--full-index",
            "--no-renames",
            "--encoding=UTF-8",
            f"{commit}^..{commit}",
            "--",
            *pathspec,
        )

    # -- writing ----------------------------------------------------------

    def reword(
        self, base: str, commits: list[str], messages: dict[str, str]
    ) -> dict[str, str]:
        """Recreate ``commits`` (a first-parent chain on ``base``) with new messages.

        Trees, authors and author dates are kept, so the work tree and the index
        do not change; the current branch is moved to the new last commit.
        Commits not in ``messages`` keep their message (but get a new id when
        an earlier one changed). Returns old id -> new id.
        """
        mapping: dict[str, str] = {}
        parent = base
        msg_file = self.git_dir / "PATCHSET_REWORD_MSG"
        try:
            for commit in commits:
                name, email, date = self.run(
                    "log", "-1", "--format=%an%x00%ae%x00%aI", commit
                ).split("\0")
                message = messages.get(commit)
                if message is None:
                    raw = self.run_bytes("cat-file", "commit", commit)
                    msg_file.write_bytes(raw.split(b"\n\n", 1)[1])
                else:
                    msg_file.write_bytes(message.encode("utf-8", "surrogateescape"))
                env = {
                    "GIT_AUTHOR_NAME": name,
                    "GIT_AUTHOR_EMAIL": email,
                    "GIT_AUTHOR_DATE": date,
                }
                parent = self.run(
                    "commit-tree",
                    f"{commit}^{{tree}}",
                    "-p",
                    parent,
                    "-F",
                    str(msg_file),
                    env=env,
                ).strip()
                mapping[commit] = parent
        finally:
            msg_file.unlink(missing_ok=True)
        if commits:
            self.run("update-ref", "-m", "build.py: reword", "HEAD", parent)
        return mapping

    def add_all(self) -> None:
        self.run("add", "-A")

    def add_paths(self, paths: list[str]) -> None:
        """Stage exactly these paths (added, modified or deleted), even if ignored."""
        for i in range(0, len(paths), _PATH_CHUNK):
            chunk = paths[i : i + _PATH_CHUNK]
            self.run("add", "-A", "-f", "--", *[f":(top,literal){p}" for p in chunk])

    def commit(
        self,
        message: str,
        author: tuple[str, str],
        *,
        allow_empty: bool = False,
    ) -> str:
        """Commit the index with message kept verbatim; returns the commit id."""
        msg_file = self.git_dir / "PATCHSET_COMMIT_MSG"
        msg_file.write_bytes(message.encode("utf-8", "surrogateescape"))
        args = [
            "commit",
            "-q",
            "--no-verify",
            "--cleanup=verbatim",
            "-F",
            str(msg_file),
        ]
        if allow_empty:
            args.append("--allow-empty")
        env = {"GIT_AUTHOR_NAME": author[0], "GIT_AUTHOR_EMAIL": author[1]}
        try:
            self.run(*args, env=env)
        finally:
            msg_file.unlink(missing_ok=True)
        head = self.head()
        assert head is not None
        return head

    def amend_head(self) -> str:
        """Fold the index into HEAD, keeping its message and author; the new id."""
        self.run("commit", "-q", "--amend", "--no-edit", "--no-verify", "--allow-empty")
        head = self.head()
        assert head is not None
        return head

    def drop_head(self) -> None:
        """Move the current branch (or detached HEAD) to HEAD's parent, keeping
        the index and the files as they are."""
        self.run("reset", "-q", "--soft", "HEAD^")

    def discard_head(self) -> None:
        """Move the current branch (or detached HEAD) to HEAD's parent, and the
        index and tracked files with it: HEAD's change and any staged edit go."""
        self.run("reset", "-q", "--hard", "HEAD^")

    def fetch_refs(self, other_git_dir: Path, refspecs: list[str]) -> None:
        """Copy refs (and their objects) from another local repository."""
        self.run("fetch", "-q", "--no-tags", str(other_git_dir), *refspecs)

    def delete_refs(self, refs: list[str]) -> None:
        for ref in refs:
            self._ok("update-ref", "-d", ref)

    def set_branch(self, branch: str, rev: str = "HEAD") -> None:
        """Point ``branch`` at rev and make it the current branch (files untouched)."""
        self.run("update-ref", f"refs/heads/{branch}", rev)
        self.run("symbolic-ref", "HEAD", f"refs/heads/{branch}")

    # -- rebase (3-way; stops at a conflict with the work tree ready to resolve) --

    def rebase_onto(
        self, onto: str, upstream: str, branch: str, *, pause_after_each: bool = False
    ) -> bool:
        """``git rebase --onto``; False when it stopped (a conflict, or a pause).

        Commits that become empty are dropped. With ``pause_after_each`` the
        rebase stops once each commit is replayed (a ``break`` after every
        ``pick`` of git's own to-do list), so the caller can look at it
        (``rebase_paused``) before ``rebase_continue``.
        """
        if not pause_after_each:
            return self._rebase("-q", "--onto", onto, upstream, branch)
        env = {**_NO_EDITOR, "GIT_SEQUENCE_EDITOR": _PAUSE_AFTER_EACH_PICK}
        return self._rebase(
            "-q", "-i", "--empty=drop", "--onto", onto, upstream, branch, env=env
        )

    def rebase_continue(self) -> bool:
        return self._rebase("--continue")

    def rebase_skip(self) -> bool:
        return self._rebase("--skip")

    def rebase_abort(self) -> None:
        if self.rebase_in_progress():
            self.run("rebase", "--abort", env=_NO_EDITOR)

    def _rebase(self, *args: str, env: dict[str, str] = _NO_EDITOR) -> bool:
        try:
            self.run("rebase", *args, env=env)
        except GitError:
            if self.rebase_in_progress() and not self.rebase_paused():
                return False  # stopped inside a commit: a conflict to resolve
            raise  # git refused to go on (e.g. unstaged edits at a pause)
        return not self.rebase_in_progress()

    def rebase_in_progress(self) -> bool:
        return (self.git_dir / "rebase-merge").is_dir() or (
            self.git_dir / "rebase-apply"
        ).is_dir()

    def rebase_stopped_at(self) -> str | None:
        """The commit being replayed when the rebase stopped, if any."""
        return self.rev_parse("REBASE_HEAD")

    def rebase_paused(self) -> bool:
        """Whether the rebase stopped between commits (a pause), not inside one.

        At a pause HEAD is the commit just replayed; git keeps no REBASE_HEAD
        then, while a commit that stopped (a conflict) has one.
        """
        return self.rebase_in_progress() and self.rebase_stopped_at() is None

    def unmerged_files(self) -> list[str]:
        out = self.run("diff", "--name-only", "--diff-filter=U", "-z")
        return sorted({p for p in out.split("\0") if p})

    def index_matches_head(self) -> bool:
        return self.index_matches("HEAD")

    def index_matches(self, rev: str) -> bool:
        """Whether the index holds exactly rev's tree."""
        return self._ok("diff", "--cached", "--quiet", rev)

    def tag(self, name: str, rev: str = "HEAD") -> None:
        self.run("tag", "-f", name, rev)

    def reset_hard(self, rev: str) -> None:
        """Reset index and tracked files to rev and remove untracked files.

        Ignored files (``info/exclude``) are kept: they are build artifacts.
        """
        self.run("reset", "-q", "--hard", rev)
        self.run("clean", "-q", "-f", "-d")


def _stderr(exc: git.exc.GitCommandError) -> str:
    text = (exc.stderr or "").strip()
    if text.startswith("stderr:"):
        text = text[len("stderr:") :].strip().strip("'")
    return text or str(exc)
