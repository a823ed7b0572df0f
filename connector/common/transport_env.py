# SPDX-License-Identifier: Apache-2.0
"""Defaults for the Mooncake TCP transport's queue limits and timeouts.

Mooncake's TCP transport (0.3.13) admits ~1024 queued entries per peer, each within
1 s; a KV transfer has one entry per (layer, K/V, block run), ~12k for a 2048-token
prompt of a 48-layer model, rejected at once (-1, no log line). The defaults raise
those limits, keep the admission timeout (20 s) below a push's deadline, and pin the
timeouts and lanes ``ExtConfig.engine_write_bound_s`` is computed from. They apply
to ``tcp`` only, where the user left the variable unset, and must be in the
environment before the TransferEngine is built. RDMA is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm.logger import init_logger

from .config import is_loopback, load
from .write_bounds import (
    DEFAULT_ENGINE_TRANSFER_TIMEOUT_S,
    ENGINE_NO_PROGRESS_S,
    MC_TCP_LANES_PER_PEER,
    MC_TCP_MAX_CONNECTIONS_PER_PEER,
    MC_TCP_PROGRESS_TIMEOUT_SEC,
    MC_TCP_STATUS_TIMEOUT_SEC,
    MC_TRANSFER_TIMEOUT,
    SERIES_ENGINE_LANES,
)

logger = init_logger(__name__)

TCP_TRANSPORT_DEFAULTS: dict[str, str] = {
    # the transport's own maxima
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    # below the push deadline (config.ExtConfig.push_timeout_s)
    "MC_TCP_ADMISSION_TIMEOUT_MS": "20000",
    # explicit, because config.ExtConfig.engine_write_bound_s is computed from it
    MC_TRANSFER_TIMEOUT: str(int(DEFAULT_ENGINE_TRANSFER_TIMEOUT_S)),
    # explicit, because the same bound is computed from the transport's watchdog
    # (config.engine_no_progress_s): a later engine's other default cannot slip in
    MC_TCP_PROGRESS_TIMEOUT_SEC: str(ENGINE_NO_PROGRESS_S),
    MC_TCP_STATUS_TIMEOUT_SEC: str(ENGINE_NO_PROGRESS_S),
    # one connection to a peer: once the watchdog dropped it, the transport connects
    # again for the write's queued slices, and with each more lane a connect to a
    # peer whose link is down adds a SYN span to the write (write_bounds.engine_reconnect_s)
    MC_TCP_LANES_PER_PEER: str(SERIES_ENGINE_LANES),
}


def apply_transport_env_defaults(
    protocol: str, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """Set the TCP transport defaults the user left unset; return what was set."""
    env = os.environ if environ is None else environ
    if protocol != "tcp":
        return {}
    applied = {k: v for k, v in TCP_TRANSPORT_DEFAULTS.items() if k not in env}
    if MC_TCP_MAX_CONNECTIONS_PER_PEER in env:  # the lanes' old name, set by the user
        applied.pop(MC_TCP_LANES_PER_PEER, None)
    host = load().bootstrap_host
    if host not in ("0.0.0.0", "::") and "MC_TCP_BIND_ADDRESS" not in env:
        # the engine listens where the bootstrap server does (MOONCAKE_BOOTSTRAP_HOST)
        applied["MC_TCP_BIND_ADDRESS"] = host
    env.update(applied)
    if applied:
        logger.info("Mooncake TCP transport defaults (unset by the user): %s", applied)
    log_engine_listeners(env)
    return applied


def engine_listen_note(env: Mapping[str, str]) -> str:
    """Where Mooncake's engine (0.3.13, TCP) listens: MC_TCP_BIND_ADDRESS only picks
    the advertised address (tests/integration/test_engine_listeners.py)."""
    lo, hi = env.get("MC_MIN_RPC_PORT", "15000"), env.get("MC_MAX_RPC_PORT", "17000")
    return (
        f"Mooncake's transfer engine listens on ALL interfaces (handshake 0.0.0.0, data *) "
        f"on TCP ports {lo}-{hi}, whatever MC_TCP_BIND_ADDRESS says; a peer that reaches "
        "them can read and write this instance's registered KV. Allow those ports only "
        "from the other instances (firewall; MC_MIN_RPC_PORT/MC_MAX_RPC_PORT pin the range) "
        "or run the instance in a network namespace"
    )


def log_engine_listeners(env: Mapping[str, str]) -> None:
    """Say it at start: loudly where the operator asked for a local instance."""
    host = env.get("MC_TCP_BIND_ADDRESS") or load().bootstrap_host
    log = logger.warning if is_loopback(host) else logger.info
    log("%s.", engine_listen_note(env))
