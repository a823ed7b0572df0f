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
