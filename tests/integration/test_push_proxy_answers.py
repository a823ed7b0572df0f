"""An answer the source's own code did not give does not end a push; a source
whose pushes land nothing is no longer asked.

Two real instances (C: the reference and the KV fingerprint; D: the destination)
and, on D's allowlist, a push source in this process with a Mooncake transfer
engine of its own, standing for a source behind a proxy whose read timeout is
shorter than the write: it answers /match_blocks as C does (it forwards D's
call to C and claims every full block), and /push_blocks with a proxy's
``504 Gateway Timeout`` at once, while "the source behind it" still writes: 3 s
later, garbage into every block D asked for. D must keep the push's blocks
out of use until its hold has passed (the late bytes then land in blocks nobody
uses), not end the push at the 504, prefill into the blocks and cache them
before the late bytes arrive; past the push's budget it prefills the request in
other blocks. The same prompt asked again, served from D's prefix cache, must
then match C's reference.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import complete, forwarded_match_claiming_every_block
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    FAILURES_TO_DEMOTE,
)

pytestmark = pytest.mark.integration

LATE_S = 3.0  # the write behind the proxy lands this long after its 504
PUSH_TIMEOUT_S = 5  # D's MOONCAKE_PUSH_TIMEOUT_S: its hold is about 31 s here
# the source's engine: its transport drops a connection stalled this long
WATCHDOG_S = 5


class SourceBehindAProxy:
    """Answers /push_blocks 504 without the source's refusal header, then writes
    random bytes into every block and KV tensor the push named."""

    def __init__(self):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        # the transport reads its watchdog once, when it starts: only this engine's
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", str(WATCHDOG_S))
            mp.setenv("MC_TCP_STATUS_TIMEOUT_SEC", str(WATCHDOG_S))
            if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("the test's transfer engine did not start")
        self.garbage: np.ndarray | None = None
        self.c_bootstrap = ""
        self.fingerprint: dict = {}
        self.landed = threading.Event()
        self.answered_at = 0.0
        self.url = ""
        self.pushes = 0  # /push_blocks calls
        self.fails = False  # answer every push with a failed write of its own

    def respond(self, handler: BaseHTTPRequestHandler, path: str, raw: bytes):
        if path == "/match_blocks":
            return self.match(raw, handler.headers.get("authorization"))
        if path == "/push_blocks":
            self.pushes += 1
            if self.fails:
                # the source's own answer: its write failed, nothing landed
                return {"status": "failed", "pushed_blocks": 0, "message": "cut"}
            push = json.loads(raw)
            threading.Thread(target=self.write_late, args=(push,), daemon=True).start()
            body = b"<html><body>504 Gateway Time-out</body></html>"
            handler.send_response(504)
            handler.send_header("content-type", "text/html")
            handler.send_header("content-length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            self.answered_at = time.monotonic()
            return None
        raise AssertionError(f"unexpected call {path}")

    def match(self, raw: bytes, authorization: str | None) -> dict:
        out = forwarded_match_claiming_every_block(
            self.c_bootstrap, raw, authorization, BLOCK
        )
        self.fingerprint = out["fingerprint"]
        # the engine's floor, its short watchdog, a kernel that gives up on
        # orphaned connections at once and a transport that connects again for no
        # longer than a second: D's hold for this source is as short as it can be
        # (5 + 5 + 5 + 11 + 5 s)
        return {
            **out,
            "engine_timeout_s": 5,
            "tcp_orphan_retries": 1,
            "engine_no_progress_s": WATCHDOG_S,
            "engine_reconnect_s": 1,
        }

    def write_late(self, push: dict) -> None:
        time.sleep(LATE_S)
        blen = self.fingerprint["block_len"]
        blocks, bases = push["dst_block_ids"], push["dst_kv_base_addrs"]
        n = len(blocks) * len(bases)
        self.garbage = np.random.default_rng(5).integers(
            0, 256, n * blen, dtype=np.uint8
        )
        src = self.garbage.ctypes.data
        assert self.engine.register_memory(src, self.garbage.nbytes) == 0
        srcs = [src + k * blen for k in range(n)]
        dsts = [base + b * blen for b in blocks for base in bases]
        rc = self.engine.batch_transfer_sync_write(
            push["dst_session"], srcs, dsts, [blen] * n
        )
        assert rc == 0, f"the late write into D failed ({rc})"
        self.landed.set()


def pushed_from(source, d, ids):
    """D's answer to ``ids`` with a push from ``source`` asked for."""
    return complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": source.url},
    )


@pytest.fixture(scope="module")
def env(push_source_cluster):
    source = SourceBehindAProxy()
    cl, server = push_source_cluster(
        source.respond,
        instances={
            "d": {
                "env": {
                    "MOONCAKE_PUSH_TIMEOUT_S": str(PUSH_TIMEOUT_S),
                    # every push granted whatever it cost: only failures demote
                    "MOONCAKE_PUSH_POLICY": "always",
                }
            }
        },
    )
    source.url = server.url
    source.c_bootstrap = cl["c"].bootstrap_url
    return cl["c"], cl["d"], source


def test_a_proxys_504_keeps_the_push_blocks_until_the_hold_has_passed(env):
    c, d, source = env
    # C has run a step: its mirror knows the scheduler's hashing (its /match_blocks answers)
    complete(c.url, prompt(BLOCK, seed=8100), max_tokens=1, logprobs=None, timeout=300)
    ids = prompt(3 * BLOCK + 5, seed=8110)  # new to D: no local hit
    t0 = time.monotonic()
    first = pushed_from(source, d, ids)
    took = time.monotonic() - t0
    assert source.answered_at, "the source was never asked to push"
    assert source.landed.wait(30), "the late write did not land"
    assert not first.cached_tokens
    assert took > LATE_S, (
        f"D answered {took:.1f} s after the request, before the write behind the "
        f"proxy landed ({LATE_S:g} s after its 504): it ended the push at the 504"
    )
    reference = reference_completion(c.url, ids, max_tokens=4)
    check = compare(first, reference, expected_cached_tokens=None)
    assert check.ok, check.problems
    # the same prompt again: D serves its 3 full blocks from its prefix cache,
    # which must not hold a byte of the late write
    again = complete(d.url, ids, max_tokens=4, logprobs=5, timeout=300)
    assert again.cached_tokens >= 3 * BLOCK, (
        f"D's prefix cache served {again.cached_tokens} tokens: the check below "
        "would not read the blocks the late write hit"
    )
    check = compare(again, reference, expected_cached_tokens=None)
    assert check.ok, (
        f"D's cached blocks hold the bytes a write landed after the push ended: "
        f"{check.problems}"
    )
    assert wait_no_blocks_in_use(d.url) == (0.0,)


def test_a_source_whose_pushes_land_nothing_is_no_longer_asked(env):
    """The same source now answers every push with a failed write of its own.
    Under MOONCAKE_PUSH_POLICY=always (no cost judged), after FAILURES_TO_DEMOTE
    pushes in a row that landed nothing (the 504 above counts as one when it ran
    first), D prefills its requests locally without asking the source (before,
    every push from a source whose writes never landed was granted); one probe
    follows PROBE_AFTER_S later (unit-tested). Every answer matches C's
    reference."""
    c, d, source = env
    source.fails = True
    asked = []
    for i in range(FAILURES_TO_DEMOTE + 2):
        before = source.pushes
        ids = prompt(3 * BLOCK + 5, seed=8200 + i)
        out = pushed_from(source, d, ids)
        asked.append(source.pushes - before)
        check = compare(
            out,
            reference_completion(c.url, ids, max_tokens=4),
            expected_cached_tokens=None,
        )
        assert check.ok, check.problems
    assert 1 <= sum(asked) <= FAILURES_TO_DEMOTE, asked
    assert asked == sorted(asked, reverse=True) and asked[-2:] == [0, 0], (
        f"pushes asked of the source, request by request: {asked}; it should no "
        f"longer be asked after {FAILURES_TO_DEMOTE} in a row landed nothing"
    )
    assert wait_no_blocks_in_use(d.url) == (0.0,)
