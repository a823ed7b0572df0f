# SPDX-License-Identifier: Apache-2.0
"""What this series adds in each worker process, behind one object.

``ExtMooncakeConnectorWorker`` (connector.py) owns one :class:`WorkerExtension`, calls
it from its overrides, and upstream's worker calls it at the hook points (hooks.py).
What runs is decided once from kv_role and configuration (:class:`WorkerRoles`); each
capability's per-step part is a :class:`WorkerFeature`. It reads the upstream state
it is handed (:class:`RegisteredKV`) and never writes upstream fields: it calls back
into the subclass that owns them (``on_send_failed``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from vllm.logger import init_logger

from .common.auth import EndpointGuard
from .common.config import ExtConfig, load
from .common.engine_write import WriteFn, terminal_write_fn
from .common.fingerprint import (
    KVFingerprint,
    attention_backend_name,
    kv_layout,
    local_fingerprint,
)
from .common.gpu_order import record_after_compute
from .common.kv_reader import KVReader
from .hashsync.worker_sync import WorkerHashSync
from .hooks import UpstreamHooks
from .layerwise.decode_pulls import PullOutcomes
from .layerwise.prefill_answer import PullAnswers
from .layerwise.prefill_sender import LayerwiseSender
from .metadata import ExtMetadata
from .prefill_bootstrap import BootstrapServerStartError, own_bootstrap_url
from .push.decode_receiver import PushReceiver
from .push.protocol import PushOutcome, RankRegistration
from .push.source_ranks import RankPorts, rank_listener, rank_port, register_rank
from .push.source_server import PushServer
from .routes import Served, add_routes
from .vllm_compat import all_block_ids, bootstrap_server
from .xfer import with_ext

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


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
    protocol: str = "tcp"  # the transfer engine's (kv_connector_extra_config)
    tp_rank: int = 0
    engine_id: str = ""  # upstream's, the same on every rank of this instance
    dp_rank: int = 0


@dataclass(frozen=True)
class WorkerRoles:
    """Which capabilities run on this worker, from its kv_role and configuration."""

    layerwise_prefill: bool  # sends layer-wise (P)
    layerwise_decode: bool  # receives layer-wise pulls (D)
    push_source: bool  # holds a hash mirror and serves pushes (C)
    push_destination: bool = True  # asks sources for a prompt's prefix (D, any role)

    @classmethod
    def of(cls, vllm_config: VllmConfig, config: ExtConfig) -> WorkerRoles:
        role = vllm_config.kv_transfer_config.kv_role  # type: ignore[union-attr]
        producer, consumer = role == "kv_producer", role == "kv_consumer"
        return cls(
            layerwise_prefill=config.layerwise and not consumer,
            layerwise_decode=config.layerwise and not producer,
            # one stage holds every layer's KV: no pushes from pipeline stages
            push_source=not consumer
            and vllm_config.cache_config.enable_prefix_caching
            and vllm_config.parallel_config.pipeline_parallel_size == 1,
        )


class WorkerFeature:
    """One capability's per-step part on a worker (every method: nothing by default)."""

    def before_forward(self, meta: ExtMetadata) -> None:
        """Before the forward pass, with the step's metadata (bind_connector_metadata)."""

    def start_load_kv(self, meta: ExtMetadata) -> None:
        """With the step's metadata (after the forward on 0.32.0 if loads are async)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """After an attention layer wrote its KV."""

    def finished(self, sending: set[str], recving: set[str]) -> None:
        """After the forward pass was launched: add the requests this feature ended."""

    def shutdown(self) -> None:
        pass


class HashMirrorStep(WorkerFeature):
    """The hash mirror: new blocks are matchable once their step's forward completed."""

    def __init__(self, sync: WorkerHashSync, event_tensor: torch.Tensor | None):
        self.sync = sync
        self._event_tensor = event_tensor

    def before_forward(self, meta: ExtMetadata) -> None:
        # not in start_load_kv (after the forward on 0.32.0): a block the step
        # evicted and reused would already be overwritten
        self.sync.on_metadata(meta.hash_delta)

    def finished(self, sending: set[str], recving: set[str]) -> None:
        event = (
            record_after_compute(self._event_tensor)
            if self._event_tensor is not None
            else None
        )
        self.sync.after_step(event)

    def shutdown(self) -> None:
        self.sync.close()


class LayerwisePrefillStep(WorkerFeature):
    """P: each layer's KV to decode as soon as it is computed."""

    def __init__(self, sender: LayerwiseSender):
        self.sender = sender

    def before_forward(self, meta: ExtMetadata) -> None:
        self.sender.on_metadata(meta.layerwise)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.sender.layer_saved(layer_name, kv_layer)

    def finished(self, sending: set[str], recving: set[str]) -> None:
        sending |= self.sender.poll()

    def shutdown(self) -> None:
        self.sender.shutdown()


class LayerwiseDecodeStep(WorkerFeature):
    """D: every layer-wise pull reported once (pull outcomes)."""

    def __init__(self, pulls: PullOutcomes):
        self.pulls = pulls

    def finished(self, sending: set[str], recving: set[str]) -> None:
        once = self.pulls.report_once(recving)
        recving.clear()
        recving |= once


class PushSourceStep(WorkerFeature):
    """A push source: its scheduler's prefill backlog, for /match_blocks answers."""

    def __init__(self, server: PushServer):
        self.server = server

    def before_forward(self, meta: ExtMetadata) -> None:
        if meta.prefill_backlog_tokens is not None:
            self.server.prefill_backlog_tokens = meta.prefill_backlog_tokens


class PushDestinationStep(WorkerFeature):
    """D: the step's push jobs started; each push ended once."""

    def __init__(self, receiver: PushReceiver):
        self.receiver = receiver

    def start_load_kv(self, meta: ExtMetadata) -> None:
        self.receiver.start(meta.push_jobs)
        if meta.push_decisions is not None:
            self.receiver.decisions = meta.push_decisions

    def finished(self, sending: set[str], recving: set[str]) -> None:
        recving |= self.receiver.merge_finished(None) or set()

    def shutdown(self) -> None:
        self.receiver.shutdown()


class WorkerExtension(UpstreamHooks):
    def __init__(
        self,
        vllm_config: VllmConfig,
        config: ExtConfig | None = None,
        on_send_failed: Callable[[Any], None] | None = None,
    ):
        self.config = config or load()
        self.vllm_config = vllm_config
        self.roles = WorkerRoles.of(vllm_config, self.config)
        self.guard = EndpointGuard(
            self.config
        )  # every route of this worker (routes.py)
        # built at registration (on_kv_caches_registered), by role
        self.sender: LayerwiseSender | None = None
        self.hashsync: WorkerHashSync | None = None
        self.push_server: PushServer | None = None
        self.push_receiver: PushReceiver | None = None
        # TP > 1 push source, a rank r >= 1: its own listener (source_ranks.py)
        self.rank_listener: Any = None
        # before registration: upstream's pull path may report to it from the start
        self.pulls = PullOutcomes() if self.roles.layerwise_decode else None
        self.features: list[WorkerFeature] = (
            [LayerwiseDecodeStep(self.pulls)] if self.pulls is not None else []
        )
        self.answers = PullAnswers(self.config)  # P's layer-wise answers to D
        self._write: WriteFn | None = None  # every engine write of this worker
        self.fingerprint: KVFingerprint | None = (
            None  # once the KV caches are registered
        )
        # the worker subclass frees a failed post-hoc send's blocks (it owns that state)
        self._on_send_failed = on_send_failed

    def on_kv_caches_registered(self, kv: RegisteredKV) -> None:
        cfg, roles = self.config, self.roles
        # Every write (layer-wise, push, upstream's post-hoc send) returns only
        # once none of its bytes can still land (engine_write.py).
        write_fn = self._write = terminal_write_fn(kv.write_fn, cfg, kv.protocol)
        layout = kv_layout(
            kv.kv_caches, kv.split_k_and_v, attention_backend_name(self.vllm_config)
        )
        fingerprint = self.fingerprint = local_fingerprint(
            self.vllm_config, cfg, kv.block_len, len(kv.base_addrs), layout
        )
        logger.info("KV fingerprint of this instance: %s", fingerprint)
        kv_reader = KVReader.for_kv_caches(
            kv.kv_caches, kv.split_k_and_v, kv.block_len, kv.num_blocks
        )
        features: list[WorkerFeature] = []
        if roles.push_source:
            self.hashsync = WorkerHashSync(kv.block_size)
            features.append(
                HashMirrorStep(self.hashsync, next(iter(kv.kv_caches.values()), None))
            )
            self.push_server = PushServer(
                self.hashsync,
                write_fn,
                kv.base_addrs,
                kv.block_len,
                fingerprint,
                kv.session,
                cfg,
                reader=kv_reader.read,
                tp_rank=kv.tp_rank,
            )
            features.append(PushSourceStep(self.push_server))
            if kv.tp_size > 1:
                self._serve_ranks(kv, self.push_server)
        if roles.layerwise_prefill:
            self.sender = LayerwiseSender.for_kv_caches(
                write_fn,
                kv.kv_caches,
                kv.split_k_and_v,
                kv.base_addrs,
                kv.block_len,
                kv.block_size,
                cfg,
                max_blocks_per_request=-(
                    -self.vllm_config.model_config.max_model_len // kv.block_size
                ),
                tp_rank=kv.tp_rank,
            )
            features.append(LayerwisePrefillStep(self.sender))
            logger.info("Mooncake layer-wise KV push enabled (MOONCAKE_LAYERWISE)")
        if roles.push_destination:
            self.push_receiver = PushReceiver(
                kv.session,
                kv.base_addrs,
                kv.block_len,
                kv.block_size,
                kv.num_blocks,
                fingerprint,
                cfg,
                kv=kv_reader,
                tp_rank=kv.tp_rank,
            )
            features.append(PushDestinationStep(self.push_receiver))
        self.features = features + self.features

    # ---- the hook points in upstream's worker (hooks.py) ------------------------------
    @override
    def write_blocks(
        self,
        engine: Any,
        session: str,
        src: list[int],
        dst: list[int],
        lengths: list[int],
    ) -> int:
        """Upstream's post-hoc send through our terminal write: a failed send's blocks
        are freed only once none of its bytes can land."""
        if self._write is None:
            raise RuntimeError("write_blocks before the KV caches were registered")
        return self._write(session, src, dst, lengths)

    @override
    def send_failed(self, send_meta: Any) -> None:
        """A post-hoc send's write failed: free P's blocks now, not at the abort timeout."""
        if self._on_send_failed is not None:
            self._on_send_failed(send_meta)

    @override
    def bootstrap_server(self, vllm_config: VllmConfig, host: str, port: int) -> Any:
        """The server bound at MOONCAKE_BOOTSTRAP_HOST (upstream: 0.0.0.0), our routes added."""
        server = bootstrap_server(vllm_config, self.config.bootstrap_host, port)
        self.register_routes(server.app)
        return server

    @override
    def xfer_metadata(self, metadata: Any) -> Any:
        """D: each pull request carries this series' fields (xfer_request_fields)."""
        return with_ext(metadata, self.xfer_request_fields())

    @override
    def registration_host(self, host: str) -> str:
        """Where this worker registers with the bootstrap server (ExtConfig)."""
        return self.config.reachable_bootstrap_host(host)

    def _serve_ranks(self, kv: RegisteredKV, server: PushServer) -> None:
        """TP > 1 push source (source_ranks.py): rank 0 records its ranks; a rank r
        >= 1 serves its pushes on a listener of its own, registered with rank 0."""
        rank0_url = own_bootstrap_url(self.vllm_config, self.config)
        registration = partial(
            RankRegistration,
            tp_rank=kv.tp_rank,
            engine_port=int(kv.session.rsplit(":", 1)[1]),
            engine_id=kv.engine_id,
            dp_rank=kv.dp_rank,
        )
        if kv.tp_rank == 0:
            own = registration(port=int(rank0_url.rsplit(":", 1)[1]))
            server.ranks = RankPorts(kv.tp_size, own, server.ranks_registered)
            return
        try:
            port = rank_port(
                self.config.push_rank_port, kv.tp_rank, kv.tp_size, kv.dp_rank
            )
            listener = rank_listener(self.vllm_config, self.config.bootstrap_host, port)
            self.register_routes(listener.app)
            listener.start()
        except (BootstrapServerStartError, ValueError) as e:
            # push is off, the instance serves
            logger.warning(
                "TP rank %d serves no prefix pushes, so neither does this instance "
                "(destinations prefill locally): %s",
                kv.tp_rank,
                e,
            )
            return
        self.rank_listener = listener
        reg = registration(port=listener.port)

        def registered(source_id: str, engine_ports: list[int]) -> None:
            server.source_id = source_id
            server.ranks_registered(engine_ports)

        register_rank(rank0_url, reg, self.config, registered)

    def register_routes(self, app: Any) -> None:
        """This series' routes on the bootstrap server, behind this worker's guard."""
        add_routes(
            app,
            self.guard,
            self.config,
            Served(
                hashsync=lambda: self.hashsync,
                push=lambda: self.push_server,
                layerwise=lambda: self.sender,
                hashsync_here=self.roles.push_source,
                push_here=self.roles.push_source,
                layerwise_here=self.roles.layerwise_prefill,
                writes=lambda: self._write,
                push_decisions=lambda: (
                    self.push_receiver.decisions if self.push_receiver else None
                ),
            ),
        )

    # ---- every step -------------------------------------------------------------------
    def before_forward(self, meta: ExtMetadata | None) -> None:
        meta = meta or ExtMetadata()
        for feature in self.features:
            feature.before_forward(meta)

    def start_load_kv(self, meta: ExtMetadata | None) -> None:
        meta = meta or ExtMetadata()
        for feature in self.features:
            feature.start_load_kv(meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        for feature in self.features:
            feature.save_kv_layer(layer_name, kv_layer)

    def get_finished(
        self, done_sending: set[str] | None, done_recving: set[str] | None
    ) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = set(done_sending or ()), set(done_recving or ())
        for feature in self.features:
            feature.finished(sending, recving)
        return sending or None, recving or None

    def build_worker_meta(self) -> PushOutcome | None:
        return (
            self.push_receiver.take_outcome()
            if self.push_receiver is not None
            else None
        )

    def block_ids_with_load_errors(self) -> set[int]:
        return self.pulls.take_invalid_block_ids() if self.pulls is not None else set()

    # ---- upstream's pull protocol ----------------------------------------------------------
    def pull_completed(self, d_req_id: str, block_ids: list[int]) -> bool:
        """D: all KV of a pull arrived. False: do not report it (duplicate, cleanup-only)."""
        if self.pulls is None:
            return True
        return self.pulls.completed(d_req_id, block_ids)

    def pulls_failed(
        self, pull_metas: dict[str, Any], req_ids: Any, reason: str
    ) -> None:
        """D: these pulls failed (P's error answer, a timeout, a broken socket)."""
        if self.pulls is None:
            return
        for req_id in req_ids or ():
            pm = pull_metas.get(req_id)
            if pm is not None:
                self.pulls.failed(
                    pm.d_req_id, all_block_ids(pm.local_block_ids), reason
                )

    @property
    def serves_xfer_requests(self) -> bool:
        return self.sender is not None

    async def serve_xfer_request(
        self, meta: Any, tp_size: int, send: Callable[[Any], Awaitable[None]]
    ) -> None:
        """P: answer D's MooncakeXferMetadata from the layer-wise sender."""
        assert self.sender is not None
        await self.answers.serve(self.sender, self.fingerprint, meta, tp_size, send)

    def xfer_request_fields(self) -> dict[str, Any]:
        """D: each pull request's ``ext`` (pull limits, KV fingerprint), checked by P."""
        fields: dict[str, Any] = dict(self.config.decode_limits())
        if self.fingerprint is not None:
            fields["fingerprint"] = self.fingerprint.model_dump()
        return fields

    def shutdown(self) -> None:
        for feature in self.features:
            feature.shutdown()
        if self.rank_listener is not None:
            self.rank_listener.shutdown()
