# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync, scheduler process: BlockPool's cache/evict events -> per-step deltas.

Each delta, with the hash configuration, rides in the connector metadata to the
worker. :class:`WorkerResetNotifier` tells a worker in another process of a reset
before the reset returns; if that fails, the worker forgets with the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpcore

from vllm.logger import init_logger

from ..common.auth import request_headers
from ..common.config import ExtConfig
from ..common.peer_client import AnswerTooLarge, DeadlinePassed, SourceLanes
from .feed_protocol import RESET_PATH, ResetNotice, reset_proof
from .hash_config import RESET_KEY, SCHEDULER_ID
from .hashing import scheduler_hash_config
from .scheduler_recorder import HashDelta, get_recorder

logger = init_logger(__name__)

RESET_NOTICE_DEADLINE_S = 5.0  # connect, send and the whole answer, in all


class WorkerResetNotifier:
    """Tells the worker's mirror, via its bootstrap server, of a prefix-cache reset."""

    def __init__(self, base_url: str, config: ExtConfig):
        self.base_url = base_url
        self.url = base_url + RESET_PATH
        self.config = config
        # one connection to the instance's own server, kept between resets
        self.lanes = SourceLanes("mooncake-reset-notice", 1)

    def __call__(self, resets: int) -> None:
        body = ResetNotice(
            scheduler_id=SCHEDULER_ID,
            resets=resets,
            proof=reset_proof(RESET_KEY, SCHEDULER_ID, resets),
        )
        content = body.model_dump_json().encode()
        headers = request_headers(self.config, "POST", RESET_PATH, content)
        deadline = time.monotonic() + RESET_NOTICE_DEADLINE_S
        try:
            r = self.lanes.post(self.base_url, RESET_PATH, content, headers, deadline)
        except (
            DeadlinePassed,
            AnswerTooLarge,
            httpcore.NetworkError,
            httpcore.ProtocolError,
            OSError,
            ValueError,  # not a URL the client takes
        ) as e:
            why = f"{type(e).__name__}: {e}"
        else:
            if r.status in (200, 404):  # 404: no mirror on this instance
                return
            why = f"{r.status} {r.text()}"
        logger.warning(
            "Mooncake block-hash sync: the prefix cache was reset, but telling "
            "the worker's mirror (POST %s) failed: %s. Until this instance's next "
            "step its /match_blocks may offer blocks the cache has forgotten; "
            "send it a request before it serves pushes again.",
            self.url,
            why,
        )


class SchedulerHashSync:
    """Scheduler side: turns BlockPool's cache/evict events into per-step deltas."""

    def __init__(self, hash_algo: str, notifier: Callable[[int], None] | None = None):
        from vllm.v1.core import block_pool

        self.hash_algo = hash_algo
        # Record from the start: the first step caches blocks in schedule(),
        # before build() runs for that step.
        recorder = get_recorder()
        recorder.enable()
        recorder.worker_notifier = None
        block_pool.block_hash_observer = recorder
        self._notifier = notifier  # told of resets from the first delta on
        self._configured = False

    def build(self) -> HashDelta:
        recorder = get_recorder()
        if not self._configured:
            # NONE_HASH is drawn when the engine core starts, after the
            # connector is built: read it on the first step, not in __init__.
            recorder.set_hash_config(scheduler_hash_config(self.hash_algo))
            # NOTE: before this delta the worker's mirror holds nothing and has no
            # key to check a notice with: a reset until now needs no notice
            recorder.worker_notifier = self._notifier
            self._configured = True
            logger.info("Mooncake block-hash sync enabled (%s)", self.hash_algo)
        return recorder.drain()
