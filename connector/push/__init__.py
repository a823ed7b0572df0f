# SPDX-License-Identifier: Apache-2.0
"""Prefix push migration: instance C (the source) writes its cached prefix into D's blocks.

protocol.py              every message: HTTP bodies, scheduler -> worker jobs,
                         worker -> scheduler outcomes
decode_scheduler.py      D's scheduler: ask C, count the held blocks as external tokens
decode_receiver.py       D's worker: one PushTransfer per push, ended exactly once
source_server.py         C: match, push and proof of write (served by routes.py)
source_destinations.py   C: where it may write (never its own engine; layouts)
source_writer.py         C: the engine write, on a low-priority thread

D's calls to C go through common/peer_client.py (bounded in time, bytes and source).
"""
