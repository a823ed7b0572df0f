# SPDX-License-Identifier: Apache-2.0
"""P's bootstrap server: upstream's ``MooncakeBootstrapServer`` whose ``start()``
binds in the caller and returns, or raises :class:`BootstrapServerStartError` naming
the address, within a deadline (upstream's ``start`` is never called, its ``shutdown``
is). Connections are limited (common/http_limits.py: deadlines, a body cap of the
largest a route accepts, a bounded number open, per address too), on upstream's
routes as on ours.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)
from vllm.logger import init_logger

from .common.config import ExtConfig, load
from .common.http_limits import LimitedH11Protocol
from .push.source_server import PROOF_MAX_BODY_BYTES

logger = init_logger(__name__)

START_TIMEOUT_S = 30.0
PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
# upstream's POST /register: one small JSON object (ids, ranks, an address)
UPSTREAM_MAX_BODY_BYTES = 64 * 1024


def largest_body_bytes(config: ExtConfig) -> int:
    """The largest request body any route of this server accepts (upstream's or ours)."""
    return max(
        UPSTREAM_MAX_BODY_BYTES, PROOF_MAX_BODY_BYTES, config.push_max_body_bytes
    )


def own_bootstrap_url(vllm_config: Any, config: ExtConfig) -> str:
    """This instance's bootstrap server, as its own processes reach it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        get_mooncake_bootstrap_addr,
    )
    from vllm.utils.network_utils import make_zmq_path

    host, port = get_mooncake_bootstrap_addr(vllm_config)
    # built as upstream's worker builds its registration URL
    return make_zmq_path("http", config.reachable_bootstrap_host(host), port)


class BootstrapServerStartError(RuntimeError):
    """P's bootstrap server could not listen, or did not start in time."""


def why_not(error: BaseException) -> str:
    """Why a socket could not listen, as its error says it."""
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


class PrefillBootstrapServer(MooncakeBootstrapServer):
    """Upstream's server whose ``start()`` returns or raises within ``START_TIMEOUT_S``."""

    _listener: socket.socket | None = None
    # the connections' body cap; None: largest_body_bytes(this process's config)
    max_body_bytes: int | None = None

    def _cannot_listen(self, error: BaseException) -> BootstrapServerStartError:
        return BootstrapServerStartError(
            f"Mooncake bootstrap server cannot listen on {self.host}:{self.port} "
            f"({why_not(error)}). Another process may hold the port: free it, or start "
            f"this prefill instance with {PORT_ENV} set to a free port (D learns "
            "it from the request's kv_transfer_params)."
        )

    @override
    def start(self, *, timeout: float = START_TIMEOUT_S) -> None:
        """Bind here (an error is raised in the caller, naming the address), then wait
        for uvicorn at most ``timeout`` s. Not upstream's: 0.18.1's waits for ever on
        a taken port (P never starts nor exits), 0.32.0's error names no address."""
        if self.server_thread is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            listener = socket.create_server((self.host, self.port), family=family)
        except OSError as e:
            raise self._cannot_listen(e) from e
        self._listener = listener
        self.port = listener.getsockname()[1]
        max_body = self.max_body_bytes or largest_body_bytes(load())
        server = self.server = uvicorn.Server(
            uvicorn.Config(
                app=self.app,
                host=self.host,
                port=self.port,
                # deadlines, a body cap and bounded connections (http_limits.py)
                http=LimitedH11Protocol.admitting(max_body),
            )
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                server.run(sockets=[listener])
            except BaseException as e:  # uvicorn ends a failed start with SystemExit
                failure.append(e)

        self.server_thread = threading.Thread(
            target=run, name="mooncake_bootstrap_server", daemon=True
        )
        self.server_thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self.server_thread.is_alive() or time.monotonic() >= deadline:
                why = (
                    f"did not start within {timeout:.0f}s"
                    if self.server_thread.is_alive()
                    else f"exited during start-up ({failure[0] if failure else 'no error'})"
                )
                self._stop_listener(server)
                raise BootstrapServerStartError(
                    f"Mooncake bootstrap server on {self.host}:{self.port} {why}"
                ) from (failure[0] if failure else None)
            time.sleep(0.01)
        logger.info("Mooncake Bootstrap Server started at %s:%d", self.host, self.port)

    def _stop_listener(self, server: uvicorn.Server) -> None:
        server.should_exit = True
        if self.server_thread is not None:
            self.server_thread.join(timeout=5)
        self.server_thread = None
        self.server = None
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @override
    def shutdown(self) -> None:
        super().shutdown()
        self._close_listener()


class PushRankListener(PrefillBootstrapServer):
    """A TP rank >= 1's push listener (push/source_ranks.py): the same server, at
    the port MOONCAKE_PUSH_RANK_PORT sets."""

    @override
    def _cannot_listen(self, error: BaseException) -> BootstrapServerStartError:
        # not the bootstrap server's advice: its port variable does not move this one
        return BootstrapServerStartError(
            f"its push listener cannot listen on {self.host}:{self.port} "
            f"({why_not(error)}); set MOONCAKE_PUSH_RANK_PORT to the first of a free "
            "range (TP rank r of DP rank d listens at it + d x (TP size - 1) + r - 1), "
            "or to 0 (the kernel picks)"
        )
