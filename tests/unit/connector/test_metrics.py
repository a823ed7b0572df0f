"""GET /metrics: this series' counters in Prometheus' text format (metrics.py),
parsed with Prometheus' own client parser, behind the GET routes' key."""

from __future__ import annotations

import httpx
from helpers import (
    LW_TENSOR,
    LayerwiseEngine,
    lw_dest,
    lw_step,
    make_layerwise_sender,
    sender_idle,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.engine_write import (
    TerminalWriter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_refusal import (
    RefusedPeers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    LayerwiseMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.metrics import (
    exposition,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_cost import (
    Decision,
)


def samples(text: str) -> dict[str, float]:
    """Every sample (name and labels) -> value; fails on text Prometheus rejects."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class FailingEngine:
    def transfer_submit_write(self, *args):
        return 1

    def transfer_check_status(self, batch_id):
        return -1


class NoFence:
    fenced, blind_holds, fence_seconds, fencing = 2, 3, 7.5, 1

    def note(self, session):
        pass

    def wait(self, session, bound_s, started):
        return 0.0


def test_refused_peers_and_fenced_writes_are_exposed():
    w = TerminalWriter(
        FailingEngine(),
        ExtConfig(),
        sleep=lambda s: None,
        fence=NoFence(),
        peers=RefusedPeers(refuse_after=2),
    )
    for _ in range(3):
        w("10.0.0.2:17002", [1], [2], [8])
    got = samples(exposition(w))
    assert got["vllm_mooncake_ext_peers_refused"] == 1
    assert got["vllm_mooncake_ext_peer_refusals_total"] == 1
    assert got["vllm_mooncake_ext_writes_refused_total"] == 1
    assert got["vllm_mooncake_ext_writes_fencing"] == 1
    assert got["vllm_mooncake_ext_writes_fenced_total"] == 2
    assert got["vllm_mooncake_ext_fence_seconds_total"] == 7.5
    assert got["vllm_mooncake_ext_writes_held_blind_total"] == 3
    # before the KV caches are registered: zeros, not an error
    assert samples(exposition(None))["vllm_mooncake_ext_peers_refused"] == 0


def test_the_push_sources_metrics_are_served_behind_the_key(c_server):
    c = c_server(ExtConfig(bootstrap_host="0.0.0.0", bootstrap_token="tok-metrics"))
    assert httpx.get(c.url + "/metrics").status_code == 401
    r = c.http.get("/metrics", headers=c.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    assert got["vllm_mooncake_ext_push_requests_total{outcome=ok}"] == 0
    assert got["vllm_mooncake_ext_push_overdue"] == 0
    assert "vllm_mooncake_ext_layerwise_bytes_total" not in got  # no sender here


def test_a_destinations_push_decisions_are_exposed_by_reason():
    got = samples(exposition(None, push_decisions={"pushed": 3, "not_worth_it": 2}))
    assert got["vllm_mooncake_ext_push_decisions_total{reason=pushed}"] == 3
    assert got["vllm_mooncake_ext_push_decisions_total{reason=not_worth_it}"] == 2
    reasons = {k for k in got if k.startswith("vllm_mooncake_ext_push_decisions")}
    assert len(reasons) == len(Decision)  # every reason, zeros included
    assert "vllm_mooncake_ext_push_decisions_total" not in str(
        samples(exposition(None))
    )


def test_a_prefills_layerwise_writers_and_writes_in_flight_are_exposed(loop):
    engine = LayerwiseEngine()
    sender = make_layerwise_sender(engine)
    gate = engine.gate("d:1")
    fut = loop.submit(sender.push("T", lw_dest("d:1")))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("T")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert engine.entered["d:1"].wait(5)  # the write is in the engine
    got = samples(exposition(None, layerwise=sender))
    assert got["vllm_mooncake_ext_layerwise_writers"] == 1
    # one write per KV tensor of the layer (its two slots), in one engine call
    assert got["vllm_mooncake_ext_layerwise_writes_in_flight"] == 2
    gate.set()
    assert wait_until(lambda: sender_idle(sender))
    got = samples(exposition(None, layerwise=sender))
    assert got["vllm_mooncake_ext_layerwise_writes_in_flight"] == 0
    sender.shutdown()
    fut.cancel()  # D's answer waits for the prefill's end, which this test skips
