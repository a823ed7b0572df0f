"""Prefix push is safe to expose: two real instances, the real Mooncake engine.

C and D share a token (MOONCAKE_BOOTSTRAP_TOKEN). Checked here across the wire:
- nothing unauthenticated: no or a wrong token -> 401 on every endpoint of ours,
  and the token itself (a bearer header) does not open the POST routes, which
  take signed requests only (connector/common/auth.py);
- fuzzing C's /push_blocks and /match_blocks with signed requests (so inputs reach
  validation): only 4xx, C writes nothing (its push counters), both keep serving
  and D's next answer is correct;
- destinations C refuses: a push signed for another source sharing the token
  (421: a capture does not replay between sources), its own session, a
  session's second layout signed earlier than its first, block ids beyond the
  destination's cache, a mismatched fingerprint;
- limits: an oversized body, a million-token push, 200 concurrent pushes at a
  black-hole session: 413/429 at once and a legitimate push still completes;
- hostile or slow sources (a fake C in this process, on D's allowlist): absurd
  answers, a KV-cache mismatch, an "ok" that proves nothing, a source trickling
  bytes: D stays up and prefills locally, correctly, within its deadlines.
Pure logic (TP=2 refusal: tests/unit/connector/push/test_push_destination_refusals.py;
guard modes: tests/unit/connector/push/test_push_endpoint_guard.py; the in-process
fuzz of >= 1000 inputs per endpoint: tests/unit/connector/push/test_push_fuzz.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import BLOCK
from harness.pd_client import complete, push_stats
from harness.prompts import random_prompt as prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    read_key,
    sign,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-for-tests"
AUTH = {"authorization": f"Bearer {read_key(TOKEN)}"}  # the GET routes' key


class FakeSource:
    """A push source that answers what the test tells it to (on D's allowlist)."""

    def __init__(self):
        self.mode = "ok"
        self.fingerprint: dict = {}
        self.calls = 0
        self.url = ""  # where it is served (shared_source)

    def respond(
        self, handler: BaseHTTPRequestHandler, path: str, raw: bytes
    ) -> dict | None:
        self.calls += 1
        req = json.loads(raw or b"{}")
        full = len(req.get("token_ids", [])) // BLOCK
        if self.mode == "slow":
            handler.send_response(200)
            handler.send_header("content-type", "application/json")
            handler.send_header("content-length", "1000")
            handler.end_headers()
            for _ in range(120):  # one byte a second: per-read timeouts never fire
                try:
                    handler.wfile.write(b" ")
                    handler.wfile.flush()
                except OSError:
                    return None
                time.sleep(1)
            return None
        if path == "/match_blocks":
            matched = {
                "huge": 10**18,
                "negative": -5,
                "more": full + 50,
                "ok_inconsistent": full,
                "ok_unwritten": full,
                "mismatch": full,
            }[self.mode]
            fp = dict(self.fingerprint)
            if self.mode == "mismatch":
                fp["block_size"] = 16
            return {
                "matched_blocks": matched,
                "matched_tokens": matched * BLOCK,
                "total_full_blocks": full,
                "fingerprint": fp,
                "engine_timeout_s": 30,
                "now_unix_ms": int(time.time() * 1000),
                "source_id": "fake-source",
            }
        if path == "/push_proof":  # bytes guessed as zeros
            return {"status": "ok", "probe_values": ["00" * 8 for _ in req["probes"]]}
        # /push_blocks: claims success, writes nothing
        n_blocks = len(req.get("dst_block_ids", []))
        fp = self.fingerprint
        consistent = n_blocks * fp["block_len"] * fp["num_kv_tensors"]
        return {
            "status": "ok",
            "pushed_blocks": n_blocks,
            "matched_blocks": n_blocks,
            # ok_unwritten: numbers that add up, a push id to prove it by
            "bytes": consistent if self.mode == "ok_unwritten" else 123,
            "push_id": "guessed",
        }


@pytest.fixture(scope="module")
def cluster(shared_cluster, shared_source):
    """C, D and x64 (another block size: a push source and destination that must
    never match) share TOKEN; the fake source is on D's allowlist."""
    fake = FakeSource()
    cl = shared_cluster("push", answer=fake.respond)
    assert cl.token == TOKEN
    # test_limits_answer_at_once_and_a_legitimate_push_still_completes: 4 at once
    assert cl["c"].spec.env["MOONCAKE_PUSH_MAX_CONCURRENT"] == "4"
    fake.url = shared_source.url
    return cl, fake


@pytest.fixture(scope="module")
def env(cluster):
    cl, fake = cluster
    return cl["c"], cl["d"], fake


@pytest.fixture(scope="module")
def x64(cluster):
    return cluster[0]["x64"]


def match_timeout_s(d) -> float:
    return float(d.spec.env["MOONCAKE_PUSH_MATCH_TIMEOUT_S"])


def signed(url: str, content: bytes, at_ms: int | None = None) -> dict:
    """Headers of a POST to one of our routes, signed as D signs (at ``at_ms``: now)."""
    return {
        "authorization": sign(
            TOKEN, "POST", httpx.URL(url).raw_path.decode(), content, now_ms=at_ms
        ),
        "content-type": "application/json",
    }


def post(url, body, headers=None, timeout=30, at_ms=None):
    """POST ``body`` as JSON: signed, unless ``headers`` are given."""
    content = json.dumps(body).encode()
    if headers is None:
        headers = signed(url, content, at_ms)
    return httpx.post(url, content=content, headers=headers, timeout=timeout)


def cached_on_c(c, ids):
    complete(c.url, ids, max_tokens=1, logprobs=None, timeout=300)
    deadline = time.monotonic() + 30
    while True:
        m = post(c.bootstrap_url + "/match_blocks", {"token_ids": ids}).json()
        if m["matched_blocks"] == len(ids) // BLOCK or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def process_group_rss_mib(inst) -> float:
    """Resident memory of an instance's processes (API server, engine core)."""
    import os

    pgid = os.getpgid(inst.proc.pid)
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                total += next(
                    int(line.split()[1]) for line in f if line.startswith("VmRSS:")
                )
        except (OSError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


def assert_d_correct(c, d, seed):
    ids = prompt(300, seed=seed)
    got = complete(d.url, ids, max_tokens=4, logprobs=5, timeout=300)
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems


def test_every_endpoint_needs_the_token(env):
    c, _, _ = env
    ids = prompt(2 * BLOCK, seed=7000)
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": TOKEN},
        # the signing key itself is never a bearer key: one GET sent in clear
        # would give away what signs pushes
        {"authorization": f"Bearer {TOKEN}"},
    ):
        assert (
            post(
                c.bootstrap_url + "/match_blocks", {"token_ids": ids}, headers
            ).status_code
            == 401
        )
        assert post(c.bootstrap_url + "/push_blocks", {}, headers).status_code == 401
        assert (
            httpx.get(c.bootstrap_url + "/hashsync", headers=headers).status_code == 401
        )
        assert (
            httpx.get(c.bootstrap_url + "/push/stats", headers=headers).status_code
            == 401
        )
    assert httpx.get(c.bootstrap_url + "/hashsync", headers=AUTH).status_code == 200
    assert httpx.get(c.bootstrap_url + "/push/stats", headers=AUTH).status_code == 200
    # the read key opens only the GET routes
    assert (
        post(c.bootstrap_url + "/match_blocks", {"token_ids": ids}, AUTH).status_code
        == 401
    )
    # signed, it passes (503 until C's first step has sent its hash configuration)
    assert post(c.bootstrap_url + "/match_blocks", {"token_ids": ids}).status_code in (
        200,
        503,
    )


def assert_pushed_to_d(c, d, ids, seed):
    """A turn 2 (``ids``, cached on C, + 40 tokens) on D with push_from C: C's
    blocks of ``ids`` come over."""
    got = complete(
        d.url,
        ids + prompt(40, seed=seed),
        max_tokens=4,
        logprobs=None,
        timeout=300,
        kv_transfer_params={"push_from": c.bootstrap_url},
    )
    assert got.cached_tokens == len(ids) // BLOCK * BLOCK, got.cached_tokens


def valid_push(c, ids, fingerprint, **over):
    body = {
        "token_ids": ids,
        "block_size": BLOCK,
        "dst_session": "127.0.0.1:1",
        "dst_kv_base_addrs": [
            (i + 1) << 32 for i in range(fingerprint["num_kv_tensors"])
        ],
        "dst_block_ids": list(range(len(ids) // BLOCK)),
        "first_block": 0,
        "deadline_unix_ms": int(time.time() * 1000) + 60_000,
        "dst_num_blocks": 64,
        "fingerprint": fingerprint,
        "source_id": source_id_of(c),
    }
    body.update(over)
    return body


def source_id_of(inst) -> str:
    """The name an instance's /match_blocks answers carry (a push names it back)."""
    ask = {"token_ids": [1] * BLOCK}
    m = post(inst.bootstrap_url + "/match_blocks", ask)
    if m.status_code == 503:  # no step yet, so no hash configuration: take one
        complete(inst.url, prompt(BLOCK, seed=7999), max_tokens=1, logprobs=None)
        m = post(inst.bootstrap_url + "/match_blocks", ask)
    assert m.status_code == 200, m.text
    return m.json()["source_id"]


def mutations(rng, body):
    """Malformed variants of a valid body."""
    weird = [
        None,
        True,
        -1,
        2**70,
        1.5,
        float("nan"),
        "5",
        [],
        {},
        "x" * 1000,
        [1, "a"],
        -(2**63),
    ]
    keys = list(body)
    for _ in range(1000):
        b = json.loads(json.dumps(body))
        kind = rng.randrange(6)
        if kind == 0:
            b[rng.choice(keys)] = rng.choice(weird)
        elif kind == 1:
            del b[rng.choice(keys)]
        elif kind == 2:
            b[f"extra{rng.randrange(9)}"] = rng.choice(weird)
        elif kind == 3 and b.get("dst_block_ids"):
            b["dst_block_ids"] = [rng.choice([-1, 64, 10**9, 0, 0])] * rng.randrange(
                1, 5
            )
        elif kind == 4:
            b["fingerprint"] = {
                **b.get("fingerprint", {}),
                rng.choice(
                    ["model", "dtype", "block_size", "tp_size", "block_len"]
                ): rng.choice(weird),
            }
        else:
            raw = json.dumps(b, allow_nan=True)
            yield raw[: rng.randrange(len(raw))].encode()  # truncated JSON
            continue
        yield json.dumps(b, allow_nan=True).encode()


def test_fuzzing_the_source_writes_nothing_and_both_keep_serving(env):
    c, d, _ = env
    ids = prompt(3 * BLOCK, seed=7100)
    fp = cached_on_c(c, ids)["fingerprint"]
    before = push_stats(c.bootstrap_url)
    rng = random.Random(7)
    codes: dict[int, int] = {}
    tried = 0
    cases = (
        ("/push_blocks", valid_push(c, ids, fp)),
        ("/match_blocks", {"token_ids": ids, "cache_salt": None}),
    )
    client = httpx.Client(timeout=30)  # one client: kept connections, one TLS context
    for path, body in cases:
        for raw in mutations(rng, body):
            r = client.post(
                c.bootstrap_url + path,
                content=raw,
                headers=signed(c.bootstrap_url + path, raw),
            )
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            tried += 1
            assert r.status_code < 500, (
                f"{path} answered {r.status_code} to {raw[:200]!r}"
            )
            if path == "/push_blocks":
                assert r.status_code != 200 or r.json()["status"] != "ok", raw[:200]
    client.close()
    after = push_stats(c.bootstrap_url)
    assert after["bytes"] == before["bytes"] and after["ok"] == before["ok"], (
        before,
        after,
    )
    print(
        f"fuzz: {tried} inputs, answers {codes}, 5xx 0, bytes written "
        f"{after['bytes'] - before['bytes']}"
    )
    assert tried >= 2000
    assert_d_correct(c, d, 7101)


def test_destinations_the_source_refuses(env, x64):
    c, _, _ = env
    ids = prompt(2 * BLOCK, seed=7200)
    fp = cached_on_c(c, ids)["fingerprint"]
    before = push_stats(c.bootstrap_url)
    own = httpx.get(c.bootstrap_url + "/hashsync", headers=AUTH).json()
    assert own["size"] > 0
    cases = {
        "block id beyond the destination": (
            valid_push(c, ids, fp, dst_block_ids=[0, 64]),
            422,
        ),
        "fingerprint mismatch": (valid_push(c, ids, {**fp, "block_size": 16}), 409),
        "tp 2": (valid_push(c, ids, {**fp, "tp_size": 2}), 409),
        "overlapping tensors": (
            valid_push(c, ids, fp, dst_kv_base_addrs=[1 << 32] * fp["num_kv_tensors"]),
            422,
        ),
        # signed with the same token, but for another source (x64): a capture
        # does not replay from one source to another
        "for another source": (
            valid_push(c, ids, fp, source_id=source_id_of(x64)),
            421,
        ),
    }
    for name, (body, code) in cases.items():
        r = post(c.bootstrap_url + "/push_blocks", body)
        assert r.status_code == code, (name, r.status_code, r.text)
    # a session's layout is fixed by its first push (here: a black hole, nothing listens)
    # against any push signed before it; one signed later re-registers (a restart)
    now = int(time.time() * 1000)
    first = post(
        c.bootstrap_url + "/push_blocks",
        valid_push(c, ids, fp, dst_session="127.0.0.1:2"),
        at_ms=now,
    )
    assert first.status_code == 200 and first.json()["status"] == "failed", first.text
    other = post(
        c.bootstrap_url + "/push_blocks",
        valid_push(c, ids, fp, dst_session="127.0.0.1:2", dst_num_blocks=65),
        at_ms=now - 1000,
    )
    assert other.status_code == 409, other.text
    assert push_stats(c.bootstrap_url)["bytes"] == before["bytes"]


def test_limits_answer_at_once_and_a_legitimate_push_still_completes(env):
    c, d, _ = env
    ids = prompt(4 * BLOCK, seed=7300)
    fp = cached_on_c(c, ids)["fingerprint"]
    t0 = time.monotonic()
    big = b"[" + b"1," * 4_000_000 + b"1]"  # 8 MB: above the body limit
    try:
        r = httpx.post(
            c.bootstrap_url + "/push_blocks",
            content=big,
            headers=signed(c.bootstrap_url + "/push_blocks", big),
            timeout=60,
        )
        assert r.status_code == 413, r.text
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server answered 413 and closed before the whole body was sent
    assert (
        httpx.get(c.bootstrap_url + "/hashsync", headers=AUTH, timeout=10).status_code
        == 200
    )
    million = post(c.bootstrap_url + "/push_blocks", valid_push(c, [1] * 1_000_000, fp))
    assert million.status_code == 413, million.text
    assert time.monotonic() - t0 < 20
    # 200 concurrent pushes at a black-hole session: at most 4 run, the rest 429 at once
    body = valid_push(c, ids, fp, dst_session="127.0.0.1:3")

    def one(_):
        t = time.monotonic()
        code = post(c.bootstrap_url + "/push_blocks", body, timeout=120).status_code
        return code, time.monotonic() - t

    rss_before = process_group_rss_mib(c)
    with cf.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(200)))
    grew = process_group_rss_mib(c) - rss_before
    assert grew < 512, f"C's memory grew by {grew:.0f} MiB under 200 concurrent pushes"
    codes = [code for code, _ in answers]
    busy = [secs for code, secs in answers if code == 429]
    assert set(codes) <= {200, 429} and busy, codes
    # "at once" = without waiting for a slot; the exact bound is the unit test's (gated
    # writes); here 50 clients share 2 cores with three instances
    assert max(busy) < 10.0, f"a 429 took {max(busy):.2f}s"
    # a legitimate push (D, via push_from) still lands
    turn2 = ids + prompt(40, seed=7301)
    got = complete(
        d.url,
        turn2,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": c.bootstrap_url},
    )
    assert got.cached_tokens == 4 * BLOCK, got.cached_tokens
    check = compare(
        got,
        reference_completion(c.url, turn2, max_tokens=4),
        expected_cached_tokens=None,
    )
    assert check.ok, check.problems


def test_connections_without_a_request_are_closed_and_their_number_capped(env):
    """Connections to C's bootstrap server that never complete a request's headers
    (nothing sent, or a trickle) are closed at the header deadline, and beyond the
    cap new ones are closed at once; C's memory does not grow and a push from D
    is served right after."""
    import select
    import socket

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.http_limits import (
        HEADER_DEADLINE_S,
        MAX_CONNECTIONS,
    )

    c, d, _ = env
    url = httpx.URL(c.bootstrap_url)
    rss_before = process_group_rss_mib(c)
    n = MAX_CONNECTIONS + 44
    socks = []
    t0 = time.monotonic()
    try:
        for i in range(n):
            s = socket.create_connection((url.host, url.port), timeout=5)
            if i % 2:
                s.sendall(b"POST /push_blocks HTTP/1.1\r\nHost: c\r\n")  # no end
            socks.append(s)
        open_at: dict[int, float] = {}  # connection -> when C closed it
        index = {s: i for i, s in enumerate(socks)}
        while len(open_at) < n and time.monotonic() - t0 < HEADER_DEADLINE_S + 20:
            waiting = [s for s, i in index.items() if i not in open_at]
            ready, _, _ = select.select(waiting, [], [], 0.2)
            for s in ready:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data == b"":
                    open_at[index[s]] = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    at_once = sum(1 for t in open_at.values() if t < 2)
    print(
        f"{n} idle connections: {at_once} closed within 2 s, the last after "
        f"{max(open_at.values(), default=0):.1f} s"
    )
    assert len(open_at) == n, f"{n - len(open_at)} connections still open"
    assert at_once >= n - MAX_CONNECTIONS, f"only {at_once} closed at once"
    assert max(open_at.values()) < HEADER_DEADLINE_S + 10, max(open_at.values())
    grew = process_group_rss_mib(c) - rss_before
    assert grew < 256, f"C's memory grew by {grew:.0f} MiB"
    ids = prompt(2 * BLOCK, seed=7340)
    cached_on_c(c, ids)
    assert_pushed_to_d(c, d, ids, seed=7341)


def test_a_destination_whose_writes_keep_failing_is_refused_for_a_while(env):
    """C's writes into a session where no engine listens fail; after a few in a
    row, C refuses that destination: the next push is answered ``failed`` with
    the reason at once, nothing is submitted to the engine, and the refusal is
    counted in /push/stats and /metrics."""
    c, d, _ = env
    ids = prompt(2 * BLOCK, seed=7350)
    fp = cached_on_c(c, ids)["fingerprint"]
    body = valid_push(c, ids, fp, dst_session="127.0.0.1:4")
    before = push_stats(c.bootstrap_url)
    messages = []
    for _ in range(8):
        r = post(c.bootstrap_url + "/push_blocks", body)
        assert r.status_code == 200 and r.json()["status"] == "failed", r.text
        messages.append(r.json()["message"])
        if "refused" in messages[-1]:
            break
    assert "127.0.0.1:4 are refused" in messages[-1], messages
    assert "nothing written" in messages[-1], messages
    assert all("transfer engine returned -1" in m for m in messages[:-1]), messages
    after = push_stats(c.bootstrap_url)
    assert after["peer_refused"] == before["peer_refused"] + 1, (before, after)
    assert after["refused_peers_now"] >= 1, after
    metrics = httpx.get(c.bootstrap_url + "/metrics", headers=AUTH, timeout=10)
    assert metrics.status_code == 200, metrics.text
    lines = dict(
        line.rsplit(" ", 1)
        for line in metrics.text.splitlines()
        if line and not line.startswith("#")
    )
    assert float(lines["vllm_mooncake_ext_peers_refused"]) >= 1, metrics.text
    assert float(lines["vllm_mooncake_ext_writes_refused_total"]) >= 1, metrics.text
    assert httpx.get(c.bootstrap_url + "/metrics", timeout=10).status_code == 401
    assert_pushed_to_d(c, d, ids, seed=7351)  # another destination: still served


HOSTILE = ["huge", "negative", "more", "mismatch", "ok_inconsistent", "ok_unwritten"]


@pytest.mark.parametrize("mode", HOSTILE)
def test_hostile_source_answers_leave_d_up_and_correct(env, mode):
    c, d, fake = env
    if not fake.fingerprint:
        fake.fingerprint = cached_on_c(c, prompt(BLOCK, seed=7400))["fingerprint"]
    fake.mode = mode
    ids = prompt(
        3 * BLOCK + 5, seed=7410 + HOSTILE.index(mode)
    )  # new to D: no local hit
    got = complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": fake.url},
    )
    assert not got.cached_tokens, (
        f"{mode}: {got.cached_tokens} tokens counted from a hostile source"
    )
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, (mode, check.problems)
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    assert wait_no_blocks_in_use(d.url) == (0.0,)


def test_slow_loris_source_ends_by_local_prefill_within_the_deadline(env):
    c, d, fake = env
    fake.mode = "slow"
    ids = prompt(2 * BLOCK + 9, seed=7500)
    t0 = time.monotonic()
    got = complete(
        d.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=120,
        kv_transfer_params={"push_from": fake.url},
    )
    took = time.monotonic() - t0
    deadline_s = match_timeout_s(d)
    assert took < deadline_s + 20, (
        f"took {took:.1f}s with a {deadline_s:g} s match deadline"
    )
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems


@pytest.mark.parametrize("direction", ["128 from 64", "64 from 128"])
def test_block_size_mismatch_falls_back_to_local_prefill(env, x64, direction):
    """Instances with different block sizes: the destination sees the source's
    fingerprint in its /match_blocks answer and prefills locally (one warning
    naming both block sizes); the source would refuse the push with 409 too
    (tests/unit/connector/push/test_push_destination_refusals.py)."""
    c, d, _ = env
    x = x64
    src, dst = (x, d) if direction == "128 from 64" else (c, x)
    ids = prompt(4 * BLOCK + 3, seed=7600 if direction.startswith("128") else 7700)
    complete(src.url, ids, max_tokens=1, logprobs=None, timeout=300)
    got = complete(
        dst.url,
        ids,
        max_tokens=4,
        logprobs=5,
        timeout=300,
        kv_transfer_params={"push_from": src.bootstrap_url},
    )
    assert not got.cached_tokens, got.cached_tokens
    check = compare(
        got, reference_completion(c.url, ids, max_tokens=4), expected_cached_tokens=None
    )
    assert check.ok, check.problems
    assert "block_size" in dst.log_text()
