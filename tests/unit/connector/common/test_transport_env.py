"""connector/common/transport_env.py: the TCP transport defaults, and (with the real
Mooncake engine over loopback, no vLLM) the failure they exist to prevent."""

import subprocess
import sys
import textwrap

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common import (
    transport_env,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.transport_env import (
    TCP_TRANSPORT_DEFAULTS,
    apply_transport_env_defaults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.write_bounds import (
    engine_lanes,
)


@pytest.fixture(autouse=True)
def default_bootstrap_host(monkeypatch):
    """The defaults depend on MOONCAKE_BOOTSTRAP_HOST (config.load(), read once per
    process): these tests use the default (0.0.0.0), whatever the environment says."""
    monkeypatch.setattr(transport_env, "load", lambda: ExtConfig())


def test_tcp_sets_every_default_when_unset():
    env = {}
    applied = apply_transport_env_defaults("tcp", env)
    assert applied == TCP_TRANSPORT_DEFAULTS == env


def test_user_setting_wins():
    env = {"MC_TCP_ADMISSION_TIMEOUT_MS": "1234"}
    applied = apply_transport_env_defaults("tcp", env)
    assert env["MC_TCP_ADMISSION_TIMEOUT_MS"] == "1234"
    assert "MC_TCP_ADMISSION_TIMEOUT_MS" not in applied
    assert env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "65535"


def test_one_lane_unless_the_user_set_the_lanes_under_either_name():
    """One connection to a peer (write_bounds.engine_reconnect_s: each lane more adds a SYN
    span to the bound a write's peers hold blocks for), and what the configuration
    computes the bound with is what the transport gets."""
    env = {}
    apply_transport_env_defaults("tcp", env)
    assert env["MC_TCP_LANES_PER_PEER"] == "1"
    assert engine_lanes(env) == 1 == engine_lanes({})
    env = {"MC_TCP_LANES_PER_PEER": "4"}
    apply_transport_env_defaults("tcp", env)
    assert env["MC_TCP_LANES_PER_PEER"] == "4" and engine_lanes(env) == 4
    env = {"MC_TCP_MAX_CONNECTIONS_PER_PEER": "4"}  # the old name
    apply_transport_env_defaults("tcp", env)
    assert "MC_TCP_LANES_PER_PEER" not in env and engine_lanes(env) == 4


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "::1"])
def test_engine_binds_where_the_bootstrap_server_does(monkeypatch, host):
    monkeypatch.setattr(transport_env, "load", lambda: ExtConfig(bootstrap_host=host))
    env = {}
    applied = apply_transport_env_defaults("tcp", env)
    assert applied == {**TCP_TRANSPORT_DEFAULTS, "MC_TCP_BIND_ADDRESS": host} == env
    env = {"MC_TCP_BIND_ADDRESS": "0.0.0.0"}  # the user's setting wins
    assert "MC_TCP_BIND_ADDRESS" not in apply_transport_env_defaults("tcp", env)
    assert env["MC_TCP_BIND_ADDRESS"] == "0.0.0.0"
    assert apply_transport_env_defaults("rdma", {}) == {}


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_wildcard_bind_sets_no_engine_address(monkeypatch, host):
    monkeypatch.setattr(transport_env, "load", lambda: ExtConfig(bootstrap_host=host))
    assert "MC_TCP_BIND_ADDRESS" not in apply_transport_env_defaults("tcp", {})


@pytest.mark.parametrize("protocol", ["rdma", "efa", ""])
def test_other_protocols_untouched(protocol):
    env = {}
    assert apply_transport_env_defaults(protocol, env) == {}
    assert env == {}


# 12288 entries = 48 layers x K/V x 128 non-contiguous blocks: one 2048-token
# post-hoc transfer of the default model.
ENGINE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mooncake.engine import TransferEngine
    def engine():
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        return e
    a, b = engine(), engine()
    n, size = 12288, 4096
    src = np.full(n * size, 7, dtype=np.uint8); dst = np.zeros(n * size, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    rc = a.batch_transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}",
        [src.ctypes.data + i * size for i in range(n)],
        [dst.ctypes.data + i * size for i in range(n)], [size] * n)
    print("RESULT", rc, bool((dst == 7).all()))
""")


def run_engine(env_defaults: bool) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_TCP_")}
    if env_defaults:
        apply_transport_env_defaults("tcp", env)
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, f"engine script failed (rc={out.returncode}):\n{out.stderr[-2000:]}"
    return lines[0]


def test_real_engine_rejects_a_large_batch_with_mooncake_defaults_and_moves_it_with_ours():
    pytest.importorskip("mooncake.engine")
    assert (
        run_engine(env_defaults=False) == "RESULT -1 False"
    )  # the premise of the defaults
    assert run_engine(env_defaults=True) == "RESULT 0 True"


def test_the_start_log_says_the_engine_listens_everywhere_and_names_the_ports(caplog):
    """MC_TCP_BIND_ADDRESS does not confine Mooncake's listeners: say so, loudly where
    the operator asked for a loopback instance, with the ports to firewall."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.transport_env import (
        log_engine_listeners,
    )

    with caplog.at_level(logging.INFO):
        log_engine_listeners(
            {
                "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                "MC_MIN_RPC_PORT": "21000",
                "MC_MAX_RPC_PORT": "21019",
            }
        )
        log_engine_listeners({"MC_TCP_BIND_ADDRESS": "10.0.0.5"})
    (local, other) = [
        r for r in caplog.records if "listens on ALL interfaces" in r.getMessage()
    ]
    assert local.levelno == logging.WARNING and "21000-21019" in local.getMessage()
    assert other.levelno == logging.INFO and "15000-17000" in other.getMessage()
