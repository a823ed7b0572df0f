"""connector/io_affinity.py: CPU lists, and the poller's per-thread priority."""

import os
import threading

import pytest

from connector.io_affinity import deprioritize_current_poller, parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def run_in_thread(fn):
    out = {}

    def body():
        out["ret"] = fn()
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_poller_thread_alone_is_deprioritized(monkeypatch):
    monkeypatch.setenv("MOONCAKE_IO_CPUS", "0")
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = run_in_thread(deprioritize_current_poller)
    assert out == {"ret": True, "nice": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


def test_unset_changes_nothing(monkeypatch):
    monkeypatch.delenv("MOONCAKE_IO_CPUS", raising=False)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = run_in_thread(deprioritize_current_poller)
    assert out == {"ret": False, "nice": before}
