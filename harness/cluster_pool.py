"""Clusters that consecutive test modules share.

A cluster start costs 45-110 s on a 2-core machine, most of CI's time. Modules
whose tests need the same configuration run one after another on one cluster:
``run_order`` puts the modules of each shared cluster together, in their stated
order, and ``ClusterPool`` keeps the one live shared cluster. At each hand-over to
the next module the cluster must be fit: every instance alive and healthy, and
no KV block held on any of them (each module must leave the KV at baseline
anyway); otherwise it is started anew, saying why. Log checks read
``Instance.log_text()``, which starts at the hand-over.

The configurations themselves are the integration tests' (tests/integration/
conftest.py, SHARED_CLUSTERS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from harness.kv_usage import wait_no_blocks_in_use
from harness.launcher import Cluster

HANDOVER_KV_TIMEOUT_S = 30.0


def run_order(modules: Sequence[str], shared: Mapping[str, Sequence[str]]) -> list[int]:
    """Indices of ``modules`` (one entry per test, its module's file name) in the
    order to run them: the modules of each shared cluster (``shared``: name ->
    its modules in their order) together, in that order, where the first of them
    was collected; every other test keeps its place, tests of a module theirs."""
    group = {m: (name, i) for name, ms in shared.items() for i, m in enumerate(ms)}
    first: dict[str, int] = {}
    keys = []
    for n, module in enumerate(modules):
        if module in group:
            name, order = group[module]
            keys.append((first.setdefault(name, n), order, n))
        else:
            keys.append((n, 0, n))
    return sorted(range(len(modules)), key=keys.__getitem__)


def unfit(cluster: Cluster) -> str | None:
    """Why the cluster cannot pass to the next module, or None."""
    for inst in cluster.instances.values():
        if inst.proc is None or inst.proc.poll() is not None:
            return f"instance {inst.spec.name} is not running"
        if not inst.healthy():
            return f"instance {inst.spec.name} is not healthy"
    urls = [inst.url for inst in cluster.instances.values()]
    usage = wait_no_blocks_in_use(*urls, timeout=HANDOVER_KV_TIMEOUT_S)
    if any(usage):
        names = list(cluster.instances)
        return (
            f"KV blocks still in use after the last module: {dict(zip(names, usage))}"
        )
    return None


class ClusterPool:
    """Owns the one live shared cluster. ``make(name)`` builds the cluster ``name``
    (not started); ``check`` says why a live one cannot be handed over (``unfit``)."""

    def __init__(
        self,
        make: Callable[[str], Cluster],
        check: Callable[[Cluster], str | None] = unfit,
    ) -> None:
        self.make = make
        self.check = check
        self.name: str | None = None
        self.cluster: Cluster | None = None
        self.started: list[Cluster] = []

    def get(self, name: str, *, fresh: bool = False) -> Cluster:
        """The live cluster ``name``, fit for its next module; started if there is
        none, if another one runs, if it is unfit, or if ``fresh``."""
        if self.cluster is not None and self.name == name:
            why = "a fresh start is asked for" if fresh else self.check(self.cluster)
            if why is None:
                for inst in self.cluster.instances.values():
                    inst.mark_log()
                return self.cluster
            print(f"[cluster pool] {name}: {why}; starting it again", flush=True)
        self.release()
        cluster = self.make(name)
        self.started.append(cluster)
        self.cluster, self.name = cluster.start(), name
        return cluster

    def live(self, name: str) -> Cluster | None:
        """The live cluster ``name`` as the modules before left it, without the
        hand-over check (for a test that checks the state they left); None if
        another one runs or none."""
        return self.cluster if self.name == name else None

    def release(self) -> None:
        """Stop the live cluster, if any."""
        if self.cluster is not None:
            self.cluster.stop()
        self.cluster = self.name = None
