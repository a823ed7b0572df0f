"""Fixtures the integration modules share: their vLLM clusters, and push sources
served from this process.

A module either starts its instances once (module scope) through ``pd_cluster``:
one call names what the module needs (roles, environment, hosts, model,
arguments), and the factory owns the cluster's life (log folder, start-up,
teardown, and for hosts of their own, that no namespace or link is left behind);
or it takes one of SHARED_CLUSTERS through ``shared_cluster``, a cluster that the
modules named with it run on one after another (harness/cluster_pool.py), and
reads from it what its tests depend on (each such module asserts those values).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from harness.cluster_pool import ClusterPool, run_order
from harness.launcher import BLOCK, Cluster, InstanceSpec, free_port
from harness.model import TEST_SHAPE, ensure_model
from harness.routers import kv_events_args

PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
CD_ROLES = {"c": "kv_producer", "d": "kv_consumer"}
DEFAULT_SPEC = dict(kv_cache_gib=2, max_model_len=4096)
COMMON_ARGS = ["--enable-prompt-tokens-details"]  # D's cached tokens in every answer
PUSH_TOKEN = "s3cret-token-for-tests"
SPEC_FIELDS = {f.name for f in fields(InstanceSpec)}

# vLLM's CPU backend compiles two sampler helpers with torch.compile (Inductor) at
# start-up (patch 0012's warm-up): ~22 s of each instance's ~50 s start on this
# machine. The instances of these tests run them eagerly (the same arithmetic),
# unless a cluster asks for compile (torch_compile=True): test_cold_start's, which
# checks that warm-up, and the README recipe's, which runs as a user does.
EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}

ClusterFactory = Callable[..., Cluster]
# (request handler, path, body) -> a JSON answer, or None once it answered itself
Answer = Callable[[BaseHTTPRequestHandler, str, bytes], dict | None]


def instance_specs(
    roles: Mapping[str, str | None],
    *,
    model: str,
    env: Mapping[str, str],
    extra_args: Sequence[str],
    instances: Mapping[str, Mapping[str, Any]],
    spec: Mapping[str, Any],
) -> list[InstanceSpec]:
    """One InstanceSpec per role, in order: the first on core 0, the others on core 1
    (the machine has two). ``instances[name]`` overrides fields of one instance; its
    ``env`` and ``extra_args`` add to the common ones, ``tp=N`` runs N tensor-parallel
    ranks, one core each."""
    unknown = set(instances) - set(roles)
    if unknown:
        raise ValueError(
            f"instances {sorted(unknown)} have no role (roles: {list(roles)})"
        )
    specs = []
    for i, (name, role) in enumerate(roles.items()):
        over = dict(instances.get(name, {}))
        tp = over.pop("tp", 1)
        args = [*COMMON_ARGS, *extra_args, *over.pop("extra_args", [])]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        cores = "|".join(map(str, range(tp))) if tp > 1 else "0" if i == 0 else "1"
        values = {**DEFAULT_SPEC, "cores": cores, **spec, **over}
        if bad := set(values) - SPEC_FIELDS:
            raise TypeError(f"not InstanceSpec fields: {sorted(bad)}")
        values["env"] = {**env, **values.get("env", {})}
        specs.append(
            InstanceSpec(name, role=role, model=model, extra_args=args, **values)
        )
    return specs


def make_cluster(
    log_dir,
    roles: Mapping[str, str | None] = PD_ROLES,
    *,
    env: Mapping[str, str] | None = None,
    hosts: bool | None = None,
    model: str | None = None,
    extra_args: Sequence[str] = (),
    token: str | None = None,
    instances: Mapping[str, Mapping[str, Any]] | None = None,
    specs: list[InstanceSpec] | None = None,
    torch_compile: bool = False,
    **spec: Any,
) -> Cluster:
    """A cluster (not started) as pd_cluster describes it, logging to ``log_dir``."""
    if specs is None:
        specs = instance_specs(
            roles,
            model=model or str(ensure_model(TEST_SHAPE)),
            env=env or {},
            extra_args=extra_args,
            instances=instances or {},
            spec=spec,
        )
    if not torch_compile:
        specs = eager(specs)
    return Cluster(specs, log_dir, hosts=hosts, token=token)


def eager(specs: Sequence[InstanceSpec]) -> list[InstanceSpec]:
    """``specs`` running vLLM's torch.compile'd code eagerly (EAGER_ENV), where
    their own environment does not say otherwise."""
    return [replace(s, env={**EAGER_ENV, **s.env}) for s in specs]


def assert_torn_down(clusters: Sequence[Cluster]) -> None:
    left = [
        x for c in clusters if c.topology is not None for x in c.topology.leftovers()
    ]
    assert left == [], f"the topology was not torn down: {left}"


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory) -> Iterator[ClusterFactory]:
    """Starts a cluster of real vLLM instances for the module and returns it started;
    every cluster it started is stopped at the module's end.

    ``pd_cluster(roles=PD_ROLES, *, env={}, hosts=None, model=None, extra_args=(),
    token=None, instances={}, specs=None, **spec)``:

    - ``roles``: instance name -> role, in order (the first on core 0, the rest on 1);
    - ``env``, ``extra_args``: for every instance (arguments after COMMON_ARGS);
    - ``instances``: per instance, the InstanceSpec fields that differ (``env`` and
      ``extra_args`` add to the common ones; ``tp=N``: N tensor-parallel ranks);
    - ``spec``: InstanceSpec fields of every instance (else DEFAULT_SPEC);
    - ``model``: a model directory (default: the project's generated model);
    - ``hosts``, ``token``: Cluster's (a host of its own per instance; the
      cluster's bootstrap token, in this process's environment while it runs);
    - ``specs``: instances built elsewhere (a benchmark's own);
    - ``torch_compile``: vLLM's torch.compile'd code compiled at start-up as a user's
      instance does (else run eagerly: EAGER_ENV).
    """
    started: list[Cluster] = []

    def start(*args: Any, **kwargs: Any) -> Cluster:
        cluster = make_cluster(tmp_path_factory.mktemp("logs"), *args, **kwargs)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in reversed(started):
        cluster.stop()
    assert_torn_down(started)


def send_json(handler: BaseHTTPRequestHandler, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class SourceServer:
    """An HTTP server on loopback in this process that a test makes a push source
    (on D's allowlist): every POST is answered by ``answer(handler, path, body)``
    (the attribute; with none, 404)."""

    def __init__(self, answer: Answer | None) -> None:
        self.answer = answer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if server.answer is None:
                    self.send_error(404, "no test answers here now")
                    return
                body = server.answer(self, self.path, raw)
                if body is not None:
                    send_json(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def push_source_cluster(
    pd_cluster: ClusterFactory,
) -> Iterator[Callable[..., tuple[Cluster, SourceServer]]]:
    """C (kv_producer, a push source) and D (kv_consumer) sharing a bootstrap token
    (``token``, PUSH_TOKEN by default), D also taking pushes from a source served by
    this process (``answer``, see SourceServer): returns (the cluster, the source).
    ``roles`` adds instances; ``instances``, ``env`` and the rest go to pd_cluster."""
    sources: list[SourceServer] = []

    def start(
        answer: Answer,
        *,
        token: str = PUSH_TOKEN,
        roles: Mapping[str, str | None] | None = None,
        instances: Mapping[str, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[Cluster, SourceServer]:
        source = SourceServer(answer)
        sources.append(source)
        per = {name: dict(over) for name, over in (instances or {}).items()}
        per.setdefault("d", {})["extra_push_sources"] = [source.url]
        cluster = pd_cluster(
            {**CD_ROLES, **(roles or {})}, token=token, instances=per, **kwargs
        )
        return cluster, source

    yield start
    for source in sources:
        source.close()


# Clusters that consecutive modules share (harness/cluster_pool.py): their
# configurations, and their modules in the order they run.

UNREACHABLE_SOURCE = "http://127.0.0.1:9"  # on D's allowlist, nothing listens there
PUSH_FAIL_WRITE_PROMPT_LEN = 5 * BLOCK + 11  # C fails every push of a prompt this long
PD_MAX_BATCHED = 512  # C's prefill chunk: below test_pd_baseline's 600-token prompt


@dataclass(frozen=True)
class SharedCluster:
    modules: tuple[str, ...]  # file names, in the order they run
    config: Callable[[SourceServer], dict[str, Any]]  # make_cluster's arguments


LAYERWISE_FROM_256 = {"MOONCAKE_LAYERWISE": "1", "MOONCAKE_LAYERWISE_MIN_TOKENS": "256"}
SHARED_CLUSTERS: dict[str, SharedCluster] = {
    # C and D share a token; C fails the push of one prompt length (and serves
    # POST /reset_prefix_cache) and prefills in chunks of PD_MAX_BATCHED tokens;
    # D takes pushes from C, from an address where nothing listens, and from the
    # source this process serves (shared_source); x64, of another block size, never
    # matches; d_faulty, a second decode instance, zeroes the first block it
    # receives (test_pd_baseline: the check going red). test_posthoc_write_failure
    # kills D: it runs last but test_teardown, which stops the cluster.
    "push": SharedCluster(
        (
            "test_pd_baseline.py",
            "test_push.py",
            "test_push_partial_writer.py",
            "test_push_exposed.py",
            "test_push_auto.py",
            "test_posthoc_write_failure.py",
            "test_teardown.py",
        ),
        lambda source: dict(
            roles={**CD_ROLES, "x64": "kv_both", "d_faulty": "kv_consumer"},
            token=PUSH_TOKEN,
            env={
                "MOONCAKE_PUSH_MATCH_TIMEOUT_S": "5",
                "MOONCAKE_PUSH_MAX_CONCURRENT": "4",
            },
            instances={
                "c": {
                    "env": {
                        "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": str(
                            PUSH_FAIL_WRITE_PROMPT_LEN
                        ),
                        # POST /reset_prefix_cache (vLLM 0.32.0 serves it only so)
                        "VLLM_SERVER_DEV_MODE": "1",
                    },
                    "max_num_batched_tokens": PD_MAX_BATCHED,
                },
                "d": {
                    "extra_push_sources": [UNREACHABLE_SOURCE, source.url],
                    "env": {
                        # the hostile fake's pushes land nothing by design: D must
                        # keep asking it to check each of its answers
                        "MOONCAKE_FAULT_KEEP_ASKING_SOURCE": source.url,
                        # these tests push prompts of 2-5 blocks to check what a
                        # push does, not whether it pays: on a 2-core Xeon with
                        # AMX, after the earlier modules' pushes, D's gate judged 2
                        # blocks at 80.7 ms against 72.2 ms of local prefill and
                        # kept them local (the gate's choice is unit-tested)
                        "MOONCAKE_PUSH_POLICY": "always",
                    },
                },
                "x64": {"block_size": 64},
                "d_faulty": {"env": {"MOONCAKE_FAULT_ZERO_RECV_BLOCK": "0"}},
            },
        ),
    ),
    # two kv_both instances, every request push_from "auto" (MOONCAKE_PUSH_AUTO):
    # each follows the other's feed and finds itself among its push sources, and
    # sends vLLM's KV events to a loopback port (kv_events_args);
    # test_push_auto_router puts vllm-router in front of them
    "push_auto": SharedCluster(
        ("test_push_auto_router.py",),
        lambda _: dict(
            roles={"a": "kv_both", "b": "kv_both"},
            token=PUSH_TOKEN,
            env={"MOONCAKE_PUSH_AUTO": "1"},
            instances={
                "a": {"extra_args": kv_events_args(free_port())},
                "b": {"extra_args": kv_events_args(free_port())},
            },
        ),
    ),
    # layer-wise P -> D in chunks of 256 tokens; P fails the writes of one prompt
    # length (777 tokens); test_routers puts dispatchers in front of it
    "layerwise": SharedCluster(
        ("test_layerwise.py", "test_layerwise_unknown_ids.py", "test_routers.py"),
        lambda _: dict(
            max_num_batched_tokens=256,
            env={
                **LAYERWISE_FROM_256,
                "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN": "777",
                "MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S": "8",
                "MOONCAKE_LAYERWISE_TIMEOUT_S": "20",
            },
        ),
    ),
    # layer-wise P -> D, prompts of up to 2048 tokens in one forward pass, D's
    # transfer threads on D's core. test_cold_start needs the first request after
    # the start: it runs first.
    "layerwise_io_on_decode_core": SharedCluster(
        ("test_cold_start.py", "test_io_cpus.py"),
        lambda _: dict(
            torch_compile=True,  # test_cold_start checks the start-up's warm-up
            max_num_batched_tokens=2048,
            env={**LAYERWISE_FROM_256, "MOONCAKE_IO_CPUS": "1"},
        ),
    ),
}
_HERE = Path(__file__).parent


def shared_name(item: pytest.Item) -> str | None:
    if item.path.parent != _HERE:
        return None
    for name, shared in SHARED_CLUSTERS.items():
        if item.path.name in shared.modules:
            return name
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of a shared cluster run together (cluster_pool.run_order)."""
    here = [item.path.name if item.path.parent == _HERE else "" for item in items]
    order = run_order(here, {n: s.modules for n, s in SHARED_CLUSTERS.items()})
    items[:] = [items[i] for i in order]


_POOL: list[ClusterPool] = []  # the session's pool, for the hand-over hook


@pytest.fixture(scope="session")
def shared_source() -> Iterator[SourceServer]:
    """The push source this process serves to the "push" cluster's D (its answer
    is set by shared_cluster for one module at a time)."""
    source = SourceServer(None)
    yield source
    source.close()


@pytest.fixture(scope="session")
def cluster_pool(tmp_path_factory, shared_source) -> Iterator[ClusterPool]:
    def make(name: str) -> Cluster:
        config = SHARED_CLUSTERS[name].config(shared_source)
        return make_cluster(tmp_path_factory.mktemp(f"logs-{name}"), **config)

    pool = ClusterPool(make)
    _POOL.append(pool)
    yield pool
    _POOL.remove(pool)
    pool.release()
    assert_torn_down(pool.started)


@pytest.fixture(scope="module")
def shared_cluster(
    cluster_pool: ClusterPool, shared_source: SourceServer
) -> Iterator[Callable[..., Cluster]]:
    """``shared_cluster(name, answer=None, fresh=False)``: the live cluster
    SHARED_CLUSTERS[name], fit for this module (ClusterPool.get); ``answer``
    answers what D posts to shared_source during this module; ``fresh``: a
    cluster started for this module."""

    def get(name: str, *, answer: Answer | None = None, fresh: bool = False) -> Cluster:
        cluster = cluster_pool.get(name, fresh=fresh)
        shared_source.answer = answer
        return cluster

    yield get
    shared_source.answer = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """A shared cluster stops once the next test is of none of its modules."""
    yield
    for pool in _POOL:
        if pool.name is not None and (
            nextitem is None or shared_name(nextitem) != pool.name
        ):
            pool.release()
