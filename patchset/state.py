"""What ``apply`` recorded, kept as JSON in the tree's git dir.

Commits are matched to patches by commit id, and each patch's sha256 at the
time it was applied tells ``status`` whether the file changed since. The
state lives next to the objects it names (in the git dir), so deleting the
tree's git dir forgets both together.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import PatchsetError
from .identity import OVERLAY_TRAILER

STATE_FILE = "patchset-state.json"
REBASE_STATE_FILE = "patchset-rebase.json"  # while a rebase is under way
# 2: patch commits carry the Patch-Filename trailer (patchset/identity.py);
# apply rebuilds a version-1 tree's commits so they get it.
VERSION = 2


@dataclass
class AppliedPatch:
    name: str
    sha256: str  # of the patch file when it was applied or exported
    commit: str
    subject: str = ""


@dataclass
class State:
    sdist_sha256: str
    pristine: str
    patches: list[AppliedPatch] = field(default_factory=list)
    overlay_commit: str | None = None
    version: int = VERSION

    def commits(self) -> list[str]:
        """The commit chain this state expects on top of the pristine commit."""
        chain = [p.commit for p in self.patches]
        if self.overlay_commit:
            chain.append(self.overlay_commit)
        return chain


def load(git_dir: Path) -> State | None:
    path = git_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return State(
            sdist_sha256=data["sdist_sha256"],
            pristine=data["pristine"],
            patches=[AppliedPatch(**p) for p in data.get("patches", [])],
            overlay_commit=data.get("overlay_commit"),
            version=int(data.get("version", 1)),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchsetError(
            f"{path} is unreadable ({exc}); delete the tree and its git dir and run "
            "`python build.py apply` again"
        ) from exc


def save(git_dir: Path, state: State) -> None:
    path = git_dir / STATE_FILE
    data = asdict(state)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class RebaseState:
    """Kept in the roll's git dir while a rebase is under way."""

    from_version: str
    onto: str
    patches: list[str]  # the pinned series, in order
    from_patches: str = "patches"  # the pinned series' folder, relative to the root
    # the last replayed commit the check passed (or --accept)
    checked: str | None = None
    flagged: str | None = None  # the replayed commit the check stopped at
    # Patches the rebase stopped at (a conflict, or the check): git never drops
    # those by itself, so one missing at the end was dropped by the user.
    stopped_at: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # dropped through build.py

    def note(self, names: list[str], key: str | None) -> None:
        if key and key != OVERLAY_TRAILER and key not in names:
            names.append(key)

    def save(self, git_dir: Path) -> None:
        (git_dir / REBASE_STATE_FILE).write_text(
            json.dumps(asdict(self), indent=2) + "\n"
        )

    @classmethod
    def load(cls, git_dir: Path) -> RebaseState | None:
        path = git_dir / REBASE_STATE_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))
