"""The series' rules, written once.

Every command that reads the series asks ``validate_series``: ``check``
reports every problem, ``apply`` (and ``rebase``, ``check --release``, through
``tree.load_patches``) refuses a series it cannot load, ``status`` shows the
series-file problems. The rules:

- ``option``: a series line carries an option other than ``-p1``
  (``series.parse_series`` finds these while parsing);
- ``outside``: a series line names something other than a file of the patch
  folder (an absolute path, a folder, '..', a symlink out of it:
  ``Project.patch_name_problem``);
- ``duplicate``: a patch is listed twice;
- ``missing``: a listed patch has no file;
- ``unlisted``: a patch file in the folder is not listed;
- ``parse``: a patch's diff does not parse;
- ``header``: a patch's header breaks the header policy (``headers``).

The first four make the series unusable (``blocks_loading``): which patches,
in which order, is not known. The others leave a series that can be loaded,
applied and looked at, and only ``check`` fails on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .headers import header_problems
from .series import Patch, SeriesEntry, read_patch

if TYPE_CHECKING:
    from .project import Project

OPTION = "option"
OUTSIDE = "outside"
DUPLICATE = "duplicate"
MISSING = "missing"
UNLISTED = "unlisted"
PARSE = "parse"
HEADER = "header"
BLOCKS_LOADING = (OPTION, OUTSIDE, DUPLICATE, MISSING)


@dataclass(frozen=True)
class SeriesProblem:
    code: str  # one of the rules above
    message: str  # names the series line or the patch, and what to do
    patch: str | None = None

    @property
    def blocks_loading(self) -> bool:
        return self.code in BLOCKS_LOADING


@dataclass
class SeriesReport:
    entries: list[SeriesEntry] = field(default_factory=list)
    patches: list[Patch] = field(
        default_factory=list
    )  # listed, present, each once, in order
    header: list[str] = field(default_factory=list)  # the series' leading comment block
    problems: list[SeriesProblem] = field(default_factory=list)

    @property
    def loading_problems(self) -> list[SeriesProblem]:
        return [p for p in self.problems if p.blocks_loading]


def validate_series(project: Project) -> SeriesReport:
    """Read the series and its patch files, and say what breaks the rules."""
    series = project.series()
    report = SeriesReport(entries=list(series.entries), header=list(series.header))
    report.problems += [SeriesProblem(OPTION, msg) for msg in series.problems]
    seen: set[str] = set()
    for entry in series.entries:
        if entry.name in seen:
            report.problems.append(
                SeriesProblem(
                    DUPLICATE,
                    f"series line {entry.line}: {entry.name} is listed twice",
                    entry.name,
                )
            )
            continue
        seen.add(entry.name)
        why = project.patch_name_problem(entry.name)
        if why is not None:
            report.problems.append(
                SeriesProblem(
                    OUTSIDE,
                    f"series line {entry.line}: {entry.name} {why}; list each patch "
                    f"by its file name in {project.patches}/",
                    entry.name,
                )
            )
            continue
        path = project.patch_path(entry.name)
        if not path.is_file():
            report.problems.append(
                SeriesProblem(
                    MISSING,
                    f"series line {entry.line}: {entry.name} is listed but "
                    f"{project.rel(path)} does not exist",
                    entry.name,
                )
            )
            continue
        patch = read_patch(path, entry.name)
        report.patches.append(patch)
        if patch.parse_error:
            report.problems.append(
                SeriesProblem(PARSE, f"{entry.name}: {patch.parse_error}", entry.name)
            )
        report.problems += [
            SeriesProblem(HEADER, f"{entry.name}: {msg}", entry.name)
            for msg in header_problems(patch)
        ]
    report.problems += identity_problems(report.patches)
    for name in project.patch_files_on_disk():
        if name not in seen:
            report.problems.append(
                SeriesProblem(
                    UNLISTED,
                    f"{project.rel(project.patches_dir / name)} is not listed in "
                    f"{project.rel(project.series_path)} (add it, or delete it)",
                    name,
                )
            )
    return report


def identity_problems(patches: list[Patch]) -> list[SeriesProblem]:
    """Every patch of a series carries one author identity (its From: line): the
    one most of them carry; each other patch is named."""
    by_author: dict[tuple[str, str] | None, list[str]] = {}
    for patch in patches:
        by_author.setdefault(patch.header.author, []).append(patch.name)
    if len(by_author) < 2:
        return []
    main = max(by_author, key=lambda a: len(by_author[a]))

    def who(author: tuple[str, str] | None) -> str:
        return f"{author[0]} <{author[1]}>" if author else "no author"

    return [
        SeriesProblem(
            HEADER,
            f"{name}: its From: is {who(author)}, the series' identity is "
            f"{who(main)} ({len(by_author[main])} patches): one identity for every "
            "patch",
            name,
        )
        for author, names in by_author.items()
        if author != main
        for name in names
    ]
