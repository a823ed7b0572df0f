# SPDX-License-Identifier: Apache-2.0
"""Every route this series adds to the bootstrap server, behind one guard.

Served by the first worker's bootstrap server next to upstream's ``/register`` and
``/query`` (left as they are): the push source's (C) ``/match_blocks``,
``/push_blocks``, ``/push_proof``, ``/push/stats``, ``/push/ranks`` (TP > 1: each
rank's listener, source_ranks.py); the hash mirror's ``/hashsync``,
``/hashsync/feed``, ``/hashsync/reset``; P's ``/layerwise/transfers``; ``/metrics``.
Authentication is the router's dependency (:func:`bootstrap_router`): no route is
served without it, and a POST's signature is checked before its body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .common.auth import BODY_READ_DEADLINE_S, EndpointGuard, signed_target
from .common.config import ExtConfig
from .hashsync.feed_protocol import (
    FEED_PATH,
    RESET_PATH,
    FeedPage,
    FeedRequest,
    ResetNotice,
)
from .hashsync.worker_sync import WorkerHashSync
from .layerwise.prefill_sender import LayerwiseSender
from .metrics import CONTENT_TYPE, exposition
from .push.protocol import SOURCE_REFUSAL, RankRegistered, RankRegistration
from .push.source_ranks import RANKS_PATH
from .push.source_server import NO_PREFIX_CACHING, PROOF_MAX_BODY_BYTES, PushServer

NOT_READY = "KV caches not registered yet; retry"
MAX_SAMPLE = 256  # GET /hashsync?sample=N
FEED_CHECK_S = 0.02  # how often a waiting feed request looks while a step is sealed
NO_MIRROR = (
    "no block-hash mirror on this instance (a decode-only instance, or prefix "
    "caching is off)"
)


@dataclass(frozen=True)
class Served:
    """What the routes read: each getter returns None while its feature is not
    built yet (or, where ``*_here`` is False, never on this instance)."""

    hashsync: Callable[[], WorkerHashSync | None]
    push: Callable[[], PushServer | None]
    layerwise: Callable[[], LayerwiseSender | None]
    hashsync_here: bool = True  # the block-hash mirror runs on this instance
    push_here: bool = True  # this instance serves pushes (prefix caching on)
    layerwise_here: bool = (
        True  # this instance sends layer-wise (P, MOONCAKE_LAYERWISE)
    )
    # the worker's write function, every path (engine_write.TerminalWriter)
    writes: Callable[[], Any] = lambda: None
    # D: its push decisions by reason (decode_cost.Decision; None: not a destination)
    push_decisions: Callable[[], dict[str, int] | None] = lambda: None


@dataclass(frozen=True)
class Caller:
    """An authenticated request: when it arrived (monotonic s), its body (POST)
    and its signed timestamp (None when the endpoints are open)."""

    received: float
    body: bytes = b""
    signed_ms: int | None = None


async def read_capped(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it exceeds ``limit`` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def refusal(status: int, detail: Any) -> HTTPException:
    """An answer of this server's before anything of the request was acted on,
    marked so (protocol.SOURCE_REFUSAL): D ends a push at once only on those."""
    return HTTPException(status_code=status, detail=detail, headers=SOURCE_REFUSAL)


def _refuse(denied: tuple[int, Any] | None) -> None:
    if denied is not None:
        raise refusal(*denied)


def authenticator(
    guard: EndpointGuard, config: ExtConfig, clock: Callable[[], float] = time.monotonic
) -> Callable[[Request], Any]:
    """The dependency every route of :func:`bootstrap_router` runs first."""
    body_caps = {"/push_proof": PROOF_MAX_BODY_BYTES}

    async def authenticate(request: Request) -> Caller:
        received = clock()  # a push's budget runs from here
        authorization = request.headers.get("authorization")
        if request.method in ("GET", "HEAD"):
            _refuse(guard.check(authorization))
            return Caller(received)
        # signed: the header (its signature over the body's hash, its timestamp) is
        # checked before a byte of the body is read; then the body, capped and
        # within a total deadline, must hash to the signed value
        target = signed_target(request.scope)
        _refuse(guard.verify_header(request.method, target, authorization).denied)
        cap = body_caps.get(request.url.path, config.push_max_body_bytes)
        try:
            body = await asyncio.wait_for(
                read_capped(request, cap), BODY_READ_DEADLINE_S
            )
        except TimeoutError:
            _refuse(
                (
                    408,
                    {
                        "field": "body",
                        "message": f"not received whole within {BODY_READ_DEADLINE_S:g} s",
                    },
                )
            )
        if body is None:
            _refuse((413, {"field": "body", "message": f"larger than {cap} bytes"}))
        assert body is not None
        verified = guard.verify(request.method, target, authorization, body)
        _refuse(verified.denied)
        return Caller(received, body, verified.signed_ms)

    return authenticate


def bootstrap_router(
    guard: EndpointGuard,
    config: ExtConfig,
    served: Served,
    clock: Callable[[], float] = time.monotonic,
) -> APIRouter:
    """This series' routes, every one behind ``guard``."""
    authenticate = authenticator(guard, config, clock)
    # a router-level dependency runs for every route added below; handlers that
    # need what it found name the same callable (FastAPI runs it once per request)
    router = APIRouter(dependencies=[Depends(authenticate)])

    def mirror() -> WorkerHashSync:
        sync = served.hashsync()
        if sync is None:
            if not served.hashsync_here:
                raise refusal(404, NO_MIRROR)
            raise refusal(503, NOT_READY)
        return sync

    def push_server() -> PushServer:
        server = served.push()
        if server is None:
            raise refusal(503, NOT_READY if served.push_here else NO_PREFIX_CACHING)
        return server

    async def run(
        server: PushServer, job: Callable[[], tuple[int, dict[str, Any]]], limited: bool
    ) -> JSONResponse:
        token = server.try_begin() if limited else None
        if limited and token is None:
            raise refusal(
                429,
                f"{server.config.push_max_concurrent} pushes in progress; retry later",
            )
        try:
            # hashing and the write block (the engine releases the GIL): off the event loop
            code, out = await asyncio.to_thread(job)
        finally:
            if token is not None:
                server.end(token)
        # PushServer answers other than 200 only before it writes anything
        return JSONResponse(
            out, status_code=code, headers=None if code == 200 else SOURCE_REFUSAL
        )

    @router.post("/match_blocks")
    async def match_blocks(caller: Caller = Depends(authenticate)) -> JSONResponse:
        server = push_server()
        return await run(server, lambda: server.match(caller.body), limited=False)

    @router.post("/push_blocks")
    async def push_blocks(caller: Caller = Depends(authenticate)) -> JSONResponse:
        server = push_server()
        return await run(
            server,
            lambda: server.push(caller.body, caller.received, caller.signed_ms),
            limited=True,
        )

    @router.post("/push_proof")
    async def push_proof(caller: Caller = Depends(authenticate)) -> JSONResponse:
        server = push_server()
        return await run(
            server, lambda: server.proof(caller.body, caller.received), limited=False
        )

    @router.post(RANKS_PATH)
    async def push_ranks(
        request: Request, caller: Caller = Depends(authenticate)
    ) -> JSONResponse:
        server = push_server()
        ranks = server.ranks  # rank 0 of a TP > 1 source only (source_ranks.py)
        if ranks is None:
            raise refusal(404, "this instance serves pushes from one TP rank")
        client = request.client.host if request.client else None
        if not server.on_this_host(client):  # an instance's ranks share one host
            raise refusal(403, f"{client}: not this host, so not a rank of it")
        try:
            reg = RankRegistration.model_validate_json(caller.body)
        except ValueError as e:
            raise refusal(422, f"not a rank registration: {str(e)[:300]}") from None
        try:
            engine_ports = ranks.register(reg)
        except ValueError as e:
            raise refusal(409, f"not registered: {e}") from None
        answer = RankRegistered(source_id=server.source_id, engine_ports=engine_ports)
        return JSONResponse(answer.model_dump())

    @router.get("/push/stats")
    async def push_stats() -> dict[str, Any]:
        server = push_server()
        return {
            **server.stats,
            "overdue_now": server.num_overdue(),
            "bytes_by_destination": server.bytes_to.snapshot(),
            **server.write_stats(),
        }

    @router.get("/hashsync")
    async def hashsync(sample: str = "8") -> dict[str, Any]:
        if not sample.isdigit() or len(sample) > 6:
            raise HTTPException(
                status_code=422, detail=f"sample: a whole number 0..{MAX_SAMPLE}"
            )
        return mirror().debug(min(int(sample), MAX_SAMPLE))

    @router.post(FEED_PATH)
    async def hashsync_feed(
        request: Request, caller: Caller = Depends(authenticate)
    ) -> JSONResponse:
        sync = mirror()
        try:
            req = FeedRequest.model_validate_json(caller.body)
        except ValueError as e:
            raise refusal(422, f"not a feed request: {str(e)[:300]}") from None
        end = clock() + req.wait_ms / 1000
        loop = asyncio.get_running_loop()
        moved = asyncio.Event()

        def wake() -> None:  # the engine's thread, holding the table's lock
            with contextlib.suppress(RuntimeError):  # the server's loop has closed
                loop.call_soon_threadsafe(moved.set)

        def look() -> tuple[FeedPage | None, bool]:
            return sync.feed(req), sync.table.awaits_device()

        sync.table.watch(wake)
        try:
            while True:
                moved.clear()
                # a snapshot (up to 65,536 keys) is encoded off the event loop
                page, device = await asyncio.to_thread(look)
                if page is None:
                    raise refusal(503, "no engine step has run yet; retry")
                if page.reset or page.events or clock() >= end:
                    return JSONResponse(page.model_dump())
                if await request.is_disconnected():  # the peer gave up: stop looking
                    return JSONResponse(page.model_dump())
                left = max(0.0, end - clock())
                # an idle source wakes no one until its table moves; a step sealed on
                # the device is published once its event completes, which nothing
                # signals, so look again soon while one is
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        moved.wait(), min(FEED_CHECK_S, left) if device else left
                    )
        finally:
            sync.table.unwatch(wake)

    @router.post(RESET_PATH)
    async def hashsync_reset(caller: Caller = Depends(authenticate)) -> JSONResponse:
        sync = mirror()
        try:
            notice = ResetNotice.model_validate_json(caller.body)
        except ValueError as e:
            raise refusal(422, f"not a reset notice: {str(e)[:300]}") from None
        denied = sync.on_reset_notice(notice)
        if denied is not None:
            raise refusal(*denied)
        return JSONResponse({"resets": notice.resets, "size": sync.table.size()})

    @router.get("/layerwise/transfers")
    async def layerwise_transfers() -> dict[str, Any]:
        sender = served.layerwise()
        if sender is None:
            if not served.layerwise_here:
                raise HTTPException(
                    status_code=404, detail="layer-wise push is not enabled here"
                )
            raise HTTPException(status_code=503, detail=NOT_READY)
        return sender.snapshot()

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = exposition(
            served.writes(),
            served.push(),
            served.layerwise(),
            served.push_decisions(),
        )
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    return router


def drop_generated_docs(app: Any) -> None:
    """Remove and turn off FastAPI's generated API description: nothing needs it, and
    it would list every endpoint and body to anyone who can reach the port."""
    urls = ("openapi_url", "docs_url", "redoc_url", "swagger_ui_oauth2_redirect_url")
    generated = {u for u in (getattr(app, a, None) for a in urls) if u}
    app.router.routes[:] = [
        r for r in app.router.routes if getattr(r, "path", None) not in generated
    ]
    for a in urls[:3]:
        setattr(app, a, None)


def add_routes(
    app: Any,
    guard: EndpointGuard,
    config: ExtConfig,
    served: Served,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Add this series' routes to upstream's bootstrap server app (before it starts)."""
    guard.log_at_start()
    drop_generated_docs(app)
    # the routes themselves (each carries the router's guard dependency), not an
    # included router: the app lists every path it serves
    app.router.routes.extend(bootstrap_router(guard, config, served, clock).routes)
