"""connector/config.py: every knob read once, bad values named, bounds that the
"no byte after the end" invariant relies on refused."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.config import (
    ConfigError,
    ExtConfig,
)


def test_defaults_and_derived_bounds():
    cfg = ExtConfig.from_env({})
    assert not cfg.layerwise and cfg.layerwise_min_tokens == 256
    assert cfg.layerwise_timeout_s == 480  # upstream's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
    assert cfg.push_timeout_s == 30 and cfg.engine_transfer_timeout_s == 30
    assert cfg.push_hold_s == 30 + 30 + 5
    assert not cfg.faults.armed


def test_values_are_read():
    cfg = ExtConfig.from_env({"MOONCAKE_LAYERWISE": "1", "MOONCAKE_PUSH_TIMEOUT_S": "3",
                              "MC_TRANSFER_TIMEOUT": "10", "MOONCAKE_PUSH_CLOCK_SKEW_S": "1",
                              "MOONCAKE_FAULT_DELAY_WRITE": "600:12",
                              "MOONCAKE_FAULT_HOLD_WRITE": "1500:10:4.5",
                              "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "100"})
    assert cfg.layerwise and cfg.layerwise_timeout_s == 100
    assert cfg.push_hold_s == 14
    assert (cfg.faults.delay_write_prompt_len, cfg.faults.delay_write_s) == (600, 12.0)
    f = cfg.faults
    assert (f.hold_write_prompt_len, f.hold_write_after, f.hold_write_s) == (1500, 10, 4.5)


@pytest.mark.parametrize("env,name", [
    ({"MOONCAKE_LAYERWISE_MIN_TOKENS": "x"}, "MOONCAKE_LAYERWISE_MIN_TOKENS"),
    ({"MOONCAKE_PUSH_TIMEOUT_S": "-1"}, "MOONCAKE_PUSH_TIMEOUT_S"),
    ({"MOONCAKE_PUSH_TIMEOUT_S": "nan"}, "MOONCAKE_PUSH_TIMEOUT_S"),
    ({"MOONCAKE_FAULT_DELAY_WRITE": "600"}, "MOONCAKE_FAULT_DELAY_WRITE"),
    ({"MOONCAKE_FAULT_HOLD_WRITE": "600:3"}, "MOONCAKE_FAULT_HOLD_WRITE"),
    ({"MOONCAKE_IO_CPUS": "9999"}, "MOONCAKE_IO_CPUS"),
])
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        ExtConfig.from_env(env)


def test_layerwise_timeout_must_end_before_the_decode_side_gives_up():
    """D frees a pull's blocks VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s after asking;
    P must have answered (timeout + wait for its in-flight write) before that."""
    assert ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "500"})  # 500 + 35 < 540
    with pytest.raises(ConfigError, match="MOONCAKE_LAYERWISE_TIMEOUT_S"):
        ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "520"})  # 520 + 35 >= 540
    with pytest.raises(ConfigError, match="MC_TRANSFER_TIMEOUT"):
        ExtConfig.from_env({"MC_TRANSFER_TIMEOUT": "600"})


@pytest.mark.parametrize("bind,upstream,expected", [
    ("10.231.7.2", "127.0.0.1", "10.231.7.2"),  # bound to one address: register there
    ("0.0.0.0", "127.0.0.1", "127.0.0.1"),  # upstream's default: unchanged
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("10.231.7.2", "10.0.0.9", "10.0.0.9"),  # a real DP master address is kept
])
def test_worker_registers_where_the_bootstrap_server_listens(bind, upstream, expected):
    """The bug the two-host harness found: upstream registered at 127.0.0.1 while the
    server listened on MOONCAKE_BOOTSTRAP_HOST only, and retried for ever (the
    instance never became healthy)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.extension import (
        WorkerExtension,
    )

    fake = SimpleNamespace(config=ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_HOST": bind}))
    assert WorkerExtension.registration_host(fake, upstream) == expected
