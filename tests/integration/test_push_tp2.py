"""Prefix push between tensor-parallel instances (three real instances: C and D at
TP 2, a third at TP 1).

Each of C's ranks holds its own heads' shard of every block and serves it from a
listener of its own (at MOONCAKE_PUSH_RANK_PORT; rank 1 registers its port with
rank 0, which names both in its /match_blocks answer); D's rank r asks C's rank r. The push counts only when
both ranks' writes are proven: a write failing on one rank fails the whole push
(D prefills locally, nothing stranded). A TP 1 destination of the TP 2 source is
refused at the match, with one warning naming both sizes, and prefills locally. A
second TP 2 source whose rank 1 finds MOONCAKE_PUSH_RANK_PORT taken serves its own
requests and no pushes (one warning naming the port and the variable); D prefills
locally.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK, free_port
from harness.pd_client import (
    RequestFailed,
    complete,
    match_blocks,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import random_prompt as prompt

pytestmark = pytest.mark.integration

FAULTY_PROMPT_LEN = 4 * BLOCK + 5  # rank 1's writes of this length fail
RANK1_PORT = free_port()  # C's rank 1 serves pushes here (MOONCAKE_PUSH_RANK_PORT)


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    # held while the instances start: c2's rank 1 is to listen on it
    with socket.create_server(("127.0.0.1", 0)) as taken:
        yield SimpleNamespace(**started(pd_cluster, taken.getsockname()[1]))


def started(pd_cluster, taken_port: int) -> dict:
    cl = pd_cluster(
        {
            "c": "kv_producer",
            "d": "kv_consumer",
            "d1": "kv_consumer",
            "c2": "kv_producer",
        },
        kv_cache_gib=1,
        max_model_len=2048,
        instances={
            "c2": {"tp": 2, "env": {"MOONCAKE_PUSH_RANK_PORT": str(taken_port)}},
            "c": {
                "tp": 2,
                "env": {
                    "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": f"{FAULTY_PROMPT_LEN}@1",
                    "MOONCAKE_PUSH_RANK_PORT": str(RANK1_PORT),
                },
            },
            # D pushes every match: these tests check each rank's writes, and a
            # measured gate may keep a 4-block push local (its local prefill timed
            # by the test before) on a busy host
            "d": {"tp": 2, "env": {"MOONCAKE_PUSH_POLICY": "always"}},
        },
    )
    return {name: cl[name] for name in ("c", "d", "d1", "c2")} | {
        "taken_port": taken_port
    }


def held_on_c(c, ids) -> dict:
    """C computes ``ids``; its /match_blocks answer once it holds their full blocks."""
    complete(c.url, ids, max_tokens=1, logprobs=None, timeout=300)
    return wait_for_matched_blocks(c.bootstrap_url, ids, len(ids) // BLOCK)


def rank_stats(c, match: dict) -> list[dict]:
    """Each of C's ranks' push counters, from the listener its match answer names."""
    host = c.bootstrap_url.rsplit(":", 1)[0]
    return [push_stats(c.bootstrap_url)] + [
        push_stats(f"{host}:{port}") for port in match["rank_ports"][1:]
    ]


def pushed(d, c, ids):
    return complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": c.bootstrap_url},
    )


def test_each_rank_writes_its_own_shard_and_d_decodes_from_both(cluster):
    c, d = cluster.c, cluster.d
    ids = prompt(4 * BLOCK + 3, seed=8800)
    match = held_on_c(c, ids)
    assert match["fingerprint"]["tp_size"] == 2
    assert match["rank_ports"] == [int(c.bootstrap_url.rsplit(":", 1)[1]), RANK1_PORT]
    before = rank_stats(c, match)
    got = pushed(d, c, ids)
    check = compare(
        got,
        reference_completion(d.url, ids, max_tokens=4),
        expected_cached_tokens=4 * BLOCK,
    )
    assert check.ok, check.problems
    after = rank_stats(c, match)
    written = [a["bytes"] - b["bytes"] for a, b in zip(after, before)]
    assert [a["ok"] - b["ok"] for a, b in zip(after, before)] == [1, 1], after
    # the two shards of 4 blocks: equal halves of the blocks' KV
    assert written[0] == written[1] > 0, written
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)


def test_a_write_failing_on_one_rank_fails_the_whole_push(cluster):
    c, d = cluster.c, cluster.d
    ids = prompt(FAULTY_PROMPT_LEN, seed=8801)
    match = held_on_c(c, ids)
    before = rank_stats(c, match)
    got = pushed(d, c, ids)
    # rank 0's shard landed, rank 1's did not: no block counts, D computed them all
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got, reference_completion(d.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    after = rank_stats(c, match)
    assert [a["ok"] - b["ok"] for a, b in zip(after, before)] == [1, 0], after
    assert [a["failed"] - b["failed"] for a, b in zip(after, before)] == [0, 1], after
    assert wait_no_blocks_in_use(c.url, d.url) == (0.0, 0.0)
    # D serves the next push of another prompt whole
    ids = prompt(4 * BLOCK + 3, seed=8802)
    held_on_c(c, ids)
    assert pushed(d, c, ids).cached_tokens == 4 * BLOCK


def test_a_tp1_destination_of_a_tp2_source_prefills_locally(cluster):
    c, d1 = cluster.c, cluster.d1
    ids = prompt(4 * BLOCK + 3, seed=8803)
    held_on_c(c, ids)
    got = pushed(d1, c, ids)
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got,
        reference_completion(d1.url, ids, max_tokens=4),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems
    assert "tp_size 1 (this instance) != 2" in d1.log_path.read_text()
    assert match_blocks(c.bootstrap_url, ids)["matched_blocks"] == 4
    assert wait_no_blocks_in_use(c.url, d1.url) == (0.0, 0.0)


def test_a_source_whose_rank_port_is_taken_serves_and_pushes_nothing(cluster):
    c2, d = cluster.c2, cluster.d
    ids = prompt(4 * BLOCK + 3, seed=8804)
    complete(c2.url, ids, max_tokens=1, logprobs=None, timeout=300)  # it serves
    # rank 1 never registered: rank 0 answers every match 503
    with pytest.raises(RequestFailed, match="503"):
        match_blocks(c2.bootstrap_url, ids)
    got = pushed(d, c2, ids)
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got, reference_completion(d.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    log = c2.log_path.read_text()
    warned = [line for line in log.splitlines() if "serves no prefix pushes" in line]
    assert len(warned) == 1, warned
    assert f":{cluster.taken_port} " in warned[0], warned
    assert "MOONCAKE_PUSH_RANK_PORT" in warned[0], warned
    assert wait_no_blocks_in_use(c2.url, d.url) == (0.0, 0.0)
