# SPDX-License-Identifier: Apache-2.0
"""Layer-wise KV push (MOONCAKE_LAYERWISE=1).

Upstream MooncakeConnector moves a request's KV after its whole prefill, so the
transfer sits on the critical path of the decode instance's first token. With
MOONCAKE_LAYERWISE=1 the prefill instance (P) writes each layer's KV into the
decode instance's (D) blocks as soon as that layer is computed, hiding the
transfer behind the remaining layers (and chunks) of the prefill.

D keeps upstream's protocol: it sends its block ids and KV base addresses to
P's worker over ZMQ (MooncakeXferMetadata) and waits for FINISH.

  protocol.py           scheduler -> worker metadata, the per-request mode
  prefill_scheduler.py  P's scheduler: which blocks each step computes
  prefill_tracker.py    P: pure state machine of every transfer (no I/O, unit-tested)
  prefill_answer.py     P's worker: its answer to D's pull request (refusal or sender)
  prefill_sender.py     P's worker: the owner of all transfers and of their end
  prefill_writers.py    P's worker: one writer thread per D session with work
  prefill_stats.py      P's worker: totals and timelines (GET /layerwise/transfers)
  decode_pulls.py       D's worker: each pull reported to D's scheduler exactly once
"""
