"""P counts and names layer-wise transfers whose decode request came after prefill.

A dispatcher that sends D's request only once P has answered (vllm-router with
``--kv-connector mooncake``) leaves layer-wise nothing to overlap: the KV is
sent after the prefill, as post-hoc would. P's sender counts each such
transfer (totals and ``/metrics``), marks it in its timeline and warns once per
decode instance. A pull that arrives early, or for a post-hoc transfer (sent
whole by design), is not counted.
"""

from __future__ import annotations

import logging

from helpers import (
    LW_TENSOR,
    lw_dest,
    lw_finished,
    lw_step,
    make_layerwise_sender,
    wait_until,
)

from harness.metrics import samples
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import metrics
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise import (
    prefill_sender,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.protocol import (
    LayerwiseMetadata,
)

LATE_METRIC = "vllm_mooncake_ext_layerwise_destination_after_prefill_total"


def prefill_done(sender, tid: str) -> None:
    """P computes the whole prompt of ``tid`` in one step and finishes it."""
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step(tid)]))
    sender.layer_saved("l0", LW_TENSOR)
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished(tid)]))


def late_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "arrived after prefill" in r.message
    ]


def metric(sender, name: str) -> float:
    (value,) = samples(metrics.exposition(None, layerwise=sender), name)
    return value


def test_a_pull_after_prefill_is_counted_marked_and_warned_once_per_peer(loop, caplog):
    caplog.set_level(logging.WARNING, logger=prefill_sender.logger.name)
    sender = make_layerwise_sender()
    for tid, session in (("a", "d:1"), ("b", "d:1"), ("c", "d:2")):
        prefill_done(sender, tid)
        assert loop.submit(sender.push(tid, lw_dest(session))).result(5) is None
    snap = sender.snapshot()
    assert snap["totals"]["destination_after_prefill"] == 3
    by_id = {t["transfer_id"]: t for t in snap["transfers"]}
    for tid in "abc":
        t = by_id[tid]
        assert t["layerwise"] and t["destination_after_prefill"], t
        assert t["destination_at"] >= t["prefill_end"], t
        assert t["bytes_before_prefill_end"] == 0, t
    assert metric(sender, LATE_METRIC) == 3
    warned = late_warnings(caplog)
    assert len(warned) == 2, warned  # one per decode instance
    assert "d:1" in warned[0] and "d:2" in warned[1]
    assert "one after the other" in warned[0]
    sender.shutdown()


def test_a_pull_before_prefill_ends_is_not_counted(loop, caplog):
    caplog.set_level(logging.WARNING, logger=prefill_sender.logger.name)
    sender = make_layerwise_sender()
    # D asks before P has even scheduled the request ...
    early = loop.submit(sender.push("a", lw_dest()))
    assert wait_until(lambda: sender.tracker.num_unannounced() == 1)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("a")]))
    sender.layer_saved("l0", LW_TENSOR)
    assert early.result(5) is None
    # ... and while P computes it (scheduled, prompt not finished)
    sender.on_metadata(LayerwiseMetadata(steps=[lw_step("b")]))
    during = loop.submit(sender.push("b", lw_dest()))
    assert wait_until(lambda: sender.log.get("b").destination_at is not None)
    assert sender.log.get("b").prefill_end is None
    sender.layer_saved("l0", LW_TENSOR)
    assert during.result(5) is None
    snap = sender.snapshot()
    assert snap["totals"]["destination_after_prefill"] == 0
    by_id = {t["transfer_id"]: t for t in snap["transfers"]}
    assert not by_id["a"]["destination_after_prefill"]
    assert by_id["b"]["destination_at"] is not None
    assert not by_id["b"]["destination_after_prefill"]
    assert late_warnings(caplog) == []
    sender.shutdown()


def test_a_post_hoc_transfer_pulled_after_prefill_is_not_counted(loop, caplog):
    """A prompt under the layer-wise threshold is sent whole by design: never
    stepped, so its late pull says nothing about the dispatcher."""
    caplog.set_level(logging.WARNING, logger=prefill_sender.logger.name)
    sender = make_layerwise_sender()
    sender.on_metadata(LayerwiseMetadata(finished=[lw_finished("p")]))
    assert loop.submit(sender.push("p", lw_dest())).result(5) is None
    assert sender.snapshot()["totals"]["destination_after_prefill"] == 0
    assert not sender.log.get("p").layerwise
    assert late_warnings(caplog) == []
    sender.shutdown()


def test_the_peers_named_in_the_warning_are_bounded(loop, caplog, monkeypatch):
    monkeypatch.setattr(prefill_sender, "MAX_LATE_PEERS", 2)
    caplog.set_level(logging.WARNING, logger=prefill_sender.logger.name)
    sender = make_layerwise_sender()
    for i in range(4):
        prefill_done(sender, f"t{i}")
        assert loop.submit(sender.push(f"t{i}", lw_dest(f"d:{i}"))).result(5) is None
    assert len(late_warnings(caplog)) == 2
    assert len(sender._late_peers) == 2
    assert sender.snapshot()["totals"]["destination_after_prefill"] == 4
    sender.shutdown()
