"""Fuzz of /push_blocks, /match_blocks and /hashsync over real HTTP: no input
makes C write a byte or crash.

C's transfer engine is a memmove between numpy buffers that logs every call and
copies only into memory registered for the named destination session (as the
real engine writes only into a peer's registered segments), so "nothing was
written" is checked twice: the call log is empty and the destination's bytes are
unchanged. In-process HTTP; no vLLM instance.
"""

from __future__ import annotations

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
    required_fields,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    request_headers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushBlocksRequest,
)

# never an integer in strict mode (None and lists only where the field is a plain int)
WRONG_SCALARS = [True, False, "16", "", "abc", "0x10", {}, {"a": 1}]
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
PRINTABLE = st.characters(min_codepoint=32, max_codepoint=126)


def wrong_int(none_and_lists: bool = False) -> st.SearchStrategy:
    """Not an integer (floats included, integral ones too: strict mode); None or a
    list only if ``none_and_lists`` (a required int field)."""
    lists = [None, [], [1], [1, 2]] if none_and_lists else []
    return st.one_of(
        st.sampled_from(WRONG_SCALARS + lists),
        st.floats(),
        st.text(max_size=8),
        st.sampled_from(RAW_NON_INTS).map(Raw),
    )


# for optional string fields: neither None nor a string
WRONG_STR = st.one_of(
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    st.sampled_from([Raw("NaN"), Raw("1e400")]),
)
NOT_A_LIST = st.one_of(
    st.sampled_from([None, "1,2,3", "", {}, {"0": 1}, Raw("NaN")]),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.text(max_size=8),
)


def wrong_int_list(good: list[int]) -> st.SearchStrategy:
    """A list of ints gone wrong: not a list, one or every element not an int, or
    a list nested where an int belongs."""
    k = st.integers(0, len(good) - 1)
    bad = wrong_int(none_and_lists=True)
    return st.one_of(
        wrong_int(),
        NOT_A_LIST,
        st.tuples(k, bad).map(lambda kb: good[: kb[0]] + [kb[1]] + good[kb[0] + 1 :]),
        st.tuples(bad, st.integers(1, len(good))).map(lambda bn: [bn[0]] * bn[1]),
        st.just([list(good)]),
        k.map(lambda i: good[:i] + [[good[i]]] + good[i + 1 :]),
    )


def not_int(value) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def bad_fingerprint() -> st.SearchStrategy:
    fp = FP.model_dump()

    def with_(field, value):
        return {**fp, field: value}

    return st.one_of(
        st.sampled_from([None, "x", 1, [], [fp], True]),
        st.sampled_from(["model", "dtype", "block_size", "tp_size"]).map(
            lambda f: {k: v for k, v in fp.items() if k != f}
        ),
        st.tuples(
            st.sampled_from(["extra", "Model", "tp", "kv_dtype"]),
            st.sampled_from([1, "x", None]),
        ).map(lambda fv: with_(*fv)),
        # another KV cache: 409
        st.sampled_from(
            [
                ("model", "Other:fedcba9876543210"),
                ("model", ""),
                ("dtype", "bfloat16/auto"),
                ("dtype", "float32/fp8"),
                ("block_size", BS * 4),
                ("tp_size", 2),
                ("tp_size", 0),
                ("block_len", BLEN * 2),
                ("num_kv_tensors", SLOTS + 1),
            ]
        ).map(lambda fv: with_(*fv)),
        st.integers().filter(lambda v: v != BS).map(lambda v: with_("block_size", v)),
        st.integers().filter(lambda v: v != BLEN).map(lambda v: with_("block_len", v)),
        # a field of the wrong type
        st.sampled_from(["model", "dtype"]).flatmap(
            lambda f: WRONG_STR.map(lambda v: with_(f, v))
        ),
        st.sampled_from(
            ["block_size", "tp_size", "block_len", "num_kv_tensors"]
        ).flatmap(
            lambda f: wrong_int(f in ("block_size", "tp_size")).map(
                lambda v: with_(f, v)
            )
        ),
    )


def bad_value(field: str, d: KV, max_tokens: int) -> st.SearchStrategy:
    """Values of ``field`` that make a /push_blocks request invalid by the
    protocol: the right JSON type but out of bounds, or the wrong type."""
    a, b = d.bases
    huge = st.integers(min_value=2**63)
    if field == "token_ids":
        return st.one_of(
            st.just([]),
            st.tuples(st.integers(0, len(TOKENS) - 1), st.integers(1, 2**70)).map(
                lambda kv: TOKENS[: kv[0]] + [-kv[1]] + TOKENS[kv[0] + 1 :]
            ),
            st.lists(st.integers(max_value=-1), min_size=1, max_size=len(TOKENS)),
            st.integers(0, BS - 1).map(lambda n: list(range(n))),  # under one block
            wrong_int_list(TOKENS),
            NOT_A_LIST,
            st.just(TOKENS * (max_tokens // len(TOKENS) + 1)),  # too many: 413
            st.integers(1, 50).map(lambda n: list(range(max_tokens + n))),
        )
    if field == "block_size":  # C's block size only
        return st.one_of(
            wrong_int(none_and_lists=True),
            st.integers().filter(lambda v: v != BS),
            st.just(Raw("9" * 400)),
        )
    if field == "first_block":
        return st.one_of(
            wrong_int(none_and_lists=True),
            st.integers(max_value=-1),
            st.integers(1, 3),
            huge,
            st.just(Raw("9" * 400)),
        )
    if field == "block_len":  # C's block length, or null
        return st.one_of(wrong_int(), st.integers().filter(lambda v: v != BLEN))
    if field == "deadline_unix_ms":  # passed
        return st.one_of(
            wrong_int(none_and_lists=True),
            st.integers(max_value=0),
            st.just(Raw("-" + "9" * 400)),
        )
    if field == "dst_num_blocks":  # <= the largest block id, or tensors past 2**64
        return st.one_of(
            wrong_int(none_and_lists=True),
            st.integers(max_value=max(DST_BLOCKS)),
            st.integers(min_value=2**58),
            st.just(Raw("9" * 400)),
        )
    if field == "dst_session":
        return st.one_of(
            st.sampled_from(
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
                ]
            ),
            st.integers(min_value=65536).map(lambda port: f"h:{port}"),
            st.text(PRINTABLE.filter(lambda ch: ch != ":"), max_size=20),  # no port
            WRONG_STR,
        )
    if field == "dst_kv_base_addrs":
        return st.one_of(
            st.sampled_from(
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
                ]
            ),
            st.integers(max_value=-1).map(lambda v: [v, b]),
            st.integers(min_value=2**64).map(lambda v: [a, v]),
            wrong_int_list([a, b]),
        )
    if field == "dst_block_ids":
        return st.one_of(
            st.sampled_from(
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
                ]
            ),
            st.lists(st.integers(min_value=NBLK), min_size=3, max_size=3),
            st.lists(st.integers(max_value=-1), min_size=3, max_size=3),
            wrong_int_list(DST_BLOCKS),
        )
    if field in ("cache_salt", "lora_name", "request_id"):
        return WRONG_STR
    if field == "source_id":  # another source's, empty, too long, not a string
        return st.one_of(
            st.sampled_from(["another-source", C_SOURCE + "x", ""]),
            st.text(min_size=65, max_size=80),
            st.text(max_size=12).filter(lambda t: t != C_SOURCE),
            WRONG_STR,
        )
    raise AssertionError(field)


PUSH_REQUIRED = required_fields(PushBlocksRequest)
# kinds both endpoints' fuzz sends
BODY_KINDS = ["duplicate", "truncated", "not_json", "empty", "too_large", "auth"]
PUSH_KINDS = ["field", "fields", "missing", "extra", "fingerprint", *BODY_KINDS]
# names no request field has (a prefix no field starts with)
UNKNOWN_FIELD = st.one_of(
    st.sampled_from(
        ["x", "status", "dst_addr", "src_addr", "__proto__", "token", "dst_block_id"]
        + ["Token_ids", "fingerprint2", "ok"]
    ),
    st.text(max_size=8).map(lambda t: "x_" + t),
)
ANY_JSON_VALUE = st.one_of(
    st.sampled_from([1, "a", None, [1], {"a": 1}, True]), st.integers(), st.text()
)


def not_json(body: dict, extra: list[bytes]) -> st.SearchStrategy:
    """Bodies that are not one JSON object of the request."""
    text = dumps(body)
    return st.one_of(
        st.binary(min_size=1, max_size=300),
        st.text(PRINTABLE, min_size=1, max_size=300).map(str.encode),
        st.sampled_from(
            [b"null", b"true", b"[]", b"{}", b"42", b'"x"', b"NaN"] + extra
        ),
        st.sampled_from(
            [
                b"[" + text + b"]",
                text + b"x",
                text + b"}",
                text + text,
                "\ufeff".encode() + text,
                text.decode().encode("utf-16"),
                text.decode().encode("utf-32"),
            ]
        ),
        st.integers(300, 20000).map(lambda n: b"[" * n),
        st.integers(300, 5000).map(lambda n: b'{"a":' * n),
    )


def duplicated(body: dict, field: str, value) -> bytes:
    """``body`` with ``field`` written once more at the end (the occurrence a
    parser keeps)."""
    return dumps(body)[:-1] + b', "' + field.encode() + b'": ' + dumps(value) + b"}"


def padded(body: dict, max_tokens: int) -> bytes:
    """A request padded with spaces past the body cap: 413."""
    return dumps(body)[:-1] + b" " * (70_000 + 48 * max_tokens) + b"}"


def wrong_auth(extra: list[dict]) -> st.SearchStrategy:
    """Headers with a wrong or missing token."""
    return st.one_of(
        st.sampled_from(
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
                {"x-authorization": f"Bearer {TOKEN}"},
            ]
            + extra
        ),
        st.text("abcdef0123456789", min_size=len(TOKEN), max_size=len(TOKEN)).map(
            lambda t: {"authorization": f"Bearer {t}"}
        ),
    )


def push_request(draw, d: KV, max_tokens: int) -> tuple[str, dict, bytes]:
    """One malformed /push_blocks request (kind, headers, body), invalid by the
    protocol whatever else it says, so C must refuse it."""
    body = push_body(d)
    kind = draw(st.sampled_from(PUSH_KINDS))
    headers = dict(AUTH)
    if kind in ("field", "fields"):
        fields = [f for f in body if f != "fingerprint"]
        n = 1 if kind == "field" else draw(st.integers(2, 4))
        for f in draw(
            st.lists(st.sampled_from(fields), min_size=n, max_size=n, unique=True)
        ):
            body[f] = draw(bad_value(f, d, max_tokens))
        return kind, headers, dumps(body)
    if kind == "missing":
        for f in draw(
            st.lists(
                st.sampled_from(PUSH_REQUIRED), min_size=1, max_size=3, unique=True
            )
        ):
            del body[f]
        return kind, headers, dumps(body)
    if kind == "extra":
        body[draw(UNKNOWN_FIELD)] = draw(ANY_JSON_VALUE)
        return kind, headers, dumps(body)
    if kind == "fingerprint":
        body["fingerprint"] = draw(bad_fingerprint())
        return kind, headers, dumps(body)
    if kind == "duplicate":  # the last occurrence is invalid (the one a parser keeps)
        f = draw(
            st.sampled_from(
                [f for f in PUSH_REQUIRED if f != "fingerprint"]
                + ["first_block", "block_len"]
            )
        )
        if draw(st.booleans()):  # the first occurrence invalid too
            body[f] = draw(bad_value(f, d, max_tokens))
        return kind, headers, duplicated(body, f, draw(bad_value(f, d, max_tokens)))
    if kind == "truncated":
        text = dumps(body)
        return kind, headers, text[: draw(st.integers(1, len(text) - 1))]
    if kind == "not_json":
        extra = [b"a=1&b=2", b"<push/>", b"{'token_ids': [1]}"]
        return kind, headers, draw(not_json(body, extra))
    if kind == "empty":
        return kind, headers, b""
    if kind == "too_large":
        return kind, headers, padded(body, max_tokens)
    return kind, draw(wrong_auth([])), dumps(body)  # a valid push, wrong credentials


MATCH_KINDS = ["tokens", "strings", "missing", "extra", *BODY_KINDS]


def bad_tokens(max_tokens: int) -> st.SearchStrategy:
    """token_ids of /match_blocks gone wrong (negative ids: see
    test_match_blocks_refuses_negative_token_ids_as_push_blocks_does)."""
    return st.one_of(
        st.just([]),
        wrong_int_list(TOKENS),
        NOT_A_LIST,
        st.integers(1, 100).map(lambda n: list(range(max_tokens + n))),  # 413
        st.tuples(st.sampled_from(TOKENS), st.integers(2, 5)).map(
            lambda tk: [tk[0]] * (max_tokens * tk[1])
        ),
        st.sampled_from(["NaN", "Infinity", "1e400", "1" + "0" * 5000, "01", "-"]).map(
            lambda t: [Raw(t)] * 8
        ),
    )


def match_request(draw, max_tokens: int) -> tuple[str, dict, bytes]:
    """One malformed /match_blocks request (kind, headers, body)."""
    body = {"token_ids": TOKENS, "cache_salt": None, "lora_name": None}
    kind = draw(st.sampled_from(MATCH_KINDS))
    headers = dict(AUTH)
    if kind == "tokens":
        body["token_ids"] = draw(bad_tokens(max_tokens))
        if draw(st.booleans()):
            f = draw(st.sampled_from(["cache_salt", "lora_name"]))
            body[f] = draw(st.one_of(st.none(), st.text(max_size=4), WRONG_STR))
        return kind, headers, dumps(body)
    if kind == "strings":
        for f in draw(
            st.lists(
                st.sampled_from(["cache_salt", "lora_name"]),
                min_size=1,
                max_size=2,
                unique=True,
            )
        ):
            body[f] = draw(WRONG_STR)
        return kind, headers, dumps(body)
    if kind == "missing":
        del body["token_ids"]
        return kind, headers, dumps(body)
    if kind == "extra":
        name = draw(
            st.one_of(
                st.sampled_from(
                    ["block_size", "fingerprint", "x", "token_id", "dst_session"]
                ),
                st.text(max_size=8).map(lambda t: "x_" + t),
            )
        )
        body[name] = draw(st.one_of(ANY_JSON_VALUE, st.just(FP.model_dump())))
        return kind, headers, dumps(body)
    if kind == "duplicate":
        f = draw(st.sampled_from(["token_ids", "cache_salt", "lora_name"]))
        bad = draw(bad_tokens(max_tokens) if f == "token_ids" else WRONG_STR)
        return kind, headers, duplicated(body, f, bad)
    if kind == "truncated":
        text = dumps(body)
        return kind, headers, text[: draw(st.integers(1, len(text) - 1))]
    if kind == "not_json":
        extra = [
            b"0",
            b'"token_ids"',
            b"Infinity",
            b"token_ids=1,2,3",
            str(TOKENS).encode() + b"x",
        ]
        return kind, headers, draw(not_json(body, extra))
    if kind == "empty":
        return kind, headers, b""
    if kind == "too_large":
        return kind, headers, padded(body, max_tokens)
    extra = [{"authorization": "Bearer " + TOKEN[::-1]}]
    return kind, draw(wrong_auth(extra)), dumps(body)


EXPECTED = {"auth": {401}, "too_large": {413}}
FUZZ_N = 1000
# Deterministic (the same inputs on every run, as CI needs) and no example
# database written into the checkout; C's fixture serves every example.
FUZZ = settings(
    max_examples=FUZZ_N,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


class Tally:
    """What the fuzz sent and what C answered; offenders are any answer that is
    not a 4xx (or not the status a kind must get)."""

    def __init__(self):
        self.tried, self.codes, self.kinds, self.bad = 0, Counter(), Counter(), []

    @property
    def crashes(self) -> int:
        return sum(v for k, v in self.codes.items() if k >= 500 or k < 0)

    def describe(self, path: str) -> str:
        return (
            f"{path}: {self.tried} inputs, {self.crashes} crashes (5xx or dropped), "
            f"statuses {dict(self.codes)}, kinds {dict(self.kinds)}"
        )


def send(c: CServer, path: str, req: tuple[str, dict, bytes], tally: Tally) -> None:
    kind, headers, content = req
    if headers == AUTH:  # valid credentials: signed as D signs
        headers = request_headers(c.config, "POST", path, content)
    tally.tried += 1
    tally.kinds[kind] += 1
    try:
        r = c.http.post(
            path,
            content=content,
            headers={"content-type": "application/json", **headers},
        )
        code, text = r.status_code, r.text[:200]
    except httpx.HTTPError as e:  # the server dropped the connection
        code, text = -1, repr(e)
    tally.codes[code] += 1
    want = EXPECTED.get(kind)
    if not 400 <= code < 500 or (want is not None and code not in want):
        tally.bad.append((kind, code, text, content[:300]))
    # Hypothesis shrinks a failing input to a small one and names it
    assert 400 <= code < 500 and (want is None or code in want), (kind, code, text)


def test_fuzz_push_and_match_blocks_never_write_never_crash(c_servers, record_property):
    cfg = ExtConfig(bootstrap_token=TOKEN, push_max_tokens=256)
    c = c_servers(cfg)
    d = c.destination()
    before = d.snapshot()
    push, match = Tally(), Tally()

    @FUZZ
    @given(st.data())
    def fuzz_push(data):
        send(c, "/push_blocks", push_request(data.draw, d, cfg.push_max_tokens), push)

    @FUZZ
    @given(st.data())
    def fuzz_match(data):
        send(c, "/match_blocks", match_request(data.draw, cfg.push_max_tokens), match)

    fuzz_push()
    fuzz_match()
    written = changed_bytes(before, d.snapshot())
    logged = len(c.engine.log)
    summary = (
        f"{push.describe('/push_blocks')}; {match.describe('/match_blocks')}; "
        f"{written} destination bytes changed, {logged} engine calls "
        f"({c.engine.bytes_logged()} bytes)"
    )
    print(summary)
    record_property("fuzz_summary", summary)
    assert push.tried >= FUZZ_N and match.tried >= FUZZ_N, summary
    assert set(push.kinds) == set(PUSH_KINDS), summary
    assert set(match.kinds) == set(MATCH_KINDS), summary
    assert written == 0 and logged == 0, summary
    assert c.server.stats["ok"] == 0 and c.server.stats["bytes"] == 0, summary
    # still serving: the same template, valid, is pushed byte-exact and matched
    r = c.post("/push_blocks", push_body(d))
    assert_push_ok(c, d, r)
    m = c.post("/match_blocks", {"token_ids": TOKENS})
    assert m.status_code == 200 and m.json()["matched_blocks"] == 3, m.text
    assert m.json()["fingerprint"] == FP.model_dump()


HASHSYNC_VALUES = [
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
# what a URL's query may hold as typed (no '&' or '#': they would split it)
QUERY_TEXT = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="&#"),
    max_size=12,
)


def hashsync_query(draw) -> tuple[str, dict]:
    """A /hashsync query string and the headers it is sent with."""
    params = [
        f"{name}={value}"
        for name, value in draw(
            st.lists(
                st.tuples(
                    st.one_of(
                        st.sampled_from(
                            [
                                "sample",
                                "sample",
                                "Sample",
                                "x",
                                "sample[]",
                                "",
                                "%73ample",
                            ]
                        ),
                        QUERY_TEXT,
                    ),
                    st.one_of(st.sampled_from(HASHSYNC_VALUES), QUERY_TEXT),
                ),
                max_size=3,
            )
        )
    ]
    if draw(st.booleans()):
        params.append(draw(st.sampled_from(["sample", "&&", "=", "==8", "sample==1"])))
    headers = draw(
        st.sampled_from(
            [
                AUTH,
                AUTH,
                {},
                {"authorization": "Bearer x"},
                {"authorization": f"Basic {TOKEN}"},
                {"authorization": TOKEN},
            ]
        )
    )
    return "&".join(params), headers


def test_fuzz_hashsync_never_crashes(c_servers, record_property):
    c = c_servers(ExtConfig(bootstrap_token=TOKEN))
    tally = Tally()

    @FUZZ
    @given(st.data())
    def fuzz(data):
        query, headers = hashsync_query(data.draw)
        try:
            r = c.http.get(
                "/hashsync" + ("?" + query if query else ""), headers=headers
            )
            code = r.status_code
        except httpx.HTTPError as e:
            code = -1
            tally.bad.append((query, headers, repr(e)))
        tally.tried += 1
        tally.codes[code] += 1
        if code >= 500 or code < 0:
            tally.bad.append((query, headers, code))
        elif headers is not AUTH and code == 200:
            tally.bad.append((query, headers, "200 without the token"))
        assert 0 <= code < 500 and (headers is AUTH or code != 200), (query, code)

    fuzz()
    summary = (
        f"/hashsync: {tally.tried} inputs, statuses {dict(tally.codes)}, "
        f"offenders {tally.bad[:5]}"
    )
    print(summary)
    record_property("hashsync_fuzz_summary", summary)
    assert tally.tried >= FUZZ_N and not tally.bad, summary
    codes = tally.codes
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
