"""Fixtures of the prefix-push unit tests."""

from __future__ import annotations

import pytest
from helpers import FP, TOKEN, CServer

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)


@pytest.fixture
def c_servers(c_server):
    """conftest's c_server, but a C without a config of its own requires TOKEN and
    takes at most 64 tokens."""

    def make(
        config: ExtConfig | None = None, fingerprint: KVFingerprint = FP
    ) -> CServer:
        return c_server(
            config or ExtConfig(bootstrap_token=TOKEN, push_max_tokens=64), fingerprint
        )

    return make
