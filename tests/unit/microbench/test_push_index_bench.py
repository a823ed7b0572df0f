"""microbench/push_index: a tiny run end to end (fill in several pages, lookups
decomposed as best() runs them, memory) and the shaping of its rows into tables,
summary and page."""

from __future__ import annotations

import gc
import json

import pytest

from microbench.push_index.__main__ import (
    INDEX_TABLE,
    LOOKUP_TABLE,
    index_display,
    lookup_display,
    marginal_walk_ns,
    markdown,
    markdown_table,
    report,
    summary_lines,
)
from microbench.push_index.bench import (
    BLOCK_SIZE,
    Layout,
    Plan,
    blocks_best_hashes,
    hash_blocks,
    run,
    set_lookups,
    spread,
    walk,
)

TINY = Plan(
    sizes=(1_200,),
    layouts=[Layout(1, 1), Layout(3, 3)],
    prompts=(32, 128),
    calls=3,
    warmup=1,
    fill_repeats=1,
    page_events=250,  # several pages per source, the first a reset
)


@pytest.fixture(scope="module")
def measured():
    return run(TINY, lambda message: None)


def test_a_tiny_run_fills_every_source_through_pages_and_finds_the_hit(measured):
    assert [(r["sources"], r["configs"]) for r in measured["indexes"]] == [
        (1, 1),
        (3, 3),
    ]
    for r in measured["indexes"]:
        assert r["correct"], r["stats"]
        assert sum(r["held"]) == 1_200
        assert r["pages"] == sum(-(-n // 250) for n in r["held"])
        assert r["tracemalloc_bytes_per_block"] > 8  # at least the 64-bit value
        assert r["getsizeof_bytes_per_block"] > 8
    rows = measured["lookups"]
    assert len(rows) == 2 * 2 * 2  # indexes x prompts x (hit, miss)
    assert all(r["correct"] for r in rows)
    # the bench hashed as many blocks as best() drew, and walked to its answer
    assert all(r["blocks_hashed"] == r["blocks_hashed_by_best"] for r in rows)
    assert all(r["walk_answer"] == r["answer"] for r in rows)
    hit = next(r for r in rows if r["case"] == "hit" and r["prompt_tokens"] == 128)
    assert hit["answer"] == {"origin": "http://source-0:8998", "blocks": 8}
    three = [r for r in rows if r["sources"] == 3]
    assert {r["configs_hashed"] for r in three} == {3}
    # a miss stops at block 0 on each source: one block hashed per configuration
    assert {r["lookups"] for r in three if r["case"] == "miss"} == {3}
    assert {r["blocks_hashed"] for r in rows if r["case"] == "miss"} == {1, 3}
    # a hit hashes the held run (the whole prompt), each other configuration 1 block
    assert hit["lookups"] == hit["blocks_hashed"] == 8
    hit3 = next(r for r in three if r["case"] == "hit" and r["prompt_tokens"] == 128)
    assert hit3["blocks_hashed_per_config"] == [8, 1, 1]
    assert hit3["lookups"] == 8 + 2
    assert hit3["whole_prompt_blocks"] == 3 * 8
    assert all(r["best_s"]["n"] == r["whole_prompt_hash_s"]["n"] == 3 for r in rows)


def test_the_decomposition_follows_best_on_a_partial_run(measured):
    """A prompt held for its first blocks then not: best() hashes one block past
    the run; the copied loop stops there too."""
    from microbench.push_index.bench import Keys, fill, groups, source_keys

    keys = Keys(TINY, lambda message: None)
    layout = Layout(3, 1)
    index, _, _ = fill(layout, source_keys(keys, layout, 1_200), keys, TINY)
    tokens = keys.hit_tokens[: 3 * BLOCK_SIZE] + keys.tokens(5 * BLOCK_SIZE)
    grouped = groups(index)
    whole = hash_blocks(tokens, {c: 8 for c in grouped})
    counts = blocks_best_hashes(grouped, whole)
    assert list(counts.values()) == [3 + 1]
    hashed = hash_blocks(tokens, counts)
    assert hashed == {c: h[:4] for c, h in whole.items()}
    got = index.best(tokens, None, None, 0)
    assert got is not None and got.blocks == 3
    assert walk(grouped, hashed) == got
    assert set_lookups(grouped, hashed) == 3 + 1 + 1 + 1  # 3 sources, then source 0


def test_tables_summary_and_page(measured, tmp_path):
    result = {
        "machine": {
            "cpu_model": "a CPU",
            "cores": 2,
            "mem_gib": 1.0,
            "python": "3.11",
            "vllm": "0.0",
            "date": "2000-01-01",
            "commit": "abc1234",
            "dirty": True,
            "measured_uncommitted": [],
            "loadavg_start": 0.5,
            "loadavg_end": 1.5,
        },
        "command": "python -m microbench.push_index",
        "seconds": 1.0,
        "config": {
            "hash_algo": "sha256",
            "block_size": 16,
            "page_events": 250,
            "calls": 3,
            "warmup": 1,
        },
        **measured,
    }
    result["summary"] = {"lines": summary_lines(result)}
    # one size (its costliest lookup, its costliest miss), two indexes
    assert len(result["summary"]["lines"]) == 2 + 2
    shown = lookup_display(measured["lookups"])
    assert {r["walk_ns"] is None for r in shown if r["case"] == "miss"} == {True}
    assert shown[0]["answer_blocks"] == "2 on source-0"
    table = markdown_table(index_display(measured["indexes"]), INDEX_TABLE)
    assert table.count("\n") == 1 + 2 and "| 1,200 | 3 src / 3 cfg |" in table
    assert set(marginal_walk_ns(measured["lookups"])) == {
        (1_200, "1 src / 1 cfg"),
        (1_200, "3 src / 3 cfg"),
    }
    page = markdown(result, "x.json", None)
    assert "abc1234 with uncommitted changes" in page
    assert page.count("\n| ") == (2 + 2) + (2 + 8)  # two tables, head and rule each
    assert all(h in page for _, h, _ in LOOKUP_TABLE)
    out = tmp_path / "r.json"
    assert report(result, out) == 0
    assert json.loads(out.read_text())["lookups"][0]["case"] == "hit"
    assert out.with_suffix(".md").exists()


def test_main_writes_the_page_with_the_current_method(tmp_path, monkeypatch):
    import microbench.push_index.__main__ as cli

    tiny = {
        **cli.QUICK,
        "sizes": (1_200,),
        "layouts": ((3, 3),),
        "prompts": (32,),
        "calls": 2,
        "warmup": 1,
        "fill_repeats": 1,
        "traced_sizes": (),
    }
    monkeypatch.setattr(cli, "QUICK", tiny)
    try:
        assert cli.main(["--out-dir", str(tmp_path)]) == 0
    finally:
        gc.unfreeze()  # main() freezes the collector's heap, as vLLM's engine does
    (out,) = tmp_path.glob("*-push-index.json")
    result = json.loads(out.read_text())
    assert result["config"]["apply_slice"] > 0
    page = out.with_suffix(".md").read_text()
    assert "whole-prompt hashing" in page and "stops at the first block" in page
    assert "still hashes the whole prompt" not in page


def test_spread_and_layouts():
    s = spread([5.0, 1.0, 3.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 3)
    assert s["p10"] <= s["median"] <= s["p90"]
    assert spread([2.0])["p10"] == spread([2.0])["p90"] == 2.0
    assert spread([]) == {"n": 0}
    with pytest.raises(ValueError):
        Layout(1, 2)
    assert [Layout(3, 2).config_of(s) for s in range(3)] == [0, 1, 0]
