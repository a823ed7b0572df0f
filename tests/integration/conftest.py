"""Fixtures the integration modules share: their vLLM clusters, and push sources
served from this process.

Every module starts its instances once (module scope) through ``pd_cluster``: one
call names what the module needs (roles, environment, hosts, model, arguments), and
the factory owns the cluster's life (log folder, start-up, teardown, and for hosts
of their own, that no namespace or link is left behind).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from harness.launcher import Cluster, InstanceSpec
from harness.model import ModelShape, ensure_model

PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
CD_ROLES = {"c": "kv_producer", "d": "kv_consumer"}
DEFAULT_SPEC = dict(kv_cache_gib=2, max_model_len=4096)
COMMON_ARGS = ["--enable-prompt-tokens-details"]  # D's cached tokens in every answer
PUSH_TOKEN = "s3cret-token-for-tests"
SPEC_FIELDS = {f.name for f in fields(InstanceSpec)}

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
    - ``specs``: instances built elsewhere (a benchmark's own), started as they are.
    """
    started: list[Cluster] = []

    def start(
        roles: Mapping[str, str | None] = PD_ROLES,
        *,
        env: Mapping[str, str] | None = None,
        hosts: bool | None = None,
        model: str | None = None,
        extra_args: Sequence[str] = (),
        token: str | None = None,
        instances: Mapping[str, Mapping[str, Any]] | None = None,
        specs: list[InstanceSpec] | None = None,
        **spec: Any,
    ) -> Cluster:
        if specs is None:
            specs = instance_specs(
                roles,
                model=model or str(ensure_model(ModelShape())),
                env=env or {},
                extra_args=extra_args,
                instances=instances or {},
                spec=spec,
            )
        cluster = Cluster(
            specs, tmp_path_factory.mktemp("logs"), hosts=hosts, token=token
        )
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in reversed(started):
        cluster.stop()
    left = [
        x for c in started if c.topology is not None for x in c.topology.leftovers()
    ]
    assert left == [], f"the topology was not torn down: {left}"


def send_json(handler: BaseHTTPRequestHandler, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class SourceServer:
    """An HTTP server on loopback in this process that a test makes a push source
    (on D's allowlist): every POST is answered by ``answer(handler, path, body)``."""

    def __init__(self, answer: Answer) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                body = answer(self, self.path, raw)
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
