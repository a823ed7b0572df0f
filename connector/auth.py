# SPDX-License-Identifier: Apache-2.0
"""Who may call this series' endpoints on the bootstrap server.

``/push_blocks`` makes this instance write memory (its transfer engine into a
peer's registered buffers); ``/match_blocks`` and ``/hashsync`` tell what its
prefix cache holds. Upstream's bootstrap server binds 0.0.0.0 and has no
authentication, so these endpoints need their own:

- ``MOONCAKE_BOOTSTRAP_TOKEN`` set: every call must carry
  ``Authorization: Bearer <token>`` (compared in constant time), else 401.
  D sends it on its /match_blocks and /push_blocks calls (same variable).
- no token, server bound to loopback (``MOONCAKE_BOOTSTRAP_HOST=127.0.0.1``):
  open; only local processes can reach it.
- no token, bound to anything else: closed (403, saying what to set), unless
  ``MOONCAKE_BOOTSTRAP_INSECURE=1`` says the network is trusted (logged loudly).

Upstream's own ``/register`` and ``/query`` are left as upstream has them.
"""

from __future__ import annotations

import hmac

from vllm.logger import init_logger

from .config import ExtConfig

logger = init_logger(__name__)

HEADER = "authorization"


class EndpointGuard:
    def __init__(self, config: ExtConfig):
        self._token = config.bootstrap_token
        self.host = config.bootstrap_host
        self.open = self._token is None and (config.bootstrap_loopback or config.bootstrap_insecure)
        self.closed = self._token is None and not self.open
        self._insecure = config.bootstrap_insecure and self._token is None \
            and not config.bootstrap_loopback

    def log_at_start(self) -> None:
        if self._insecure:
            logger.warning(
                "MOONCAKE_BOOTSTRAP_INSECURE=1: /push_blocks, /match_blocks and /hashsync are "
                "served WITHOUT authentication on %s: anyone who reaches this port can make "
                "this instance write KV into any registered peer. Use only on a trusted network.",
                self.host)
        elif self.closed:
            logger.warning(
                "The bootstrap server binds %s and MOONCAKE_BOOTSTRAP_TOKEN is not set: prefix "
                "push endpoints are closed (403). Set the same MOONCAKE_BOOTSTRAP_TOKEN on every "
                "instance, or MOONCAKE_BOOTSTRAP_HOST=127.0.0.1 for a single host.", self.host)

    def check(self, authorization: str | None) -> tuple[int, str] | None:
        """None if the call may proceed, else (HTTP status, reason)."""
        if self.open:
            return None
        if self.closed:
            return 403, (f"prefix push endpoints are closed: the bootstrap server binds "
                         f"{self.host} and no MOONCAKE_BOOTSTRAP_TOKEN is set on this instance")
        scheme, _, given = (authorization or "").partition(" ")
        assert self._token is not None
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(),
                                                                  self._token.encode()):
            return 401, "missing or wrong token (Authorization: Bearer <MOONCAKE_BOOTSTRAP_TOKEN>)"
        return None


def client_headers(config: ExtConfig) -> dict[str, str]:
    """Headers D sends with its calls to a push source."""
    headers = {"content-type": "application/json"}
    if config.bootstrap_token:
        headers["authorization"] = f"Bearer {config.bootstrap_token}"
    return headers
