"""The launcher's cluster token for hosts off loopback stays with that cluster.

It used to be left in the test process's environment (os.environ.setdefault):
every later loopback cluster then demanded it, and clients that do not send it
(curl in the README recipe, raw posts) got 401 (seen in CI after test_faults.py)."""

from __future__ import annotations

import os
from unittest import mock

from harness.launcher import Cluster, InstanceSpec

TOKEN_ENV = "MOONCAKE_BOOTSTRAP_TOKEN"


def test_cluster_token_is_in_the_environment_only_while_the_cluster_runs(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cluster = Cluster([InstanceSpec("a", model="m")], tmp_path, hosts=True)
    assert cluster.instances["a"].spec.env[TOKEN_ENV]
    with (
        mock.patch.object(cluster.topology, "create"),
        mock.patch.object(cluster.topology, "destroy"),
        mock.patch("harness.launcher.Instance.start"),
        mock.patch("harness.launcher.Instance.wait_ready"),
        cluster,
    ):
        assert os.environ[TOKEN_ENV] == cluster.instances["a"].spec.env[TOKEN_ENV]
    assert TOKEN_ENV not in os.environ
    loopback = Cluster([InstanceSpec("b", model="m")], tmp_path)
    assert TOKEN_ENV not in loopback.instances["b"].environment()


def test_a_port_taken_at_start_up_restarts_the_cluster_once(tmp_path, monkeypatch):
    from harness import launcher

    c = launcher.Cluster(
        [launcher.InstanceSpec("p", role="kv_producer", model="m")], tmp_path
    )
    calls = []

    def once():
        calls.append(1)
        if len(calls) == 1:
            raise launcher.InstanceStartError(
                "vLLM instance 'p' exited ... DistNetworkError: ... EADDRINUSE, message: "
                "address already in use"
            )
        return c

    monkeypatch.setattr(c, "_start_once", once)
    assert c.start() is c and len(calls) == 2
    # any other start-up failure, or a second port failure, is raised
    calls.clear()
    monkeypatch.setattr(
        c,
        "_start_once",
        lambda: (_ for _ in ()).throw(
            launcher.InstanceStartError("exited with code 1: CUDA error")
        ),
    )
    import pytest

    with pytest.raises(launcher.InstanceStartError, match="CUDA"):
        c.start()


def test_the_restart_after_a_taken_port_picks_new_ports(tmp_path, monkeypatch):
    """The retry used the ports picked before the first attempt, so a bootstrap port
    another process took made the second start fail the same way."""
    import socket

    from harness import launcher

    c = launcher.Cluster(
        [
            launcher.InstanceSpec("p", role="kv_producer", model="m"),
            launcher.InstanceSpec("fixed", role="kv_producer", model="m", port=18123),
        ],
        tmp_path,
    )
    seen, takers = [], []

    def once():
        p = c.instances["p"]
        seen.append(
            (p.port, p.bootstrap_port, c.instances["fixed"].port, c.push_sources)
        )
        if len(seen) == 1:
            # another process takes P's bootstrap port between our check and P's bind
            s = socket.socket()
            s.bind(("127.0.0.1", p.bootstrap_port))
            takers.append(s)
            raise launcher.InstanceStartError(
                f"[Errno 98] error while attempting to bind on address "
                f"('127.0.0.1', {p.bootstrap_port}): address already in use"
            )
        return c

    monkeypatch.setattr(c, "_start_once", once)
    try:
        assert c.start() is c
    finally:
        for s in takers:
            s.close()
    (port1, boot1, fixed1, sources1), (port2, boot2, fixed2, sources2) = seen
    assert boot2 != boot1 and port2 != port1
    assert fixed1 == fixed2 == 18123  # a port the spec names is kept
    assert f":{boot2}" in sources2 and f":{boot1}" not in sources2


def test_a_port_taken_far_above_the_log_tail_is_still_seen(tmp_path):
    """vLLM's API server prints a long traceback of its own after the engine core's
    EADDRINUSE (about 60 lines): the start-up error's tail of the log no longer
    holds it, and the cluster was not retried."""
    import subprocess
    import time

    from harness import launcher

    log = tmp_path / "b.log"
    log.write_text(
        "INFO starting\n"
        "(EngineCore pid=1) torch.distributed.DistNetworkError: The server socket "
        "has failed to listen on any local network address. port: 42649, "
        "code: -98, name: EADDRINUSE, message: address already in use\n"
        + "".join(
            f"(APIServer pid=2)   File 'x.py', line {i}, in f\n" for i in range(60)
        )
        + "(APIServer pid=2) RuntimeError: Engine core initialization failed.\n"
    )
    inst = launcher.Instance(launcher.InstanceSpec("b", model="m"), 1, None, log)
    inst.proc = subprocess.Popen(["true"])
    inst.proc.wait()
    try:
        inst.wait_ready(time.monotonic() + 5)
    except launcher.InstanceStartError as e:
        error = e
    assert "EADDRINUSE" not in str(error)  # the message keeps its short tail
    assert launcher.port_taken(error)
