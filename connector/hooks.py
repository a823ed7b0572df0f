# SPDX-License-Identifier: Apache-2.0
"""The few calls upstream's MooncakeConnectorWorker makes into this series.

At five points inside long upstream methods the patched file calls
``hooks_of(self).<hook>(...)``: a worker with an ``ext`` (WorkerExtension) runs its
overrides, any other (upstream's class, its tests' stand-ins) :data:`UPSTREAM`, which
does what upstream did. Imported by upstream's ``mooncake_connector.py``: never
import it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .vllm_compat import bootstrap_server

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class UpstreamHooks:
    """Upstream's behaviour at each hook point."""

    def bootstrap_server(self, vllm_config: VllmConfig, host: str, port: int) -> Any:
        """Worker.__init__: the bootstrap server, not yet started."""
        return bootstrap_server(vllm_config, host, port)

    def registration_host(self, host: str) -> str:
        """Worker.register_worker_with_bootstrap: where the worker registers."""
        return host

    def send_failed(self, send_meta: Any) -> None:
        """Worker.send_kv_to_decode: one of D's requests got a failed write."""

    def write_blocks(
        self,
        engine: Any,
        session: str,
        src: list[int],
        dst: list[int],
        lengths: list[int],
    ) -> int:
        """Worker._send_blocks: the post-hoc send's write."""
        return engine.batch_transfer_sync_write(session, src, dst, lengths)

    def xfer_metadata(self, metadata: Any) -> Any:
        """Worker.receive_kv_from_single_worker: D's pull request as sent."""
        return metadata


UPSTREAM = UpstreamHooks()


def hooks_of(worker: Any) -> UpstreamHooks:
    """The hooks ``worker`` runs: its ``ext`` if it has one, else upstream's."""
    return getattr(worker, "ext", UPSTREAM)
