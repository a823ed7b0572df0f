"""The compat report for people: the grid, the legend, the first breaks.

``render`` turns the JSON report (``run.run_compat``) into the text
``build.py compat`` prints; ``problems_found`` and ``exit_code`` say whether
anything breaks (exit 1).
"""

from __future__ import annotations

import re

from ..errors import EXIT_OK, EXIT_PROBLEMS
from .applycheck import APPLIES, BREAKS, CODES
from .imports import IMPORT_BREAKS

LEGEND = (
    "patches: . exact  o offset  f fuzz  U already upstream (reverse-applies)  "
    "C conflict  M target file missing/moved\n"
    "         D obsolete: a Backport (or superseded) patch whose change the release "
    "has: drop it\n"
    "         * checked after an earlier patch failed on the same file\n"
    "ovl: . ok  C an overlay file collides with an upstream file  P a destination's "
    "parent is gone\n"
    "imp: . ok  N imported vLLM names/modules missing  ? some unverifiable\n"
    "ovr: . ok  N overrides / super() calls of our subclasses broken  w only warnings "
    "(a method of ours now also upstream)"
)


# -- one line per release, while the run goes ---------------------------------


def count_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[s]} {s}" for s in CODES if counts.get(s)) or "none"


def overlay_text(res: dict) -> str:
    ov = res["overlay"]
    gone = [d["dst"] for d in ov["destinations"] if not d["parent_exists"]]
    bits = []
    if ov["collisions"]:
        bits.append(f"overlay: {len(ov['collisions'])} file(s) collide")
    if gone:
        bits.append(f"overlay: {len(gone)} destination parent(s) gone")
    return "; ".join(bits) or "overlay ok"


def _broken_imports(res: dict) -> list[dict]:
    return [i for i in res["imports"] if i["status"] in IMPORT_BREAKS]


def imports_text(res: dict) -> str:
    broken = _broken_imports(res)
    ok = sum(1 for i in res["imports"] if i["status"] == "ok")
    text = f"imports {ok} ok"
    if broken:
        text += f", {len(broken)} broken"
    unsure = sum(1 for i in res["imports"] if i["status"] == "unverifiable")
    if unsure:
        text += f", {unsure} unverifiable"
    return text


def overrides_text(res: dict) -> str:
    ov = res.get("overrides") or {}
    if not ov.get("classes") and not ov.get("problems"):
        return "no subclasses of upstream classes"
    bits = [f"{n} {what}" for what in ("errors", "warnings") if (n := ov.get(what))]
    return f"overrides of {len(ov['classes'])} subclasses: {', '.join(bits) or 'ok'}"


def _overrides_code(res: dict) -> str:
    ov = res.get("overrides") or {}
    if ov.get("errors"):
        return str(ov["errors"])
    return "w" if ov.get("warnings") else "."


def problems_found(report: dict) -> bool:
    for res in report["versions"]:
        if any(r["status"] in BREAKS for r in res["patches"]):
            return True
        if overlay_text(res) != "overlay ok" or _broken_imports(res):
            return True
        if (res.get("overrides") or {}).get("errors"):
            return True
    return False


# -- rendering -----------------------------------------------------------


def _short(name: str, index: int) -> str:
    m = re.match(r"(\d{4})-", name)
    return m.group(1) if m else f"#{index + 1}"


def render(report: dict) -> str:
    series = report["series"]
    cols = [_short(p["name"], i) for i, p in enumerate(series)]
    head = (
        f"{'version':<9}"
        + "".join(f"{c:>6}" for c in cols)
        + "   ovl  imp  ovr   applies"
    )
    lines = [
        (
            f"compat: {len(series)} patches + overlay imports vs "
            f"{report['pinned']['name']} releases (pinned {report['pinned']['version']})"
        ),
        head,
    ]
    for res in report["versions"]:
        cells = []
        for row in res["patches"]:
            code = CODES[row["status"]] + (
                "*" if row.get("after_failed_same_files") else ""
            )
            cells.append(f"{code:>6}")
        ov = res["overlay"]
        gone = any(not d["parent_exists"] for d in ov["destinations"])
        ovl = "C" if ov["collisions"] else "P" if gone else "."
        broken = _broken_imports(res)
        unsure = any(i["status"] == "unverifiable" for i in res["imports"])
        imp = str(len(broken)) if broken else "?" if unsure else "."
        c = res["counts"]
        applies = sum(c.get(s, 0) for s in APPLIES)
        detail = ", ".join(f"{c[s]} {s}" for s in APPLIES if c.get(s))
        up = f"; {c['upstream']} upstream" if c.get("upstream") else ""
        up += f"; {c['obsolete']} obsolete" if c.get("obsolete") else ""
        ovr = _overrides_code(res)
        lines.append(
            f"{res['version']:<9}" + "".join(cells) + f"{ovl:>6}{imp:>5}{ovr:>5}   "
            f"{applies}/{len(series)}" + (f" ({detail})" if detail else "") + up
        )
    lines += ["legend:", *("  " + x for x in LEGEND.splitlines())]
    lines.append("patches:")
    for col, p in zip(cols, series):
        lines.append(f"  {col}  {p['subject']}")
    obsolete = _first_obsolete(report)
    if obsolete:
        lines.append("obsolete (the release has the change; drop the patch there):")
    for col, p in zip(cols, series):
        row = obsolete.get(p["name"])
        if row:
            lines.append(
                f"  {col}  obsolete from {row['version']}: drop it "
                f"({row['obsolete']['claim']}; {row['obsolete']['how']})"
            )
    fb = report["first_breaks"]
    if fb["patches"] or fb["imports"] or fb.get("overrides"):
        lines.append("first break:")
    for col, p in zip(cols, series):
        entry = fb["patches"].get(p["name"])
        if not entry:
            continue
        after = entry.get("after_failed_same_files")
        lines.append(
            f"  {col}  {entry['status']} from {entry['version']} (after {entry['after']})"
            + (
                f"; checked after failed {', '.join(_short(n, 0) for n in after)}, "
                f"alone on {entry['version']}'s files: {entry.get('alone_on_target')}"
                if after
                else ""
            )
        )
        for cause in entry["causes"]:
            if "hunk" in cause:
                lines.append(
                    f"        {cause['file']} hunk {cause['hunk']}: {cause['hunk_header']}"
                )
                if cause.get("note"):
                    lines.append(f"        {cause['note']}")
                for dl in (cause.get("upstream_change") or "").splitlines()[2:14]:
                    lines.append(f"          {dl}")
            else:
                moved = cause.get("moved_to")
                lines.append(
                    f"        {cause['file']} is gone"
                    + (f"; likely moved to {moved}" if moved else "")
                )
            if (commits := cause.get("commits")) is not None:
                lines.append(f"        upstream commits: {_commits_text(commits)}")
    for res in report["versions"]:
        ov = res["overlay"]
        for path in ov["collisions"]:
            lines.append(
                f"  overlay {res['version']}: {path} collides with an upstream file"
            )
        for d in ov["destinations"]:
            if not d["parent_exists"]:
                lines.append(
                    f"  overlay {res['version']}: {d['parent']}/ (parent of {d['dst']}) is gone"
                )
    for label, entry in fb["imports"].items():
        where = entry.get("defined_in") or entry.get("candidates")
        lines.append(
            f"  import {label}: {entry['status']} from {entry['version']} "
            f"(after {entry['after']})"
            + (f"; now in {', '.join(where)}" if where else "")
        )
        commits = entry.get("commits")
        if isinstance(commits, list) or commits:
            lines.append(f"        upstream commits: {_commits_text(commits)}")
    for entry in (fb.get("overrides") or {}).values():
        subject = ".".join(x for x in (entry["cls"], entry["method"]) if x)
        lines.append(
            f"  override {entry['where']} {subject}: {entry['kind']} ({entry['severity']}) "
            f"from {entry['version']} (after {entry['after']})"
        )
        lines.append(f"        {entry['message']}")
        if entry.get("commits") is not None:
            lines.append(f"        upstream commits: {_commits_text(entry['commits'])}")
    return "\n".join(lines)


def _first_obsolete(report: dict) -> dict[str, dict]:
    """Patch name -> its row on the first release it is obsolete on."""
    out: dict[str, dict] = {}
    for res in report["versions"]:
        for row in res["patches"]:
            if row["status"] == "obsolete" and row["name"] not in out:
                out[row["name"]] = {**row, "version": res["version"]}
    return out


def _commits_text(commits: list[dict] | str) -> str:
    if isinstance(commits, str):  # why they could not be named
        return commits
    shown = ", ".join(f"{c['sha'][:12]} {c['subject']!r}" for c in commits[:5])
    return shown or "none found"


def exit_code(report: dict) -> int:
    return EXIT_PROBLEMS if problems_found(report) else EXIT_OK
