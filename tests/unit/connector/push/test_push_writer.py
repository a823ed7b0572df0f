"""connector/push/source_writer.py: the push's write runs on its own thread at nice 19."""

import os
import threading

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.source_writer import (
    WRITER_NICE,
    LowPriorityWriter,
)


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_returns_the_engines_code_after_it_returned_from_a_lowered_thread():
    calls = []

    def write(session, src, dst, lens, layout=None):
        calls.append(
            (session, src, dst, lens, threading.get_native_id(), nice_of_this_thread())
        )
        return -7

    before = nice_of_this_thread()
    w = LowPriorityWriter(write)
    assert w("peer:1", [1], [2], [3]) == -7
    [(session, src, dst, lens, tid, nice)] = calls
    assert (session, src, dst, lens) == ("peer:1", [1], [2], [3])
    assert tid != threading.get_native_id() and nice == WRITER_NICE == 19
    assert nice_of_this_thread() == before  # the caller's thread is untouched


def test_what_the_engine_raises_reaches_the_caller():
    def write(*_):
        raise ValueError("peer vanished")

    with pytest.raises(ValueError, match="peer vanished"):
        LowPriorityWriter(write)("peer:1", [], [], [])


def test_the_caller_waits_for_the_write():
    gate, done = threading.Event(), []

    def write(*_):
        gate.wait(5)
        done.append(True)
        return 0

    t = threading.Thread(target=lambda: LowPriorityWriter(write)("p", [], [], []))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not done  # still inside the write
    gate.set()
    t.join(5)
    assert done == [True]


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_writer_never_raises_its_priority(nice):
    with pytest.raises(ValueError, match="0..19"):
        LowPriorityWriter(lambda *_: 0, nice=nice)
