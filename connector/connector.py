# SPDX-License-Identifier: Apache-2.0
"""This series' MooncakeConnector: subclasses of upstream's facade, scheduler and worker.

``"kv_connector": "MooncakeConnector"`` resolves to :class:`ExtMooncakeConnector`. Each
override calls upstream's with ``super()`` and hands this series' part to its side's
extension: scheduler_extension.py in the scheduler process, worker_extension.py in
each worker process (also called at upstream's hook points, hooks.py). ``build.py
check`` and ``compat`` check the overrides against each vLLM release.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from typing_extensions import override

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
    MooncakeConnectorMetadata,
    MooncakeConnectorScheduler,
    MooncakeConnectorWorker,
    MooncakeXferResponse,
    PullReqMeta,
    SendBlockMeta,
)
from vllm.logger import init_logger

from .common.fault_injection import zero_received_block
from .common.io_affinity import threads_started_on_io_cpus
from .common.transport_env import apply_transport_env_defaults
from .scheduler_extension import SchedulerExtension
from .vllm_compat import (
    all_block_ids,
    init_kwargs,
    kv_geometry,
    one_group_block_ids,
    send_layout_on_every_pull,
    split_k_and_v,
)
from .worker_extension import RegisteredKV, WorkerExtension
from .xfer import ExtXferMetadata

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# A worker that cannot register with its bootstrap server gives up after this
# (upstream retries for ever: an instance that never becomes healthy, silently).
REGISTRATION_DEADLINE_S = 120.0


class ExtMooncakeConnectorScheduler(MooncakeConnectorScheduler):
    """Scheduler process: prefix push on D, layer-wise on P, block-hash recording."""

    @override
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(
            vllm_config,
            engine_id,
            **init_kwargs(MooncakeConnectorScheduler, kv_cache_config),
        )
        self.ext = SchedulerExtension(vllm_config)

    @override
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.ext.owns(request):
            return self.ext.get_num_new_matched_tokens(request, num_computed_tokens)
        return self.ext.admit_pull(
            request, super().get_num_new_matched_tokens(request, num_computed_tokens)
        )

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        self.ext.seen_alloc(request, num_external_tokens)
        if self.ext.owns(request):
            return self.ext.update_state_after_alloc(
                request, blocks, num_external_tokens
            )
        rid = request.request_id
        queued_before = rid in self._reqs_need_send
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        # Upstream queued a do_remote_decode request for its post-hoc send: if
        # layer-wise takes it, upstream's send path must not track it.
        if not queued_before and rid in self._reqs_need_send:
            transfer_id = (request.kv_transfer_params or {}).get("transfer_id")
            if transfer_id and self.ext.takes_send(request, transfer_id):
                del self._reqs_need_send[rid]

    @override
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> MooncakeConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.ext = self.ext.build_metadata(scheduler_output)  # type: ignore[attr-defined]
        return meta

    @override
    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # a list on 0.18.1, one list per KV cache group from 0.32.0
        self.ext.seen_finished(request)
        if self.ext.owns(request):
            return self.ext.request_finished(request)
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        # a pull that was never scheduled (upstream turns it into a cleanup-only
        # pull without blocks, decode_pulls.py)
        unscheduled_pull = bool(transfer_id and params.get("do_remote_prefill"))
        ids = one_group_block_ids(block_ids)
        if (
            transfer_id
            and not unscheduled_pull
            and params.get("do_remote_decode")
            and ids is not None
        ):
            delay = self.ext.send_finished(request, ids, transfer_id)
            if delay is not None:
                return delay, None
        delay, out = super().request_finished(request, block_ids)
        return delay, self.ext.finished_params(request, out)


class ExtMooncakeConnectorWorker(MooncakeConnectorWorker):
    """Worker process: layer-wise (P, D), prefix push (C, D), hash mirror, routes."""

    @override
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # Before upstream's __init__: its hooks (bootstrap server) run inside it.
        self.ext = WorkerExtension(vllm_config, on_send_failed=self._free_failed_send)
        self._listener_error: BaseException | None = None
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        # TCP: the transport's queue limits and timeouts, set before the engine is
        # built; explicit MC_* settings win (transport_env.py).
        self._protocol = kv_transfer_config.kv_connector_extra_config.get(
            "mooncake_protocol", "rdma"
        )
        apply_transport_env_defaults(self._protocol)
        # MOONCAKE_IO_CPUS: the transfer threads start off the compute cores.
        with threads_started_on_io_cpus():
            super().__init__(
                vllm_config,
                engine_id,
                **init_kwargs(MooncakeConnectorWorker, kv_cache_config),
            )
        # P decodes D's pull requests with this series' fields (xfer.py).
        self._xfer_meta_decoder = msgspec.msgpack.Decoder(ExtXferMetadata)

    # ---- registration -----------------------------------------------------------------
    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        if self._listener_error is not None:
            raise RuntimeError(
                f"Mooncake sender listener failed at start: {self._listener_error}"
            ) from self._listener_error
        if self.ext.roles.layerwise_decode:
            send_layout_on_every_pull(self)
        geometry = kv_geometry(self)
        self.ext.on_kv_caches_registered(
            RegisteredKV(
                write_fn=self.engine.batch_transfer_sync_write,
                session=f"{self.hostname}:{self.rpc_port}",
                kv_caches=kv_caches,
                split_k_and_v=geometry.split_k_and_v,
                base_addrs=list(self.kv_caches_base_addr),
                block_len=geometry.block_len,
                block_size=geometry.block_size,
                num_blocks=geometry.num_blocks,
                tp_size=self.tp_size,
                protocol=self._protocol,
                tp_rank=self.tp_rank,
                engine_id=str(self.engine_id),
                dp_rank=self.dp_rank,
            )
        )

    @override
    async def _mooncake_sender_listener(self, ready_event: threading.Event):
        # Upstream's register_kv_caches waits for ready_event with no timeout: a
        # listener that fails before setting it (registration gave up) would hang
        # the worker without a word. Record the error and let the wait end.
        try:
            await super()._mooncake_sender_listener(ready_event)
        except BaseException as e:
            if not ready_event.is_set():
                self._listener_error = e
                ready_event.set()
            raise

    @override
    async def register_worker_with_bootstrap(self):
        try:
            await asyncio.wait_for(
                super().register_worker_with_bootstrap(), REGISTRATION_DEADLINE_S
            )
        except TimeoutError:
            raise RuntimeError(
                f"cannot register with the Mooncake bootstrap server for "
                f"{REGISTRATION_DEADLINE_S:.0f} s: check MOONCAKE_BOOTSTRAP_HOST and "
                "VLLM_MOONCAKE_BOOTSTRAP_PORT"
            ) from None

    # ---- every step -------------------------------------------------------------------
    @override
    def start_load_kv(self, metadata: MooncakeConnectorMetadata):
        super().start_load_kv(metadata)
        self.ext.start_load_kv(getattr(metadata, "ext", None))

    @override
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        return self.ext.get_finished(*super().get_finished())

    @override
    def shutdown(self):
        super().shutdown()
        self.ext.shutdown()

    # ---- P: D's pull requests ---------------------------------------------------------
    @override
    async def send_kv_to_decode(self, identity: bytes, sock: Any, meta: Any):
        if not self.ext.serves_xfer_requests:
            return await super().send_kv_to_decode(identity, sock, meta)
        await self.ext.serve_xfer_request(
            meta,
            self.tp_size,
            lambda resp: sock.send_multipart((identity, self._encoder.encode(resp))),
        )

    def _free_failed_send(self, send_meta: SendBlockMeta) -> None:
        """A terminal write for D failed: free P's blocks once none of the request's is in flight."""
        if send_meta.sending == 0 and send_meta.p_req_id:
            self.reqs_need_send.pop(send_meta.transfer_id, None)
            self.finished_sending_reqs.add(send_meta.p_req_id)

    # ---- D: pulls ---------------------------------------------------------------------
    @override
    async def receive_kv_from_single_worker(
        self, worker_addr: str, pull_metas: dict[str, PullReqMeta]
    ):
        await super().receive_kv_from_single_worker(worker_addr, pull_metas)
        # Upstream returns on FINISH, on P's ERROR answer, on a broken socket: a
        # pull that did not complete by then failed (each pull ends once).
        failed = [r for r, pm in pull_metas.items() if pm.pull_tasks_count > 0]
        if failed:
            self.ext.pulls_failed(
                pull_metas,
                failed,
                f"no complete answer from the prefill worker at {worker_addr}",
            )

    @override
    def process_pulling_result(
        self, response: MooncakeXferResponse, pull_metas: dict[str, PullReqMeta]
    ):
        already = {
            pm.d_req_id
            for pm in pull_metas.values()
            if pm.d_req_id in self.finished_recving_reqs
        }
        super().process_pulling_result(response, pull_metas)
        for req_id in response.ok_reqs or ():
            pm = pull_metas.get(req_id)
            if pm is None or pm.pull_tasks_count != 0 or pm.d_req_id in already:
                continue
            block_ids = all_block_ids(pm.local_block_ids)
            if not self.ext.pull_completed(pm.d_req_id, block_ids):
                self.finished_recving_reqs.discard(pm.d_req_id)
                continue
            zero_received_block(self.device_kv_caches, block_ids, split_k_and_v(self))
        if response.err_reqs:
            self.ext.pulls_failed(pull_metas, response.err_reqs, str(response.err_msg))


class ExtMooncakeConnector(MooncakeConnector):
    """The facade vLLM builds for ``"kv_connector": "MooncakeConnector"``."""

    @override
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # Upstream's __init__ builds its own halves by name (and the worker's
        # transfer engine, threads and bootstrap server); its body is repeated here
        # with this series' halves (tests/unit/connector/test_ext_connector.py checks that
        # upstream's body is the one this was written against).
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        assert vllm_config.kv_transfer_config.engine_id is not None
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ExtMooncakeConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = ExtMooncakeConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    # ---- scheduler side ---------------------------------------------------------------
    @override
    def on_new_request(self, request: Request) -> None:
        """The scheduler received a request (0.18.1: called by our scheduler patch)."""
        super().on_new_request(request)
        assert isinstance(self.connector_scheduler, ExtMooncakeConnectorScheduler)
        self.connector_scheduler.ext.on_new_request(request)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput):
        super().update_connector_output(connector_output)
        assert isinstance(self.connector_scheduler, ExtMooncakeConnectorScheduler)
        self.connector_scheduler.ext.on_connector_output(connector_output)

    @override
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's KV cache manager (0.18.1: bound by our scheduler patch)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        assert isinstance(self.connector_scheduler, ExtMooncakeConnectorScheduler)
        self.connector_scheduler.ext.push.bind_kv_cache_manager(kv_cache_manager)

    @override
    def keeps_engine_stepping_while_blocks_held(self) -> bool:
        """Keep stepping, paced, while finished requests' blocks wait (0.18.1's patch asks)."""
        assert isinstance(self.connector_scheduler, ExtMooncakeConnectorScheduler)
        return self.connector_scheduler.ext.keep_stepping_while_blocks_held()

    # ---- worker side ------------------------------------------------------------------
    @override
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Runs before every forward pass in every release (unlike start_load_kv on 0.32.0)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(self.connector_worker, ExtMooncakeConnectorWorker):
            self.connector_worker.ext.before_forward(
                getattr(connector_metadata, "ext", None)
            )

    @override
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert isinstance(self.connector_worker, ExtMooncakeConnectorWorker)
        return self.connector_worker.ext.build_worker_meta()

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert isinstance(self.connector_worker, ExtMooncakeConnectorWorker)
        return (
            super().get_block_ids_with_load_errors()
            | self.connector_worker.ext.block_ids_with_load_errors()
        )

    @override
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs,
    ) -> None:
        """With MOONCAKE_LAYERWISE=1 (P), this layer's new KV goes to decode now."""
        assert isinstance(self.connector_worker, ExtMooncakeConnectorWorker)
        self.connector_worker.ext.save_kv_layer(layer_name, kv_layer)
