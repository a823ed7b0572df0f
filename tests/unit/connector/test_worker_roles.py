"""What each side runs is decided once, from kv_role and the configuration; the
idle-step pacing sits where the scheduler asks to keep stepping."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.connector import (
    ExtMooncakeConnector,
    ExtMooncakeConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_pulls import (
    PullOutcomes,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.layerwise.decode_timeline import (
    DecodePullTimeline,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.metadata import (
    ExtMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    SchedulerExtension,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
    LayerwiseDecodeStep,
    WorkerExtension,
    WorkerFeature,
    WorkerRoles,
)


def vllm_config(role: str, prefix_caching: bool = True, block_size: int = 16):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role),
        cache_config=SimpleNamespace(
            enable_prefix_caching=prefix_caching,
            block_size=block_size,
            prefix_caching_hash_algo="sha256",
        ),
        model_config=None,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
    )


LAYERWISE = ExtConfig(layerwise=True)


@pytest.mark.parametrize(
    "role, config, prefix_caching, expected",
    [
        ("kv_producer", LAYERWISE, True, (True, False, True)),
        ("kv_consumer", LAYERWISE, True, (False, True, False)),
        ("kv_both", LAYERWISE, True, (True, True, True)),
        ("kv_producer", ExtConfig(), True, (False, False, True)),
        ("kv_producer", LAYERWISE, False, (True, False, False)),
    ],
)
def test_roles_follow_kv_role_and_the_configuration(
    role, config, prefix_caching, expected
):
    roles = WorkerRoles.of(vllm_config(role, prefix_caching), config)
    assert (
        roles.layerwise_prefill,
        roles.layerwise_decode,
        roles.push_source,
    ) == expected
    assert roles.push_destination  # any instance may be pushed into


class Recording(WorkerFeature):
    def __init__(
        self,
        name: str,
        log: list,
        sends: set[str] = frozenset(),
        recvs: set[str] = frozenset(),
    ):
        self.name, self.log, self.sends, self.recvs = name, log, set(sends), set(recvs)

    def before_forward(self, meta):
        self.log.append((self.name, "before"))

    def start_load_kv(self, meta):
        self.log.append((self.name, "start"))

    def save_kv_layer(self, layer_name, kv_layer):
        self.log.append((self.name, layer_name))

    def finished(self, sending, recving):
        sending |= self.sends
        recving |= self.recvs

    def shutdown(self):
        self.log.append((self.name, "shutdown"))


def test_each_step_reaches_every_feature_this_worker_runs_and_no_other():
    w = WorkerExtension(vllm_config("kv_consumer"), ExtConfig())
    assert w.features == []  # a decode without layer-wise: nothing until registration
    log: list = []
    w.features = [Recording("a", log, sends={"p1"}), Recording("b", log, recvs={"d1"})]
    w.before_forward(ExtMetadata())
    w.save_kv_layer("layer.0", None)
    w.start_load_kv(ExtMetadata())  # after the forward from vLLM 0.32.0
    assert w.get_finished(None, {"d0"}) == ({"p1"}, {"d0", "d1"})
    w.shutdown()
    assert log == [
        ("a", "before"),
        ("b", "before"),
        ("a", "layer.0"),
        ("b", "layer.0"),
        ("a", "start"),
        ("b", "start"),
        ("a", "shutdown"),
        ("b", "shutdown"),
    ]


def test_nothing_finished_is_reported_as_none_as_upstream_does():
    w = WorkerExtension(vllm_config("kv_consumer"), ExtConfig())
    w.features = [Recording("a", [])]
    assert w.get_finished(None, None) == (None, None)


def test_a_layerwise_decode_reports_its_pulls_from_the_start():
    w = WorkerExtension(vllm_config("kv_consumer"), LAYERWISE)
    assert w.pulls is not None and len(w.features) == 1


def scheduler_extension(interval_s: float) -> SchedulerExtension:
    ext = SchedulerExtension.__new__(SchedulerExtension)
    ext.config = ExtConfig(idle_step_interval_s=interval_s)
    ext.layerwise, ext.hashsync, ext.backlog = None, None, None
    ext.pull_timeline = DecodePullTimeline()
    ext.push = SimpleNamespace(
        take_jobs=lambda: [], decisions_changed=lambda: None, prefill_timer=None
    )
    return ext


def test_an_empty_step_is_not_slowed_down_by_the_metadata():
    """D waiting for a pull steps with nothing scheduled: no sleep there."""
    ext = scheduler_extension(0.2)
    started = time.monotonic()
    ext.build_metadata(
        SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    )
    assert time.monotonic() - started < 0.1


def test_keeping_an_idle_engine_stepping_is_paced():
    """The scheduler asks the facade only when finished requests hold blocks and
    nothing else is left: the answer comes at most once per idle_step_interval_s."""
    facade = ExtMooncakeConnector.__new__(ExtMooncakeConnector)
    facade.connector_scheduler = ExtMooncakeConnectorScheduler.__new__(
        ExtMooncakeConnectorScheduler
    )
    facade.connector_scheduler.ext = scheduler_extension(0.05)
    started = time.monotonic()
    assert facade.keeps_engine_stepping_while_blocks_held() is True
    assert time.monotonic() - started >= 0.05


def finished_recving(step: LayerwiseDecodeStep, upstream: set[str]) -> set[str]:
    recving = set(upstream)
    step.finished(set(), recving)
    return recving


def test_a_failed_pull_upstream_also_reports_reaches_the_scheduler_once():
    """vLLM 0.32.0's receiver reports a pull it saw fail in finished_recving too;
    a second report, a step after the scheduler failed and freed the request,
    trips its `assert req_id in self.requests` (seen: D's engine died in the
    link-down fault tests)."""
    pulls = PullOutcomes()
    step = LayerwiseDecodeStep(pulls)
    pulls.failed("d-1", [3], "no complete answer")  # this tracker first
    assert finished_recving(step, set()) == {"d-1"}
    assert finished_recving(step, {"d-1"}) == set()  # upstream's, a step later
    assert finished_recving(step, {"d-2"}) == {"d-2"}  # upstream first
    pulls.failed("d-2", [4], "no complete answer")
    assert finished_recving(step, set()) == set()
    pulls.failed("d-3", [5], "P refused")  # both in one step
    assert finished_recving(step, {"d-3"}) == {"d-3"}
    assert pulls.completed("d-4", [6])  # a pull that completed: upstream reports it
    assert finished_recving(step, {"d-4"}) == {"d-4"}
    assert pulls.take_invalid_block_ids() == {3, 4, 5}


def test_a_pull_without_blocks_is_never_reported_whatever_arrives_first():
    """A pull with no local blocks only frees P's blocks for a request that ended
    before it was scheduled (vLLM's abort of a rejected request); the scheduler does
    not know it. It was told apart by the scheduler's metadata, which reached the
    worker after the pull had started: when P answered at once (an error), D
    reported it and its engine died on `assert req_id in self.requests` (seen on
    vLLM 0.32.0 in the layer-wise abort test)."""
    pulls = PullOutcomes()
    step = LayerwiseDecodeStep(pulls)
    pulls.failed(
        "cleanup-1", [], "a second request for a transfer that is being served"
    )
    assert finished_recving(step, set()) == set()
    assert not pulls.completed("cleanup-2", [])
    assert finished_recving(step, set()) == set()
    assert pulls.completed("d-1", [7])  # a pull into blocks is reported
    assert pulls.take_invalid_block_ids() == set()
