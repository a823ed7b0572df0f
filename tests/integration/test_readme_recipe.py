"""The README's recipe ("P and D by hand") works as written.

The commands are extracted from README.md (every ```bash block preceded by
``<!-- recipe -->``), never copied here, and run in order in one bash process,
as a user pastes them into a shell at the project root. The test only chooses
free ports and a log folder through the variables the recipe reads
(P_PORT, D_PORT, P_BOOT, LOGS), runs the blocks with ``set -eo pipefail``
so that a failing command fails the test, and reads P's GET /hashsync and
GET /push/stats itself before the last block stops the servers. Each block's
stdout is parsed: the disaggregated request must come back from P and D (HTTP
200: the recipe's curl uses --fail-with-body), with text, D's prompt KV from P
(all prompt tokens cached but the one vLLM 0.18.1 recomputes) and a completed layer-wise transfer on P; turn 2 on
D must get the prefix pushed from P (D's cached tokens = the pushed blocks, P's
/hashsync answering with its table, P's push counters up). The recipe's servers
run in the test's own process group, which is killed at the end whatever
happened.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.launcher import BLOCK, free_port
from harness.vllm_series import selected
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RECIPE_BLOCK = re.compile(
    r"^<!-- recipe -->\n```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL
)
MARK = "### vmp-recipe-block"
DEADLINE_S = 420  # the whole recipe: start-up ~30-60 s, requests a few seconds
# P's block-hash table and push counters, read through the harness while the
# recipe's servers still run: one JSON line
PROBE = """\
import json, os
import httpx
from harness.pd_client import bootstrap_headers, push_stats
boot = "http://127.0.0.1:" + os.environ["P_BOOT"]
out = {}
try:
    r = httpx.get(boot + "/hashsync", headers=bootstrap_headers(), timeout=30)
    out["hashsync"] = r.json() if r.status_code == 200 else f"{r.status_code}: {r.text[:300]}"
    out["push_stats"] = push_stats(boot)
except Exception as e:
    out["error"] = repr(e)
print(json.dumps({"probe": out}))
"""


def recipe_blocks() -> list[str]:
    blocks = RECIPE_BLOCK.findall(README.read_text(encoding="utf-8"))
    assert len(blocks) == 4, (
        f"README.md has {len(blocks)} recipe blocks (<!-- recipe --> then ```bash), expected 4: "
        "start, P/D request, prefix push, stop"
    )
    return blocks


def script(blocks: list[str]) -> str:
    """The recipe's blocks in order, each after a marker line; before the last one
    (which stops the servers), the test's own probe of P (PROBE)."""
    parts = ["set -eo pipefail"]
    for i, block in enumerate(blocks):
        if i == len(blocks) - 1:
            parts += [
                f"echo '{MARK} probe'",
                f"PYTHONPATH={shlex.quote(str(ROOT))} {shlex.quote(sys.executable)} "
                f"-c {shlex.quote(PROBE)}",
            ]
        parts += [f"echo '{MARK} {i}'", block]
    parts.append(f"echo '{MARK} end'")
    return "\n".join(parts) + "\n"


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def split_output(out: str) -> dict[str, str]:
    sections, current = {}, None
    for line in out.splitlines():
        if line.startswith(MARK):
            current = line[len(MARK) :].strip()
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def completions(section: str) -> list[dict]:
    return [j for j in json_lines(section) if j.get("object") == "text_completion"]


def cached(c: dict) -> int:
    return ((c.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens"
    ) or 0


def test_readme_recipe_runs_as_written(tmp_path):
    blocks = recipe_blocks()
    assert any("MOONCAKE_LAYERWISE=1" in b for b in blocks)
    logs = tmp_path / "logs"
    env = dict(
        os.environ,
        P_PORT=str(free_port()),
        D_PORT=str(free_port()),
        P_BOOT=str(free_port()),
        LOGS=str(logs),
        # the release under test: the recipe activates ${VENV:-.venv}
        VENV=str(selected().venv.relative_to(ROOT)),
    )
    for var in ("MOONCAKE_LAYERWISE", "MOONCAKE_PUSH_SOURCES", "VLLM_TARGET_DEVICE"):
        env.pop(var, None)
    path = tmp_path / "recipe.sh"
    path.write_text(script(blocks))
    out_path = tmp_path / "out.txt"
    t0 = time.monotonic()
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(proc)
    elapsed = time.monotonic() - t0
    out = out_path.read_text(errors="replace")

    def log_tail(name: str) -> str:
        p = logs / name
        return (
            "\n".join(p.read_text(errors="replace").splitlines()[-25:])
            if p.exists()
            else "(none)"
        )

    assert code == 0, (
        f"the recipe {f'timed out after {DEADLINE_S}s' if code is None else f'exited {code}'}"
        f"\n--- output:\n{out[-4000:]}\n--- p.log:\n{log_tail('p.log')}\n--- d.log:\n{log_tail('d.log')}"
    )
    print(f"recipe ran in {elapsed:.0f}s")
    sections = split_output(out)
    assert "end" in sections, out
    assert "ready" in sections["0"], sections["0"]

    # The disaggregated request: P's one token, D's completion with P's KV, layer-wise.
    pd = sections["1"]
    (d_pd, p_pd) = completions(
        pd
    )  # D's answer is printed first, then P's (saved to a file)
    assert (
        p_pd["usage"]["completion_tokens"] == 1 and p_pd["choices"][0]["text"].strip()
    ), p_pd
    assert (
        d_pd["usage"]["completion_tokens"] == 8 and d_pd["choices"][0]["text"].strip()
    ), d_pd
    prompt_len = d_pd["usage"]["prompt_tokens"]
    assert cached(d_pd) == cached_tokens_of_whole_prompt(prompt_len), (
        f"D did not get the prompt's KV from P: {d_pd['usage']}"
    )
    (layerwise,) = [j for j in json_lines(pd) if "transfers" in j]
    done = [
        t
        for t in layerwise["transfers"]
        if t["outcome"] == "completed"
        and t["prompt_len"] == prompt_len
        and t["bytes_written"] > 0
    ]
    assert done, f"no completed layer-wise transfer on P: {layerwise}"

    # Turn 2 with push_from: the prefix came from P's cache by push.
    push = sections["2"]
    (p_turn1, d_turn2) = completions(push)
    assert (
        p_turn1["choices"][0]["text"].strip() and d_turn2["choices"][0]["text"].strip()
    )
    turn1_len = p_turn1["usage"]["prompt_tokens"]
    assert cached(d_turn2) == (turn1_len // BLOCK) * BLOCK, (
        f"D's turn 2 did not get P's {turn1_len // BLOCK} full blocks: {d_turn2['usage']}"
    )
    # P's /hashsync answers with its table, and its push counters (GET /push/stats) moved
    (probe,) = [j["probe"] for j in json_lines(sections["probe"]) if "probe" in j]
    assert "error" not in probe, (
        f"reading P's /hashsync and /push/stats failed: {probe}"
    )
    table, stats = probe["hashsync"], probe["push_stats"]
    assert isinstance(table, dict) and table["size"] > 0 and table["hash_algo"], table
    assert stats["ok"] >= 1 and stats["bytes"] > 0, stats

    # The recipe's own stop block ended both servers.
    assert not re.search(r"kill: .*No such process", sections["3"]), sections["3"]
