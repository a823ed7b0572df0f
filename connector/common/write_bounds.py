# SPDX-License-Identifier: Apache-2.0
"""How long a write can still land after it was given up, from the Mooncake engine's
and the kernel's timers as they read them.

The engine's TCP transport and Linux can deliver a write's queued bytes well after
the call returned and the task was marked FAILED. These pure functions (reading
/proc/sys at most) bound that time from Mooncake's MC_* variables and this host's
sysctls; ``ExtConfig.engine_write_bound_s`` and ``push_hold_for_s`` combine them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

# Mooncake's per-call timeout (0.3.13, TransferEnginePy): a batch_transfer_sync_*
# call gives up after max(5, atoi(MC_TRANSFER_TIMEOUT)) seconds plus 1 ns per
# byte, counted after the segment handshake; transport_env.py sets it where
# unset. Giving up is not an end: the batch's slices stay queued and can land
# seconds later, so this series never writes with those calls (engine_write.py).
MC_TRANSFER_TIMEOUT = "MC_TRANSFER_TIMEOUT"
DEFAULT_ENGINE_TRANSFER_TIMEOUT_S = 30
ENGINE_TIMEOUT_FLOOR_S = 5
# Mooncake's TCP transport (0.3.13, tcp_wire.h) drops a connection, failing its
# slices, after MC_TCP_PROGRESS_TIMEOUT_SEC without payload progress (its
# no-progress watchdog, separate from the call's timeout) and fails a slice whose
# status frame has not come within MC_TCP_STATUS_TIMEOUT_SEC; each read as
# atoi(value) when that is above 0, else 30. A connection can stall up to the
# larger of the two before the transport lets it go (engine_no_progress_s).
MC_TCP_PROGRESS_TIMEOUT_SEC = "MC_TCP_PROGRESS_TIMEOUT_SEC"
MC_TCP_STATUS_TIMEOUT_SEC = "MC_TCP_STATUS_TIMEOUT_SEC"
ENGINE_NO_PROGRESS_S = 30
# Linux keeps a TCP connection that was closed with data still queued (an
# orphan, FIN-WAIT-1) and retransmits that data until net.ipv4.tcp_orphan_retries
# retransmissions have timed out (0 means 8), by the kernel's time model
# (tcp_model_timeout: the RTO doubles from TCP_RTO_MIN up to TCP_RTO_MAX). The
# transport's watchdog closes a stalled connection that way, so its queued bytes
# can still be delivered that long after the stall began (measured: a write cut
# off for good returned 106.8 s after the cut with the default,
# docs/results/2026-11-27-cut-for-good.md).
TCP_RTO_MIN_S = 0.2
TCP_RTO_MAX_S = 120.0
LINUX_ORPHAN_RETRIES = 8  # what tcp_orphan_retries=0 (the default) means
# RDMA (reliable-connected queue pairs): how long after the engine reports a write
# FAILED its packets can still be placed in the peer's memory (docs/architecture.md,
# "RDMA"); no kernel queue shows it, so a failed RDMA write is held this long.
RDMA_FAILED_WRITE_HOLD_S = 10.0
TCP_ORPHAN_RETRIES_PATH = "/proc/sys/net/ipv4/tcp_orphan_retries"
# A dropped connection is not the end of a write either: the transport (0.3.13,
# connection pool, tcp_transport_lane_impl.h) keeps the write's slices that no
# connection had taken yet queued for the peer and opens its connections ("lanes",
# MC_TCP_LANES_PER_PEER, 4 by default) again, one at a time, with no timeout of its
# own; the queued slices fail only once every lane failed to connect. A connect to
# a peer whose link is down lasts until the kernel gives up the SYN
# (tcp_syn_span_s: net.ipv4.tcp_syn_retries, and tcp_syn_linear_timeouts where the
# kernel has it; 131 s with 6 and 4), unless an ICMP error or a failed ARP ends it
# sooner; had the link come back meanwhile, the connect succeeds and the slices are
# written. Measured (a write cut off for good while the machine was loaded): the
# first connect lasted 133 s after the watchdog, three more about 3 s each (ARP had
# failed), and the write returned 174.4 s after the cut.
MC_TCP_LANES_PER_PEER = "MC_TCP_LANES_PER_PEER"
MC_TCP_MAX_CONNECTIONS_PER_PEER = "MC_TCP_MAX_CONNECTIONS_PER_PEER"  # its old name
# What transport_env.py sets where the user did not: one lane, so that a write's
# reconnect (ENGINE_CONNECT_ALLOWANCE_S + one SYN span after the watchdog) ends
# before the orphans' last delivery, and the bound keeps its size. The engine's own
# default is 4.
SERIES_ENGINE_LANES = 1
ENGINE_DEFAULT_LANES = 4
ENGINE_CONNECT_ALLOWANCE_S = 5  # name resolution, the 1 s reconnect cooldown, load
TCP_SYN_RETRIES_PATH = "/proc/sys/net/ipv4/tcp_syn_retries"
TCP_SYN_LINEAR_TIMEOUTS_PATH = "/proc/sys/net/ipv4/tcp_syn_linear_timeouts"
LINUX_SYN_RETRIES = 6
LINUX_SYN_LINEAR_TIMEOUTS = 4  # where the kernel has the setting
TCP_TIMEOUT_INIT_S = 1.0  # a SYN's first retransmission timeout
# Time allowed for the segment handshake of a first write to a peer (it has no
# timeout of its own in the engine).
ENGINE_HANDSHAKE_ALLOWANCE_S = 5
# The engine's own throughput assumption (its timeout grows by 1 ns per byte).
ENGINE_NS_PER_BYTE = 1


def _atoi(raw: str) -> int:
    """C's atoi, as Mooncake reads its variables: the leading integer, else 0."""
    m = re.match(r"\s*([+-]?\d+)", raw)
    return int(m.group(1)) if m else 0


def engine_timeout_s(env: Mapping[str, str]) -> int:
    """MC_TRANSFER_TIMEOUT as Mooncake reads it: ``max(5, atoi(value))`` seconds,
    30 when unset (so "1" means 5, "7.9" means 7, "abc" means 5)."""
    raw = env.get(MC_TRANSFER_TIMEOUT)
    if raw is None:
        return DEFAULT_ENGINE_TRANSFER_TIMEOUT_S
    return max(ENGINE_TIMEOUT_FLOOR_S, _atoi(raw))


def _mooncake_timeout_s(env: Mapping[str, str], name: str, default: int) -> int:
    """A TCP transport timeout as Mooncake reads it: ``atoi(value)`` if > 0, else default."""
    value = _atoi(env.get(name) or "")
    return value if value > 0 else default


def engine_no_progress_s(env: Mapping[str, str]) -> int:
    """How long the TCP transport lets a connection stall before dropping it."""
    return max(
        _mooncake_timeout_s(env, name, ENGINE_NO_PROGRESS_S)
        for name in (MC_TCP_PROGRESS_TIMEOUT_SEC, MC_TCP_STATUS_TIMEOUT_SEC)
    )


def tcp_retransmission_span_s(retries: int) -> float:
    """The kernel's time model (tcp_model_timeout) for ``retries`` retransmissions."""
    linear_after = 9  # ilog2(TCP_RTO_MAX / TCP_RTO_MIN)
    if retries <= linear_after:
        return ((2 << retries) - 1) * TCP_RTO_MIN_S
    return ((2 << linear_after) - 1) * TCP_RTO_MIN_S + (
        retries - linear_after
    ) * TCP_RTO_MAX_S


def stalled_delivery_bound_s(
    orphan_retries: int, no_progress_s: int = ENGINE_NO_PROGRESS_S
) -> float:
    """How long after a stall queued bytes can still land: the larger of
    ``no_progress_s`` and the orphans' retransmission span, plus one backed-off
    interval (at most that span and TCP_RTO_MAX), plus 1 s."""
    span = max(no_progress_s, tcp_retransmission_span_s(orphan_retries))
    return span + min(span, TCP_RTO_MAX_S) + 1.0


def tcp_syn_span_s(syn_retries: int, linear_timeouts: int = 0) -> float:
    """How long the kernel tries to connect without an answer: ``linear_timeouts``
    timeouts of 1 s, then ``syn_retries`` + 1 doubling from 1 s up to TCP_RTO_MAX
    (127 s with 6 and 0, 131 s with 6 and 4)."""
    return linear_timeouts * TCP_TIMEOUT_INIT_S + sum(
        min(TCP_TIMEOUT_INIT_S * (1 << k), TCP_RTO_MAX_S)
        for k in range(syn_retries + 1)
    )


def engine_lanes(env: Mapping[str, str]) -> int:
    """The transport's connections to a peer: MC_TCP_LANES_PER_PEER (or its old
    name) when above 0, else this series' default (transport_env.py)."""
    for name in (MC_TCP_LANES_PER_PEER, MC_TCP_MAX_CONNECTIONS_PER_PEER):
        value = _atoi(env.get(name) or "")
        if value > 0:
            return value
    return SERIES_ENGINE_LANES


def engine_reconnect_s(
    env: Mapping[str, str],
    syn_retries_path: str = TCP_SYN_RETRIES_PATH,
    syn_linear_path: str = TCP_SYN_LINEAR_TIMEOUTS_PATH,
) -> int:
    """How long the transport may spend reconnecting for a write's queued slices:
    each lane in turn, this host's SYN span plus ENGINE_CONNECT_ALLOWANCE_S."""
    syn_retries = _read_int(syn_retries_path)
    if syn_retries is None or syn_retries <= 0:
        syn_retries = LINUX_SYN_RETRIES
    linear = _read_int(syn_linear_path) or 0
    per_lane = tcp_syn_span_s(syn_retries, max(0, linear)) + ENGINE_CONNECT_ALLOWANCE_S
    return math.ceil(engine_lanes(env) * per_lane)


# The longest reconnect D accepts from a push source unless its own is longer: the
# engine's default lanes, each the span of the kernel's defaults (6 SYN retries
# after 4 linear ones).
ENGINE_RECONNECT_MAX_S = math.ceil(
    ENGINE_DEFAULT_LANES
    * (
        tcp_syn_span_s(LINUX_SYN_RETRIES, LINUX_SYN_LINEAR_TIMEOUTS)
        + ENGINE_CONNECT_ALLOWANCE_S
    )
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def tcp_orphan_retries(path: str = TCP_ORPHAN_RETRIES_PATH) -> int:
    """net.ipv4.tcp_orphan_retries as the kernel applies it (0 and unreadable: 8)."""
    value = _read_int(path)
    return value if value is not None and value > 0 else LINUX_ORPHAN_RETRIES
