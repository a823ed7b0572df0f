"""connector/common/config.py: every knob read once, bad values named, bounds that the
"no byte after the end" invariant relies on refused."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
)


def test_defaults_and_derived_bounds():
    cfg = ExtConfig.from_env({})
    assert not cfg.layerwise and cfg.layerwise_min_tokens == 256
    # upstream's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480), capped so that it plus the
    # bound on an in-flight write (5 + 30 + 30) plus 5 s ends before D gives up (540)
    assert cfg.layerwise_timeout_s == 470
    assert cfg.push_timeout_s == 30 and cfg.engine_transfer_timeout_s == 30
    # D's hold for a push C never answers: push timeout + C's bound for the bytes
    # (handshake 5 + C's MC_TRANSFER_TIMEOUT + 1 ns/byte + watchdog 30) + skew
    assert cfg.push_hold_for_s(0) == 30 + (5 + 30 + 0 + 30) + 5
    assert (
        cfg.push_hold_for_s(2 * 10**9, source_engine_timeout_s=60)
        == 30 + (5 + 60 + 2 + 30) + 5
    )
    assert not cfg.faults.armed


def test_values_are_read():
    cfg = ExtConfig.from_env(
        {
            "MOONCAKE_LAYERWISE": "1",
            "MOONCAKE_PUSH_TIMEOUT_S": "3",
            "MC_TRANSFER_TIMEOUT": "10",
            "MOONCAKE_PUSH_CLOCK_SKEW_S": "1",
            "MOONCAKE_FAULT_DELAY_WRITE": "600:12",
            "MOONCAKE_FAULT_HOLD_WRITE": "1500:10:4.5",
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "100",
        }
    )
    assert cfg.layerwise and cfg.layerwise_timeout_s == 100
    assert cfg.push_hold_for_s(0) == 3 + (5 + 10 + 30) + 1
    assert (cfg.faults.delay_write_prompt_len, cfg.faults.delay_write_s) == (600, 12.0)
    f = cfg.faults
    assert (f.hold_write_prompt_len, f.hold_write_after, f.hold_write_s) == (
        1500,
        10,
        4.5,
    )


@pytest.mark.parametrize(
    "env,name",
    [
        ({"MOONCAKE_LAYERWISE_MIN_TOKENS": "x"}, "MOONCAKE_LAYERWISE_MIN_TOKENS"),
        ({"MOONCAKE_PUSH_TIMEOUT_S": "-1"}, "MOONCAKE_PUSH_TIMEOUT_S"),
        ({"MOONCAKE_PUSH_TIMEOUT_S": "nan"}, "MOONCAKE_PUSH_TIMEOUT_S"),
        ({"MOONCAKE_FAULT_DELAY_WRITE": "600"}, "MOONCAKE_FAULT_DELAY_WRITE"),
        ({"MOONCAKE_FAULT_HOLD_WRITE": "600:3"}, "MOONCAKE_FAULT_HOLD_WRITE"),
        ({"MOONCAKE_IO_CPUS": "9999"}, "MOONCAKE_IO_CPUS"),
    ],
)
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        ExtConfig.from_env(env)


def test_layerwise_timeout_must_end_before_the_decode_side_gives_up():
    """D frees a pull's blocks VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s after asking;
    P must have answered (timeout + the bound on its in-flight write) before that."""
    assert ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "470"})  # 470 + 65 < 540
    with pytest.raises(ConfigError, match="MOONCAKE_LAYERWISE_TIMEOUT_S"):
        ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "480"})  # 480 + 65 >= 540
    with pytest.raises(ConfigError, match="MC_TRANSFER_TIMEOUT"):
        ExtConfig.from_env({"MC_TRANSFER_TIMEOUT": "600"})
    with pytest.raises(ConfigError, match="MC_TRANSFER_TIMEOUT"):  # no default fits
        ExtConfig.from_env({"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "1"})


@pytest.mark.parametrize(
    "bind,upstream,expected",
    [
        (
            "10.231.7.2",
            "127.0.0.1",
            "10.231.7.2",
        ),  # bound to one address: register there
        ("0.0.0.0", "127.0.0.1", "127.0.0.1"),  # upstream's default: unchanged
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
        ("10.231.7.2", "10.0.0.9", "10.0.0.9"),  # a real DP master address is kept
    ],
)
def test_worker_registers_where_the_bootstrap_server_listens(bind, upstream, expected):
    """The bug the two-host harness found: upstream registered at 127.0.0.1 while the
    server listened on MOONCAKE_BOOTSTRAP_HOST only, and retried for ever (the
    instance never became healthy)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
        WorkerExtension,
    )

    fake = SimpleNamespace(config=ExtConfig.from_env({"MOONCAKE_BOOTSTRAP_HOST": bind}))
    assert WorkerExtension.registration_host(fake, upstream) == expected


def test_a_prefill_refuses_a_decode_that_gives_up_before_it_may_answer():
    """P answers a layer-wise pull at the latest after MOONCAKE_LAYERWISE_TIMEOUT_S + the
    bound on an in-flight write; the decode side frees its blocks when it gives up."""
    d = ExtConfig.from_env({"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "20"})
    assert d.decode_limits() == {"pull_give_up_s": 80.0}
    p = ExtConfig.from_env(
        {"MOONCAKE_LAYERWISE_TIMEOUT_S": "60", "MC_TRANSFER_TIMEOUT": "5"}
    )
    why = p.layerwise_refusal(d.decode_limits())  # 60 + (5 + 5 + 30) = 100 >= 80
    assert (
        why
        and "100 s" in why
        and "80 s" in why
        and "MOONCAKE_LAYERWISE_TIMEOUT_S" in why
    )
    assert p.layerwise_refusal({"pull_give_up_s": 101.0}) is None
    assert (
        ExtConfig.from_env({}).layerwise_refusal(ExtConfig.from_env({}).decode_limits())
        is None
    )
    assert p.layerwise_refusal(None) is None  # a decode without the hook: not checkable
    for bad in (float("nan"), float("inf"), 0.0, -5.0, "x"):
        assert "invalid" in p.layerwise_refusal({"pull_give_up_s": bad})
