"""Proof of write that the source cannot prepare for (push/receiver.py, push/server.py).

D plants random canaries at secret random positions of the blocks it asks for
and sends /push_blocks without them. Once C has answered (its write has
returned), D reads its own bytes there, and only then asks C (/push_proof,
naming the push id C returned) for the source bytes at those positions; C
answers only while the pushed source blocks' generations are unchanged. A
source that writes only part of the blocks cannot know which words D will
check, and writing them once it is told comes too late.

The layout reproduces the case this guards against: 3 blocks of 2 KV tensors of
256 bytes (1536 bytes); a source that writes 8 words (64 bytes) and leaves 1472
bytes of whatever D's blocks held. Real HTTP, a memmove engine between torch
tensors standing in for the two KV caches; D's positions come from a seeded
generator, so every run checks the same positions. For positions drawn at
random, the chance that a partial writer passes is worked out in
push/receiver.py's docstring.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
import torch
from helpers import C_SOURCE, filled_mirror, push_job, serve_push, wait_until

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.kv_reader import (
    KVReader,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push import source_server
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)

BS, NBLK, BLEN, SLOTS = 4, 8, 256, 2
CFG = HashConfig("sha256", b"\x05" * 32)
TOKENS = list(range(900, 900 + 3 * BS))
C_BLOCKS = [5, 2, 6]
DST = (3, 4, 7)
FP = KVFingerprint(
    model="m",
    dtype="float32",
    block_size=BS,
    tp_size=1,
    block_len=BLEN,
    num_kv_tensors=SLOTS,
)
TOKEN = "proof-test-token"
C_CONFIG = ExtConfig(bootstrap_host="127.0.0.1", bootstrap_token=TOKEN)
D_CONFIG = ExtConfig(push_timeout_s=5, bootstrap_token=TOKEN)
SEEDS = [1, 2, 3, 7, 42]


def kv(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NBLK * BLEN,), dtype=torch.uint8, generator=g)
        for _ in range(SLOTS)
    ]


def block(t, b):
    return t[b * BLEN : (b + 1) * BLEN]


def stale_bytes(c_kv, d_kv, n=3):
    """Bytes of D's first ``n`` destination blocks that differ from C's source blocks."""
    return sum(
        int((block(c, cb) != block(d, db)).sum())
        for c, d in zip(c_kv, d_kv)
        for cb, db in zip(C_BLOCKS[:n], DST[:n])
    )


class Log:
    def __init__(self):
        self.lock = threading.Lock()
        self.entries: list[str] = []

    def __call__(self, what):
        with self.lock:
            self.entries.append(what)

    def index(self, what):
        return self.entries.index(what)

    def all(self, prefix):
        return [i for i, e in enumerate(self.entries) if e.startswith(prefix)]


class Source(PushServer):
    """C with a memmove engine. ``words``: None writes the blocks whole; else a
    function of the push body giving the (block index, KV tensor, offset) words
    it writes, 8 bytes each, and nothing else. Told the positions of a proof,
    such a source first writes them too (late), then answers."""

    def __init__(self, c_kv, d_kv, words=None, log=None, clock=time.monotonic, held=3):
        sync = filled_mirror(BS, TOKENS, C_BLOCKS[:held], CFG)
        self.c_kv, self.d_kv, self.words, self.log = c_kv, d_kv, words, log or Log()
        super().__init__(
            sync,
            self._engine,
            [t.data_ptr() for t in c_kv],
            BLEN,
            FP,
            "c:1",
            C_CONFIG,
            reader=KVReader(c_kv, BLEN, NBLK).read,
            clock=clock,
            source_id=C_SOURCE,
        )

    def _copy(self, i, slot, off, n=8):
        src, dst = C_BLOCKS[i] * BLEN + off, DST[i] * BLEN + off
        self.d_kv[slot][dst : dst + n] = self.c_kv[slot][src : src + n]

    def _engine(self, session, src, dst, lens):
        self.log("c: write starts")
        for i, slot, off in (
            self._body_words
            if self.words
            else [(i, s, 0) for i in range(3) for s in range(SLOTS)]
        ):
            self._copy(i, slot, off, 8 if self.words else BLEN)
        self.log("c: write returns")
        return 0

    def push(self, payload, *args, **kw):
        self.log("c: push received")
        body = json.loads(payload)
        if self.words:
            self._body_words = self.words(body)
        return super().push(payload, *args, **kw)

    def proof(self, payload, received=None):
        self.log("c: proof received")
        if self.words:  # a late write of exactly the words asked for
            for i, slot, off in json.loads(payload).get("probes", []):
                self._copy(i, slot, off)
        return super().proof(payload, received)


def probes_or_guess(body):
    """The words D checks if the push names them, else a guess: the first word of
    each block and tensor, the second of the first block (8 words, 64 bytes)."""
    told = [tuple(p) for p in body.get("probes", [])]
    return told or [(i, s, 0) for i in range(3) for s in range(SLOTS)] + [
        (0, 0, 8),
        (0, 1, 8),
    ]


def first_half(body):
    return [
        (i, s, off)
        for i in range(3)
        for s in range(SLOTS)
        for off in range(0, BLEN // 2, 8)
    ]


class Receiver:
    def __init__(self, d_kv, seed, reader=None, config=D_CONFIG, **kw):
        self.rec = PushReceiver(
            "d:1",
            [t.data_ptr() for t in d_kv],
            BLEN,
            BS,
            NBLK,
            FP,
            config,
            kv=reader or KVReader(d_kv, BLEN, NBLK),
            **kw,
        )
        self.rec._rng = random.Random(seed)

    def push(self, url):
        self.rec.start([push_job("r", url, DST, tokens=TOKENS)])
        assert wait_until(lambda: bool(self.rec.merge_finished(None)), 10)
        return self.rec.take_outcome().landed["r"]


def run(words, seed, **receiver_kw):
    c_kv, d_kv = kv(1), kv(2)
    src = Source(c_kv, d_kv, words, receiver_kw.pop("log", None))
    url, stop = serve_push(src)
    try:
        landed = Receiver(d_kv, seed, **receiver_kw).push(url)
    finally:
        stop()
    return landed, stale_bytes(c_kv, d_kv), src


@pytest.mark.parametrize("seed", SEEDS)
def test_a_source_writing_whole_blocks_gets_all_of_them(seed):
    landed, stale, src = run(None, seed)
    assert (landed, stale) == (3, 0)
    assert src.stats["proofs_ok"] == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_a_source_writing_only_the_probed_words_gets_no_block(seed):
    """It writes the 8-byte words D checks when the push names them, else 8
    guessed words (64 of 1536 bytes), and the words a proof asks for once asked."""
    landed, stale, _ = run(probes_or_guess, seed)
    assert stale >= 1536 - 64 - 16 * 8, stale
    assert landed == 0, (
        f"D accepted {landed} of 3 blocks of which {stale} of 1536 bytes "
        "were never written by the source"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_source_writing_half_of_every_block_gets_no_block(seed):
    landed, stale, _ = run(first_half, seed)
    assert stale >= 1536 // 2 - 16 * 8, stale
    assert landed == 0, f"D accepted {landed} of 3 half-written blocks"


class Lying(Source):
    """Writes every block, then does not prove it as it should."""

    lie = ""

    def push(self, payload, *args, **kw):
        code, out = super().push(payload, *args, **kw)
        if self.lie == "no id":
            out["push_id"] = None
        return code, out

    def proof(self, payload, received=None):
        code, out = super().proof(payload, received)
        if self.lie == "other bytes":
            out["probe_values"] = ["00" * 8 for _ in out["probe_values"]]
        elif self.lie == "fewer bytes":
            out["probe_values"] = out["probe_values"][:-1]
        elif self.lie == "failed":
            out = {"status": "failed", "message": "changed"}
        elif self.lie == "slow":
            time.sleep(3)
        return code, out


@pytest.mark.parametrize(
    "lie", ["no id", "other bytes", "fewer bytes", "failed", "slow"]
)
def test_an_unproven_push_counts_no_block_and_ends_without_waiting_for_the_hold(lie):
    """D waits for a proof no longer than for a match (MOONCAKE_PUSH_MATCH_TIMEOUT_S):
    the write has returned, nothing more can land."""
    c_kv, d_kv = kv(1), kv(2)
    src = type("Liar", (Lying,), {"lie": lie})(c_kv, d_kv)
    url, stop = serve_push(src)
    try:
        t0 = time.monotonic()
        landed = Receiver(
            d_kv,
            1,
            config=ExtConfig(
                push_timeout_s=5, push_match_timeout_s=0.5, bootstrap_token=TOKEN
            ),
        ).push(url)
        took = time.monotonic() - t0
    finally:
        stop()
    assert landed == 0
    assert took < 2.5, f"the push ended {took:.1f} s after it started"


# ---- C's /push_proof -------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def push_body(**over):
    body = {
        "token_ids": TOKENS,
        "block_size": BS,
        "dst_session": "127.0.0.1:17002",
        "dst_kv_base_addrs": [1 << 20, 2 << 20],
        "dst_block_ids": list(DST),
        "deadline_unix_ms": int(time.time() * 1000) + 60_000,
        "dst_num_blocks": NBLK,
        "source_id": C_SOURCE,
        "fingerprint": FP.model_dump(),
        "block_len": BLEN,
    }
    body.update(over)
    return json.dumps(body)


def proof_body(push_id, probes):
    return json.dumps({"push_id": push_id, "probes": [list(p) for p in probes]})


def pushed(src, **over):
    code, out = src.push(push_body(**over))
    assert code == 200 and out["status"] == "ok", out
    assert out["push_id"]
    return out


def c_value(c_kv, i, slot, off):
    start = C_BLOCKS[i] * BLEN + off
    return bytes(c_kv[slot][start : start + 8].tolist()).hex()


def test_proof_answers_the_source_bytes_once():
    c_kv = kv(1)
    src = Source(c_kv, kv(2))
    out = pushed(src)
    probes = [(0, 0, 0), (2, 1, BLEN - 8), (1, 0, 128)]
    code, ans = src.proof(proof_body(out["push_id"], probes))
    assert code == 200 and ans["status"] == "ok", ans
    assert ans["probe_values"] == [c_value(c_kv, *p) for p in probes]
    code, ans = src.proof(proof_body(out["push_id"], probes))
    assert code == 404, "a push id was good for a second proof"


def test_proof_refuses_an_unknown_id():
    src = Source(kv(1), kv(2))
    pushed(src)
    real = pushed(src)["push_id"]
    for push_id in [
        "nope",
        "",
        "x" * 65,
        real[:-1] + ("A" if real[-1] != "A" else "B"),
    ]:
        code, ans = src.proof(proof_body(push_id, [(0, 0, 0)]))
        assert code in (404, 422) and "probe_values" not in ans, (push_id, code, ans)


def test_proof_refuses_an_expired_id():
    clock = Clock()
    src = Source(kv(1), kv(2), clock=clock)
    out, kept = pushed(src), pushed(src)
    clock.now += src.proof_kept_s(3 * BLEN * SLOTS) - 0.01
    assert src.proof(proof_body(kept["push_id"], [(0, 0, 0)]))[0] == 200
    clock.now += 0.02
    code, ans = src.proof(proof_body(out["push_id"], [(0, 0, 0)]))
    assert code == 404 and "expired" in ans["detail"]["message"], ans


def test_remembered_pushes_are_bounded(monkeypatch):
    monkeypatch.setattr(source_server, "PROOFS_KEPT", 2)
    src = Source(kv(1), kv(2))
    ids = [pushed(src)["push_id"] for _ in range(3)]
    assert (
        src.proof(proof_body(ids[0], [(0, 0, 0)]))[0] == 404
    )  # the oldest was dropped
    assert src.proof(proof_body(ids[2], [(0, 0, 0)]))[0] == 200


def test_remembered_blocks_are_bounded(monkeypatch):
    monkeypatch.setattr(
        source_server, "PROOF_BLOCKS_KEPT", 5
    )  # room for one 3-block push
    src = Source(kv(1), kv(2))
    ids = [pushed(src)["push_id"] for _ in range(2)]
    assert src.proof(proof_body(ids[0], [(0, 0, 0)]))[0] == 404
    assert src.proof(proof_body(ids[1], [(0, 0, 0)]))[0] == 200


@pytest.mark.parametrize(
    "probe",
    [
        (3, 0, 0),  # a block not pushed (3 asked)
        (-1, 0, 0),
        (0, SLOTS, 0),
        (0, -1, 0),
        (0, 0, BLEN - 7),
        (0, 0, -8),
        (0, 0, 2**40),
    ],
)
def test_proof_refuses_positions_outside_the_pushed_blocks(probe):
    src = Source(kv(1), kv(2))
    code, ans = src.proof(proof_body(pushed(src)["push_id"], [(0, 0, 0), probe]))
    assert code == 422 and ans["detail"]["field"] == "probes", (probe, code, ans)
    assert "probe_values" not in ans


def test_proof_refuses_the_blocks_c_did_not_push():
    """C holds 2 of the 3 blocks asked for: block index 2 is not C's to reveal."""
    src = Source(kv(1), kv(2), held=2)
    out = pushed(src)
    assert out["pushed_blocks"] == 2
    code, ans = src.proof(proof_body(out["push_id"], [(2, 0, 0)]))
    assert code == 422 and "probe_values" not in ans


def test_proof_refuses_too_many_positions():
    src = Source(kv(1), kv(2))
    probes = [(0, 0, 8 * k) for k in range(17)]
    code, ans = src.proof(proof_body(pushed(src)["push_id"], probes))
    assert code == 422 and ans["detail"]["field"] == "probes"


def test_proof_fails_once_a_pushed_block_was_reused():
    src = Source(kv(1), kv(2))
    out = pushed(src)
    hashes = src.sync.prompt_hashes(TOKENS, None, None)
    src.sync.on_metadata(
        HashDelta(
            events=[(HashEventKind.REMOVED, to_pool_key(hashes[1]), 2)], hash_config=CFG
        )
    )
    src.sync.after_step()
    code, ans = src.proof(proof_body(out["push_id"], [(0, 0, 0)]))
    assert code == 200 and ans["status"] == "failed" and not ans["probe_values"], ans


def test_proof_over_http_is_authenticated_like_every_endpoint():
    """Signed as D signs its calls (auth.py); the body is capped at a few KiB."""
    src = Source(kv(1), kv(2))
    url, stop = serve_push(src)

    def post(body, config=D_CONFIG):
        body = body.encode() if isinstance(body, str) else body
        return httpx.post(
            url + "/push_proof",
            content=body,
            headers=request_headers(config, "POST", "/push_proof", body),
        )

    try:
        body = proof_body(pushed(src)["push_id"], [(0, 0, 0)])
        for headers in ({}, {"authorization": f"Bearer {TOKEN}"}):
            r = httpx.post(
                url + "/push_proof",
                content=body,
                headers={**headers, "content-type": "application/json"},
            )
            assert r.status_code == 401, r.text
        assert post(body, ExtConfig(bootstrap_token="another")).status_code == 401
        assert post(b"{" + b" " * (1 << 16) + b"}").status_code == 413
        r = post(body)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        r = post(proof_body("unknown", [(0, 0, 0)]))
        assert r.status_code == 404, r.text
    finally:
        stop()


# ---- GPU ordering (fake events, as tests/unit/connector/common/test_gpu_order.py) -----------------------


class FakeEvent:
    def __init__(self, log):
        self.log = log
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.log("d: canaries synchronized")
        self.done = True


class LoggedReader(KVReader):
    def __init__(self, tensors, log):
        super().__init__(tensors, BLEN, NBLK)
        self.log = log

    def read(self, slot, block, offset):
        self.log("d: read")
        return super().read(slot, block, offset)

    def write(self, slot, block, offset, data):
        self.log("d: canary copy queued")
        super().write(slot, block, offset, data)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_canaries_complete_before_the_push_and_d_reads_between_write_and_proof(seed):
    """The canary copies are queued on the compute stream: the event recorded
    after them is waited on before /push_blocks goes out (else C's write could
    land first, or a canary overwrite pushed KV after the proof). D reads its
    bytes after C's write returned and before C learns the positions."""
    log = Log()
    events: list[FakeEvent] = []

    def event(tensor):
        log("d: event recorded")
        events.append(FakeEvent(log))
        return events[-1]

    c_kv, d_kv = kv(1), kv(2)
    src = Source(c_kv, d_kv, None, log)
    url, stop = serve_push(src)
    try:
        r = Receiver(d_kv, seed, reader=LoggedReader(d_kv, log), event_factory=event)
        landed = r.push(url)
    finally:
        stop()
    assert landed == 3
    e = log.entries
    assert len(events) == 1, e
    planted, recorded = log.all("d: canary copy queued"), log.index("d: event recorded")
    assert planted and max(planted) < recorded, e
    assert (
        recorded < log.index("d: canaries synchronized") < log.index("c: push received")
    ), e
    reads = log.all("d: read")
    assert reads and log.index("c: write returns") < min(reads), e
    assert max(reads) < log.index("c: proof received"), e
