"""A push source that writes only part of the blocks gets none of them accepted.

Two real instances (C: the reference and the KV fingerprint; D: the destination)
and, on D's allowlist, a hostile source in this process with a Mooncake transfer
engine of its own. It answers /match_blocks with C's fingerprint (it forwards
D's call to C, authorization included) and every full block of the prompt
and, asked to push, writes only 8-byte words into D's KV cache: the positions
D checks when the push names them, else a guess of one word per block and
tensor (64 bytes in all), and, asked for a proof, the positions asked for
before answering; it answers "ok" with consistent numbers and the bytes it
wrote. D must count none of the blocks (the rest holds whatever D's blocks
held before), prefill them itself and answer correctly. C, D and the source are
the shared "push" cluster (tests/integration/conftest.py), as in
tests/integration/test_push_exposed.py, whose hostile answers write nothing.
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

pytestmark = pytest.mark.integration

WORD = 8


class PartialWriter:
    """A push source that writes 8-byte words into the destination, nothing else."""

    def __init__(self):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("the test's transfer engine did not start")
        self.src = np.random.default_rng(11).integers(1, 256, 1 << 16, dtype=np.uint8)
        if self.engine.register_memory(self.src.ctypes.data, self.src.nbytes) != 0:
            raise RuntimeError("register_memory failed")
        self.c_bootstrap = ""  # where /match_blocks is forwarded to
        self.fingerprint: dict = {}
        self.pushes: dict[str, dict] = {}
        self.words_written = 0
        self.lock = threading.Lock()
        self.url = ""  # where it is served (shared_source)

    def respond(self, handler: BaseHTTPRequestHandler, path: str, raw: bytes) -> dict:
        if path == "/match_blocks":
            return self.match(raw, handler.headers.get("authorization"))
        return self.answer(path, json.loads(raw))

    def write(self, push: dict, words: list[list[int]]) -> list[str]:
        """Write one word of this source's bytes at each (block index, tensor,
        offset) of D's blocks; the hex of what was written, in order."""
        blen = self.fingerprint["block_len"]
        src, dst, values = [], [], []
        with self.lock:
            for i, slot, off in words:
                k = self.words_written % (self.src.nbytes // WORD)
                self.words_written += 1
                src.append(self.src.ctypes.data + k * WORD)
                dst.append(
                    push["dst_kv_base_addrs"][slot]
                    + push["dst_block_ids"][i] * blen
                    + off
                )
                values.append(self.src[k * WORD : (k + 1) * WORD].tobytes().hex())
        rc = self.engine.batch_transfer_sync_write(
            push["dst_session"], src, dst, [WORD] * len(src)
        )
        assert rc == 0, f"the partial write into D failed ({rc})"
        return values

    def match(self, raw: bytes, authorization: str | None) -> dict:
        out = forwarded_match_claiming_every_block(
            self.c_bootstrap, raw, authorization, BLOCK
        )
        self.fingerprint = out["fingerprint"]
        return out

    def answer(self, path: str, req: dict) -> dict:
        fp = self.fingerprint
        if path == "/push_proof":  # told the positions: write them now, then answer
            push = self.pushes.pop(req["push_id"])
            return {"status": "ok", "probe_values": self.write(push, req["probes"])}
        n = len(req["dst_block_ids"])
        told = req.get("probes")
        words = (
            told
            or [[i, slot, 0] for i in range(n) for slot in range(fp["num_kv_tensors"])][
                :8
            ]
        )
        values = self.write(req, words)
        body = {
            "status": "ok",
            "pushed_blocks": n,
            "matched_blocks": n,
            "total_full_blocks": n,
            "bytes": n * fp["block_len"] * fp["num_kv_tensors"],
        }
        if told is not None:
            body["probe_values"] = values
        else:
            push_id = f"p{len(self.pushes)}-{time.monotonic_ns()}"
            self.pushes[push_id] = req
            body["push_id"] = push_id
        return body


@pytest.fixture(scope="module")
def env(shared_cluster, shared_source):
    writer = PartialWriter()
    cl = shared_cluster("push", answer=writer.respond)
    writer.url = shared_source.url
    return cl["c"], cl["d"], writer


def test_a_source_writing_only_a_few_words_of_each_block_gets_no_block(env):
    c, d, writer = env
    writer.c_bootstrap = c.bootstrap_url
    complete(c.url, prompt(BLOCK, seed=8000), max_tokens=1, logprobs=None, timeout=300)
    for seed in (8010, 8011):
        ids = prompt(3 * BLOCK + 5, seed=seed)  # new to D: no local hit
        before = writer.words_written
        got = complete(
            d.url,
            ids,
            max_tokens=4,
            logprobs=5,
            timeout=300,
            kv_transfer_params={"push_from": writer.url},
        )
        assert writer.words_written > before, "the source was never asked to push"
        fp = writer.fingerprint
        assert not got.cached_tokens, (
            f"D counted {got.cached_tokens} tokens from a source that wrote "
            f"{(writer.words_written - before) * WORD} of the "
            f"{3 * fp['block_len'] * fp['num_kv_tensors']} bytes of 3 blocks"
        )
        check = compare(
            got,
            reference_completion(c.url, ids, max_tokens=4),
            expected_cached_tokens=None,
        )
        assert check.ok, check.problems
    assert wait_no_blocks_in_use(d.url) == (0.0,)
