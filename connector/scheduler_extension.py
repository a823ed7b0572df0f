# SPDX-License-Identifier: Apache-2.0
"""What this series adds in the scheduler process, behind one object.

``ExtMooncakeConnectorScheduler`` (connector.py) owns one :class:`SchedulerExtension`
and calls it from its overrides. It reads upstream's requests; only prefix push
(push/decode_scheduler.py) writes upstream state: a request's ``num_computed_tokens``
when a push lands short or is released, and one more ``ref_cnt`` on a released
push's blocks while a source may still write into them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from .common.config import ExtConfig, load
from .common.fingerprint import local_fingerprint
from .hashsync.scheduler_sync import SchedulerHashSync, WorkerResetNotifier
from .layerwise.decode_admission import PullAdmission, Verdict
from .layerwise.decode_timeline import TIMELINE_PARAM, DecodePullTimeline
from .layerwise.prefill_scheduler import LayerwiseScheduler
from .layerwise.protocol import MODE_PARAM, TransferMode, requested_mode
from .metadata import ExtMetadata
from .prefill_bootstrap import own_bootstrap_url
from .push.decode_scheduler import PushScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def is_consumer(vllm_config: VllmConfig) -> bool:
    return vllm_config.kv_transfer_config.kv_role == "kv_consumer"  # type: ignore[union-attr]


class PrefillBacklog:
    """Admitted requests not computed yet: their prompt tokens (a source's /match_blocks
    answers) and number (a destination's cost of a local prefill). Never writes them."""

    def __init__(self) -> None:
        self._live: dict[str, Request] = {}

    def added(self, request: Request) -> None:
        self._live[request.request_id] = request

    def finished(self, request: Request) -> None:
        self._live.pop(request.request_id, None)

    def tokens(self, scheduled: Mapping[str, int]) -> int:
        """Prompt tokens left after this step's ``scheduled`` (req id -> tokens): 0 if idle."""
        # vLLM advances num_computed_tokens after the metadata is built (both releases)
        return sum(
            max(
                0,
                r.num_prompt_tokens
                - r.num_computed_tokens
                - scheduled.get(r.request_id, 0),
            )
            for r in self._live.values()
        )

    def queued(self, behind: str) -> int:
        """Requests other than ``behind`` whose prompt is not computed yet."""
        return sum(
            1
            for rid, r in self._live.items()
            if rid != behind and r.num_computed_tokens < r.num_prompt_tokens
        )


class SchedulerExtension:
    """Layer-wise (P, MOONCAKE_LAYERWISE), prefix push (D, any role) and block-hash
    recording (not kv_consumer, prefix caching on), built once from configuration."""

    def __init__(self, vllm_config: VllmConfig, config: ExtConfig | None = None):
        self.config = cfg = config or load()
        cache = vllm_config.cache_config
        self.layerwise = (
            LayerwiseScheduler(cfg.layerwise_min_tokens) if cfg.layerwise else None
        )
        self._warned_no_layerwise = False
        self.push = PushScheduler(
            cache.block_size,
            cfg,
            local_fingerprint(vllm_config, cfg),
            workers=vllm_config.parallel_config.world_size,
            pipeline_parallel=vllm_config.parallel_config.pipeline_parallel_size,
        )
        self.hashsync = (
            SchedulerHashSync(
                cache.prefix_caching_hash_algo,
                WorkerResetNotifier(own_bootstrap_url(vllm_config, cfg), cfg),
            )
            if not is_consumer(vllm_config) and cache.enable_prefix_caching
            else None
        )
        self.pull_timeline = DecodePullTimeline()
        self.admission = PullAdmission(cfg.decode_max_pulls, cfg.decode_pull_wait_s)
        # a source reports it; a push destination weighs its own queue with it
        self.backlog = (
            PrefillBacklog() if self.hashsync is not None or cfg.push_sources else None
        )
        if self.backlog is not None and cfg.push_sources:
            self.push.own_queue = self.backlog.queued

    # ---- requests this series owns (prefix push on D) ---------------------------------
    def owns(self, request: Request) -> bool:
        return self.push.handles(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.push.matched_or_held(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.push.update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.push.request_finished(request), None

    # ---- upstream's pulls on D ---------------------------------------------------------
    def admit_pull(
        self, request: Request, matched: tuple[int | None, bool]
    ) -> tuple[int | None, bool]:
        """D: upstream's answer, through pull admission (decode_admission.py): beyond
        the bound a pull waits (None); one that waited too long is prefilled here (0)."""
        count, load_async = matched
        if not (count and load_async):
            return matched
        verdict = self.admission.ask(request.request_id)
        if verdict is Verdict.ADMIT:
            return matched
        if verdict is Verdict.WAIT:
            return None, False
        return 0, False

    # ---- every request ------------------------------------------------------------------
    def seen_alloc(self, request: Request, num_external_tokens: int) -> None:
        """Any request was allocated: D times its local prefills and records a pull's start."""
        if self.push.prefill_timer is not None:
            self.push.prefill_timer.allocated(request, num_external_tokens)
        params = request.kv_transfer_params or {}
        if (
            num_external_tokens > 0
            and params.get("do_remote_prefill")
            and params.get("transfer_id")
            and not self.owns(request)
        ):
            rid = request.request_id
            self.pull_timeline.allocated(rid, self.admission.queued_since(rid))
            self.admission.started(rid)

    def seen_finished(self, request: Request) -> None:
        self.admission.forget(request.request_id)
        if self.backlog is not None:
            self.backlog.finished(request)
        if self.push.prefill_timer is not None:
            self.push.prefill_timer.finished(request)

    def finished_params(
        self, request: Request, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """D: a finished request's kv_transfer_params, plus a timed pull's timeline."""
        timeline = self.pull_timeline.finished(request.request_id)
        if timeline is None:
            return params
        return {**(params or {}), TIMELINE_PARAM: timeline}

    # ---- every new request --------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """A request entered the waiting queue: into the backlog, and (P, layer-wise)
        its do_remote_decode transfer is announced to the worker."""
        if self.backlog is not None:
            self.backlog.added(request)
        if self.layerwise is None:
            return
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        if (
            params.get("do_remote_decode")
            and isinstance(transfer_id, str)
            and transfer_id
        ):
            # told now, so a pull D sends while the prompt waits is kept, not refused
            # as an unknown id
            self.layerwise.received(transfer_id)

    def takes_send(self, request: Request, transfer_id: str) -> bool:
        """P: a do_remote_decode request was allocated. True: layer-wise sends it."""
        if self.layerwise is None:
            self._warn_if_layerwise_asked(request)
            return False
        self.layerwise.track(request, transfer_id)
        return True

    def _warn_if_layerwise_asked(self, request: Request) -> None:
        """Without MOONCAKE_LAYERWISE a layer-wise request is sent post-hoc, logged once."""
        try:
            asked = requested_mode(getattr(request, "kv_transfer_params", None))
        except ValueError:
            asked = None
        if asked is TransferMode.LAYERWISE and not self._warned_no_layerwise:
            self._warned_no_layerwise = True
            logger.warning(
                "Request %s asks for %s=layerwise but this prefill instance runs without "
                "MOONCAKE_LAYERWISE=1: its KV is sent post-hoc (upstream's path). Start the "
                "prefill instance with MOONCAKE_LAYERWISE=1 to allow layer-wise per request.",
                request.request_id,
                MODE_PARAM,
            )

    def send_finished(
        self, request: Request, block_ids: list[int], transfer_id: str
    ) -> bool | None:
        """P: a do_remote_decode request finished. None: upstream handles it;
        else whether to delay freeing its blocks."""
        if self.layerwise is None:
            return None
        return self.layerwise.request_finished(request, block_ids, transfer_id)

    # ---- every step -----------------------------------------------------------------
    def build_metadata(self, scheduler_output: SchedulerOutput) -> ExtMetadata:
        meta = ExtMetadata(
            push_jobs=self.push.take_jobs(),
            push_decisions=self.push.decisions_changed(),
        )
        if self.push.prefill_timer is not None:
            self.push.prefill_timer.step(scheduler_output)
        self.pull_timeline.step_scheduled(scheduler_output.num_scheduled_tokens)
        if self.layerwise is not None:
            meta.layerwise = self.layerwise.build(scheduler_output)
        if self.hashsync is not None:
            meta.hash_delta = self.hashsync.build()
        if self.backlog is not None and self.hashsync is not None:  # a source
            meta.prefill_backlog_tokens = self.backlog.tokens(
                scheduler_output.num_scheduled_tokens
            )
        return meta

    def keep_stepping_while_blocks_held(self) -> bool:
        """Only finished requests holding blocks for a transfer remain: keep stepping."""
        # a transfer's end is learnt only in a step; at most one idle step per
        # interval: an idle engine must not spin a core
        time.sleep(self.config.idle_step_interval_s)
        return True

    def on_connector_output(self, output: KVConnectorOutput) -> None:
        """Before vLLM's finished_recving: cut back unlanded pushed tokens, release late pushes."""
        self.push.on_connector_output(output)

        self.pull_timeline.kv_arrived(output.finished_recving or ())
        self.admission.ended(output.finished_recving or ())
