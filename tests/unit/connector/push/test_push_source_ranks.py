"""A push source of TP > 1 (push/source_ranks.py): rank 0 records where each rank
serves its pushes and names the ports in /match_blocks; D's rank r asks C's rank r
at the source's own host. In-process HTTP; no vLLM instance."""

from __future__ import annotations

import json
import threading
import time

import pytest
from helpers import (
    C_SOURCE,
    FP,
    TOKENS,
    Blocks,
    assert_landed,
    assert_push_ok,
    d_request,
    push_body,
    refused,
)
from test_push_scheduler import BS, C_FP, SRC, Clock, http_answer
from test_push_scheduler import FP as D_FP

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
    FaultConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_receiver import (
    PushReceiver,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    PushJob,
    RankRegistration,
    rank_urls,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_ranks import (
    RANKS_PATH,
    RankPorts,
    rank_port,
    register_rank,
)

FP2 = FP.model_copy(update={"tp_size": 2})


ENGINE = "engine-7f3a"


def reg(rank, port, engine_port=None, engine_id=ENGINE, dp_rank=0):
    return RankRegistration(
        tp_rank=rank,
        port=port,
        engine_port=engine_port or 17100 + rank,
        engine_id=engine_id,
        dp_rank=dp_rank,
    )


def test_rank_listeners_take_one_range_per_host_from_the_first_port():
    # TP 4, two DP ranks on one host: ranks 1-3 of each, contiguous, no overlap
    ports = [rank_port(20000, r, 4, d) for d in (0, 1) for r in (1, 2, 3)]
    assert ports == [20000, 20001, 20002, 20003, 20004, 20005]
    assert rank_port(0, 3, 4, 1) == 0  # unset: the kernel picks
    with pytest.raises(ValueError, match="past 65535"):
        rank_port(65535, 2, 4, 0)


@pytest.mark.parametrize("raw", ["-1", "65536", "x"])
def test_a_rank_port_that_is_no_port_is_refused_at_start(raw):
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_RANK_PORT"):
        ExtConfig.from_env({"MOONCAKE_PUSH_RANK_PORT": raw})


def test_rank_zero_records_each_rank_of_its_own_instance_once():
    completed: list[list[int]] = []
    ranks = RankPorts(3, reg(0, 9000), completed.append)
    assert ranks.ports() is None and "1, 2" in ranks.missing()
    assert ranks.register(reg(2, 9102)) is None
    assert ranks.register(reg(2, 9102)) is None  # a retry sends the same
    assert ranks.ports() is None and "rank(s) 1 " in ranks.missing()
    for bad, why in [
        (reg(2, 9103), "registered already"),
        (reg(0, 9100), "ranks are 1..2"),
        (reg(3, 9100), "ranks are 1..2"),
        (reg(1, 0), "out of range"),
        (reg(1, 9101, engine_port=70000), "out of range"),
        (reg(1, 9101, engine_id="another"), "not this instance's"),
        (reg(1, 9101, dp_rank=1), "not this instance's"),
    ]:
        with pytest.raises(ValueError, match=why):
            ranks.register(bad)
    assert ranks.register(reg(1, 9101)) == [17100, 17101, 17102]
    assert ranks.ports() == [9000, 9101, 9102] and completed == [[17100, 17101, 17102]]
    assert ranks.register(reg(1, 9101)) == [17100, 17101, 17102]  # told again
    assert len(completed) == 1


def test_d_asks_each_rank_at_the_sources_own_host():
    assert rank_urls("http://c:9000", None, 1) == ()
    assert rank_urls("http://c:9000", [9000, 9101], 2) == (
        "http://c:9000",
        "http://c:9101",
    )
    # rank 0 is the source D reached, whatever port C thinks it has
    assert rank_urls("http://[::1]:8000", [9000, 9101], 2) == (
        "http://[::1]:8000",
        "http://[::1]:9101",
    )
    for ports, why in [
        (None, "0 TP rank ports for TP size 2"),
        ([9000], "1 TP rank ports"),
        ([9000, 9101, 9102], "3 TP rank ports"),
        ([9000, 70000], "out of range"),
    ]:
        with pytest.raises(ValueError, match=why):
            rank_urls("http://c:9000", ports, 2)
    with pytest.raises(ValueError, match="plain HTTP"):
        rank_urls("https://c:9000", [9000, 9101], 2)


def two_rank_source(c_server):
    """Rank 0 of a TP 2 source (CServer), its registry wired as the worker wires it."""
    c = c_server(fingerprint=FP2)
    c.server.ranks = RankPorts(2, reg(0, 9000), c.server.ranks_registered)
    return c


def test_rank_zero_serves_once_every_rank_registered(c_server):
    c = two_rank_source(c_server)
    d = c.destination()
    body = push_body(d, fingerprint=FP2.model_dump())
    r = c.post("/match_blocks", {"token_ids": TOKENS})
    assert r.status_code == 503 and "rank(s) 1 " in r.text, r.text
    out = refused(c, body, 503, d)  # no rank writes before all are known
    assert "not all registered" in out["detail"]["message"]
    r = c.post(RANKS_PATH, reg(1, 9101).model_dump())
    assert r.status_code == 200, r.text
    assert r.json() == {"source_id": C_SOURCE, "engine_ports": [17100, 17101]}
    answer = c.post("/match_blocks", {"token_ids": TOKENS}).json()
    assert answer["rank_ports"] == [9000, 9101] and answer["matched_blocks"] == 3
    assert_push_ok(c, d, c.post("/push_blocks", body))
    # another registration for a known rank, another instance's rank, a rank out
    # of range, a malformed body
    for bad, code in [
        (reg(1, 9999).model_dump(), 409),
        (reg(1, 9101, engine_id="another").model_dump(), 409),
        ({**reg(1, 9101).model_dump(), "tp_rank": 2}, 409),
        ({"tp_rank": "1", "port": 9101}, 422),
    ]:
        r = c.post(RANKS_PATH, bad)
        assert r.status_code == code, (bad, r.text)
    assert c.post("/match_blocks", {"token_ids": TOKENS}).json()["rank_ports"] == [
        9000,
        9101,
    ]


def test_no_rank_writes_into_another_ranks_engine(c_server):
    """Each rank has a transfer engine of its own on this host: a push naming rank 1's
    engine as its destination would write rank 0's shard into C's own KV cache."""
    c = two_rank_source(c_server)
    sibling = "127.0.0.1:17101"  # rank 1's engine (C_SESSION: rank 0's)
    d = c.destination(sibling)
    assert c.post(RANKS_PATH, reg(1, 9101).model_dump()).status_code == 200
    out = refused(c, push_body(d, sibling, fingerprint=FP2.model_dump()), 409, d)
    assert out["detail"]["field"] == "dst_session" and "own" in out["detail"]["message"]


def test_a_registration_from_another_host_is_refused(c_server):
    c = two_rank_source(c_server)
    assert c.server.on_this_host("127.0.0.1") and c.server.on_this_host("::1")
    assert not c.server.on_this_host("192.0.2.7")  # TEST-NET-1: no host of ours
    assert not c.server.on_this_host(None) and not c.server.on_this_host("name")


def test_one_rank_sources_name_no_ports_and_take_no_registration(c_server):
    c = c_server()
    assert "rank_ports" not in c.post("/match_blocks", {"token_ids": TOKENS}).json()
    r = c.post(RANKS_PATH, reg(1, 9101).model_dump())
    assert r.status_code == 404, r.text


def test_a_rank_registers_over_http_until_every_rank_has(c_server):
    c = c_server(fingerprint=FP2)
    c.server.ranks = RankPorts(3, reg(0, 9000), c.server.ranks_registered)
    got: list[tuple[str, list[int]]] = []
    t1 = register_rank(c.url, reg(1, 9101), c.config, lambda *a: got.append(a), 10)
    time.sleep(1.5)  # rank 1 asks again while rank 2 is missing
    assert got == [] and t1.is_alive()
    t2 = register_rank(c.url, reg(2, 9102), c.config, lambda *a: got.append(a), 10)
    t1.join(15)
    t2.join(15)
    assert got == [(C_SOURCE, [17100, 17101, 17102])] * 2


def test_a_rank_gives_up_registering_when_refused(c_server):
    c = c_server()  # one rank: refuses any registration (404)
    got: list = []
    started = time.monotonic()
    register_rank(c.url, reg(1, 9101), c.config, lambda *a: got.append(a), 5).join(10)
    assert got == [] and time.monotonic() - started < 5  # a refusal is final


def test_a_rank_gives_up_registering_at_its_deadline(c_server):
    c = c_server(fingerprint=FP2)
    c.server.ranks = RankPorts(3, reg(0, 9000))  # rank 2 never comes
    got: list = []
    started = time.monotonic()
    register_rank(c.url, reg(1, 9101), c.config, lambda *a: got.append(a), 2).join(10)
    assert got == [] and 2 <= time.monotonic() - started < 5


def test_d_takes_each_ranks_url_from_the_match():
    config = ExtConfig(push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC,))
    d_fp = D_FP.model_copy(update={"tp_size": 2})
    s = PushScheduler(BS, config, d_fp, workers=2)
    c_fp = C_FP.model_copy(update={"tp_size": 2})

    def answer(ports):
        def post(source, path, content, headers, deadline):
            return http_answer(
                200,
                {
                    "matched_blocks": 4,
                    "matched_tokens": 4 * BS,
                    "total_full_blocks": 5,
                    "fingerprint": c_fp.model_dump(),
                    "engine_timeout_s": 30,
                    "source_id": C_SOURCE,
                    "now_unix_ms": int(time.time() * 1000),
                    "rank_ports": ports,
                },
            )

        return post

    def ask(rid, ports):
        r = d_request(rid, 5 * BS + 3, SRC + "/")
        s._lanes.post = answer(ports)
        s.get_num_new_matched_tokens(r, 0)
        deadline = time.monotonic() + 5
        while not s._matches[rid].done() and time.monotonic() < deadline:
            time.sleep(0.01)
        return r, s.get_num_new_matched_tokens(r, 0)

    r, got = ask("r1", [9000, 9101])
    assert got == (4 * BS, True)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 4 * BS)
    (job,) = s.take_jobs()
    assert job.rank_urls == (SRC, SRC.rsplit(":", 1)[0] + ":9101")
    # a TP 2 source that names no ports cannot be asked: local prefill
    s = PushScheduler(BS, config, d_fp, workers=2)
    _, got = ask("r2", None)
    assert got == (0, False) and s.stats["match_failed"] == 1


def test_d_rank_one_asks_c_rank_one_for_its_shard(monkeypatch):
    posted: list[tuple[str, dict]] = []
    done = threading.Event()

    def post(source, path, content, headers, deadline):
        posted.append((source + path, json.loads(content)))
        done.set()
        return http_answer(200, {"status": "failed", "message": "x"})

    rec = PushReceiver(
        "d:1", [100, 200], 64, BS, 16, C_FP, ExtConfig(), clock=Clock(), tp_rank=1
    )
    monkeypatch.setattr(rec._lanes, "post", post)
    rank1 = "http://c:9101"
    rec.start(
        [
            PushJob(
                "r1",
                SRC,
                tuple(range(80)),
                None,
                None,
                0,
                (5, 6, 7),
                source_id=C_SOURCE,
                rank_urls=(SRC, rank1),
            )
        ]
    )
    assert done.wait(5)
    ((url, body),) = posted
    assert url == rank1 + "/push_blocks" and body["tp_rank"] == 1


def test_a_write_fault_for_one_rank_fails_that_ranks_pushes_only(c_server):
    """MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN=N@R, the integration tests' failure of
    one rank's write: rank 0 writes its shard, rank 1 answers "failed"."""
    faults = FaultConfig(fail_write_prompt_len=len(TOKENS), fail_write_rank=1)
    config = ExtConfig(bootstrap_host="127.0.0.1", faults=faults)
    for rank, status in [(0, "ok"), (1, "failed")]:
        c = c_server(config, fingerprint=FP2, tp_rank=rank)
        c.server.ranks_registered([])
        d = c.destination()
        body = push_body(d, fingerprint=FP2.model_dump(), tp_rank=rank)
        r = c.post("/push_blocks", body)
        assert r.status_code == 200 and r.json()["status"] == status, r.text
        if status == "ok":
            assert_landed(c.c, d)
        else:
            assert c.engine.entered == 0  # nothing written
