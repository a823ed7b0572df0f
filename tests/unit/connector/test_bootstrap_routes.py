"""The bootstrap server serves this series' routes and upstream's, not FastAPI's
generated API description (/docs, /redoc, /openapi.json), which would list every
endpoint and its body to anyone who can reach the port."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.config import ExtConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.extension import WorkerExtension

GENERATED = ["/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"]


def bootstrap_app() -> FastAPI:
    """As upstream's MooncakeBootstrapServer builds it, with our routes added."""
    app = FastAPI()

    @app.get("/query")  # upstream's own route
    def query():
        return {"workers": 0}

    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
                          cache_config=SimpleNamespace(enable_prefix_caching=True))
    WorkerExtension(cfg, ExtConfig(bootstrap_host="127.0.0.1")).register_routes(app)
    return app


def test_the_generated_api_description_is_not_served():
    client = TestClient(bootstrap_app())
    for path in GENERATED:
        assert client.get(path).status_code == 404, path


def test_upstreams_and_our_routes_are_still_served():
    app = bootstrap_app()
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/query", "/match_blocks", "/push_blocks", "/hashsync"} <= paths
    assert not paths & set(GENERATED)
    assert TestClient(app).get("/query").json() == {"workers": 0}
