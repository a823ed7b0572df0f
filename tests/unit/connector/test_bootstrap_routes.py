"""The bootstrap server serves this series' routes and upstream's, not FastAPI's
generated API description (/docs, /redoc, /openapi.json), which would list every
endpoint and its body to anyone who can reach the port; every route of this
series runs the guard first, by construction (routes.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.auth import (
    EndpointGuard,
    read_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    reset_proof,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    HashConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.scheduler_recorder import (
    HashDelta,
    HashEventKind,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.worker_sync import (
    WorkerHashSync,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.routes import (
    Served,
    bootstrap_router,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
    WorkerExtension,
)

GENERATED = ["/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"]


def bootstrap_app(config: ExtConfig | None = None) -> FastAPI:
    """As upstream's MooncakeBootstrapServer builds it, with our routes added."""
    app = FastAPI()

    @app.get("/query")  # upstream's own route
    def query():
        return {"workers": 0}

    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
    )
    WorkerExtension(
        cfg, config or ExtConfig(bootstrap_host="127.0.0.1")
    ).register_routes(app)
    return app


def test_the_generated_api_description_is_not_served():
    client = TestClient(bootstrap_app())
    for path in GENERATED:
        assert client.get(path).status_code == 404, path


def test_upstreams_and_our_routes_are_still_served():
    app = bootstrap_app()
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {
        "/query",
        "/match_blocks",
        "/push_blocks",
        "/push_proof",
        "/push/stats",
        "/push/ranks",
        "/hashsync",
        "/hashsync/feed",
        "/hashsync/reset",
        "/layerwise/transfers",
        "/metrics",
    } <= paths
    assert not paths & set(GENERATED)
    assert TestClient(app).get("/query").json() == {"workers": 0}


TOKEN = "tok-5d1e0c2b"


def test_every_route_of_this_series_answers_401_without_credentials():
    app = bootstrap_app(ExtConfig(bootstrap_host="0.0.0.0", bootstrap_token=TOKEN))
    ours = [r for r in app.routes if isinstance(r, APIRoute) and r.path != "/query"]
    assert len(ours) == 10
    client = TestClient(app)
    for route in ours:
        for method in route.methods:
            r = client.request(method, route.path, content=b"{}")
            assert r.status_code == 401, (method, route.path, r.status_code)
    assert client.get("/query").status_code == 200  # upstream's own: as upstream has it


def test_a_route_added_to_the_router_runs_the_guard_without_asking_for_it():
    config = ExtConfig(bootstrap_host="0.0.0.0", bootstrap_token=TOKEN)
    router = bootstrap_router(
        EndpointGuard(config),
        config,
        Served(hashsync=lambda: None, push=lambda: None, layerwise=lambda: None),
    )

    @router.get("/another")
    async def another() -> dict:
        return {"served": True}

    app = FastAPI()
    app.router.routes.extend(router.routes)
    client = TestClient(app)
    assert client.get("/another").status_code == 401
    ok = client.get("/another", headers={"authorization": f"Bearer {read_key(TOKEN)}"})
    assert ok.json() == {"served": True}


def test_a_feature_this_instance_never_runs_is_404_and_one_not_ready_yet_503():
    app = bootstrap_app()  # a producer with prefix caching, nothing registered yet
    client = TestClient(app)
    assert client.get("/hashsync").status_code == 503
    assert client.get("/push/stats").status_code == 503
    assert (
        client.get("/layerwise/transfers").status_code == 404
    )  # MOONCAKE_LAYERWISE unset


def test_a_reset_notice_empties_the_mirror_only_from_its_own_scheduler():
    """POST /hashsync/reset: the instance's scheduler in another process tells the
    mirror of a reset; a notice naming another scheduler, not the next reset, not
    proved by the scheduler's key, or malformed is refused and leaves the mirror
    as it was."""
    sync = WorkerHashSync(block_size=4)
    key = "5e" * 32
    cfg = HashConfig("sha256", b"\x01" * 32, scheduler_id="sched-a", reset_key=key)

    def notice(sid: str, resets: int, proof_key: str = key) -> bytes:
        proof = reset_proof(proof_key, sid, resets)
        return json.dumps(
            {"scheduler_id": sid, "resets": resets, "proof": proof}
        ).encode()

    sync.on_metadata(
        HashDelta(
            events=[(HashEventKind.STORED, b"k" * 36, 3)], hash_config=cfg, resets=0
        )
    )
    sync.after_step()
    config = ExtConfig(bootstrap_host="127.0.0.1")
    app = FastAPI()
    app.router.routes.extend(
        bootstrap_router(
            EndpointGuard(config),
            config,
            Served(hashsync=lambda: sync, push=lambda: None, layerwise=lambda: None),
        ).routes
    )
    client = TestClient(app)
    try:
        for body, status in (
            (notice("sched-b", 1), 409),
            (notice("sched-a", 2), 409),
            (notice("sched-a", 1, "another key"), 403),
            (b'{"scheduler_id": "sched-a", "resets": 1}', 422),
            (b'{"scheduler_id": "sched-a", "resets": "1"}', 422),
            (b'{"scheduler_id": "sched-a", "resets": 0}', 422),
            (b"[]", 422),
        ):
            r = client.post("/hashsync/reset", content=body)
            assert r.status_code == status, (body, r.text)
            assert sync.table.size() == 1
        r = client.post("/hashsync/reset", content=notice("sched-a", 1))
        assert r.json() == {"resets": 1, "size": 0}
        assert sync.table.size() == 0
        # a delta drained before that reset (a step in flight) brings nothing back
        sync.on_metadata(
            HashDelta(events=[(HashEventKind.STORED, b"k" * 36, 3)], resets=0)
        )
        sync.after_step()
        assert sync.table.size() == 0
    finally:
        sync.close()
