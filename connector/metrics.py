# SPDX-License-Identifier: Apache-2.0
"""``GET /metrics`` on the bootstrap server: this series' counters for Prometheus.

The stats routes' numbers in text format 0.0.4 for the worker whose bootstrap server
answers (the first): writes (engine_write.py), pushes as a source, layer-wise as P,
push decisions as a destination (a kv_consumer runs no bootstrap server). Not vLLM's
own ``/metrics``; guarded by the GET routes' bearer key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .common.engine_write import write_stats
from .push.decode_cost import Decision

PREFIX = "vllm_mooncake_ext_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# write_stats' keys -> (metric, type, help)
WRITES = {
    "fencing_now": (
        "writes_fencing",
        "gauge",
        "Failed writes waiting now until the kernel has delivered or dropped the bytes "
        "they queued; their blocks (and the peer's, held for them) are out of use.",
    ),
    "fenced_writes": (
        "writes_fenced_total",
        "counter",
        "Failed writes that waited for the kernel's send queues to the peer.",
    ),
    "blind_holds": (
        "writes_held_blind_total",
        "counter",
        "Failed writes held for the longest time their bytes can still land, because "
        "the kernel's send queues could not be read or the peer's name resolved to "
        "nothing (fail closed).",
    ),
    "fence_seconds": (
        "fence_seconds_total",
        "counter",
        "Seconds failed writes waited for the kernel's send queues, in all.",
    ),
    "overdue_writes": (
        "writes_overdue_total",
        "counter",
        "Writes still in flight past the engine's bound (a frozen or cut-off peer).",
    ),
    "refused_peers_now": (
        "peers_refused",
        "gauge",
        "Peers refused now because their last writes failed.",
    ),
    "peer_refusals": (
        "peer_refusals_total",
        "counter",
        "Refusals of a peer after failed writes in a row.",
    ),
    "refused_writes": (
        "writes_refused_total",
        "counter",
        "Writes to a refused peer, failed without writing anything.",
    ),
}
PUSH_OUTCOMES = ("ok", "failed", "no_match", "refused", "busy")
LAYERWISE = {
    "transfers_completed": (
        "layerwise_transfers_completed_total",
        "counter",
        "Layer-wise transfers completed.",
    ),
    "transfers_failed": (
        "layerwise_transfers_failed_total",
        "counter",
        "Layer-wise transfers failed.",
    ),
    "bytes": ("layerwise_bytes_total", "counter", "Layer-wise bytes written."),
    "writes_dropped": (
        "layerwise_writes_dropped_total",
        "counter",
        "Queued layer-wise writes of an ended transfer that never ran.",
    ),
    "destination_after_prefill": (
        "layerwise_destination_after_prefill_total",
        "counter",
        "Layer-wise transfers whose decode request arrived after the prefill ended "
        "(nothing overlapped: a dispatcher that sends P and D one after the other).",
    ),
}


def _family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]
) -> list[str]:
    """One metric family: HELP, TYPE and its samples (``labels``, value)."""
    out = [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    out += [f"{PREFIX}{name}{labels} {float(value):g}" for labels, value in samples]
    return out


def exposition(
    write_fn: Any,
    push: Any | None = None,
    layerwise: Any | None = None,
    push_decisions: dict[str, int] | None = None,
) -> str:
    """The text of ``GET /metrics``: ``write_fn``'s writes (None before registration),
    and of those present a PushServer's counters, a LayerwiseSender's, push decisions."""
    lines: list[str] = []
    stats = write_stats(write_fn) if write_fn is not None else {}
    for key, (name, kind, help_text) in WRITES.items():
        lines += _family(name, kind, help_text, [("", stats.get(key, 0))])
    if push is not None:
        counts = dict(push.stats)
        lines += _family(
            "push_requests_total",
            "counter",
            "Pushes this instance served as a source, by outcome.",
            [(f'{{outcome="{o}"}}', counts.get(o, 0)) for o in PUSH_OUTCOMES],
        )
        lines += _family(
            "push_bytes_total", "counter", "Bytes pushed.", [("", counts["bytes"])]
        )
        lines += _family(
            "push_overdue",
            "gauge",
            "Pushes whose write is past its bound now (they hold no push slot).",
            [("", push.num_overdue())],
        )
    if push_decisions is not None:
        lines += _family(
            "push_decisions_total",
            "counter",
            "Requests this instance considered for a prefix push, by what became of "
            "them: pushed (every block landed), no_holder, below_minimum "
            "(MOONCAKE_PUSH_MIN_TOKENS), not_worth_it (expected transfer >= expected "
            "local prefill, failed pushes counted at their cost, or the source's last "
            "pushes landed nothing), slow_match (the source's match answered later than "
            "the local prefill would take), refused (by the source, busy or every slot taken, "
            "or of the source), "
            "fell_back (the match failed or fewer blocks landed: prefilled locally), "
            "coalesced (waited for another request's push of its prefix).",
            [
                (f'{{reason="{d.value}"}}', push_decisions.get(d.value, 0))
                for d in Decision
            ],
        )
    if layerwise is not None:
        snap = layerwise.snapshot()
        totals = snap["totals"]
        lines += _family(
            "layerwise_writers_overdue",
            "gauge",
            "Layer-wise writers whose write is past the engine's bound now.",
            [("", snap["overdue_writers"])],
        )
        lines += _family(
            "layerwise_writers",
            "gauge",
            "Layer-wise writer threads now (one per decode session with writes).",
            [("", snap["writers"])],
        )
        lines += _family(
            "layerwise_writes_in_flight",
            "gauge",
            "Layer-wise writes (one per KV tensor and transfer) handed to the "
            "engine and not yet returned.",
            [("", snap["writes_in_flight"])],
        )
        for key, (name, kind, help_text) in LAYERWISE.items():
            lines += _family(name, kind, help_text, [("", totals[key])])
    return "\n".join(lines) + "\n"


__all__ = ["CONTENT_TYPE", "exposition"]
