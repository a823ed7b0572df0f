"""connector/common/io_affinity.py (and config.py's CPU lists): the poller's per-thread priority."""

import os
import threading

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
    parse_cpu_list,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.io_affinity import (
    deprioritize_current_poller,
)


def test_parse_cpu_list():
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(ConfigError):
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


def test_poller_thread_alone_is_deprioritized():
    cpus = ExtConfig.from_env({"MOONCAKE_IO_CPUS": "0"}).io_cpus
    assert cpus == {0}
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = run_in_thread(lambda: deprioritize_current_poller(cpus))
    assert out == {"ret": True, "nice": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before


def test_unset_changes_nothing():
    """Without MOONCAKE_IO_CPUS the writer shares the compute cores: a nice-19 writer
    waited seconds to submit each layer under load (mb7), so it keeps its priority."""
    cpus = ExtConfig.from_env({}).io_cpus
    assert cpus is None
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = run_in_thread(lambda: deprioritize_current_poller(cpus))
    assert out == {"ret": False, "nice": before}
