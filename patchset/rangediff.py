"""``build.py range-diff``: a rolled series against the pinned one, patch by patch.

What ``git range-diff`` shows for two commit ranges, on the patch files
themselves, so no tree has to be built: each patch of the roll is paired with
the pinned patch of the same name (else of the same subject) and both are
reduced to what they change: the header (subject, body, Upstream-Status) and,
per file, each hunk's removed and added lines. Context lines and line
numbers are left out, so a patch the rebase only moved is ``same``; a
``changed`` one comes with its interdiff (a diff of the two reductions).
Patches without a partner are ``only in pinned`` (dropped by the roll) or
``only in roll``.

For review before a roll replaces the pinned series. Nothing is written.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from .errors import PatchsetError
from .exactapply import file_paths
from .project import MANIFEST, ROLLS, Project
from .series import Patch, clean_subject
from .tree import load_patches

SAME = "same"
CHANGED = "changed"
ONLY_PINNED = "only in pinned"
ONLY_ROLL = "only in roll"
MARKS = {SAME: "=", CHANGED: "!", ONLY_PINNED: "<", ONLY_ROLL: ">"}
CONTEXT = 3  # lines of the reductions around each change in an interdiff
# in a roll's folder: the deltas against its neighbour reviewed so far (--expected)
EXPECTED = "range-diff.expected"


@dataclass
class Entry:
    status: str
    pinned: tuple[int, Patch] | None  # (1-based position, patch)
    roll: tuple[int, Patch] | None
    interdiff: list[str] = field(default_factory=list)

    @property
    def subject(self) -> str:
        side = self.roll or self.pinned
        assert side is not None
        return side[1].title

    def to_json(self) -> dict:
        def side(item: tuple[int, Patch] | None) -> dict | None:
            return {"index": item[0], "name": item[1].name} if item else None

        return {
            "status": self.status,
            "subject": self.subject,
            "pinned": side(self.pinned),
            "roll": side(self.roll),
            "interdiff": "\n".join(self.interdiff),
        }


def reduce(patch: Patch) -> list[str]:
    """What a patch changes, without context lines or line numbers."""
    lines = [f"Subject: {clean_subject(patch.header.subject or '')}"]
    lines += patch.header.body.splitlines()
    for pf in patch.files:
        src, dst = file_paths(pf)
        what = " (new file)" if src is None else " (deleted)" if dst is None else ""
        lines.append(f"## {dst or src}{what}")
        for hunk in pf:
            lines.append("@@")
            lines += [
                f"{line.line_type}{line.value.rstrip(chr(10))}"
                for line in hunk
                if line.line_type in ("+", "-")
            ]
    if patch.parse_error:
        lines.append(f"## does not parse: {patch.parse_error}")
    return lines


def interdiff(old: Patch, new: Patch) -> list[str]:
    """The reductions' diff, without its file and line-number headers."""
    out: list[str] = []
    for line in difflib.unified_diff(reduce(old), reduce(new), n=CONTEXT, lineterm=""):
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            if out:
                out.append("...")
            continue
        out.append(line)
    return out


def compare(pinned: list[Patch], roll: list[Patch]) -> list[Entry]:
    """Each patch of both series once, in the roll's order; dropped ones where
    they stood in the pinned series."""
    by_name = {p.name: i for i, p in enumerate(pinned)}
    partner: dict[int, int] = {}  # roll index -> pinned index
    for j, patch in enumerate(roll):
        if patch.name in by_name:
            partner[j] = by_name[patch.name]
    taken = set(partner.values())
    by_subject: dict[str, int] = {}
    for i, patch in enumerate(pinned):
        if i not in taken:
            by_subject.setdefault(patch.title, i)
    for j, patch in enumerate(roll):
        i = by_subject.pop(patch.title, None) if j not in partner else None
        if i is not None:
            partner[j] = i
    taken = set(partner.values())
    entries: list[Entry] = []
    shown: set[int] = set()

    def dropped_before(limit: int) -> None:
        for i in range(limit):
            if i not in taken and i not in shown:
                shown.add(i)
                entries.append(Entry(ONLY_PINNED, (i + 1, pinned[i]), None))

    for j, patch in enumerate(roll):
        i = partner.get(j)
        if i is None:
            entries.append(Entry(ONLY_ROLL, None, (j + 1, patch)))
            continue
        dropped_before(i)
        diff = interdiff(pinned[i], patch)
        status = CHANGED if diff else SAME
        entries.append(Entry(status, (i + 1, pinned[i]), (j + 1, patch), diff))
    dropped_before(len(pinned))
    return entries


def pick_roll(project: Project, against: str) -> Project:
    """The series to compare: ``--patches`` when it is not ``against``, else the
    only roll under ``rolls/``."""
    if project.patches != against:
        return project
    rolls = project.root / ROLLS
    found = (
        sorted(p.name for p in rolls.iterdir() if (p / MANIFEST).is_file())
        if rolls.is_dir()
        else []
    )
    if len(found) != 1:
        have = ", ".join(f"{ROLLS}/{v}" for v in found) or "none"
        raise PatchsetError(
            f"which series to compare with {against}? Say it with "
            f"`python build.py range-diff --patches {ROLLS}/VERSION` (rolls: {have})"
        )
    return Project(project.root, patches=f"{ROLLS}/{found[0]}")


def run(project: Project, against: str) -> tuple[Project, Project, list[Entry]]:
    """(roll, pinned, entries): the series ``project`` names against ``against``."""
    roll = pick_roll(project, against)
    pinned = Project(project.root, patches=against)
    if not (pinned.patches_dir / MANIFEST).is_file():
        raise PatchsetError(f"{against}/{MANIFEST} not found: nothing to compare with")
    return roll, pinned, compare(load_patches(pinned), load_patches(roll))


def render(roll: Project, pinned: Project, entries: list[Entry]) -> str:
    def label(p: Project) -> str:
        return f"{p.patches} ({p.manifest.name} {p.manifest.version})"

    def side(item: tuple[int, Patch] | None) -> str:
        return f"{item[0]}: {item[1].name}" if item else "-"

    width = max(
        [len(side(e.pinned)) for e in entries] + [len(side(e.roll)) for e in entries],
        default=1,
    )
    where = {
        ONLY_PINNED: f"only in {pinned.patches}",
        ONLY_ROLL: f"only in {roll.patches}",
    }
    lines = [
        f"range-diff: {label(roll)} against {label(pinned)}; each patch's changed "
        "lines and header compared, context and line numbers left out",
        f"legend: = same, ! changed (interdiff: - {pinned.patches}, + {roll.patches}), "
        f"< only in {pinned.patches}, > only in {roll.patches}",
    ]
    for e in entries:
        note = f" ({where[e.status]})" if e.status in where else ""
        lines.append(
            f"{MARKS[e.status]} {side(e.pinned):<{width}}  {side(e.roll):<{width}}  "
            f"{e.subject}{note}"
        )
        lines += [f"    {line}".rstrip() for line in e.interdiff]
    counts = {s: sum(1 for e in entries if e.status == s) for s in MARKS}
    lines.append(
        f"range-diff: {counts[SAME]} same, {counts[CHANGED]} changed, "
        f"{counts[ONLY_PINNED]} only in {pinned.patches}, "
        f"{counts[ONLY_ROLL]} only in {roll.patches}"
    )
    return "\n".join(lines)


def to_json(roll: Project, pinned: Project, entries: list[Entry]) -> dict:
    return {
        "pinned": {"patches": pinned.patches, "version": pinned.manifest.version},
        "roll": {"patches": roll.patches, "version": roll.manifest.version},
        "patches": [e.to_json() for e in entries],
    }


def unexpected(expected: str, now: str, name: str) -> list[str]:
    """The unified diff of the rendered range-diff ``now`` against ``expected``
    (the file ``name``); empty when they agree."""
    return list(
        difflib.unified_diff(
            expected.splitlines(),
            now.splitlines(),
            f"{name} (expected)",
            "now",
            lineterm="",
        )
    )
