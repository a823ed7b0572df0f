# SPDX-License-Identifier: Apache-2.0
"""A push source of TP > 1: every rank serves its own shard's pushes.

Rank 0's bootstrap server answers ``/match_blocks`` (every rank's hash mirror is
fed the same scheduler deltas) and names, in its answer, the port each rank serves
``/push_blocks`` and ``/push_proof`` on; D's rank r asks C's rank r for rank r's
shard. A rank r >= 1 serves this series' routes on a listener of its own at the
bootstrap host (``MOONCAKE_PUSH_RANK_PORT`` + offset, or a port the kernel picks) and
registers it with rank 0 (``POST
/push/ranks``, behind the same guard, from this host, naming the instance's engine
id and DP rank), with its transfer engine's port. Once every rank has registered,
rank 0 answers with every rank's engine port, and each rank refuses to write into
any of them. Until then no rank writes (503) and rank 0 answers ``/match_blocks``
with 503: D prefills locally. One DP engine per bootstrap server, every rank on
one host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from vllm.logger import init_logger

from ..common.auth import request_headers
from ..common.config import ExtConfig
from .protocol import RankRegistered, RankRegistration

logger = init_logger(__name__)

RANKS_PATH = "/push/ranks"
REGISTER_DEADLINE_S = 120.0  # a rank gives up registering after this
REGISTER_RETRY_S = 1.0
REGISTER_CALL_TIMEOUT_S = 5.0
RETRIED = frozenset({408, 429})  # refusals that may pass later


class RankPorts:
    """Rank 0's record of its ranks: where each serves pushes and its engine's port
    (first registration wins). ``complete(engine_ports)`` is called once, when the
    last rank registered."""

    def __init__(
        self,
        tp_size: int,
        own: RankRegistration,
        complete: Callable[[list[int]], None] = lambda ports: None,
    ):
        self.tp_size = tp_size
        self.own = own
        self._ranks = {0: own}
        self._complete = complete
        self._lock = threading.Lock()

    def register(self, reg: RankRegistration) -> list[int] | None:
        """Record rank ``reg.tp_rank``; every rank's engine port once all have
        registered (else None). ValueError naming what is refused."""
        if (reg.engine_id, reg.dp_rank) != (self.own.engine_id, self.own.dp_rank):
            raise ValueError(
                f"engine {reg.engine_id[:64]!r} DP rank {reg.dp_rank} is not this "
                f"instance's ({self.own.engine_id[:64]!r} DP rank {self.own.dp_rank})"
            )
        if not 0 < reg.tp_rank < self.tp_size:
            raise ValueError(
                f"tp_rank {reg.tp_rank}: this instance's other ranks are "
                f"1..{self.tp_size - 1}"
            )
        if not (0 < reg.port < 65536 and 0 < reg.engine_port < 65536):
            raise ValueError(f"a port is out of range: {reg.port}, {reg.engine_port}")
        with self._lock:
            known = self._ranks.setdefault(reg.tp_rank, reg)
            done = len(self._ranks) == self.tp_size
            first = done and known is reg
        if known != reg:
            # a rank registers once per start (retries send the same): another
            # registration for it is not this instance's rank
            raise ValueError(f"TP rank {reg.tp_rank} has registered already")
        ports = self.engine_ports()
        if first and ports is not None:
            self._complete(ports)
        return ports

    def ports(self) -> list[int] | None:
        """Where every rank serves pushes, rank 0's first; None until all registered."""
        with self._lock:
            if len(self._ranks) < self.tp_size:
                return None
            return [self._ranks[r].port for r in range(self.tp_size)]

    def engine_ports(self) -> list[int] | None:
        with self._lock:
            if len(self._ranks) < self.tp_size:
                return None
            return [self._ranks[r].engine_port for r in range(self.tp_size)]

    def missing(self) -> str:
        with self._lock:
            absent = [r for r in range(self.tp_size) if r not in self._ranks]
        return (
            f"TP rank(s) {', '.join(map(str, absent))} of this instance have not "
            "registered where they serve pushes; retry"
        )


def rank_port(first: int, tp_rank: int, tp_size: int, dp_rank: int) -> int:
    """The port TP rank ``tp_rank`` >= 1 of DP rank ``dp_rank`` listens on: ``first``
    + dp_rank * (tp_size - 1) + tp_rank - 1, so the ranks of every DP rank on a host
    take one contiguous range; 0 (``first`` unset) lets the kernel pick. Raises
    ValueError past 65535."""
    if first == 0:
        return 0
    port = first + dp_rank * (tp_size - 1) + tp_rank - 1
    if port > 65535:
        raise ValueError(
            f"MOONCAKE_PUSH_RANK_PORT={first} puts TP rank {tp_rank} of DP rank "
            f"{dp_rank} at port {port}, past 65535; set a lower first port"
        )
    return port


def rank_listener(vllm_config: object, host: str, port: int) -> object:
    """A bootstrap server without upstream's routes (rank 0's alone) at ``host`` and
    ``port`` (0: the kernel picks); not started. The caller adds this series' routes."""
    from ..prefill_bootstrap import PushRankListener
    from ..vllm_compat import bootstrap_server

    server = bootstrap_server(vllm_config, host, port, PushRankListener)  # type: ignore[arg-type]
    server.app.router.routes.clear()
    return server


def register_rank(
    rank0_url: str,
    reg: RankRegistration,
    config: ExtConfig,
    registered: Callable[[str, list[int]], None],
    deadline_s: float = REGISTER_DEADLINE_S,
) -> threading.Thread:
    """Register this rank with rank 0 at ``rank0_url`` on a thread, again until every
    rank has (or ``deadline_s``); then ``registered(source_id, engine_ports)``."""
    body = reg.model_dump_json().encode()

    def run() -> None:
        end = time.monotonic() + deadline_s
        last = "no attempt"
        # not through a proxy the environment names: rank 0 is on this host
        with httpx.Client(trust_env=False, timeout=REGISTER_CALL_TIMEOUT_S) as client:
            while time.monotonic() < end:
                try:
                    r = client.post(
                        rank0_url + RANKS_PATH,
                        content=body,
                        headers=request_headers(config, "POST", RANKS_PATH, body),
                    )
                    if r.status_code == 200:
                        answer = RankRegistered.model_validate_json(r.content)
                        if answer.engine_ports is not None:
                            registered(answer.source_id, answer.engine_ports)
                            logger.info(
                                "TP rank %d serves pushes on port %d (registered with %s)",
                                reg.tp_rank,
                                reg.port,
                                rank0_url,
                            )
                            return
                        last = "other ranks have not registered yet"
                    else:
                        last = f"HTTP {r.status_code} {r.text[:300]}"
                        if r.status_code < 500 and r.status_code not in RETRIED:
                            break  # refused: asking again would not change it
                except (httpx.HTTPError, ValueError) as e:  # not up yet, or garbled
                    last = repr(e)[:300]
                time.sleep(REGISTER_RETRY_S)
        logger.warning(
            "TP rank %d could not register its push listener (port %d) with rank 0 at "
            "%s (%s): this instance serves no prefix pushes (its /match_blocks answers "
            "503 and destinations prefill locally). Check MOONCAKE_BOOTSTRAP_HOST and "
            "MOONCAKE_BOOTSTRAP_TOKEN",
            reg.tp_rank,
            reg.port,
            rank0_url,
            last,
        )

    t = threading.Thread(
        target=run, name=f"mooncake-push-rank{reg.tp_rank}", daemon=True
    )
    t.start()
    return t
