"""Security hardening of prefix push: who may make C write, what, and where;
what D believes of a source's answers.

Pure logic and in-process HTTP (uvicorn on 127.0.0.1 in a thread); no vLLM
instance. C's transfer engine is a memmove between numpy buffers that logs
every call and copies only into memory registered for the named destination
session (as the real engine writes only into a peer's registered segments),
so "nothing was written" is checked twice: the call log is empty and the
destination's bytes are unchanged.

  a) EndpointGuard: token, loopback, closed, insecure opt-out
  b) fuzz of /push_blocks, /match_blocks and /hashsync over real HTTP
  c) destinations C must refuse: own session, changed layout, block ids, fingerprint,
     TP, sizes, bodies, concurrency
  d) a hostile source answering D's scheduler and receiver
  e) D's allowlist of push sources
"""

from __future__ import annotations

import contextlib
import hmac
import json
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi import (
    FastAPI,
    Request,
)  # module level: FastAPI resolves annotations by name
from fastapi.responses import Response
from helpers import (
    BLEN,
    BS,
    C_BLOCKS,
    C_SESSION,
    C_SOURCE,
    D_SESSION,
    DST_BLOCKS,
    FP,
    KV,
    NBLK,
    SCHED_FP,
    SLOTS,
    TOKENS,
    Clock,
    CServer,
    ask,
    d_request,
    push_job,
    serve,
    wait_until,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import auth
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
    client_headers,
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
    is_loopback,
    normalize_source,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_client import (
    Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    SOURCE_REFUSAL,
    KVFingerprint,
    PushBlocksResponse,
    PushRequestError,
    parse_push_request,
    validate,
)

TOKEN = "tok-3f9c2a7e51"
READ = auth.read_key(TOKEN)  # the GET routes' bearer key
AUTH = {"authorization": f"Bearer {READ}"}


# ---- shared pieces ------------------------------------------------------------------


def changed_bytes(before: bytes, after: bytes) -> int:
    return int(
        np.count_nonzero(
            np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8)
        )
    )


@pytest.fixture
def c_servers(c_server):
    """conftest's c_server, but a C without a config of its own requires TOKEN and
    takes at most 64 tokens."""

    def make(
        config: ExtConfig | None = None, fingerprint: KVFingerprint = FP
    ) -> CServer:
        return c_server(
            config or ExtConfig(bootstrap_token=TOKEN, push_max_tokens=64), fingerprint
        )

    return make


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


# ---- a) EndpointGuard ---------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "10.1.2.3"])
@pytest.mark.parametrize("insecure", [False, True])
def test_token_is_required_when_set(host, insecure):
    g = EndpointGuard(
        ExtConfig(
            bootstrap_token=TOKEN, bootstrap_host=host, bootstrap_insecure=insecure
        )
    )
    assert g.check(f"Bearer {READ}") is None
    assert g.check(f"bearer {READ}") is None  # the scheme is case-insensitive
    for header in [
        None,
        "",
        READ,
        f"Bearer {TOKEN}",  # the signing key itself is never a bearer key
        f"Bearer {auth.read_key(TOKEN + 'x')}",
        "Bearer",
        "Bearer ",
        f"Basic {READ}",
        f"Token {READ}",
        f"Bearer {READ[:-1]}",
        f"Bearer {READ}x",
        f"Bearer x{READ}",
        f"Bearer {READ.upper()}",
        f"Bearer  {READ}",
        f"Bearer {READ} ",
        f"Bearer {READ} {READ}",
        "Bearer wrong",
        "Bearer \u00e9t\u00e9",
    ]:
        denied = g.check(header)
        assert denied is not None and denied[0] == 401, (header, denied)
        assert TOKEN not in denied[1] and READ not in denied[1]  # nor echoes them


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"]
)
def test_no_token_on_loopback_is_open(host):
    assert is_loopback(host)
    g = EndpointGuard(ExtConfig(bootstrap_host=host))
    for header in [None, "", "Bearer anything", "garbage"]:
        assert g.check(header) is None


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "192.168.0.7",
        "example.com",
        "127.example.com",
        "localhost.evil",
    ],
)
def test_no_token_on_another_bind_is_closed(host):
    assert not is_loopback(host)
    g = EndpointGuard(ExtConfig(bootstrap_host=host))
    for header in [None, "", f"Bearer {TOKEN}", "Bearer "]:
        denied = g.check(header)
        assert denied is not None and denied[0] == 403, (host, header, denied)
        assert "MOONCAKE_BOOTSTRAP_TOKEN" in denied[1] and host in denied[1]
    # the explicit opt-out for a trusted network
    assert (
        EndpointGuard(ExtConfig(bootstrap_host=host, bootstrap_insecure=True)).check(
            None
        )
        is None
    )


def test_guard_from_the_environment():
    closed = EndpointGuard(ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_TOKEN": ""}))
    assert (
        closed.check(None)[0] == 403
    )  # an empty token is no token; default bind 0.0.0.0
    cfg = ExtConfig.from_env(
        {"MOONCAKE_BOOTSTRAP_TOKEN": TOKEN, "MOONCAKE_BOOTSTRAP_HOST": " 10.0.0.1 "}
    )
    assert cfg.bootstrap_host == "10.0.0.1" and cfg.bootstrap_token == TOKEN
    assert EndpointGuard(cfg).check(f"Bearer {READ}") is None
    assert (
        EndpointGuard(ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_INSECURE": "1"})).check(
            None
        )
        is None
    )
    assert (
        EndpointGuard(
            ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_HOST": "127.0.0.1"})
        ).check(None)
        is None
    )


def test_token_is_compared_with_hmac_compare_digest(monkeypatch):
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return hmac.compare_digest(a, b)

    g = EndpointGuard(ExtConfig(bootstrap_token=TOKEN))
    monkeypatch.setattr(auth, "hmac", SimpleNamespace(compare_digest=spy))
    assert g.check(f"Bearer {READ}") is None
    assert g.check("Bearer nope")[0] == 401
    assert (
        g.check(f"Bearer {READ}" + "0" * 1000)[0] == 401
    )  # other length: no exception
    assert calls == [
        (READ.encode(), READ.encode()),
        (b"nope", READ.encode()),
        ((READ + "0" * 1000).encode(), READ.encode()),
    ]


def test_d_sends_the_read_key_never_the_token():
    assert (
        client_headers(ExtConfig(bootstrap_token=TOKEN))["authorization"]
        == f"Bearer {READ}"
    )
    assert TOKEN not in READ and len(READ) == 64
    assert "authorization" not in client_headers(ExtConfig())


def test_guard_over_http(c_servers):
    """Every route of this series answers 401/403 before reading a body or writing."""
    c = c_servers()  # token set
    d = c.destination()
    for headers in [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Basic {TOKEN}"},
    ]:
        assert c.post("/push_blocks", push_body(d), headers=headers).status_code == 401
        assert (
            c.post("/match_blocks", {"token_ids": TOKENS}, headers=headers).status_code
            == 401
        )
        assert c.http.get("/hashsync", headers=headers).status_code == 401
        assert c.http.get("/layerwise/transfers", headers=headers).status_code == 401
    assert c.http.get("/hashsync", headers=AUTH).status_code == 200
    assert (
        c.http.get("/layerwise/transfers", headers=AUTH).status_code == 404
    )  # not enabled
    assert c.engine.log == [] and d.untouched()

    closed = c_servers(ExtConfig())  # no token, default bind 0.0.0.0
    d2 = closed.destination()
    for headers in [{}, AUTH]:
        assert (
            closed.post("/push_blocks", push_body(d2), headers=headers).status_code
            == 403
        )
        assert (
            closed.post(
                "/match_blocks", {"token_ids": TOKENS}, headers=headers
            ).status_code
            == 403
        )
        assert closed.http.get("/hashsync", headers=headers).status_code == 403
    assert closed.engine.log == [] and d2.untouched()

    for cfg in [
        ExtConfig(bootstrap_insecure=True),
        ExtConfig(bootstrap_host="127.0.0.1"),
    ]:
        open_ = c_servers(cfg)
        d3 = open_.destination()
        assert_push_ok(open_, d3, open_.post("/push_blocks", push_body(d3), headers={}))


def test_push_stats_have_their_own_route_behind_the_guard(c_servers):
    """C's push counters are served as GET /push/stats (bearer), not inside the
    block-hash mirror's /hashsync."""
    c = c_servers()  # token set
    d = c.destination()
    for headers in [{}, {"authorization": "Bearer wrong"}]:
        assert c.http.get("/push/stats", headers=headers).status_code == 401
    assert c.http.get("/push/stats", headers=AUTH).json()["pushes"] == 0
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    stats = c.http.get("/push/stats", headers=AUTH).json()
    assert (
        stats["pushes"] == 1 and stats["ok"] == 1 and stats["bytes"] == 3 * SLOTS * BLEN
    )
    mirror = c.http.get("/hashsync", headers=AUTH).json()
    assert mirror["size"] == 3 and "push" not in mirror


# ---- b) fuzz over real HTTP ---------------------------------------------------------


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


# never an integer in strict mode (None and lists only where the field is a plain int)
WRONG_SCALARS = [
    True,
    False,
    "16",
    "",
    "abc",
    "0x10",
    1.0,
    2.5,
    -0.0,
    1e308,
    -1e-300,
    {},
    {"a": 1},
]
# JSON literals that are not (or not valid) integers
RAW_NON_INTS = [
    "NaN",
    "-NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1E2",
    "1" + "0" * 5000,
    "0x10",
    "01",
    "+1",
    ".5",
    "1.",
    "--1",
    "1_000",
    "true1",
    "nul",
    '"\\ud800"',
]


def wrong_int(rng: random.Random, none_and_lists: bool = False):
    """Not an integer; None or a list only if ``none_and_lists`` (a required int field)."""
    pool = WRONG_SCALARS + ([None, [], [1], [1, 2]] if none_and_lists else [])
    return rng.choice(pool) if rng.random() < 0.6 else Raw(rng.choice(RAW_NON_INTS))


def wrong_str(
    rng: random.Random,
):  # for optional string fields: neither None nor a string
    return rng.choice(
        [
            5,
            -1,
            2**70,
            1.5,
            True,
            False,
            [],
            ["x"],
            {},
            {"k": "v"},
            Raw("NaN"),
            Raw("1e400"),
        ]
    )


def wrong_int_list(rng: random.Random, good: list[int]):
    k = rng.randrange(len(good)) if good else 0
    bad_elem = wrong_int(rng, none_and_lists=True)  # inside the list: never an int
    choice = rng.randrange(5)
    if choice == 0:
        return (
            wrong_int(rng)
            if rng.random() < 0.5
            else rng.choice(["1 2 3", 7, None, {"0": 1}])
        )
    if choice == 1:
        return good[:k] + [bad_elem] + good[k + 1 :]
    if choice == 2:
        return [bad_elem] * max(1, len(good))
    if choice == 3:
        return [list(good)]
    return good[:k] + [[good[k] if good else 1]] + good[k + 1 :]


def rng_not_a_list(rng: random.Random):
    return rng.choice([None, 5, 2.5, "1,2,3", "", True, {}, {"0": 1}, Raw("NaN")])


class PushFuzz:
    """Malformed /push_blocks requests, each invalid by the protocol (so C must
    refuse it whatever else the body says)."""

    REQUIRED = [
        "token_ids",
        "block_size",
        "dst_session",
        "dst_kv_base_addrs",
        "dst_block_ids",
        "deadline_unix_ms",
        "dst_num_blocks",
        "fingerprint",
        "source_id",
    ]

    def __init__(self, rng: random.Random, d: KV, max_tokens: int):
        self.rng, self.d, self.max_tokens = rng, d, max_tokens

    # per field: values that are the right JSON type but invalid, or the wrong type
    def bad_value(self, field: str):
        r, a, b = self.rng, self.d.bases[0], self.d.bases[1]
        if r.random() < 0.3 and field in (
            "block_size",
            "first_block",
            "deadline_unix_ms",
            "dst_num_blocks",
            "block_len",
        ):
            return wrong_int(
                r, none_and_lists=field != "block_len"
            )  # block_len may be null
        if r.random() < 0.3 and field in (
            "token_ids",
            "dst_kv_base_addrs",
            "dst_block_ids",
        ):
            return rng_not_a_list(r)
        if field == "token_ids":
            k = r.randrange(len(TOKENS))
            return r.choice(
                [
                    [],
                    TOKENS[:k] + [-r.randint(1, 2**70)] + TOKENS[k + 1 :],
                    [-1] * len(TOKENS),
                    list(range(BS - 1)),
                    wrong_int_list(r, TOKENS),
                    TOKENS * (self.max_tokens // len(TOKENS) + 1),  # too many: 413
                    list(range(self.max_tokens + r.randint(1, 50))),
                ]
            )
        if field == "block_size":
            return r.choice(
                [0, -BS, BS * 2, BS + 1, 1, 2**31, 2**64, -(2**63), Raw("9" * 400)]
            )
        if field == "first_block":
            return r.choice([-1, -(2**63), 1, 2, 3, 2**64, 10**30, Raw("9" * 400)])
        if field == "block_len":
            return r.choice([0, -1, BLEN - 1, BLEN + 1, BLEN * 2, 2**64, -(2**63)])
        if field == "deadline_unix_ms":
            return r.choice([0, -1, -(2**63), -(10**30), Raw("-" + "9" * 400)])
        if (
            field == "dst_num_blocks"
        ):  # <= the largest block id, or tensors beyond 2**64
            return r.choice(
                [0, -1, 1, 7, -(2**63), 2**58, 2**64, 10**30, Raw("9" * 400)]
            )
        if field == "dst_session":
            return r.choice(
                [
                    C_SESSION,
                    "nohost",
                    ":1",
                    "h:0",
                    "h:70000",
                    "h:65536",
                    "h:abc",
                    "",
                    "h:-1",
                    "h:",
                    ":",
                    "127.0.0.1",
                    "h:1:x",
                    "h:+1",
                    "h: 1",
                    "127.0.0.1:17002/x",
                    wrong_str(r),
                ]
            )
        if field == "dst_kv_base_addrs":
            return r.choice(
                [
                    [],
                    [a],
                    [a, b, a],
                    [0, b],
                    [-1, b],
                    [a, a],
                    [a, a + 1],
                    [b, b + 1],
                    [2**64 - 1, b],
                    [2**64, b],
                    [a, 2**64 - 100],
                    [2**70, 2**71],
                    wrong_int_list(r, [a, b]),
                ]
            )
        if field == "dst_block_ids":
            return r.choice(
                [
                    [],
                    [NBLK],
                    [3, 4, NBLK + 5],
                    [-1],
                    [3, 3],
                    [3, 4, 7, 8],
                    [2**64],
                    [3, 4, -7],
                    [0, 1, 2, 3, 4, 5],
                    wrong_int_list(r, DST_BLOCKS),
                ]
            )
        if field in ("cache_salt", "lora_name", "request_id"):
            return wrong_str(r)
        if field == "source_id":  # another source's, empty, too long, not a string
            return r.choice(
                ["another-source", C_SOURCE + "x", "", "s" * 65, wrong_str(r)]
            )
        if field == "fingerprint":
            return self.bad_fingerprint()
        raise AssertionError(field)

    def bad_fingerprint(self):
        r = self.rng
        fp = FP.model_dump()
        kind = r.randrange(5)
        if kind == 0:
            return r.choice([None, "x", 1, [], [fp], True])
        if kind == 1:
            del fp[r.choice(["model", "dtype", "block_size", "tp_size"])]
        elif kind == 2:
            fp[r.choice(["extra", "Model", "tp", "kv_dtype"])] = r.choice(
                [1, "x", None]
            )
        elif kind == 3:  # another KV cache: 409
            field, value = r.choice(
                [
                    ("model", "Other:fedcba9876543210"),
                    ("dtype", "bfloat16/auto"),
                    ("dtype", "float32/fp8"),
                    ("block_size", BS * 4),
                    ("tp_size", 2),
                    ("tp_size", 0),
                    ("block_len", BLEN * 2),
                    ("num_kv_tensors", SLOTS + 1),
                    ("model", ""),
                ]
            )
            fp[field] = value
        else:
            field = r.choice(
                [
                    "model",
                    "dtype",
                    "block_size",
                    "tp_size",
                    "block_len",
                    "num_kv_tensors",
                ]
            )
            fp[field] = (
                wrong_int(r, none_and_lists=field in ("block_size", "tp_size"))
                if field not in ("model", "dtype")
                else wrong_str(r)
            )
        return fp

    def one(self) -> tuple[str, dict, bytes]:
        r = self.rng
        body = push_body(self.d)
        kind = r.choices(
            [
                "field",
                "fields",
                "missing",
                "extra",
                "fingerprint",
                "duplicate",
                "truncated",
                "not_json",
                "empty",
                "too_large",
                "auth",
            ],
            [30, 15, 8, 7, 10, 7, 7, 6, 2, 2, 6],
        )[0]
        headers = dict(AUTH)
        if kind in ("field", "fields"):
            fields = [f for f in body if f != "fingerprint"]
            for f in r.sample(fields, 1 if kind == "field" else r.randint(2, 4)):
                body[f] = self.bad_value(f)
            content = dumps(body)
        elif kind == "missing":
            for f in r.sample(self.REQUIRED, r.randint(1, 3)):
                del body[f]
            content = dumps(body)
        elif kind == "extra":
            name = r.choice(
                [
                    "x",
                    "status",
                    "dst_addr",
                    "src_addr",
                    "__proto__",
                    "token",
                    "dst_block_id",
                    "Token_ids",
                    "fingerprint2",
                    "ok",
                ]
            )
            body[name] = r.choice([1, "a", None, [1], {"a": 1}, True])
            content = dumps(body)
        elif kind == "fingerprint":
            body["fingerprint"] = self.bad_fingerprint()
            content = dumps(body)
        elif (
            kind == "duplicate"
        ):  # the last occurrence is invalid (the one a parser keeps)
            f = r.choice(
                [f for f in self.REQUIRED if f != "fingerprint"]
                + ["first_block", "block_len"]
            )
            text = dumps(body)
            content = (
                text[:-1]
                + b', "'
                + f.encode()
                + b'": '
                + dumps(self.bad_value(f))
                + b"}"
            )
            if r.random() < 0.3:  # also an invalid first occurrence
                body[f] = self.bad_value(f)
                text = dumps(body)
                content = (
                    text[:-1]
                    + b', "'
                    + f.encode()
                    + b'": '
                    + dumps(self.bad_value(f))
                    + b"}"
                )
        elif kind == "truncated":
            text = dumps(body)
            content = text[: r.randrange(1, len(text))]
        elif kind == "not_json":
            content = r.choice(
                [
                    lambda: bytes(r.randrange(256) for _ in range(r.randint(1, 300))),
                    lambda: "".join(
                        chr(r.randint(32, 126)) for _ in range(r.randint(1, 300))
                    ).encode(),
                    lambda: r.choice(
                        [
                            b"null",
                            b"true",
                            b"[]",
                            b"{}",
                            b"42",
                            b'"x"',
                            b"NaN",
                            b"a=1&b=2",
                            b"<push/>",
                            b"{'token_ids': [1]}",
                        ]
                    ),
                    lambda: b"[" + dumps(body) + b"]",
                    lambda: dumps(body) + b"x",
                    lambda: dumps(body) + dumps(body),
                    lambda: "\ufeff".encode() + dumps(body),
                    lambda: dumps(body).decode().encode("utf-16"),
                    lambda: b"[" * r.randint(300, 20000),
                    lambda: b'{"a":' * r.randint(300, 5000),
                ]
            )()
        elif kind == "empty":
            content = b""
        elif kind == "too_large":  # a valid push padded past the body cap: 413
            text = dumps(body)
            content = text[:-1] + b" " * (70_000 + 48 * self.max_tokens) + b"}"
        else:  # auth: a valid push with a wrong or missing token
            headers = r.choice(
                [
                    {},
                    {"authorization": ""},
                    {"authorization": TOKEN},
                    {"authorization": "Bearer"},
                    {"authorization": f"Bearer {TOKEN[:-1]}"},
                    {"authorization": f"Bearer {TOKEN}0"},
                    {"authorization": f"Basic {TOKEN}"},
                    {"authorization": f"Token {TOKEN}"},
                    {"authorization": f"Bearer  {TOKEN}"},
                    {"authorization": f"Bearer {TOKEN.upper()}"},
                    {
                        "authorization": "Bearer "
                        + "".join(
                            r.choice("abcdef0123456789") for _ in range(len(TOKEN))
                        )
                    },
                    {"x-authorization": f"Bearer {TOKEN}"},
                ]
            )
            content = dumps(body)
        return kind, headers, content


class MatchFuzz:
    """Malformed /match_blocks requests. (Negative token ids are left to
    test_match_blocks_refuses_negative_token_ids_as_push_blocks_does.)"""

    def __init__(self, rng: random.Random, max_tokens: int):
        self.rng, self.max_tokens = rng, max_tokens

    def bad_tokens(self):
        r = self.rng
        return r.choice(
            [
                [],
                wrong_int_list(r, TOKENS),
                rng_not_a_list(r),
                "1 2 3",
                {"0": 1},
                list(range(self.max_tokens + r.randint(1, 100))),  # 413
                [r.choice(TOKENS)] * (self.max_tokens * r.randint(2, 5)),
                [
                    Raw(
                        r.choice(
                            ["NaN", "Infinity", "1e400", "1" + "0" * 5000, "01", "-"]
                        )
                    )
                ]
                * 8,
            ]
        )

    def one(self) -> tuple[str, dict, bytes]:
        r = self.rng
        body = {"token_ids": TOKENS, "cache_salt": None, "lora_name": None}
        kind = r.choices(
            [
                "tokens",
                "strings",
                "missing",
                "extra",
                "duplicate",
                "truncated",
                "not_json",
                "empty",
                "too_large",
                "auth",
            ],
            [30, 10, 6, 8, 8, 8, 12, 2, 4, 12],
        )[0]
        headers = dict(AUTH)
        if kind == "tokens":
            body["token_ids"] = self.bad_tokens()
            if r.random() < 0.3:
                body[r.choice(["cache_salt", "lora_name"])] = r.choice(
                    [None, "s", wrong_str(r)]
                )
            content = dumps(body)
        elif kind == "strings":
            for f in r.sample(["cache_salt", "lora_name"], r.randint(1, 2)):
                body[f] = wrong_str(r)
            content = dumps(body)
        elif kind == "missing":
            del body["token_ids"]
            content = dumps(body)
        elif kind == "extra":
            body[
                r.choice(["block_size", "fingerprint", "x", "token_id", "dst_session"])
            ] = r.choice([1, "a", None, [1], FP.model_dump()])
            content = dumps(body)
        elif kind == "duplicate":
            f = r.choice(["token_ids", "cache_salt", "lora_name"])
            bad = self.bad_tokens() if f == "token_ids" else wrong_str(r)
            content = (
                dumps(body)[:-1] + b', "' + f.encode() + b'": ' + dumps(bad) + b"}"
            )
        elif kind == "truncated":
            text = dumps(body)
            content = text[: r.randrange(1, len(text))]
        elif kind == "not_json":
            content = r.choice(
                [
                    lambda: bytes(r.randrange(256) for _ in range(r.randint(1, 300))),
                    lambda: "".join(
                        chr(r.randint(32, 126)) for _ in range(r.randint(1, 300))
                    ).encode(),
                    lambda: r.choice(
                        [
                            b"null",
                            b"[]",
                            b"{}",
                            b"0",
                            b'"token_ids"',
                            b"Infinity",
                            b"token_ids=1,2,3",
                            str(TOKENS).encode() + b"x",
                        ]
                    ),
                    lambda: dumps(body) + b"}",
                    lambda: "\ufeff".encode() + dumps(body),
                    lambda: dumps(body).decode().encode("utf-32"),
                    lambda: b"[" * r.randint(300, 20000),
                ]
            )()
        elif kind == "empty":
            content = b""
        elif kind == "too_large":
            content = dumps(body)[:-1] + b" " * (70_000 + 48 * self.max_tokens) + b"}"
        else:
            headers = r.choice(
                [
                    {},
                    {"authorization": f"Bearer {TOKEN}x"},
                    {"authorization": f"Basic {TOKEN}"},
                    {"authorization": TOKEN},
                    {"authorization": "Bearer " + TOKEN[::-1]},
                ]
            )
            content = dumps(body)
        return kind, headers, content


EXPECTED = {"auth": {401}, "too_large": {413}}
FUZZ_N = 1200


def run_fuzz(c: CServer, path: str, gen, n: int) -> dict:
    tried, codes, by_kind, bad = 0, Counter(), Counter(), []
    for _ in range(n):
        kind, headers, content = gen.one()
        if headers == AUTH:  # valid credentials: signed as D signs
            headers = request_headers(c.config, "POST", path, content)
        tried += 1
        by_kind[kind] += 1
        try:
            r = c.http.post(
                path,
                content=content,
                headers={"content-type": "application/json", **headers},
            )
            code, text = r.status_code, r.text[:200]
        except httpx.HTTPError as e:  # the server dropped the connection
            code, text = -1, repr(e)
        codes[code] += 1
        want = EXPECTED.get(kind)
        if not 400 <= code < 500 or (want is not None and code not in want):
            bad.append((kind, code, text, content[:300]))
    return {
        "tried": tried,
        "codes": codes,
        "kinds": by_kind,
        "bad": bad,
        "crashes": sum(v for k, v in codes.items() if k >= 500 or k < 0),
    }


def test_fuzz_push_and_match_blocks_never_write_never_crash(c_servers, record_property):
    cfg = ExtConfig(bootstrap_token=TOKEN, push_max_tokens=256)
    c = c_servers(cfg)
    d = c.destination()
    before = d.snapshot()
    rng = random.Random(20240610)
    push = run_fuzz(c, "/push_blocks", PushFuzz(rng, d, cfg.push_max_tokens), FUZZ_N)
    match = run_fuzz(c, "/match_blocks", MatchFuzz(rng, cfg.push_max_tokens), FUZZ_N)
    written = changed_bytes(before, d.snapshot())
    logged = len(c.engine.log)
    summary = (
        f"/push_blocks: {push['tried']} inputs, {push['crashes']} crashes (5xx or "
        f"dropped), statuses {dict(push['codes'])}, kinds {dict(push['kinds'])}; "
        f"/match_blocks: {match['tried']} inputs, {match['crashes']} crashes, statuses "
        f"{dict(match['codes'])}, kinds {dict(match['kinds'])}; {written} destination "
        f"bytes changed, {logged} engine calls ({c.engine.bytes_logged()} bytes)"
    )
    print(summary)
    record_property("fuzz_summary", summary)
    assert push["tried"] >= 1000 and match["tried"] >= 1000
    assert push["bad"] == [] and match["bad"] == [], (
        summary
        + "\nfirst offenders (kind, status, answer, body): "
        + repr((push["bad"] + match["bad"])[:5])
    )
    assert written == 0 and logged == 0, summary
    assert c.server.stats["ok"] == 0 and c.server.stats["bytes"] == 0, summary
    # still serving: the same template, valid, is pushed byte-exact and matched
    r = c.post("/push_blocks", push_body(d))
    assert_push_ok(c, d, r)
    m = c.post("/match_blocks", {"token_ids": TOKENS})
    assert m.status_code == 200 and m.json()["matched_blocks"] == 3, m.text
    assert m.json()["fingerprint"] == FP.model_dump()


def test_fuzz_hashsync_never_crashes(c_servers, record_property):
    c = c_servers(ExtConfig(bootstrap_token=TOKEN))
    rng = random.Random(7)
    values = [
        "",
        "0",
        "8",
        "-1",
        "256",
        "257",
        "99999999999999999999999999",
        "-99999999999999",
        "1.5",
        "1e3",
        "nan",
        "inf",
        "abc",
        "%00",
        "%ff%fe",
        "%",
        "%zz",
        "8%00",
        "0x10",
        " 8",
        "8 ",
        "+8",
        "\u00e9",
        "true",
        "[]",
        "{}",
        "9" * 5000,
        "a" * 10000,
    ]
    tried, codes, bad = 0, Counter(), []
    for i in range(1000):
        params = []
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(
                ["sample", "sample", "Sample", "x", "sample[]", "", "%73ample"]
            )
            params.append(f"{name}={rng.choice(values)}")
        if rng.random() < 0.1:
            params.append(rng.choice(["sample", "&&", "=", "==8", "sample==1"]))
        query = "&".join(params)
        headers = rng.choice(
            [
                AUTH,
                AUTH,
                {},
                {"authorization": "Bearer x"},
                {"authorization": f"Basic {TOKEN}"},
                {"authorization": TOKEN},
            ]
        )
        try:
            r = c.http.get(
                "/hashsync" + ("?" + query if query else ""), headers=headers
            )
            code = r.status_code
        except httpx.HTTPError as e:
            code = -1
            bad.append((query, headers, repr(e)))
        tried += 1
        codes[code] += 1
        if code >= 500 or code < 0:
            bad.append((query, headers, code))
        elif headers is not AUTH and code == 200:
            bad.append((query, headers, "200 without the token"))
    summary = f"/hashsync: {tried} inputs, statuses {dict(codes)}, offenders {bad[:5]}"
    print(summary)
    record_property("hashsync_fuzz_summary", summary)
    assert tried >= 1000 and not bad, summary
    assert codes[200] > 0 and codes[401] > 0, summary  # both sides were exercised


def test_match_blocks_refuses_negative_token_ids_as_push_blocks_does(c_servers):
    """The protocol: token ids are non-negative (push.protocol.validate: 422).
    /match_blocks parses the same token list but does not run that check."""
    c = c_servers()
    d = c.destination()
    bad = [-1] * (3 * BS)
    assert c.post("/push_blocks", push_body(d, token_ids=bad)).status_code == 422
    r = c.post("/match_blocks", {"token_ids": bad})
    assert r.status_code == 422, f"/match_blocks answered {r.status_code} {r.text}"


# ---- c) destinations C must refuse --------------------------------------------------


def refused(c: CServer, body: dict, status: int, *dests: KV, **kw) -> dict:
    calls = len(c.engine.log)
    snaps = [x.snapshot() for x in dests]
    r = c.post("/push_blocks", body, **kw)
    assert r.status_code == status, r.text
    assert len(c.engine.log) == calls, "the engine was called for a refused push"
    for x, s in zip(dests, snaps):
        assert x.snapshot() == s, "a refused push changed destination bytes"
    return r.json()


def test_own_session_is_refused(c_servers):
    c = c_servers()
    d = c.destination()
    c.engine.register(C_SESSION, d)  # even if C's own engine would accept the write
    out = refused(c, push_body(d, session=C_SESSION), 409, d)
    assert out["detail"]["field"] == "dst_session"
    assert c.server.stats["refused"] == 1


def test_a_known_session_cannot_change_its_layout_while_a_push_into_it_is_written(
    c_servers,
):
    """Without authentication (an open C): while a push into a destination is
    being written, no other layout is registered for it (409, nothing written);
    once it has ended, a push with another layout re-registers the destination
    (a restarted instance). An authenticated push signed earlier than the one
    that registered a layout: tests/unit/connector/push/test_push_hygiene.py."""
    c = c_servers(ExtConfig(bootstrap_host="127.0.0.1", push_max_tokens=64))
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))
    gate = c.engine.gate()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(c.post, "/push_blocks", push_body(d))
        assert wait_until(lambda: c.engine.entered == 2), "the write never started"
        other = KV(fill=False)
        c.engine.register("127.0.0.1:17003", other)
        for over in [
            {"dst_num_blocks": NBLK - 1},
            {"dst_kv_base_addrs": other.bases},
            {"dst_kv_base_addrs": d.bases[::-1]},
        ]:
            out = refused(c, push_body(d, **over), 409, other)
            assert out["detail"]["field"] == "dst_session"
            assert D_SESSION in out["detail"]["message"]
            assert "being written" in out["detail"]["message"]
        gate.set()
        assert first.result(10).json()["status"] == "ok"
    # a new session may have its own layout at any time
    assert_push_ok(
        c, other, c.post("/push_blocks", push_body(other, "127.0.0.1:17003"))
    )
    # nothing in flight: D restarted with new buffers on the same session
    restarted = KV(fill=False)
    c.engine.register(D_SESSION, restarted)
    assert_push_ok(c, restarted, c.post("/push_blocks", push_body(restarted)))


@pytest.mark.parametrize(
    "over",
    [
        {"dst_block_ids": [3, 4, NBLK]},
        {"dst_block_ids": [3, 4, 2**63]},
        {"dst_num_blocks": 7},
        {"dst_num_blocks": 2**58},  # the tensors end beyond 2**64
        {"dst_kv_base_addrs": "overlap"},
    ],
)
def test_out_of_range_destination_is_422(c_servers, over):
    c = c_servers()
    d = c.destination()
    if over.get("dst_kv_base_addrs") == "overlap":
        over = {"dst_kv_base_addrs": [d.bases[0], d.bases[0] + NBLK * BLEN - 1]}
    out = refused(c, push_body(d, **over), 422, d)
    assert out["detail"]["field"] in ("dst_block_ids", "dst_kv_base_addrs")


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "bfloat16/auto"),
        ("model", "Other:1"),
        ("block_size", BS * 4),
        ("block_len", BLEN * 2),
        ("num_kv_tensors", SLOTS + 2),
    ],
)
def test_fingerprint_mismatch_is_409_naming_both(c_servers, field, value):
    c = c_servers()
    d = c.destination()
    fp = FP.model_copy(update={field: value}).model_dump()
    out = refused(c, push_body(d, fingerprint=fp), 409, d)
    msg = out["detail"]["message"]
    assert out["detail"]["field"] == "fingerprint" and field in msg
    assert repr(getattr(FP, field)) in msg and repr(value) in msg, msg


@pytest.mark.parametrize("c_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_tensor_parallel_is_refused(c_servers, c_tp, d_tp):
    c = c_servers(fingerprint=FP.model_copy(update={"tp_size": c_tp}))
    d = c.destination()
    out = refused(
        c,
        push_body(d, fingerprint=FP.model_copy(update={"tp_size": d_tp}).model_dump()),
        409,
        d,
    )
    assert "tp" in out["detail"]["message"].lower()
    if c_tp == d_tp:
        assert "TP=1" in out["detail"]["message"]
    # and directly, as validate() sees it
    with pytest.raises(PushRequestError) as e:
        validate(
            parse_push_request(
                push_body(
                    d, fingerprint=FP.model_copy(update={"tp_size": d_tp}).model_dump()
                )
            ),
            block_size=BS,
            num_kv_tensors=SLOTS,
            block_len=BLEN,
            fingerprint=FP.model_copy(update={"tp_size": c_tp}),
        )
    assert e.value.status == 409


def test_token_count_above_the_limit_is_413(c_servers):
    c = c_servers()  # push_max_tokens=64
    d = c.destination()
    longest = TOKENS + list(range(10_000, 10_000 + 64 - len(TOKENS)))
    over = longest + [1]
    out = refused(c, push_body(d, token_ids=over), 413, d)
    assert out["detail"]["field"] == "token_ids"
    r = c.post("/match_blocks", {"token_ids": over})
    assert r.status_code == 413, r.text
    # at the limit: served (the prompt's first 3 blocks are C's)
    assert c.post("/match_blocks", {"token_ids": longest}).json()["matched_blocks"] == 3
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d, token_ids=longest)))


def raw_http(
    port: int, head: bytes, body: bytes, timeout: float = 5.0
) -> tuple[bytes, float]:
    """Send bytes as they are; return all the server sent until it closed (or the
    timeout), and how long the first byte of the answer took."""
    t0 = time.monotonic()
    first = None
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        # the server may answer and close before taking it all
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + body)
        s.settimeout(timeout)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                if first is None:
                    first = time.monotonic() - t0
                    s.settimeout(1.0)  # then read what follows, until idle
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out, first if first is not None else timeout


def statuses(raw: bytes) -> list[int]:
    return [
        int(line.split()[1])
        for line in raw.split(b"\r\n")
        if line.startswith(b"HTTP/1.")
    ]


def test_body_above_the_cap_is_413(c_servers):
    c = c_servers()
    d = c.destination()
    cap = c.config.push_max_body_bytes
    valid = dumps(push_body(d))
    padded = (
        valid[:-1] + b" " * (cap + 1 - len(valid)) + b"}"
    )  # a valid push, 1 byte too long
    assert len(padded) == cap + 1
    assert refused(c, padded.decode(), 413, d)["detail"]["field"] == "body"
    assert (
        c.post("/match_blocks", b'{"token_ids": [1]' + b" " * cap + b"}").status_code
        == 413
    )

    # no content-length (chunked): the cap still holds
    def chunks():
        yield padded[:1000]
        yield padded[1000:]

    signed = auth.sign(
        TOKEN, "POST", "/push_blocks", padded
    )  # passes until the body's size
    r = c.http.post("/push_blocks", content=chunks(), headers={"authorization": signed})
    assert r.status_code == 413 and "content-length" not in r.request.headers

    # lying content-length, too large: refused at once, the body is never waited for
    head = (
        f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10**15}\r\n\r\n"
    ).encode()
    out, took = raw_http(c.port, head, valid)
    assert statuses(out)[:1] == [413] and took < 3, (out[:200], took)

    # lying content-length, too small: only that many bytes are the body; the rest is
    # not a request. Nothing is written and nothing answers 200 or 5xx.
    head = (
        f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    ).encode()
    out, _ = raw_http(c.port, head, padded, timeout=3)
    codes = statuses(out)
    assert codes and all(400 <= s < 500 for s in codes), out[:300]
    # an invalid content-length header never reaches the handler
    for value in [
        "-1",
        "abc",
        "1e3",
        "\u00b2".encode().decode("latin-1"),
        "10, 20",
        "",
    ]:
        head = (
            f"POST /push_blocks HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
            f"Content-Length: {value}\r\n\r\n"
        ).encode("latin-1")
        out, _ = raw_http(c.port, head, valid, timeout=3)
        codes = statuses(out)
        assert all(400 <= s < 500 for s in codes), (value, out[:300])
    assert c.engine.log == [] and d.untouched()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))  # still serving


def test_concurrent_pushes_beyond_the_limit_are_429(c_servers):
    c = c_servers(ExtConfig(bootstrap_token=TOKEN, push_max_concurrent=2))
    gate = c.engine.gate()
    dests = [
        (f"127.0.0.1:{18000 + i}", c.destination(f"127.0.0.1:{18000 + i}"))
        for i in range(20)
    ]
    t0 = time.monotonic()
    done: dict[int, tuple[int, dict, float]] = {}

    def one(i):
        session, d = dests[i]
        content = json.dumps(push_body(d, session=session)).encode()
        r = httpx.post(
            c.url + "/push_blocks",
            content=content,
            timeout=30,
            headers=request_headers(c.config, "POST", "/push_blocks", content),
        )
        done[i] = (r.status_code, r.json(), time.monotonic() - t0)

    with ThreadPoolExecutor(20) as pool:
        futs = [pool.submit(one, i) for i in range(20)]
        end = time.monotonic() + 10
        while (len(done) < 18 or c.engine.entered < 2) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)  # nothing else gets in while the gate is closed
        answered_before = dict(done)
        entered_before = c.engine.entered
        gate.set()
        for f in futs:
            f.result(30)
    assert entered_before == 2, f"{entered_before} writes in progress at once (limit 2)"
    busy = [i for i, (code, _, _) in answered_before.items() if code == 429]
    assert len(busy) == 18 and len(answered_before) == 18, answered_before
    assert all(answered_before[i][2] < 5 for i in busy)  # quickly, while two were held
    ok = [
        i for i, (code, out, _) in done.items() if code == 200 and out["status"] == "ok"
    ]
    assert sorted(ok + busy) == list(range(20))
    for i in busy:
        assert dests[i][1].untouched(), (
            f"a refused push ({i}) changed destination bytes"
        )
    for i in ok:
        assert_landed(c.c, dests[i][1])
    assert c.server.stats["busy"] == 18
    d = c.destination()
    assert_push_ok(c, d, c.post("/push_blocks", push_body(d)))


# ---- d) a hostile source answering D ------------------------------------------------


class HostileC:
    """A fake C whose /match_blocks and /push_blocks answer what the test sets."""

    def __init__(self):
        self.match = (200, b"{}")
        self.push = (200, b"{}")
        self.seen: list[tuple[str, dict, bytes]] = []
        self.answered = threading.Event()
        app = FastAPI()

        async def match_blocks(request: Request):
            self.seen.append(("match", dict(request.headers), await request.body()))
            return Response(
                fresh(self.match[1]), self.match[0], media_type="application/json"
            )

        async def push_blocks(request: Request):
            self.seen.append(("push", dict(request.headers), await request.body()))
            self.answered.set()
            status, body = self.push[:2]
            headers = self.push[2] if len(self.push) > 2 else None
            return Response(
                body, status, headers=headers, media_type="application/json"
            )

        app.post("/match_blocks")(match_blocks)
        app.post("/push_blocks")(push_blocks)
        self.url, self.stop = serve(app)


@pytest.fixture(scope="module")
def hostile():
    h = HostileC()
    yield h
    h.stop()


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


def fp_with(**over):
    return FP.model_copy(update=over).model_dump()


HOSTILE_MATCHES = [  # (id, status, body, local tokens, expected)
    ("control", 200, match_answer(), 0, (4 * BS, True)),
    ("more than the prompt", 200, match_answer(matched_blocks=100), 0, (5 * BS, True)),
    (
        "more, after a local hit",
        200,
        match_answer(matched_blocks=100),
        2 * BS,
        (3 * BS, True),
    ),
    ("10**18", 200, match_answer(matched_blocks=10**18), 0, (5 * BS, True)),
    ("2**64", 200, match_answer(matched_blocks=2**64), 0, (5 * BS, True)),
    ("negative", 200, match_answer(matched_blocks=-3), 0, (0, False)),
    ("-10**18", 200, match_answer(matched_blocks=-(10**18)), 0, (0, False)),
    ("1e18", 200, match_answer(matched_blocks=Raw("1e18")), 0, (0, False)),
    ("float", 200, match_answer(matched_blocks=2.5), 0, (0, False)),
    ("float 4.0", 200, match_answer(matched_blocks=4.0), 0, (0, False)),
    ("string", 200, match_answer(matched_blocks="4"), 0, (0, False)),
    ("bool", 200, match_answer(matched_blocks=True), 0, (0, False)),
    ("null", 200, match_answer(matched_blocks=None), 0, (0, False)),
    ("NaN", 200, match_answer(matched_blocks=Raw("NaN")), 0, (0, False)),
    ("no matched_blocks", 200, match_answer(matched_blocks=...), 0, (0, False)),
    ("no fingerprint", 200, match_answer(fingerprint=...), 0, (0, False)),
    (
        "fingerprint block_size",
        200,
        match_answer(fingerprint=fp_with(block_size=2 * BS)),
        0,
        (0, False),
    ),
    (
        "fingerprint dtype",
        200,
        match_answer(fingerprint=fp_with(dtype="bfloat16/auto")),
        0,
        (0, False),
    ),
    (
        "fingerprint model",
        200,
        match_answer(fingerprint=fp_with(model="Other:1")),
        0,
        (0, False),
    ),
    (
        "fingerprint tp",
        200,
        match_answer(fingerprint=fp_with(tp_size=2)),
        0,
        (0, False),
    ),
    (
        "fingerprint extra",
        200,
        match_answer(fingerprint={**FP.model_dump(), "x": 1}),
        0,
        (0, False),
    ),
    ("fingerprint string", 200, match_answer(fingerprint="same"), 0, (0, False)),
    ("extra field", 200, match_answer(status="ok"), 0, (0, False)),
    ("500", 500, match_answer(), 0, (0, False)),
    ("401", 401, match_answer(), 0, (0, False)),
    ("not json", 200, b"<html>ok</html>", 0, (0, False)),
    ("empty", 200, b"", 0, (0, False)),
    ("array", 200, b"[" + match_answer() + b"]", 0, (0, False)),
    ("2 MiB", 200, match_answer(pad="x" * (2 << 20)), 0, (0, False)),
    ("deep", 200, b"[" * 50_000, 0, (0, False)),
]


@pytest.mark.parametrize(
    "name,status,body,local,expected",
    HOSTILE_MATCHES,
    ids=[h[0] for h in HOSTILE_MATCHES],
)
def test_hostile_match_answer_is_clamped_or_ignored(
    hostile, name, status, body, local, expected
):
    hostile.match = (status, body)
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0,
            push_match_timeout_s=5,
            push_sources=(hostile.url,),
            bootstrap_token=TOKEN,
        ),
        SCHED_FP,
    )
    hostile.seen.clear()
    r = d_request(source=hostile.url)
    got = ask(sched, r, local)  # never raises
    assert got == expected, (name, got, sched.stats)
    assert [s[0] for s in hostile.seen] == ["match"]
    assert hostile.seen[0][1].get("authorization").startswith("Mooncake-HMAC-SHA256 ")
    assert TOKEN not in json.dumps(
        hostile.seen[0][1]
    )  # signed: the token is never sent
    assert sched.stats["match_failed"] == (
        0 if got[1] or name in ("negative", "-10**18") else 1
    )
    if got[1]:  # the push asks for at most the prompt's full blocks
        sched.update_state_after_alloc(
            r, SimpleNamespace(get_block_ids=lambda: (list(range(100, 105)),)), got[0]
        )
        (job,) = sched.take_jobs()
        assert job.first_block + len(job.dst_block_ids) <= 5


def push_answer(**over):
    b = {
        "status": "ok",
        "matched_blocks": 3,
        "matched_tokens": 3 * BS,
        "pushed_blocks": 3,
        "total_full_blocks": 3,
        "bytes": 3 * BLEN * SLOTS,
        "seconds": 0.01,
        "message": "",
    }
    b.update(over)
    return dumps(b)


HOSTILE_PUSHES = [  # (id, status, body, landed, answered: ends before the hold)
    ("control", 200, push_answer(), 3, True),
    ("fewer", 200, push_answer(pushed_blocks=2, bytes=2 * BLEN * SLOTS), 2, True),
    (
        "more than asked",
        200,
        push_answer(pushed_blocks=5, bytes=5 * BLEN * SLOTS),
        0,
        True,
    ),
    (
        "10**18 blocks",
        200,
        push_answer(pushed_blocks=10**18, bytes=10**18 * BLEN * SLOTS),
        0,
        True,
    ),
    ("negative", 200, push_answer(pushed_blocks=-1, bytes=-BLEN * SLOTS), 0, True),
    ("negative, 0 bytes", 200, push_answer(pushed_blocks=-1, bytes=0), 0, True),
    ("bytes -1", 200, push_answer(bytes=3 * BLEN * SLOTS - 1), 0, True),
    ("bytes +1", 200, push_answer(bytes=3 * BLEN * SLOTS + 1), 0, True),
    ("bytes 0", 200, push_answer(bytes=0), 0, True),
    ("one tensor's bytes", 200, push_answer(bytes=3 * BLEN), 0, True),
    ("failed", 200, push_answer(status="failed"), 0, True),
    ("no_match", 200, push_answer(status="no_match"), 0, True),
    ("409 refusal", (409, SOURCE_REFUSAL), push_answer(), 0, True),
    ("500 refusal", (500, SOURCE_REFUSAL), push_answer(), 0, True),
    # answers D cannot read, or that C's own code did not give (no refusal
    # header): C may still be writing, so only the hold ends them
    ("409", 409, push_answer(), 0, False),
    ("500", 500, push_answer(), 0, False),
    ("504", 504, b"<html>gateway time-out</html>", 0, False),
    ("float blocks", 200, push_answer(pushed_blocks=3.0), 0, False),
    ("string blocks", 200, push_answer(pushed_blocks="3"), 0, False),
    ("OK", 200, push_answer(status="OK"), 0, False),
    ("extra field", 200, push_answer(dst=1), 0, False),
    ("not json", 200, b"ok", 0, False),
]


@pytest.mark.parametrize(
    "name,status,body,landed,answered",
    HOSTILE_PUSHES,
    ids=[h[0] for h in HOSTILE_PUSHES],
)
def test_hostile_push_answer_lands_nothing_it_cannot_prove(
    hostile, name, status, body, landed, answered
):
    status, headers = status if isinstance(status, tuple) else (status, None)
    hostile.push = (status, body, headers)
    hostile.answered.clear()
    hostile.seen.clear()
    d = KV(fill=False)
    cfg = ExtConfig(
        push_timeout_s=1.0,
        engine_transfer_timeout_s=1.0,
        push_clock_skew_s=0.5,
        bootstrap_token=TOKEN,
    )
    clock = Clock()
    rec = PushReceiver(D_SESSION, d.bases, BLEN, BS, NBLK, FP, cfg, clock=clock)
    job = push_job("r1", hostile.url)
    rec.start([job])
    assert hostile.answered.wait(5)
    assert hostile.seen[0][1].get("authorization").startswith("Mooncake-HMAC-SHA256 ")
    assert TOKEN not in json.dumps(
        hostile.seen[0][1]
    )  # signed: the token is never sent
    sent = json.loads(hostile.seen[0][2])
    assert sent["dst_num_blocks"] == NBLK and sent["fingerprint"] == FP.model_dump()
    end = time.monotonic() + (5 if answered else 0.5)
    finished = None
    while time.monotonic() < end and not finished:
        finished = rec.merge_finished(None)
        time.sleep(0.01)
    if not answered:
        assert finished is None, "an unreadable answer ended the push before the hold"
        clock.now += rec.hold_s(job)
        finished = rec.merge_finished(None)
    assert finished == {"r1"}
    assert rec.take_outcome().landed == {"r1": landed}


@pytest.mark.parametrize(
    "pushed,nbytes,expected",
    [
        (3, 3 * BLEN * SLOTS, 3),
        (0, 0, 0),
        (1, BLEN * SLOTS, 1),
        (4, 4 * BLEN * SLOTS, 0),
        (-1, -BLEN * SLOTS, 0),
        (3, 3 * BLEN * SLOTS + 7, 0),
        (3, 0, 0),
        (2**70, 2**70 * BLEN * SLOTS, 0),
    ],
)
def test_proven_blocks(pushed, nbytes, expected):
    rec = PushReceiver(D_SESSION, [1 << 20, 2 << 20], BLEN, BS, NBLK, FP, ExtConfig())
    job = push_job("r1", "http://c:9000")
    resp = PushBlocksResponse(status="ok", pushed_blocks=pushed, bytes=nbytes)
    assert rec.proven_blocks(job, resp) == expected


# ---- e) D's allowlist of push sources ------------------------------------------------

ALLOWED = "http://c:9000"


def allowlist_scheduler(sources=(ALLOWED,)):
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0, push_match_timeout_s=2, push_sources=tuple(sources)
        ),
        SCHED_FP,
    )
    calls = []

    def post(source, path, content, headers, deadline):
        calls.append(source + path)
        return Answer(200, fresh(match_answer()))

    sched._lanes.post = post
    return sched, calls


@pytest.mark.parametrize(
    "source",
    [
        "http://evil:9000",
        "http://c:9001",
        "https://c:9000",
        "http://c.evil:9000",
        "http://c:9000@evil:80",
        "http://evil:80#@c:9000",
        "http://evil:80?@c:9000",
        "http://evil:80/@c:9000",
        "http://c:9000 @evil:80",
        "c:9000",
        "http://c",
        "file:///etc/passwd",
        "gopher://c:9000",
        "//c:9000",
        "http://:9000",
        "http://c:9000\n@evil",
        12345,
        ["http://c:9000"],
        "http://user:pw@c:9000",
        "http://c:9000/push_blocks?",
        "http://c:9000/x",
    ],
)
def test_push_from_outside_the_allowlist_is_refused_without_a_call(source):
    sched, calls = allowlist_scheduler()
    r = d_request(source=source)
    assert sched.handles(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(r, 0) == (
        0,
        False,
    )  # asked again: still nothing
    time.sleep(0.05)
    assert calls == [] and sched._lanes.sources() == []  # no thread, no connection made
    assert sched.stats["refused_sources"] == 1 and sched.take_jobs() == []


def test_empty_allowlist_refuses_every_source():
    sched, calls = allowlist_scheduler(())
    assert ask(sched, d_request(source=ALLOWED)) == (0, False)
    assert calls == [] and sched.stats["refused_sources"] == 1


@pytest.mark.parametrize(
    "source",
    [
        "http://c:9000:1",
        "http://c:99999",
        "http://c:abc",
        "http://[::1:9000",
        "http://[zz]:9000",
    ],
)
def test_unparsable_push_from_is_refused_not_raised(source):
    """A client names push_from; whatever it writes must end in local prefill,
    never in an exception out of the scheduler's get_num_new_matched_tokens."""
    sched, calls = allowlist_scheduler()
    r = d_request(source=source)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert calls == [] and sched.stats["refused_sources"] == 1


@pytest.mark.parametrize(
    "source", ["http://c:9000", "HTTP://C:9000/", "http://c:9000//", "Http://c:9000"]
)
def test_push_from_equivalent_to_an_allowed_source_is_queried(source):
    sched, calls = allowlist_scheduler()
    assert ask(sched, d_request(source=source)) == (4 * BS, True)
    (url,) = calls
    u = httpx.URL(url)  # where httpx really connects: the allowed host and port
    assert (u.scheme, u.host, u.port) == (
        "http",
        "c",
        9000,
    ) and u.path == "/match_blocks"
    assert sched.stats["refused_sources"] == 0


@pytest.mark.parametrize(
    "text,normalized",
    [
        ("HTTP://Host:9000/", "http://host:9000"),
        ("http://host:9000", "http://host:9000"),
        ("  http://HOST:9000/path?q=1#f ", "http://host:9000"),
        ("https://h.example:443/", "https://h.example:443"),
        ("http://user:pw@Host:9000", "http://host:9000"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
        ("http://[FE80::1]:8000", "http://[fe80::1]:8000"),
    ],
)
def test_normalize_source(text, normalized):
    assert normalize_source(text) == normalized
    assert normalize_source(normalized) == normalized


@pytest.mark.parametrize(
    "text",
    [
        "host:9000",
        "http://host",
        "ftp://host:21",
        "http://:9000",
        "",
        "9000",
        "http://host:",
        "http://host:99999",
        "http://host:abc",
        "http://[::1:80",
    ],
)
def test_normalize_source_refuses_with_config_error(text):
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_SOURCES"):
        normalize_source(text)


def test_push_sources_from_the_environment():
    cfg = ExtConfig.from_env({"MOONCAKE_PUSH_SOURCES": " HTTP://A:1/ ,http://b:2,, "})
    assert cfg.push_sources == ("http://a:1", "http://b:2")
    assert ExtConfig.from_env({}).push_sources == ()
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_SOURCES"):
        ExtConfig.from_env({"MOONCAKE_PUSH_SOURCES": "http://a:1,b:2"})


@pytest.mark.parametrize(
    "source",
    [
        "http://evil:80\\@c:9000",
        "http://evil%40:80@c:9000",
        "http://evil:80;@c:9000",
        "http://c:9000@evil:80",
        "http://evil:80#@c:9000",
        "http://c:9000%2f@evil:80",
        "http://evil\t:80@c:9000",
        "http://c:9000\\\\evil:80",
    ],
)
def test_allowlist_and_http_client_agree_on_the_host(source):
    """A source the allowlist accepts is one httpx connects to: no parser differential."""
    try:
        accepted = normalize_source(source) == ALLOWED
    except ValueError:
        accepted = False
    if not accepted:
        return
    try:
        u = httpx.URL(f"{source}/match_blocks")
    except httpx.InvalidURL:
        return  # D cannot send it: the match fails, D prefills locally
    assert (u.host, u.port) == ("c", 9000), (
        f"{source!r} is allowed but httpx goes to {u.host}"
    )
