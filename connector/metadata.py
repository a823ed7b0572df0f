# SPDX-License-Identifier: Apache-2.0
"""What crosses from this series' scheduler side to its workers, once per step.

:class:`ExtMetadata` rides in ``MooncakeConnectorMetadata.ext`` (set in connector.py);
the way back is :class:`~.push.protocol.PushOutcome` (``build_connector_worker_meta``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hashsync.scheduler_recorder import HashDelta
from .layerwise.protocol import LayerwiseMetadata
from .push.protocol import PushJob


@dataclass
class ExtMetadata:
    layerwise: LayerwiseMetadata = field(default_factory=LayerwiseMetadata)
    hash_delta: HashDelta | None = None
    push_jobs: list[PushJob] = field(default_factory=list)
    # D's push decisions by reason, when they changed (served on /metrics)
    push_decisions: dict[str, int] | None = None
    # a push source: prompt tokens the scheduler admitted and has not computed
    # (served in /match_blocks answers, source_server.py; None: not a source)
    prefill_backlog_tokens: int | None = None
