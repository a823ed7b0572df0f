# SPDX-License-Identifier: Apache-2.0
"""What this series adds to upstream's MooncakeConnector, behind one object per side.

This series' subclasses of upstream's scheduler-side and worker-side classes
(connector.py) each own one extension object (``self.ext``); their overrides
call it, and so do the few one-line hooks in upstream's worker (hooks.py), so
all logic lives here (Brave's ``chromium_src`` style):

- :class:`SchedulerExtension` (scheduler process): layer-wise scheduling,
  prefix-push scheduling on D, block-hash recording, the idle-step throttle.
- :class:`WorkerExtension` (each worker process): the layer-wise sender (P)
  and pull outcomes (D), the push server (C) and receiver (D), the hash
  mirror, and their routes on the bootstrap server.

What crosses the process boundary is :class:`ExtMetadata` (scheduler ->
worker, inside upstream's connector metadata) and
:class:`~.push.protocol.PushOutcome` (worker -> scheduler). Configuration is
read once (config.load()). The extension reads upstream state it is handed
(:class:`RegisteredKV`) and never writes upstream objects' fields: where an
upstream field must change, it calls back into the subclass that owns it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)
from vllm.logger import init_logger

from ..hashsync.recorder import HashDelta
from ..hashsync.sync import SchedulerHashSync, WorkerHashSync
from ..hashsync.sync import register_routes as register_hashsync_routes
from .auth import EndpointGuard
from .config import ExtConfig, is_loopback, load
from .engine_write import WriteFn, terminal_write_fn
from .fingerprint import (
    WarnLimiter,
    attention_backend_name,
    handshake_refusal,
    kv_layout,
    local_fingerprint,
)
from .gpu_order import record_after_compute
from .hooks import UpstreamHooks
from .kv_reader import KVReader
from .layerwise.protocol import MODE_PARAM, LayerwiseMetadata, TransferMode, requested_mode
from .layerwise.pulls import PullOutcomes
from .layerwise.scheduler import LayerwiseScheduler
from .layerwise.sender import LayerwiseSender
from .layerwise.sender import register_routes as register_layerwise_routes
from .push.protocol import KVFingerprint, PushJob, PushOutcome
from .push.receiver import PushReceiver
from .push.scheduler import PushScheduler
from .push.server import PushServer
from .push.server import register_routes as register_push_routes
from .xfer import with_ext

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class ExtMetadata:
    """Scheduler -> worker, once per step (MooncakeConnectorMetadata.ext)."""

    layerwise: LayerwiseMetadata = field(default_factory=LayerwiseMetadata)
    hash_delta: HashDelta | None = None
    push_jobs: list[PushJob] = field(default_factory=list)


@dataclass(frozen=True)
class RegisteredKV:
    """What a worker registered with its transfer engine (read-only for us)."""

    write_fn: Callable[[str, list[int], list[int], list[int]], int]
    session: str  # this worker's engine session, "host:rpc_port"
    kv_caches: dict[str, torch.Tensor]
    split_k_and_v: bool
    base_addrs: list[int]
    block_len: int
    block_size: int
    num_blocks: int
    tp_size: int


def _drop_generated_docs(app: Any) -> None:
    """Remove the routes FastAPI adds for its API description and turn them off."""
    urls = ("openapi_url", "docs_url", "redoc_url", "swagger_ui_oauth2_redirect_url")
    generated = {u for u in (getattr(app, a, None) for a in urls) if u}
    app.router.routes[:] = [r for r in app.router.routes
                            if getattr(r, "path", None) not in generated]
    for a in urls[:3]:
        setattr(app, a, None)


def _roles(vllm_config: VllmConfig) -> tuple[bool, bool]:
    role = vllm_config.kv_transfer_config.kv_role  # type: ignore[union-attr]
    return role == "kv_producer", role == "kv_consumer"


class SchedulerExtension:
    def __init__(self, vllm_config: VllmConfig, config: ExtConfig | None = None):
        self.config = cfg = config or load()
        is_producer, is_consumer = _roles(vllm_config)
        cache = vllm_config.cache_config
        self.layerwise = LayerwiseScheduler(cfg.layerwise_min_tokens) if cfg.layerwise else None
        self._warned_no_layerwise = False
        self.push = PushScheduler(cache.block_size, cfg, local_fingerprint(vllm_config, cfg))
        self.hashsync = (SchedulerHashSync(cache.prefix_caching_hash_algo)
                         if not is_consumer and cache.enable_prefix_caching else None)

    # ---- requests this series owns (prefix push on D) ---------------------------------
    def owns(self, request: Request) -> bool:
        return self.push.handles(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.push.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.push.update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.push.request_finished(request), None

    # ---- upstream's P/D requests ------------------------------------------------------
    def takes_send(self, request: Request, transfer_id: str) -> bool:
        """P: a do_remote_decode request was allocated. True: layer-wise sends it
        (upstream's send path must not track it)."""
        if self.layerwise is None:
            self._warn_if_layerwise_asked(request)
            return False
        self.layerwise.track(request, transfer_id)
        return True

    def _warn_if_layerwise_asked(self, request: Request) -> None:
        """Without MOONCAKE_LAYERWISE, upstream's post-hoc path sends every request;
        a request asking for layer-wise is told once (in P's log), never failed."""
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
                request.request_id, MODE_PARAM)

    def send_finished(self, request: Request, block_ids: list[int], transfer_id: str
                      ) -> bool | None:
        """P: a do_remote_decode request finished. None: upstream handles it;
        else whether to delay freeing its blocks."""
        if self.layerwise is None:
            return None
        return self.layerwise.request_finished(request, block_ids, transfer_id)

    def pull_aborted_unscheduled(self, request_id: str) -> None:
        """D: a request finished before its pull was scheduled (cleanup-only pull)."""
        if self.layerwise is not None:
            self.layerwise.cleanup_pull(request_id)

    # ---- every step -----------------------------------------------------------------
    def build_metadata(self, scheduler_output: SchedulerOutput) -> ExtMetadata:
        meta = ExtMetadata(push_jobs=self.push.take_jobs())
        if self.layerwise is not None:
            meta.layerwise = self.layerwise.build(scheduler_output)
        if self.hashsync is not None:
            meta.hash_delta = self.hashsync.build()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # An empty step: the engine keeps stepping only to learn that
            # transfers ended (keeps_engine_stepping_while_blocks_held); do not spin.
            time.sleep(self.config.idle_step_interval_s)
        return meta

    def on_connector_output(self, output: KVConnectorOutput) -> None:
        """Before vLLM handles finished_recving: cut back pushed tokens that did
        not land, so they are prefilled locally."""
        self.push.on_worker_meta(output.kv_connector_worker_meta)


class WorkerExtension(UpstreamHooks):
    def __init__(self, vllm_config: VllmConfig, config: ExtConfig | None = None,
                 on_send_failed: Callable[[Any], None] | None = None):
        self.config = config or load()
        self.vllm_config = vllm_config
        self.is_producer, self.is_consumer = _roles(vllm_config)
        self.guard = EndpointGuard(self.config)
        self.enable_prefix_caching = vllm_config.cache_config.enable_prefix_caching
        self.sender: LayerwiseSender | None = None  # P, layer-wise
        self.pulls: PullOutcomes | None = (  # D, layer-wise
            PullOutcomes() if self.config.layerwise and not self.is_producer else None)
        self.hashsync: WorkerHashSync | None = None  # C (any non-consumer)
        self.push_server: PushServer | None = None  # C
        self.push_receiver: PushReceiver | None = None  # D
        self._event_tensor: torch.Tensor | None = None
        self._serving: set[asyncio.Task] = set()  # layer-wise answers to D in progress
        self._write: WriteFn | None = None  # every engine write of this worker
        self._warnings = WarnLimiter(logger)
        self.fingerprint: KVFingerprint | None = None  # once the KV caches are registered
        # the worker subclass frees a failed post-hoc send's blocks (it owns that state)
        self._on_send_failed = on_send_failed

    def on_kv_caches_registered(self, kv: RegisteredKV) -> None:
        cfg = self.config
        # Every write (layer-wise, push, upstream's post-hoc send) returns only
        # once none of its bytes can still land (engine_write.py).
        write_fn = self._write = terminal_write_fn(kv.write_fn, cfg)
        self._event_tensor = next(iter(kv.kv_caches.values()), None)
        layout = kv_layout(kv.kv_caches, kv.split_k_and_v,
                           attention_backend_name(self.vllm_config))
        fingerprint = self.fingerprint = local_fingerprint(
            self.vllm_config, cfg, kv.block_len, len(kv.base_addrs), layout)
        logger.info("KV fingerprint of this instance: %s", fingerprint)
        kv_reader = KVReader.for_kv_caches(kv.kv_caches, kv.split_k_and_v, kv.block_len,
                                           kv.num_blocks)
        if not self.is_consumer and self.enable_prefix_caching:
            self.hashsync = WorkerHashSync(kv.block_size)
            self.push_server = PushServer(self.hashsync, write_fn, kv.base_addrs,
                                          kv.block_len, fingerprint, kv.session, cfg,
                                          reader=kv_reader.read)
            self.hashsync.stats_provider = lambda: dict(self.push_server.stats)  # type: ignore[union-attr]
        if cfg.layerwise and not self.is_consumer:
            self.sender = LayerwiseSender.for_kv_caches(
                write_fn, kv.kv_caches, kv.split_k_and_v, kv.base_addrs, kv.block_len,
                kv.block_size, cfg)
            logger.info("Mooncake layer-wise KV push enabled (MOONCAKE_LAYERWISE)")
        self.push_receiver = PushReceiver(kv.session, kv.base_addrs, kv.block_len,
                                          kv.block_size, kv.num_blocks, fingerprint, cfg,
                                          kv=kv_reader)

    # ---- the hook points in upstream's worker (hooks.py) ------------------------------
    def write_blocks(self, engine: Any, session: str, src: list[int], dst: list[int],
                     lengths: list[int]) -> int:
        """Upstream's post-hoc send: the same terminal write as ours (not the
        engine's sync call), so a failed send's blocks are freed only once none of
        its bytes can land."""
        if self._write is None:
            raise RuntimeError("write_blocks before the KV caches were registered")
        return self._write(session, src, dst, lengths)

    def send_failed(self, send_meta: Any) -> None:
        """Upstream's post-hoc send: a write for one of D's requests failed, and it
        was terminal (write_blocks): free P's blocks now, not at
        VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (an idle P held them for minutes)."""
        if self._on_send_failed is not None:
            self._on_send_failed(send_meta)

    def bootstrap_server(self, vllm_config: VllmConfig, host: str, port: int) -> Any:
        """The bootstrap server bound at MOONCAKE_BOOTSTRAP_HOST (upstream: 0.0.0.0),
        with this series' routes, before it starts."""
        server = MooncakeBootstrapServer(vllm_config, self.config.bootstrap_host, port)
        self.register_routes(server.app)
        return server

    def xfer_metadata(self, metadata: Any) -> Any:
        """D: each pull request carries this series' fields (xfer_request_fields)."""
        return with_ext(metadata, self.xfer_request_fields())

    def registration_host(self, upstream_host: str) -> str:
        """Where this worker registers with the bootstrap server. Upstream uses the DP
        master's address, 127.0.0.1 by default; a server bound by MOONCAKE_BOOTSTRAP_HOST
        to one non-loopback address is not listening there (the worker then retried
        for ever): register at the bind address instead."""
        bind = self.config.bootstrap_host
        if bind not in ("0.0.0.0", "::") and is_loopback(upstream_host) and not is_loopback(bind):
            return bind
        return upstream_host

    def register_routes(self, app: Any) -> None:
        """Our routes on the bootstrap server (served by the first worker), each
        behind the endpoint guard (auth.py). FastAPI's generated API description
        (/docs, /redoc, /openapi.json) is removed: nothing needs it, and it would
        list every endpoint and body to anyone who can reach the port."""
        self.guard.log_at_start()
        _drop_generated_docs(app)
        register_hashsync_routes(app, lambda: self.hashsync, self.guard)
        register_push_routes(app, lambda: self.push_server, self.enable_prefix_caching)
        register_layerwise_routes(app, lambda: self.sender, self.guard)

    # ---- every step -------------------------------------------------------------------
    def start_load_kv(self, meta: ExtMetadata | None) -> None:
        """Before the forward pass."""
        meta = meta or ExtMetadata()
        if self.pulls is not None:
            self.pulls.add_cleanup(meta.layerwise.cleanup_reqs)
        if self.sender is not None:
            self.sender.on_metadata(meta.layerwise)
        if self.hashsync is not None:
            self.hashsync.on_metadata(meta.hash_delta)
        if self.push_receiver is not None:
            self.push_receiver.start(meta.push_jobs)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self.sender is not None:
            self.sender.layer_saved(layer_name, kv_layer)

    def get_finished(self, done_sending: set[str] | None, done_recving: set[str] | None
                     ) -> tuple[set[str] | None, set[str] | None]:
        """After the forward pass was launched: add what our features finished."""
        if self.hashsync is not None:
            event = (record_after_compute(self._event_tensor)
                     if self._event_tensor is not None else None)
            self.hashsync.after_step(event)
        if self.sender is not None:
            done_sending = (done_sending or set()) | self.sender.poll() or None
        if self.pulls is not None:
            done_recving = (done_recving or set()) | self.pulls.take_finished() or None
        if self.push_receiver is not None:
            done_recving = self.push_receiver.merge_finished(done_recving)
        return done_sending, done_recving

    def build_worker_meta(self) -> PushOutcome | None:
        return self.push_receiver.take_outcome() if self.push_receiver else None

    def block_ids_with_load_errors(self) -> set[int]:
        return self.pulls.take_invalid_block_ids() if self.pulls else set()

    # ---- upstream's pull protocol ----------------------------------------------------------
    def pull_completed(self, d_req_id: str) -> bool:
        """D: all KV of a pull arrived. False: do not report it (duplicate, cleanup-only)."""
        return self.pulls.completed(d_req_id) if self.pulls else True

    def pulls_failed(self, pull_metas: dict[str, Any], req_ids: Any, reason: str) -> None:
        """D: these pulls failed (P's error answer, a timeout, a broken socket)."""
        if self.pulls is None:
            return
        for req_id in req_ids or ():
            pm = pull_metas.get(req_id)
            if pm is not None:
                self.pulls.failed(pm.d_req_id, list(pm.local_block_ids), reason)

    @property
    def serves_xfer_requests(self) -> bool:
        return self.sender is not None

    async def serve_xfer_request(self, meta: Any, tp_size: int,
                                 send: Callable[[Any], Awaitable[None]]) -> None:
        """P: answer D's MooncakeXferMetadata from the layer-wise sender."""
        assert self.sender is not None
        if meta.remote_tp_size != tp_size:
            await send(MooncakeXferResponse(
                status=MooncakeXferResponseStatus.ERROR,
                err_msg=(f"layer-wise push needs equal TP sizes (prefill {tp_size}, "
                         f"decode {meta.remote_tp_size}); unset MOONCAKE_LAYERWISE")))
            return
        limits = getattr(meta, "ext", None)
        # D must still wait when P may answer, and D's KV cache must be this
        # instance's in all but its number of blocks: P writes its own blocks
        # (block_len bytes at block ids) at D's addresses
        refusal = (self.config.layerwise_refusal(limits)
                   or handshake_refusal(self.fingerprint, limits, len(meta.kv_caches_base_addr)))
        if refusal is not None:
            self._warn_once(refusal, "Layer-wise push refused: %s", refusal)
            await send(MooncakeXferResponse(status=MooncakeXferResponseStatus.ERROR,
                                            err_msg=refusal))
            return
        if limits is None:
            session = f"{meta.remote_hostname}:{meta.remote_port}"[:80]
            self._warn_once(f"no-limits:{session}", "The pull request of decode instance %s "
                            "carries no pull timeout (an instance without this series' "
                            "hooks): this prefill instance cannot check that it answers "
                            "before the decode gives up", session)

        async def reply(ok: list[str], errs: dict[str, str], last: bool) -> None:
            status = (MooncakeXferResponseStatus.FINISH if last
                      else MooncakeXferResponseStatus.CONTINUE)
            await send(MooncakeXferResponse(
                status=status, ok_reqs=ok or None, err_reqs=list(errs) or None,
                err_msg="; ".join(sorted(set(errs.values()))) or None))

        # Served as a task of its own: one of upstream's few sender worker tasks
        # must not wait out a transfer (the sender bounds how many may wait).
        task = asyncio.create_task(self.sender.serve(
            f"{meta.remote_hostname}:{meta.remote_port}", list(meta.kv_caches_base_addr),
            dict(meta.req_blocks), reply))
        self._serving.add(task)
        task.add_done_callback(self._served)

    def xfer_request_fields(self) -> dict[str, Any]:
        """D: this series' fields of each pull request (MooncakeXferMetadata.ext),
        checked by P in serve_xfer_request: the pull timeout and D's KV fingerprint."""
        fields: dict[str, Any] = dict(self.config.decode_limits())
        if self.fingerprint is not None:
            fields["fingerprint"] = self.fingerprint.model_dump()
        return fields

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        """Once per key and interval (fingerprint.WarnLimiter)."""
        self._warnings.warn(key, msg, *args)

    def _served(self, task: asyncio.Task) -> None:
        self._serving.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            logger.error("Layer-wise: serving a decode instance's request failed: %r", e)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
        if self.push_receiver is not None:
            self.push_receiver.shutdown()

