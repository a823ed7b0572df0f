"""Fuzz of /push_blocks, /match_blocks and /hashsync over real HTTP: no input
makes C write a byte or crash.

C's transfer engine is a memmove between numpy buffers that logs every call and
copies only into memory registered for the named destination session (as the
real engine writes only into a peer's registered segments), so "nothing was
written" is checked twice: the call log is empty and the destination's bytes are
unchanged. In-process HTTP; no vLLM instance.
"""

from __future__ import annotations

import random
from collections import Counter

import httpx
from helpers import (
    AUTH,
    BLEN,
    BS,
    C_SESSION,
    C_SOURCE,
    DST_BLOCKS,
    FP,
    KV,
    NBLK,
    SLOTS,
    TOKEN,
    TOKENS,
    CServer,
    Raw,
    assert_push_ok,
    changed_bytes,
    dumps,
    push_body,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)

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
