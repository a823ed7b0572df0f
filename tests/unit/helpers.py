"""Builders and stubs several unit test modules use, imported by name
(``from helpers import ...``); the fixtures built on them are in conftest.py.

- waiting: wait_until
- prefix push, C's side: a KV cache of numpy buffers (KV), a transfer engine
  that copies between them (MemEngine), a hash mirror holding a prompt's blocks
  (filled_mirror), a FastAPI app on 127.0.0.1 in a thread (serve, serve_routes,
  serve_push),
  and all of it together over real HTTP (CServer);
- prefix push, D's side: a request (d_request), a match asked until answered
  (ask), a clock a test moves by hand (Clock);
- layer-wise push, P's side: a sender on a write counter (make_layerwise_sender,
  LayerwiseEngine), D's addresses, steps and ends (lw_dest, lw_step,
  lw_finished), and what poll() reports (poll_finished_sending).
"""

from __future__ import annotations

import ctypes
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import torch
from fastapi import FastAPI

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
    read_key,
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_sender import (
    LayerwiseSender,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.prefill_tracker import (
    Destination,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    ComputedStep,
    FinishedRequest,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
    PushJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_server import (
    PushServer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.routes import (
    Served,
    add_routes,
)


def get_headers(config: ExtConfig) -> dict[str, str]:
    """Headers for the GET routes (``/push/stats``, ``/hashsync``,
    ``/layerwise/transfers``): the read key derived from the token, as a bearer (what
    harness/pd_client.py sends; never the token itself)."""
    headers = {"content-type": "application/json"}
    if config.bootstrap_token:
        headers["authorization"] = f"Bearer {read_key(config.bootstrap_token)}"
    return headers


class RecordedFence:
    """The send-queue fence (engine_write.TerminalWriter's), recording the failed
    writes it was asked to wait for; nothing is queued in the kernel."""

    def __init__(self):
        self.waited: list[str] = []
        self.noted: list[str] = []

    def note(self, session):
        self.noted.append(session)

    def wait(self, session, bound_s, started):
        self.waited.append(session)
        return 0.0


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


# ---- prefix push: C and D alike (CServer's layout) ------------------------------------

BS, SLOTS, NBLK, BLEN = 4, 2, 16, 64
HCFG = HashConfig("sha256", b"\x01" * 32)
TOKENS = list(range(500, 500 + 3 * BS + 1))  # 3 full blocks + 1 token
C_BLOCKS = [5, 2, 6]  # where C holds them
DST_BLOCKS = [3, 4, 7]  # where D wants them
FP = KVFingerprint(
    model="Arch:0123456789abcdef",
    dtype="float32/auto",
    block_size=BS,
    tp_size=1,
    block_len=BLEN,
    num_kv_tensors=SLOTS,
)
C_SESSION = "127.0.0.1:17001"  # C's own transfer engine
D_SESSION = "127.0.0.1:17002"
C_SOURCE = "c-under-test"  # the source_id of the PushServers tests build
SCHED_FP = KVFingerprint(model=FP.model, dtype=FP.dtype, block_size=BS, tp_size=1)


class KV:
    """One instance's KV cache: ``slots`` tensors of ``nblk`` blocks of ``blen``
    bytes (SLOTS, NBLK, BLEN unless a test has a layout of its own). Filled, each
    block of each tensor holds a byte of its own."""

    def __init__(
        self, fill: bool, slots: int = SLOTS, nblk: int = NBLK, blen: int = BLEN
    ):
        self.blen = blen
        self.kv = [np.zeros(nblk * blen, dtype=np.uint8) for _ in range(slots)]
        if fill:
            for s, t in enumerate(self.kv):
                for b in range(nblk):
                    t[b * blen : (b + 1) * blen] = (s * nblk + b) % 251 + 1
        self.bases = [t.ctypes.data for t in self.kv]

    def block(self, slot: int, b: int) -> np.ndarray:
        return self.kv[slot][b * self.blen : (b + 1) * self.blen]

    def snapshot(self) -> bytes:
        return b"".join(t.tobytes() for t in self.kv)

    def untouched(self) -> bool:
        return not any(t.any() for t in self.kv)


class MemEngine:
    """write_fn: logs every call; copies only into memory registered for the session
    (anything else: -1, nothing copied). gate(): writes wait until it opens."""

    def __init__(self):
        self.log: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.regions: dict[str, list[tuple[int, int]]] = {}
        self.lock = threading.Lock()
        self._gate: threading.Event | None = None
        self.entered = 0

    def register(self, session: str, kv: KV) -> None:
        self.regions[session] = [(t.ctypes.data, t.nbytes) for t in kv.kv]

    def gate(self) -> threading.Event:
        self._gate = threading.Event()
        return self._gate

    def bytes_logged(self) -> int:
        with self.lock:
            return sum(sum(lens) for _, _, lens in self.log)

    def __call__(self, session, src, dst, lens, layout=None) -> int:
        with self.lock:
            self.log.append((session, tuple(dst), tuple(lens)))
            self.entered += 1
        if self._gate is not None:
            assert self._gate.wait(30), "test gate never opened"
        regions = self.regions.get(session, [])
        for d, n in zip(dst, lens):
            if not any(lo <= d and d + n <= lo + size for lo, size in regions):
                return -1
        for s, d, n in zip(src, dst, lens):
            ctypes.memmove(d, s, n)
        return 0


def filled_mirror(
    block_size: int,
    tokens: list[int],
    blocks: list[int],
    hash_config: HashConfig,
    cache_salt: str | None = None,
) -> WorkerHashSync:
    """A worker's hash mirror whose published blocks ``blocks`` hold the full
    blocks of ``tokens``, in order."""
    sync = WorkerHashSync(block_size)
    hashes = hash_prompt_blocks(
        tokens,
        block_size,
        hash_config.hash_algo,
        hash_config.none_hash,
        cache_salt=cache_salt,
    )
    sync.on_metadata(
        HashDelta(
            events=[
                (HashEventKind.STORED, to_pool_key(h), b)
                for h, b in zip(hashes, blocks)
            ],
            hash_config=hash_config,
        )
    )
    sync.after_step()
    return sync


def serve(app) -> tuple[str, callable]:
    """Run a FastAPI app on 127.0.0.1 (a socket bound here: no port race)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical")
    )
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    end = time.monotonic() + 10
    while not uv.started and time.monotonic() < end:
        time.sleep(0.01)
    assert uv.started, "uvicorn did not start"

    def stop():
        uv.should_exit = True
        th.join(5)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


def serve_routes(
    config: ExtConfig,
    push=None,
    hashsync=None,
    layerwise=None,
    push_here: bool = True,
) -> tuple[str, callable]:
    """The bootstrap server's routes (routes.py) on 127.0.0.1, behind one guard
    built from ``config``, serving the given objects (None: not there): (url, stop)."""
    app = FastAPI()
    add_routes(
        app,
        EndpointGuard(config),
        config,
        Served(
            hashsync=lambda: hashsync,
            push=lambda: push,
            layerwise=lambda: layerwise,
            push_here=push_here,
            layerwise_here=layerwise is not None,
        ),
    )
    return serve(app)


def serve_push(server: PushServer) -> tuple[str, callable]:
    """C's /push_blocks, /match_blocks and /push_proof on 127.0.0.1: (url, stop)."""
    return serve_routes(server.config, push=server)


class CServer:
    """C: a filled KV cache whose hash mirror holds TOKENS' 3 blocks, serving
    every route of routes.py over HTTP (no layer-wise sender)."""

    def __init__(
        self,
        config: ExtConfig,
        fingerprint: KVFingerprint = FP,
        source_id: str = C_SOURCE,
        tp_rank: int = 0,
    ):
        """``tp_rank``: one rank of a TP > 1 source (source_ranks.py)."""
        self.config = config
        self.c = KV(fill=True)
        self.sync = filled_mirror(BS, TOKENS, C_BLOCKS, HCFG)
        self.engine = MemEngine()
        self.server = PushServer(
            self.sync,
            self.engine,
            self.c.bases,
            BLEN,
            fingerprint,
            C_SESSION,
            config,
            source_id=source_id,
            tp_rank=tp_rank,
        )
        self.url, self._stop = serve_routes(
            config, push=self.server, hashsync=self.sync
        )
        self.port = int(self.url.rsplit(":", 1)[1])
        self.headers = get_headers(config)  # the GET routes (bearer)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def destination(self, session: str = D_SESSION) -> KV:
        d = KV(fill=False)
        self.engine.register(session, d)
        return d

    def post(self, path: str, body, headers=None, **kw) -> httpx.Response:
        """POST as D does: signed when C has a token (auth.request_headers)."""
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        if headers is None:
            raw = content.encode() if isinstance(content, str) else content
            headers = request_headers(self.config, "POST", path, raw)
        return self.http.post(path, content=content, headers=headers, **kw)

    def close(self):
        self.http.close()
        self._stop()


# ---- prefix push: D -------------------------------------------------------------------


def push_job(rid: str, source: str, dst_blocks=DST_BLOCKS, tokens=TOKENS) -> PushJob:
    """D's job: push the leading blocks of ``tokens`` from ``source`` (a C named
    C_SOURCE) into ``dst_blocks``."""
    return PushJob(
        rid, source, tuple(tokens), None, None, 0, tuple(dst_blocks), source_id=C_SOURCE
    )


def d_request(
    rid="r1",
    n_tokens=5 * BS + 3,
    source="http://c:9000",
    tokens=None,
    params=None,
    salt=None,
):
    """A request as D's PushScheduler reads it: ``n_tokens`` tokens (or ``tokens``),
    naming ``source`` (or with ``params`` as its kv_transfer_params)."""
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(n_tokens) if tokens is None else tokens),
        kv_transfer_params={"push_from": source} if params is None else params,
        cache_salt=salt,
        lora_request=None,
        num_computed_tokens=0,
        num_external_computed_tokens=0,
    )


class Blocks:
    """What vLLM allocated for a request (KVCacheBlocks, one group): the ids, and
    vLLM's block objects, each held once (by the request)."""

    def __init__(self, ids):
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self.ids = ids
        self.blocks = ([KVCacheBlock(i, ref_cnt=1) for i in ids],)

    def get_block_ids(self):
        return (self.ids,)


def ask(sched: PushScheduler, r, local_tokens=0, timeout=10):
    first = sched.get_num_new_matched_tokens(r, local_tokens)
    if first != (None, False):
        return first
    fut = sched._matches[r.request_id]
    end = time.monotonic() + timeout
    while not fut.done() and time.monotonic() < end:
        time.sleep(0.005)
    return sched.get_num_new_matched_tokens(r, local_tokens)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# ---- layer-wise push, P's side ----------------------------------------------

LW_BS = 4
LW_TENSOR = torch.zeros(1)  # layer_saved only needs a tensor (CPU: no event)
LW_D_BASES = [1_000_000, 2_000_000]


class LayerwiseEngine:
    """write_fn stub: counts writes per session; a gated session blocks in the engine."""

    def __init__(self):
        self.lock = threading.Lock()
        self.writes: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def gate(self, session):
        self.entered[session] = threading.Event()
        self.gates[session] = threading.Event()
        return self.gates[session]

    def __call__(self, session, src, dst, lens, layout=None):
        if session in self.gates:
            self.entered[session].set()
            assert self.gates[session].wait(10), "test gate never opened"
        with self.lock:
            self.writes[session] = self.writes.get(session, 0) + 1
        return 0


def make_layerwise_sender(engine=None, timeout_s=30.0, unknown_s=60.0):
    cfg = ExtConfig(
        layerwise=True,
        layerwise_timeout_s=timeout_s,
        layerwise_unknown_timeout_s=unknown_s,
        engine_transfer_timeout_s=5,
    )
    return LayerwiseSender(
        engine or LayerwiseEngine(),
        {"l0": [0, 1]},
        [10_000, 20_000],
        64,
        LW_BS,
        cfg,
        event_factory=lambda t: None,
    )


def lw_dest(session="d:1", first=100):
    return Destination(session, LW_D_BASES, [first, first + 1])


def lw_step(tid, p_req_id=None, blocks=(1, 2), tokens=8):
    return ComputedStep(tid, p_req_id or "p" + tid, tuple(blocks), tokens, tokens)


def lw_finished(tid, p_req_id=None, blocks=(1, 2), tokens=8, aborted=False):
    return FinishedRequest(tid, p_req_id or "p" + tid, tuple(blocks), tokens, aborted)


def poll_finished_sending(sender, want, timeout=5.0) -> set[str]:
    """Everything poll() reports until ``want`` was seen (or the timeout)."""
    seen: set[str] = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end and not want <= seen:
        seen |= sender.poll()
        time.sleep(0.01)
    return seen


def sender_idle(sender) -> bool:
    """A LayerwiseSender has no batch queued and no write in flight."""
    snap = sender.snapshot()
    return not snap["writes_queued"] and not snap["writes_in_flight"]


def commit_pending(table) -> int:
    """Seal a WorkerHashTable's current step as completed and publish what is ready."""
    table.seal_pending(None)
    return table.commit_ready()


# ---- prefix push: C's endpoint, as the push tests call it ----------------------

TOKEN = "tok-3f9c2a7e51"
READ = read_key(TOKEN)  # the GET routes' bearer key
AUTH = {"authorization": f"Bearer {READ}"}


def changed_bytes(before: bytes, after: bytes) -> int:
    return int(
        np.count_nonzero(
            np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8)
        )
    )


def push_body(d: KV, session: str = D_SESSION, **over) -> dict:
    b = {
        "token_ids": TOKENS,
        "cache_salt": None,
        "lora_name": None,
        "block_size": BS,
        "dst_session": session,
        "dst_kv_base_addrs": d.bases,
        "dst_block_ids": DST_BLOCKS,
        "first_block": 0,
        "block_len": BLEN,
        "request_id": "r1",
        "deadline_unix_ms": int(time.time() * 1000) + 60_000,
        "dst_num_blocks": NBLK,
        "source_id": C_SOURCE,
        "fingerprint": FP.model_dump(),
    }
    b.update(over)
    return b


def assert_landed(c: KV, d: KV, dst_blocks=DST_BLOCKS) -> None:
    for s in range(SLOTS):
        for cb, db in zip(C_BLOCKS, dst_blocks):
            assert (d.block(s, db) == c.block(s, cb)).all(), f"slot {s} block {db}"
        for b in set(range(NBLK)) - set(dst_blocks):
            assert not d.block(s, b).any(), f"slot {s} block {b} was written"


def assert_push_ok(c_srv: CServer, d: KV, r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "ok" and out["pushed_blocks"] == 3, out
    assert out["bytes"] == 3 * SLOTS * BLEN
    assert_landed(c_srv.c, d)


def refused(c: CServer, body: dict, status: int, *dests: KV, **kw) -> dict:
    calls = len(c.engine.log)
    snaps = [x.snapshot() for x in dests]
    r = c.post("/push_blocks", body, **kw)
    assert r.status_code == status, r.text
    assert len(c.engine.log) == calls, "the engine was called for a refused push"
    for x, s in zip(dests, snaps):
        assert x.snapshot() == s, "a refused push changed destination bytes"
    return r.json()


# ---- answers and bodies written as raw JSON ---------------------------------------


def required_fields(model) -> list[str]:
    """The fields a request model (pydantic) cannot do without."""
    return [name for name, f in model.model_fields.items() if f.is_required()]


class Raw:
    """A JSON literal written as is (NaN, 1e400, 0x10, ...)."""

    def __init__(self, text: str):
        self.text = text


def dumps(obj) -> bytes:
    raws: list[str] = []

    def sub(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(o, dict):
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, list):
            return [sub(v) for v in o]
        return o

    text = json.dumps(sub(obj))
    for i, r in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', r)
    return text.encode()


NOW = Raw("@@NOW@@")  # C's clock in an answer: the time it is sent (fresh())


def match_answer(**over):
    b = {
        "matched_blocks": 4,
        "matched_tokens": 4 * BS,
        "total_full_blocks": 5,
        "fingerprint": FP.model_dump(),
        "engine_timeout_s": 30,
        "source_id": C_SOURCE,
        "now_unix_ms": NOW,
    }
    b.update(over)
    return dumps({k: v for k, v in b.items() if v is not ...})


def fresh(body: bytes) -> bytes:
    return body.replace(b"@@NOW@@", str(int(time.time() * 1000)).encode())
