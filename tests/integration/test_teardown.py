"""Stopping a cluster leaves no process of its instances behind: each instance's
process group (API server, engine core and, on 0.32.0's CPU backend, a worker)
is gone once Cluster.stop returned.

It stops the shared "push" cluster (conftest.SHARED_CLUSTERS), after its other
modules: as it stands, with D killed by test_posthoc_write_failure when that ran
before (that instance's group must be gone as well).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the process group that are still running (zombies count as gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def test_teardown_leaves_no_processes(cluster_pool, shared_cluster):
    # the live "push" cluster as the modules before left it (no hand-over check:
    # D may have been killed); started when this module runs alone
    cluster = cluster_pool.live("push") or shared_cluster("push")
    running = [i for i in cluster.instances.values() if i.proc is not None]
    assert len(running) >= 3, [i.spec.name for i in running]
    pgids = [inst.proc.pid for inst in running]
    # API server + engine core each
    assert all(len(live_processes_in_group(g)) >= 2 for g in pgids)
    cluster.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        live_processes_in_group(g) for g in pgids
    ):
        time.sleep(0.5)
    left = {g: live_processes_in_group(g) for g in pgids}
    assert not any(left.values()), f"processes left after Cluster.stop: {left}"
