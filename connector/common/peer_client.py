# SPDX-License-Identifier: Apache-2.0
"""Calls to a peer's HTTP server, bounded in time, in bytes and per peer: D's calls
to a push source and a scheduler's reset notice to its worker.

- Time: one monotonic deadline per call clamps every connect, write and read
  (httpx's timeouts restart at every read), so a trickling source is cut off too.
- Bytes: an answer above its cap is refused (a declared length before reading).
- Sources: each has its own threads and connections (:class:`SourceLanes`), so a
  slow one delays only its own calls; only allowlisted sources get them, which
  bounds their number (MOONCAKE_PUSH_SOURCES).
- No proxy variables are read. URLs are a source's normalised origin plus a path of
  D's own (:func:`source_origin`): a client cannot aim them at another route.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

from ..common.config import ConfigError, normalize_source


def source_origin(url: str) -> str:
    """A push_from value's normalised ``scheme://host:port``; ValueError (naming what
    is wrong) unless the value is just that origin, optionally with a trailing "/"."""
    if not isinstance(url, str):
        raise ValueError(f"not a string: {type(url).__name__}")
    if not url.isascii() or any(
        c.isspace() or not c.isprintable() or c in "\\?#" for c in url
    ):
        raise ValueError(
            "a query, fragment, backslash, whitespace, control or non-ASCII character"
        )
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" in netloc:
        raise ValueError("not scheme://host:port (userinfo is refused)")
    if slash and path:
        raise ValueError(f"a path ({'/' + path[:60]!r}): only an origin is accepted")
    return normalize_source(url)


# The largest answer D reads from a source (its answers are a few hundred bytes;
# a push answer with its probes a few KiB).
MAX_ANSWER_BYTES = 1 << 20
# below uvicorn's timeout_keep_alive (5 s), which the source's bootstrap server uses;
# a close lost while the link was cut would otherwise fail the first call after it
KEEPALIVE_EXPIRY_S = 2.0
# A call with less than this left (one queued behind a slow source's calls) cannot
# get a whole answer: it is not started, so the source sees no connection and no
# request cut off after its headers.
MIN_CALL_S = 0.05
# A source's lane (its threads and connections) unused this long is closed when
# another call comes: sources come and go (an instance restarted on another
# port), and their lanes would otherwise stay for the process's life.
LANE_IDLE_S = 600.0


class DeadlinePassed(TimeoutError):
    """The call did not get its whole answer before its deadline."""


class AnswerTooLarge(ValueError):
    """The answer is larger than D reads; the rest was not read."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased

    def text(self, limit: int = 300) -> str:
        return self.body[:limit].decode("utf-8", "replace")


class _Calls(threading.local):
    deadline: float | None = None  # monotonic: the current thread's call


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every wait ends at the current call's deadline."""

    def __init__(self, inner: httpcore.NetworkStream, backend: _DeadlineBackend):
        self._inner = inner
        self._backend = backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(
            max_bytes, self._backend.wait(timeout, httpcore.ReadTimeout)
        )

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._backend.wait(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._backend.forget(self)
        self._inner.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        inner = self._inner.start_tls(
            ssl_context,
            server_hostname,
            self._backend.wait(timeout, httpcore.ConnectTimeout),
        )
        self._backend.forget(self)
        return self._backend.track(inner)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    def abort(self) -> None:
        """Wake a read or write blocked on this connection (from another thread)."""
        sock = self._inner.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()
        self.calls = _Calls()
        self._lock = threading.Lock()
        self._open: set[_DeadlineStream] = set()
        self.closed = False

    def wait(self, timeout: float | None, error: type[Exception]) -> float | None:
        if self.closed:
            raise error("shut down")
        deadline = self.calls.deadline
        if deadline is None:
            return timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise error("the call's deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        return self.track(
            self._inner.connect_tcp(
                host,
                port,
                self.wait(timeout, httpcore.ConnectTimeout),
                local_address,
                socket_options,
            )
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        return self.track(
            self._inner.connect_unix_socket(
                path, self.wait(timeout, httpcore.ConnectTimeout), socket_options
            )
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def track(self, inner: httpcore.NetworkStream) -> _DeadlineStream:
        stream = _DeadlineStream(inner, self)
        with self._lock:
            if not self.closed:
                self._open.add(stream)
                return stream
        inner.close()
        raise httpcore.ConnectError("shut down")

    def forget(self, stream: _DeadlineStream) -> None:
        with self._lock:
            self._open.discard(stream)

    def abort_all(self) -> None:
        with self._lock:
            self.closed = True
            streams = list(self._open)
        for s in streams:
            s.abort()


class _SourceClient:
    """One source's kept connections (an https source's SSL context built once)."""

    def __init__(self, connections: int, max_answer_bytes: int, tls: bool):
        self.backend = _DeadlineBackend()
        self.max_answer_bytes = max_answer_bytes
        self.pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context() if tls else None,
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
            network_backend=self.backend,
        )

    def post(
        self, url: str, content: bytes, headers: dict[str, str], deadline: float
    ) -> Answer:
        left = deadline - time.monotonic()
        if left < MIN_CALL_S:
            raise DeadlinePassed(
                f"POST {url}: {max(left, 0) * 1000:.0f} ms of the deadline left before "
                "the call: not started"
            )
        # httpx parses the URL, as the allowlist test checks: no parser differential
        req = httpx.Request("POST", url, content=content, headers=headers)
        u = req.url
        target = httpcore.URL(
            scheme=u.raw_scheme, host=u.raw_host, port=u.port, target=u.raw_path
        )
        cap = self.max_answer_bytes
        self.backend.calls.deadline = deadline
        try:
            with self.pool.stream(
                "POST",
                target,
                headers=req.headers.raw,
                content=content,
                extensions={"timeout": {"pool": left}},
            ) as r:
                headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1")
                    for k, v in r.headers
                }
                declared = headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > cap:
                    raise AnswerTooLarge(
                        f"POST {url}: an answer of {int(declared)} bytes, "
                        f"more than the {cap} this instance reads; refused "
                        "unread"
                    )
                body = bytearray()
                for chunk in r.iter_stream():
                    body += chunk
                    if len(body) > cap:
                        raise AnswerTooLarge(
                            f"POST {url}: an answer of more than the {cap} "
                            "bytes this instance reads; refused"
                        )
                    if time.monotonic() >= deadline:
                        raise DeadlinePassed(
                            f"POST {url}: no whole answer within the call's deadline"
                        )
                return Answer(r.status, bytes(body), headers)
        except httpcore.TimeoutException as e:
            raise DeadlinePassed(
                f"POST {url}: no whole answer within the call's deadline ({e})"
            ) from None
        finally:
            self.backend.calls.deadline = None

    def close(self) -> None:
        self.backend.abort_all()
        # a connection another thread was using: already aborted
        with contextlib.suppress(Exception):
            self.pool.close()


_STOP = object()


class _Lane:
    """One source's threads (daemons) and connections; made on the source's first call."""

    def __init__(self, name: str, threads: int, max_answer_bytes: int, tls: bool):
        self.name = name
        self.client = _SourceClient(threads, max_answer_bytes, tls)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # calls submitted or posted and not yet done; SourceLanes raises it under
        # its lock, so a lane it finds at 0 has no call and gets none
        self._busy_lock = threading.Lock()
        self.busy = 0
        self.idle_since = time.monotonic()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def begin(self) -> None:
        with self._busy_lock:
            self.busy += 1

    def end(self) -> None:
        with self._busy_lock:
            self.busy -= 1
            if not self.busy:
                self.idle_since = time.monotonic()

    def idle_for(self, now: float) -> float:
        """How long the lane has had no call (0 while one is queued or running)."""
        with self._busy_lock:
            return 0.0 if self.busy else now - self.idle_since

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args = item
            try:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args)
                except BaseException as e:  # handed to the caller through the future
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            finally:
                self.end()

    def shutdown(self) -> list[threading.Thread]:
        """Cancel what is queued, abort what runs; returns the threads to join."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(_STOP)
        self.client.close()
        return self._threads


class SourceLanes:
    """Per push source: its own ``threads`` threads and as many connections."""

    def __init__(
        self,
        name: str,
        threads: int,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        idle_s: float = LANE_IDLE_S,
    ):
        self.name = name
        self.threads = threads
        self.max_answer_bytes = max_answer_bytes
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._closed = False

    @staticmethod
    def key(source: str) -> str:
        try:
            return normalize_source(source)
        except ConfigError:
            return source

    def _begin(self, source: str) -> _Lane:
        """``source``'s lane, one call more on it; lanes idle ``idle_s`` are closed."""
        key = self.key(source)
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            idle = [
                k
                for k, lane in self._lanes.items()
                if k != key and lane.idle_for(now) >= self.idle_s
            ]
            retired = [self._lanes.pop(k) for k in idle]
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(
                    f"{self.name}:{key.split('//', 1)[-1]}",
                    self.threads,
                    self.max_answer_bytes,
                    key.startswith("https:"),
                )
            lane.begin()
        for r in retired:
            r.shutdown()  # nothing queued or running: its threads take their stop
        return lane

    def submit(self, source: str, fn: Callable[..., Any], *args: Any) -> Future:
        lane = self._begin(source)
        return lane.submit(fn, *args)  # the lane's thread ends the call

    def post(
        self,
        source: str,
        path: str,
        content: bytes,
        headers: dict[str, str],
        deadline: float,
    ) -> Answer:
        """POST ``path`` at ``source``'s origin: the whole answer by ``deadline``, else
        DeadlinePassed or AnswerTooLarge (ValueError: ``source`` is not an origin)."""
        url = source_origin(source) + path  # ValueError before any lane is made
        lane = self._begin(source)
        try:
            return lane.client.post(url, content, headers, deadline)
        finally:
            lane.end()

    def sources(self) -> list[str]:
        with self._lock:
            return list(self._lanes)

    def shutdown(self, join_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        threads = [t for lane in lanes for t in lane.shutdown()]
        end = time.monotonic() + join_s
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
