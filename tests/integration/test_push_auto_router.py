"""Prefix push behind vllm-router's round robin, with no client naming anything.

Two kv_both instances run with MOONCAKE_PUSH_AUTO=1 behind ``vllm-router
--worker-urls A B --policy round_robin`` (its plain mode). A three-turn
session goes through the router, each turn the previous one plus new tokens;
round robin sends consecutive turns to alternate instances, so every turn
after the first lands where the previous one did not run. Each such turn must
be pushed from the other instance: the instance that served it loads exactly
the blocks the other holds beyond its own prefix hit (counted by vLLM's own
external prefix-cache counter, since the router drops the usage details), the
holder counts the push, and the answer matches a from-scratch reference
(logprobs). Turn 3 runs where turn 1 did: only the blocks beyond turn 1 come
over. Without MOONCAKE_PUSH_AUTO nothing is pushed and the first check fails.
Each instance counts what became of every request it considered for a push on
its /metrics (push_decisions_total by reason), and a prefix shorter than
MOONCAKE_PUSH_MIN_TOKENS beyond an instance's own hit is prefilled locally.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.metrics import counter, counter_when, read_when
from harness.pd_client import (
    complete,
    match_blocks,
    model_name,
    push_decisions,
    push_stats,
)
from harness.prompts import random_prompt as prompt
from harness.routers import KV_EVENTS_UNREADABLE, kv_aware_router, vllm_router_workers
from harness.vllm_series import selected
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    Decision,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    FEED_BACKOFF_MAX_S,
)

pytestmark = pytest.mark.integration

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
SERVED = "vllm:request_success_total"
FEED_S = 1.0  # a turn's blocks reach the other instance's index (a long poll)


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    cl = shared_cluster("push_auto")
    for seed, name in enumerate(("a", "b"), start=6000):
        assert cl[name].spec.env.get("MOONCAKE_PUSH_AUTO") == "1"
        # a step has run: its mirror answers and its feed serves
        complete(cl[name].url, prompt(BLOCK + 3, seed=seed), max_tokens=1, timeout=300)
    # each follower asks a source that had not run a step yet again within this
    time.sleep(FEED_BACKOFF_MAX_S + 2)
    return cl


def decisions(inst) -> dict[str, float]:
    """The instance's push decisions by reason, from its bootstrap server's /metrics."""
    return push_decisions(inst.bootstrap_url)


def grown(inst, before, timeout=10.0) -> dict[str, float]:
    """The decisions counted since ``before`` (the worker learns them a step later)."""
    after = read_when(lambda: decisions(inst), lambda d: d != before, timeout)
    return {k: v - before[k] for k, v in after.items() if v != before[k]}


def held(inst, ids) -> int:
    return match_blocks(inst.bootstrap_url, ids)["matched_blocks"]


def served(before, *instances, timeout=10.0):
    """The instance whose count of answered requests grew (vLLM updates it just
    after it answers)."""
    deadline = time.monotonic() + timeout
    while True:
        grew = [i for i in instances if counter(i.url, SERVED) > before[i.spec.name][0]]
        if len(grew) == 1:
            return grew[0]
        assert not grew and time.monotonic() < deadline, f"served by {grew}"
        time.sleep(0.2)


def test_each_turn_on_the_other_instance_is_pushed_from_the_holder(cluster, tmp_path):
    a, b = cluster["a"], cluster["b"]
    model = model_name(a.url)
    turns = [prompt(6 * BLOCK + 20, seed=6100)]
    turns.append(turns[0] + prompt(3 * BLOCK + 5, seed=6101))
    turns.append(turns[1] + prompt(2 * BLOCK + 9, seed=6102))
    served_by = []
    counted = {inst.spec.name: decisions(inst) for inst in (a, b)}
    with vllm_router_workers([a, b], tmp_path) as router:
        for k, ids in enumerate(turns, start=1):
            own = {inst.spec.name: held(inst, ids) for inst in (a, b)}
            before = {
                inst.spec.name: (
                    counter(inst.url, SERVED),
                    counter(inst.url, EXTERNAL_HITS),
                    push_stats(inst.bootstrap_url)["ok"],
                )
                for inst in (a, b)
            }
            got = complete(router.url, ids, max_tokens=4, logprobs=5, model=model)
            inst = served(before, a, b)
            other = b if inst is a else a
            served_by.append(inst.spec.name)
            check = compare(
                got,
                reference_completion(inst.url, ids, max_tokens=4),
                expected_cached_tokens=None,
            )
            assert check.ok, (k, check.problems, router.log_tail())
            want = max(0, own[other.spec.name] - own[inst.spec.name]) * BLOCK
            hits = before[inst.spec.name][1]
            loaded = (
                counter_when(inst.url, EXTERNAL_HITS, lambda v, h=hits: v > h)
                if want
                else counter(inst.url, EXTERNAL_HITS)
            ) - hits
            pushes = push_stats(other.bootstrap_url)["ok"] - before[other.spec.name][2]
            if k == 1:
                assert (want, loaded, pushes) == (0, 0, 0), (k, own, loaded, pushes)
            else:
                assert want > 0, f"turn {k} went where its prefix was: {served_by}"
                assert (loaded, pushes) == (want, 1), (k, own, want, loaded, pushes)
            time.sleep(FEED_S)
    assert served_by[0] == served_by[2] != served_by[1], served_by
    assert wait_no_blocks_in_use(a.url, b.url) == (0.0, 0.0)
    # every request each instance served (turns, references) was considered once;
    # turns 2 and 3 were pushed, the rest had no holder beyond the own hit
    for inst in (a, b):
        got = grown(inst, counted[inst.spec.name])
        assert got.get("pushed") == 1, (inst.spec.name, got)
        assert set(got) <= {"pushed", "no_holder"}, (inst.spec.name, got)


def test_a_prefix_below_the_minimum_is_prefilled_locally(cluster):
    """One held block (128 tokens) beyond B's own hit, MOONCAKE_PUSH_MIN_TOKENS 256
    (the default): B prefills it itself, asks A nothing, and counts why."""
    a, b = cluster["a"], cluster["b"]
    assert b.spec.env.get("MOONCAKE_PUSH_MIN_TOKENS") is None  # the default, 256
    ids = prompt(BLOCK + 7, seed=6200)
    complete(a.url, ids, max_tokens=1)
    assert held(a, ids) == 1 and held(b, ids) == 0
    time.sleep(FEED_S)
    before = decisions(b), counter(b.url, EXTERNAL_HITS), push_stats(a.bootstrap_url)
    got = complete(b.url, ids, max_tokens=4, logprobs=5)
    check = compare(
        got, reference_completion(a.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    assert grown(b, before[0]) == {Decision.BELOW_MINIMUM.value: 1}
    assert counter(b.url, EXTERNAL_HITS) == before[1]
    after = push_stats(a.bootstrap_url)
    assert (after["ok"], after["matches"]) == (before[2]["ok"], before[2]["matches"])


def test_each_instance_knows_itself_among_its_sources(cluster):
    for name in ("a", "b"):
        log = cluster[name].log_text()
        assert "is this instance; not following it" in log, name


# ---- behind kv_aware: a turn sent away from its holder ---------------------------------

FILLERS = 8  # streams held open on the holder: kv_aware then prices it above the other
# (the holder's cost: the turn's tokens beyond its hit x (streams + 1); the other's:
# all of the turn's tokens; vllm-router 0.1.17, src/policies/kv_aware.rs)
EVENTS_S = 2.0  # a turn's KV events reach the router's index


class HeldStreams:
    """Streaming completions through the router, each held open (one decode slot on
    the instance the router picked) until ``close``: load the router counts."""

    def __init__(self, url: str, model: str, ids: list[int]):
        self.url, self.model, self.ids = url, model, ids
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def open_one(self, timeout: float = 120.0) -> None:
        """One more stream; returns once its first token came back."""
        first = threading.Event()
        t = threading.Thread(target=self._run, args=(first,), daemon=True)
        t.start()
        self.threads.append(t)
        assert first.wait(timeout), f"no first token within {timeout} s: {self.errors}"

    def _run(self, first: threading.Event) -> None:
        body = {
            "model": self.model,
            "prompt": self.ids,
            "max_tokens": 1024,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        try:
            timeout = httpx.Timeout(600.0, connect=10.0)
            with (
                httpx.Client(timeout=timeout) as client,
                client.stream("POST", self.url + "/v1/completions", json=body) as r,
            ):
                if r.status_code != 200:
                    self.errors.append(f"HTTP {r.status_code}: {r.read()[:300]!r}")
                    first.set()
                    return
                for _ in r.iter_bytes():
                    first.set()
                    if self.stop.is_set():
                        return
        except Exception as e:  # reported by open_one / close
            self.errors.append(repr(e))
            first.set()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_behind_kv_aware_a_turn_sent_away_from_its_holder_is_pushed(cluster, tmp_path):
    """vllm-router's kv_aware policy routes by the KV events both instances publish
    (through a loopback forwarder each). The holder of turn 2 carries 8 long
    streams of turn 2 (the router credits them its prefix and sends them there),
    so kv_aware prices it above the idle instance and sends turn 3 to the other:
    it is pushed from the holder, exactly the blocks beyond its own hit, and the
    answer matches a from-scratch reference."""
    if selected().version in KV_EVENTS_UNREADABLE:
        pytest.skip(KV_EVENTS_UNREADABLE[selected().version])
    a, b = cluster["a"], cluster["b"]
    model = model_name(a.url)
    turns = [prompt(6 * BLOCK + 20, seed=6300)]
    turns.append(turns[0] + prompt(3 * BLOCK + 5, seed=6301))
    turns.append(turns[1] + prompt(2 * BLOCK + 9, seed=6302))
    with kv_aware_router([a, b], tmp_path, model) as router:

        def turn(ids):
            before = {i.spec.name: counter(i.url, SERVED) for i in (a, b)}
            got = complete(router.url, ids, max_tokens=4, logprobs=5, model=model)
            return got, served({k: (v,) for k, v in before.items()}, a, b)

        # turns 1 and 2: wherever the router sends them (turn 2, if sent away from
        # turn 1, is pushed); the instance that served turn 2 holds the session
        turn(turns[0])
        time.sleep(EVENTS_S)  # its events reached the router, its feed the other
        _, holder = turn(turns[1])
        other = b if holder is a else a
        time.sleep(EVENTS_S)
        own = {i.spec.name: held(i, turns[2]) for i in (a, b)}
        assert own[holder.spec.name] > own[other.spec.name]
        hits = counter(other.url, EXTERNAL_HITS)
        pushes = push_stats(holder.bootstrap_url)["ok"]
        counted = decisions(other)
        streams = HeldStreams(router.url, model, turns[1])
        try:
            for _ in range(FILLERS):
                streams.open_one()
            assert not streams.errors, streams.errors
            got, went = turn(turns[2])
        finally:
            streams.close()
        assert went is other, (
            f"with {FILLERS} streams on {holder.spec.name}, kv_aware still sent turn 3 "
            f"there: {router.log_tail()}"
        )
    want = (own[holder.spec.name] - own[other.spec.name]) * BLOCK
    loaded = counter_when(other.url, EXTERNAL_HITS, lambda v: v > hits) - hits
    assert loaded == want, (own, loaded)
    assert push_stats(holder.bootstrap_url)["ok"] - pushes == 1
    assert grown(other, counted).get("pushed") == 1
    # references last: a salted request's events make the router drop its index
    check = compare(
        got,
        reference_completion(other.url, turns[2], max_tokens=4),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems
    assert wait_no_blocks_in_use(a.url, b.url, timeout=120) == (0.0, 0.0)
