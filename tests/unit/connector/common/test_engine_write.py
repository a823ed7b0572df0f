"""TerminalWriter: a write returns only when every entry is terminal in the engine.

The engine is a stand-in with Mooncake's per-task answers (1 completed, -1
failed, 0 pending, -2 a slice timed out but still pending); the real engine's
behaviour is tested in tests/integration/test_engine_write.py.
"""

from __future__ import annotations

import logging

import pytest
from helpers import RecordedFence

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.engine_write import (
    TerminalWriter,
    terminal_write_fn,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.write_bounds import (
    engine_timeout_s,
)


class ScriptedEngine:
    """Each submitted task answers the statuses of its script, one per poll, then
    the last one for ever."""

    def __init__(self, scripts: list[list[int]], fail_submit_at: int | None = None):
        self.scripts = scripts
        self.fail_submit_at = fail_submit_at
        self.submitted: list[tuple[str, int, int, int]] = []
        self.polls: dict[int, int] = {}

    def transfer_submit_write(self, session, src, dst, length):
        if (
            self.fail_submit_at is not None
            and len(self.submitted) == self.fail_submit_at
        ):
            return 0
        self.submitted.append((session, src, dst, length))
        batch_id = len(self.submitted)  # never 0
        self.polls[batch_id] = 0
        return batch_id

    def transfer_check_status(self, batch_id):
        script = self.scripts[batch_id - 1]
        i = self.polls[batch_id]
        self.polls[batch_id] = i + 1
        return script[min(i, len(script) - 1)]

    def terminal_at(self, batch_id: int) -> int:
        """The poll at which the task's script first answers terminal."""
        return next(i for i, s in enumerate(self.scripts[batch_id - 1]) if s in (1, -1))


def writer(engine, fence=None, **cfg) -> TerminalWriter:
    return TerminalWriter(
        engine, ExtConfig(**cfg), sleep=lambda s: None, fence=fence or RecordedFence()
    )


@pytest.mark.parametrize(
    ("scripts", "fail_submit_at", "rc"),
    [([[1], [1]], None, 0), ([[1], [-1]], None, -1), ([[1], [1]], 1, -1)],
    ids=["completed", "a task failed", "a submit refused"],
)
def test_only_a_failed_write_waits_for_the_kernels_send_queues(
    scripts, fail_submit_at, rc
):
    fence = RecordedFence()
    eng = ScriptedEngine(scripts, fail_submit_at=fail_submit_at)
    assert writer(eng, fence)("d:1", [1, 2], [3, 4], [8, 8]) == rc
    assert fence.waited == ([] if rc == 0 else ["d:1"])


def test_a_write_returns_only_once_every_entry_is_terminal():
    eng = ScriptedEngine([[0, 0, 1], [0, 0, 0, 0, 0, 0, 1], [1]])
    assert writer(eng)("d:1", [10, 20, 30], [100, 200, 300], [4, 4, 4]) == 0
    assert eng.submitted == [
        ("d:1", 10, 100, 4),
        ("d:1", 20, 200, 4),
        ("d:1", 30, 300, 4),
    ]
    for batch_id in eng.polls:  # every task was polled up to its terminal answer
        assert eng.polls[batch_id] == eng.terminal_at(batch_id) + 1


def test_a_failed_entry_fails_the_write_only_after_the_others_are_terminal():
    # Entry 1 fails at once; entry 2 is still moving bytes for many polls.
    eng = ScriptedEngine([[-1], [0] * 50 + [1]])
    assert writer(eng)("d:1", [1, 2], [3, 4], [8, 8]) == -1
    assert eng.polls[2] == 51, "returned while an entry could still land"


def test_a_slice_timeout_is_not_an_end():
    # -2: Mooncake's slice timeout; the task is still pending and may still land.
    eng = ScriptedEngine([[-2, -2, -2, 0, 1]])
    assert writer(eng)("d:1", [1], [2], [8]) == 0
    assert eng.polls[1] == 5


def test_a_refused_submit_still_waits_for_what_was_queued_before_it():
    eng = ScriptedEngine([[0, 0, 0, 1], [1]], fail_submit_at=1)
    assert writer(eng)("d:1", [1, 2], [3, 4], [8, 8]) == -1
    assert len(eng.submitted) == 1
    assert eng.polls[1] == 4


def test_an_overdue_write_is_logged_once_and_still_waited_for(caplog):
    now = [0.0]
    eng = ScriptedEngine([[0] * 70 + [1]])  # spins first, then backs off
    cfg = ExtConfig(engine_transfer_timeout_s=5)

    def sleep(s):
        now[0] += 15.0  # every back-off step takes 15 s of the clock

    w = TerminalWriter(
        eng, cfg, clock=lambda: now[0], sleep=sleep, fence=RecordedFence()
    )
    with caplog.at_level(logging.ERROR):
        assert w("d:1", [1], [2], [1 << 20]) == 0
    assert eng.polls[1] == 71
    assert now[0] > cfg.engine_write_bound_s(1 << 20)
    assert w.overdue == 1
    assert sum("still in flight" in r.getMessage() for r in caplog.records) == 1


def test_mismatched_entry_lists_write_nothing():
    eng = ScriptedEngine([[1]])
    assert writer(eng)("d:1", [1, 2], [3], [8, 8]) == -1
    assert eng.submitted == []


def test_the_engine_write_is_wrapped_and_a_plain_function_is_not():
    class Engine(ScriptedEngine):
        def batch_transfer_sync_write(self, session, src, dst, lens):
            raise AssertionError("the giving-up call must not be used")

    eng = Engine([[1]])
    fn = terminal_write_fn(eng.batch_transfer_sync_write, ExtConfig())
    assert isinstance(fn, TerminalWriter) and fn.engine is eng
    assert fn("d:1", [1], [2], [3]) == 0

    def plain(session, src, dst, lens):
        return 0

    assert terminal_write_fn(plain, ExtConfig()) is plain


@pytest.mark.parametrize(
    "raw, seconds",
    [
        (None, 30),
        ("1", 5),
        ("5", 5),
        ("7.9", 7),
        (" 12", 12),
        ("abc", 5),
        ("-3", 5),
        ("40s", 40),
    ],
)
def test_mc_transfer_timeout_is_read_as_mooncake_reads_it(raw, seconds):
    env = {} if raw is None else {"MC_TRANSFER_TIMEOUT": raw}
    assert engine_timeout_s(env) == seconds
    assert ExtConfig.from_env(env).engine_transfer_timeout_s == seconds


def test_the_write_bound_grows_with_the_bytes_and_the_timeout():
    a = ExtConfig(engine_transfer_timeout_s=5)
    b = ExtConfig(engine_transfer_timeout_s=20)
    assert b.engine_write_bound_s(0) - a.engine_write_bound_s(0) == 15
    assert a.engine_write_bound_s(4 << 30) - a.engine_write_bound_s(0) == pytest.approx(
        4.29, 0.01
    )


class RaisingEngine(ScriptedEngine):
    """Submitting entry ``raise_at`` raises (the binding's error), after the ones
    before it were queued."""

    def __init__(self, scripts, raise_at):
        super().__init__(scripts)
        self.raise_at = raise_at

    def transfer_submit_write(self, session, src, dst, length):
        if len(self.submitted) == self.raise_at:
            raise RuntimeError("transfer engine: submit failed")
        return super().transfer_submit_write(session, src, dst, length)


def test_a_write_raising_midway_waits_for_and_fences_what_it_submitted():
    """Entry 1 raises after entry 0 was queued: before, the exception left at once
    while entry 0 could still land; the caller answered D, which freed its blocks."""
    fence = RecordedFence()
    eng = RaisingEngine([[0] * 5 + [1]], raise_at=1)
    assert writer(eng, fence)("d:1", [1, 2], [3, 4], [8, 8]) == -1
    assert len(eng.submitted) == 1 and eng.polls[1] == 6
    assert fence.waited == ["d:1"]


def test_a_write_raising_at_its_first_entry_fails_without_a_fence():
    fence = RecordedFence()
    eng = RaisingEngine([[1]], raise_at=0)
    assert writer(eng, fence)("d:1", [1], [2], [8]) == -1
    assert eng.submitted == [] and fence.waited == []


def test_a_status_read_that_raises_holds_the_write_for_its_bound():
    """The engine cannot say whether its tasks ended (they may still be queued in
    the transport, where no kernel reading shows them): held for the bound."""

    class Broken(ScriptedEngine):
        def transfer_check_status(self, batch_id):
            raise RuntimeError("transfer engine: status failed")

    now = [0.0]
    fence = RecordedFence()
    cfg = ExtConfig(engine_transfer_timeout_s=5)
    w = TerminalWriter(
        Broken([[1]]),
        cfg,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        fence=fence,
    )
    assert w("d:1", [1], [2], [8]) == -1
    assert now[0] >= cfg.engine_write_bound_s(8) and fence.waited == ["d:1"]


def test_a_failed_rdma_write_is_held_for_the_fabrics_bound_before_it_reports():
    """The RDMA transport fails a task (every work request completed, one in
    error): packets it sent may still be placed by D's queue pair until the
    fabric's packet lifetime ends. No TCP socket to D exists to read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.send_queues import (
        KernelSockets,
        PeerAddresses,
        SendQueueFence,
    )

    now = [0.0]

    def sleep(s):
        now[0] += s

    cfg = ExtConfig()
    fence = SendQueueFence(
        hold_s=200.0,
        rdma=True,
        rdma_hold_s=cfg.rdma_failed_write_hold_s,
        kernel=KernelSockets({"no TCP socket": lambda peers: []}, probe=False),
        addresses=PeerAddresses(resolve=lambda host: {"10.0.0.2"}),
        clock=lambda: now[0],
        sleep=sleep,
    )
    eng = ScriptedEngine([[0, 0, -1]])  # the transport's error completion
    w = TerminalWriter(eng, cfg, clock=lambda: now[0], sleep=sleep, fence=fence)
    assert w("10.0.0.2:17002", [1], [2], [8]) == -1
    assert now[0] >= cfg.rdma_failed_write_hold_s == 10.0
    assert fence.blind_holds == 0 and fence.fence_seconds >= 10.0
