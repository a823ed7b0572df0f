"""connector/common/config.py: every knob read once, bad values named, bounds that the
"no byte after the end" invariant relies on refused."""

from dataclasses import replace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.write_bounds import (
    ENGINE_RECONNECT_MAX_S,
    engine_lanes,
    engine_no_progress_s,
    engine_reconnect_s,
    stalled_delivery_bound_s,
    tcp_orphan_retries,
    tcp_retransmission_span_s,
    tcp_syn_span_s,
)


def syn_files(tmp_path, retries: str | None, linear: str | None) -> tuple[str, str]:
    """net.ipv4.tcp_syn_retries and tcp_syn_linear_timeouts as files (None: absent)."""
    tmp_path.mkdir(exist_ok=True)
    paths = []
    for name, text in (("tcp_syn_retries", retries), ("linear", linear)):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.fixture(autouse=True)
def linux_defaults(monkeypatch, tmp_path):
    """from_env reads this host's net.ipv4.tcp_orphan_retries, tcp_syn_retries and
    tcp_syn_linear_timeouts; these tests assume the kernel's defaults (0, applied
    as 8; 6; 4)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import config

    monkeypatch.setattr(config, "tcp_orphan_retries", lambda: 8)
    paths = syn_files(tmp_path / "defaults", "6\n", "4\n")
    real = config.engine_reconnect_s
    monkeypatch.setattr(config, "engine_reconnect_s", lambda env: real(env, *paths))


def test_defaults_and_derived_bounds():
    cfg = ExtConfig.from_env({})
    assert not cfg.layerwise and cfg.layerwise_min_tokens == 256
    # upstream's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480), capped so that it plus the
    # bound on an in-flight write (5 + 30 + 205.4) plus 5 s ends before D gives up
    # (540), in whole seconds
    cfg = ExtConfig.from_env({})
    assert (
        ExtConfig.from_env({}).layerwise_timeout_s
        == 294
        == ExtConfig().layerwise_timeout_s
    )
    assert cfg.push_timeout_s == 30 and cfg.engine_transfer_timeout_s == 30
    # D's hold for a push C never answers: push timeout + C's bound for the bytes
    # (handshake 5 + C's MC_TRANSFER_TIMEOUT + 1 ns/byte + the kernel's 205.4 for
    # the stalled connections' orphans) + skew
    assert cfg.push_hold_for_s(0) == pytest.approx(30 + (5 + 30 + 0 + 205.4) + 5)
    assert cfg.push_hold_for_s(2 * 10**9, source_engine_timeout_s=60) == pytest.approx(
        30 + (5 + 60 + 2 + 205.4) + 5
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
            "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": "2051@1",
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "300",
        }
    )
    # D gives up at 300 + 60 s; the bound on a write is 5 + 10 + 205.4 s
    assert cfg.layerwise and cfg.layerwise_timeout_s == 134  # floor(360 - 220.4 - 5)
    assert cfg.push_hold_for_s(0) == pytest.approx(3 + (5 + 10 + 205.4) + 1)
    assert (cfg.faults.delay_write_prompt_len, cfg.faults.delay_write_s) == (600, 12.0)
    f = cfg.faults
    assert (f.hold_write_prompt_len, f.hold_write_after, f.hold_write_s) == (
        1500,
        10,
        4.5,
    )
    assert (f.fail_write_prompt_len, f.fail_write_rank) == (2051, 1)
    every_rank = ExtConfig.from_env({"MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": "2051"})
    assert every_rank.faults.fail_write_rank is None


@pytest.mark.parametrize(
    "env,name",
    [
        ({"MOONCAKE_LAYERWISE_MIN_TOKENS": "x"}, "MOONCAKE_LAYERWISE_MIN_TOKENS"),
        ({"MOONCAKE_PUSH_TIMEOUT_S": "-1"}, "MOONCAKE_PUSH_TIMEOUT_S"),
        ({"MOONCAKE_PUSH_TIMEOUT_S": "nan"}, "MOONCAKE_PUSH_TIMEOUT_S"),
        ({"MOONCAKE_FAULT_DELAY_WRITE": "600"}, "MOONCAKE_FAULT_DELAY_WRITE"),
        ({"MOONCAKE_FAULT_HOLD_WRITE": "600:3"}, "MOONCAKE_FAULT_HOLD_WRITE"),
        (
            {"MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": "600@x"},
            "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN",
        ),
        (
            {"MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": "600@-1"},
            "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN",
        ),
        ({"MOONCAKE_IO_CPUS": "9999"}, "MOONCAKE_IO_CPUS"),
    ],
)
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        ExtConfig.from_env(env)


def test_layerwise_timeout_must_end_before_the_decode_side_gives_up():
    """D frees a pull's blocks VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s after asking;
    P must have answered (timeout + the bound on its in-flight write) before that."""
    # 294 + 240.4 < 540
    assert ExtConfig.from_env({"MOONCAKE_LAYERWISE_TIMEOUT_S": "294"})
    with pytest.raises(ConfigError, match="MOONCAKE_LAYERWISE_TIMEOUT_S"):
        ExtConfig.from_env(
            {"MOONCAKE_LAYERWISE_TIMEOUT_S": "300"}
        )  # 300 + 240.4 >= 540
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
    d = ExtConfig.from_env(
        {
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "200",
            "MOONCAKE_LAYERWISE_TIMEOUT_S": "1",
        }
    )
    assert d.decode_limits() == {"pull_give_up_s": 260.0}
    p = ExtConfig.from_env(
        {"MOONCAKE_LAYERWISE_TIMEOUT_S": "60", "MC_TRANSFER_TIMEOUT": "5"}
    )
    why = p.layerwise_refusal(d.decode_limits())  # 60 + (5 + 5 + 205.4) = 275.4 >= 260
    assert (
        why
        and "275.4 s" in why
        and "260 s" in why
        and "MOONCAKE_LAYERWISE_TIMEOUT_S" in why
    )
    assert p.layerwise_refusal({"pull_give_up_s": 276.0}) is None
    assert (
        ExtConfig.from_env({}).layerwise_refusal(ExtConfig.from_env({}).decode_limits())
        is None
    )
    assert p.layerwise_refusal(None) is None  # a decode without the hook: not checkable
    for bad in (float("nan"), float("inf"), 0.0, -5.0, "x"):
        assert "invalid" in p.layerwise_refusal({"pull_give_up_s": bad})


def test_the_write_bound_covers_what_a_cut_link_can_still_deliver():
    """A write whose link is cut for longer than the transport's 30 s watchdog ends
    only once the kernel has given up on the orphaned connections (send_queues.py);
    peers hold blocks for it that long. Measured with the real engine
    (MC_TRANSFER_TIMEOUT=5, 512 MiB, the kernel's default tcp_orphan_retries): the
    write returned 106.8 s after the cut; without the fence (MC_TRANSFER_TIMEOUT=30)
    it returned after 113.3 s. The engine's own rule gave 40.5 s and 65 s."""
    assert (
        ExtConfig.from_env({"MC_TRANSFER_TIMEOUT": "5"}).engine_write_bound_s(512 << 20)
        > 106.8
    )
    assert ExtConfig.from_env({}).engine_write_bound_s(0) > 113.3
    assert ExtConfig.from_env({}).push_hold_for_s(0) > 30 + 113.3


@pytest.mark.parametrize(
    "env,watchdog",
    [
        ({}, 30),
        ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "120"}, 120),
        ({"MC_TCP_STATUS_TIMEOUT_SEC": " 90s"}, 90),  # atoi: the leading digits
        ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "7"}, 7),
        ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "0"}, 30),  # not above 0: the engine's 30
        ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "-4"}, 30),
        ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "abc"}, 30),
    ],
)
def test_the_transports_watchdog_is_read_as_the_engine_reads_it(env, watchdog):
    assert engine_no_progress_s(env) == watchdog
    assert ExtConfig.from_env(env).engine_no_progress_s == watchdog


def test_the_write_bound_follows_a_raised_transport_watchdog():
    """MC_TCP_PROGRESS_TIMEOUT_SEC=200: the transport keeps a stalled connection,
    and the bytes it had queued, for 200 s before it drops it; they can land until
    the kernel gives up on the orphan after that. The bound peers hold blocks for
    must cover it (with the 30 s it assumed before, it was 5 + 5 + 61 s with one
    orphan retry: blocks freed while the write could still land)."""
    env = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_PROGRESS_TIMEOUT_SEC": "200"}
    cfg = replace(ExtConfig.from_env(env), tcp_orphan_retries=1, engine_reconnect_s=1)
    assert cfg.engine_write_bound_s(0) == pytest.approx(5 + 5 + 200 + 120 + 1)
    # D's hold for a push of a source that reports it, whatever D's own setting
    d = replace(ExtConfig.from_env({}), tcp_orphan_retries=1, engine_reconnect_s=1)
    assert d.push_hold_for_s(0, 5, 1, 200) > 200 + 120 + 1
    assert d.push_hold_for_s(0, 5, 1) < 200
    assert stalled_delivery_bound_s(1, 200) == pytest.approx(200 + 120 + 1)
    assert stalled_delivery_bound_s(1, 5) == pytest.approx(5 + 5 + 1)  # lowered too


def test_the_kernels_retransmission_model():
    # tcp_model_timeout: (2^(n+1) - 1) * 200 ms up to 9, then 120 s per retry
    assert tcp_retransmission_span_s(8) == pytest.approx(102.2)
    assert tcp_retransmission_span_s(9) == pytest.approx(204.6)
    assert tcp_retransmission_span_s(15) == pytest.approx(204.6 + 6 * 120)
    # the watchdog's 30 s is the floor; the timer past the span fires at most one
    # interval later (no longer than the span itself, nor than TCP_RTO_MAX)
    assert stalled_delivery_bound_s(1) == pytest.approx(30 + 30 + 1)
    assert stalled_delivery_bound_s(8) == pytest.approx(102.2 + 102.2 + 1)
    assert stalled_delivery_bound_s(15) == pytest.approx(924.6 + 120 + 1)


def test_the_write_bound_covers_the_transports_reconnect_after_its_watchdog():
    """Once the watchdog dropped a stalled connection, the transport connects to the
    peer again for the write's slices still queued, one lane after the other, each
    connect lasting up to the kernel's SYN span while the link is down; had the
    link come back meanwhile, they are written. Measured with the real engine (four
    lanes, a loaded machine, the link cut for good): the write returned 174.4 s
    after the cut, past the 113.5 s bound of the orphans alone (tcp_orphan_retries
    7, MC_TRANSFER_TIMEOUT=5): peers would have freed blocks it could still write."""
    env = {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_LANES_PER_PEER": "4"}
    # four lanes with upstream's abort timeout: refused at start, naming the reconnect
    with pytest.raises(ConfigError, match="544 s reconnect"):
        ExtConfig.from_env(env)
    env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = "900"
    cfg = replace(ExtConfig.from_env(env), tcp_orphan_retries=7)
    assert cfg.engine_reconnect_s == 4 * (131 + 5)
    assert cfg.engine_write_bound_s(512 << 20) > 174.4
    assert cfg.engine_write_bound_s(0) == pytest.approx(5 + 5 + 30 + 4 * 136)
    # one lane, as this series sets it: one SYN span after the watchdog, which ends
    # before the default orphans' last delivery (the bound keeps its size)
    one = ExtConfig.from_env({"MC_TRANSFER_TIMEOUT": "5"})
    assert one.engine_reconnect_s == 136
    assert one.engine_write_bound_s(0) == pytest.approx(5 + 5 + 205.4)
    seven = replace(one, tcp_orphan_retries=7)
    assert seven.engine_write_bound_s(0) == pytest.approx(5 + 5 + 30 + 136)
    # D's hold for a push follows the reconnect C reports
    assert one.push_hold_for_s(0, 5, 7, 30, 4 * 136) == pytest.approx(
        30 + 5 + 5 + 30 + 4 * 136 + 5
    )
    assert ENGINE_RECONNECT_MAX_S == 4 * 136


def test_the_kernels_syn_model():
    # 1, 2, 4 ... 64 s, the last timeout ending it; linear timeouts first at 1 s
    assert tcp_syn_span_s(6) == pytest.approx(127)
    assert tcp_syn_span_s(6, 4) == pytest.approx(131)
    assert tcp_syn_span_s(2) == pytest.approx(7)
    assert tcp_syn_span_s(8) == pytest.approx(127 + 120 + 120)  # TCP_RTO_MAX


@pytest.mark.parametrize(
    "env,lanes",
    [
        ({}, 1),  # as transport_env.py sets it
        ({"MC_TCP_LANES_PER_PEER": "4"}, 4),
        ({"MC_TCP_LANES_PER_PEER": "0"}, 1),
        ({"MC_TCP_MAX_CONNECTIONS_PER_PEER": "3"}, 3),  # the old name
        ({"MC_TCP_LANES_PER_PEER": "2", "MC_TCP_MAX_CONNECTIONS_PER_PEER": "3"}, 2),
    ],
)
def test_the_lanes_are_read_as_the_engine_reads_them(env, lanes):
    assert engine_lanes(env) == lanes


@pytest.mark.parametrize(
    "retries,linear,span",
    [
        ("6\n", "4\n", 131),
        ("6", None, 127),
        ("3", "0", 15),
        ("0", None, 127),
        (None, None, 127),
    ],
)
def test_the_syn_settings_are_read_as_the_kernel_applies_them(
    tmp_path, retries, linear, span
):
    paths = syn_files(tmp_path, retries, linear)
    assert engine_reconnect_s({}, *paths) == span + 5
    assert engine_reconnect_s({"MC_TCP_LANES_PER_PEER": "2"}, *paths) == 2 * (span + 5)


@pytest.mark.parametrize(
    "text,applied", [("0\n", 8), ("7\n", 7), ("15", 15), ("x", 8), (None, 8)]
)
def test_the_orphan_retries_are_read_as_the_kernel_applies_them(
    tmp_path, text, applied
):
    path = tmp_path / "tcp_orphan_retries"
    if text is not None:
        path.write_text(text)
    assert tcp_orphan_retries(str(path)) == applied


def test_the_push_policy_is_one_of_two_words():
    assert ExtConfig.from_env({}).push_policy == "measured"
    got = ExtConfig.from_env({"MOONCAKE_PUSH_POLICY": " Always "}).push_policy
    assert got == "always"
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_POLICY.*measured, always"):
        ExtConfig.from_env({"MOONCAKE_PUSH_POLICY": "sometimes"})
