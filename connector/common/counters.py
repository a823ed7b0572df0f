# SPDX-License-Identifier: Apache-2.0
"""Counters: the one form this series keeps its statistics in (served as JSON and on
``/metrics``)."""

from __future__ import annotations

import threading


class Counters(dict):
    """Named counters several threads may update: :meth:`add` applies one event's
    deltas in one locked step, so a copy (``dict(c)``) never shows half an event and
    no update is lost."""

    def __init__(self, **initial: float):
        super().__init__(initial)
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            dict.update(self, {k: self[k] + v for k, v in deltas.items()})
