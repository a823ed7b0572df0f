# SPDX-License-Identifier: Apache-2.0
"""Prefix push migration: instance C writes its cached prefix into D's blocks.

  protocol.py   every message: HTTP bodies (shared by client and server),
                scheduler -> worker jobs, worker -> scheduler outcomes
  server.py     C (the source): POST /match_blocks, /push_blocks, /push_proof
  scheduler.py  D's scheduler: ask C, count the held blocks as external tokens
  receiver.py   D's worker: one PushTransfer per push, ended exactly once
"""
