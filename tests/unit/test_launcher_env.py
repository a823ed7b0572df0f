"""The launcher's cluster token for hosts off loopback stays with that cluster.

It used to be left in the test process's environment (os.environ.setdefault):
every later loopback cluster then demanded it, and clients that do not send it
(curl in the README recipe, raw posts) got 401 (seen in CI after test_faults.py)."""

from __future__ import annotations

import os
from unittest import mock

from harness.launcher import Cluster, InstanceSpec

TOKEN_ENV = "MOONCAKE_BOOTSTRAP_TOKEN"


def test_cluster_token_is_in_the_environment_only_while_the_cluster_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cluster = Cluster([InstanceSpec("a", model="m")], tmp_path, hosts=True)
    assert cluster.instances["a"].spec.env[TOKEN_ENV]
    with mock.patch.object(cluster.topology, "create"), \
            mock.patch.object(cluster.topology, "destroy"), \
            mock.patch("harness.launcher.Instance.start"), \
            mock.patch("harness.launcher.Instance.wait_ready"):
        with cluster:
            assert os.environ[TOKEN_ENV] == cluster.instances["a"].spec.env[TOKEN_ENV]
    assert TOKEN_ENV not in os.environ
    loopback = Cluster([InstanceSpec("b", model="m")], tmp_path)
    assert TOKEN_ENV not in loopback.instances["b"].environment()
