"""Fixtures several unit test modules use; the plain builders and stubs behind
them, which tests also import by name, are in helpers.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers import C_SOURCE, FP, CServer

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)


class Loop:
    """An asyncio loop in a thread, as P's sender loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture
def c_server():
    """Makes C servers (helpers.CServer), closed after the test. Without a config
    of its own, C binds 127.0.0.1 with no token: its push endpoints are open."""
    made: list[CServer] = []

    def make(
        config: ExtConfig | None = None,
        fingerprint: KVFingerprint = FP,
        source_id: str = C_SOURCE,
        **rank,
    ) -> CServer:
        made.append(
            CServer(
                config or ExtConfig(bootstrap_host="127.0.0.1"),
                fingerprint,
                source_id,
                **rank,
            )
        )
        return made[-1]

    yield make
    for c in made:
        c.close()
