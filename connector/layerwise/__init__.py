# SPDX-License-Identifier: Apache-2.0
"""Layer-wise KV push (MOONCAKE_LAYERWISE=1).

The prefill instance (P) writes each layer's KV into the decode instance's (D)
blocks as soon as it is computed, hiding the transfer behind the rest of the
prefill; D keeps upstream's pull protocol (MooncakeXferMetadata over ZMQ).
P's scheduler: prefill_scheduler.py, protocol.py (its metadata to the worker).
P's worker: prefill_answer.py, prefill_sender.py (owns transfers and their end),
prefill_tracker.py (its I/O-free state machine), prefill_writers.py, prefill_stats.py.
D's scheduler: decode_admission.py (pulls in flight into D bounded),
decode_timeline.py (each pull's timeline). D's worker: decode_pulls.py (each pull
reported exactly once).
"""
