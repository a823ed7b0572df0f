"""Dispatchers in front of a prefill/decode pair, as deployments run them.

- ``vllm_router``: the vLLM project's Rust router (``vllm-router``, pinned in
  requirements/tools.txt, installed from the package index by the set-up) in PD
  mode with ``--kv-connector mooncake``. It sends P's request, waits for P's
  answer, then sends D's.
- ``vllm_router_workers``: the same router in its plain mode, balancing whole
  requests over instances that each serve them (kv_both instances with prefix
  push ``auto``).
- ``upstream_proxy``: the Mooncake proxy that ships in the release's own source
  tree (``mooncake_connector_proxy.py``, in one of PROXIES_IN_TREE). It sends P's
  and D's requests at once.

Each runs as a process bound to 127.0.0.1 on a free port, its output in a log
file; ``Dispatcher.stop`` (or leaving its ``with`` block) ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.launcher import BLOCK, Instance, free_port, log_tail
from harness.pd_client import CLIENT
from harness.vllm_series import selected

READY_TIMEOUT_S = 60.0
VLLM_ROUTER = Path(sys.executable).parent / "vllm-router"
# where releases keep it (0.18.1; 0.32.0 moved it), the same script in both
PROXIES_IN_TREE = (
    "examples/online_serving/disaggregated_serving/mooncake_connector/"
    "mooncake_connector_proxy.py",
    "examples/disaggregated/mooncake_connector/mooncake_connector_proxy.py",
)
# what upstream's proxy prints once it has every prefill instance's engine id
PROXY_READY = "All prefiller instances are ready."


@dataclass
class Dispatcher:
    name: str
    url: str  # OpenAI-compatible front: POST {url}/v1/completions
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _start(name: str, cmd: list[str], port: int, log_dir: Path) -> Dispatcher:
    log_path = Path(log_dir) / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # the proxy's ready line
        )
    return Dispatcher(name, f"http://127.0.0.1:{port}", proc, log_path)


def _wait(d: Dispatcher, ready, what: str) -> Dispatcher:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(
                f"{d.name} exited ({d.proc.returncode}) before it was ready; its log "
                f"({d.log_path}):\n{d.log_tail()}"
            )
        try:
            if ready():
                return d
        except Exception:
            pass
        time.sleep(0.2)
    d.stop()
    raise RuntimeError(
        f"{d.name} was not {what} within {READY_TIMEOUT_S:.0f}s; its log "
        f"({d.log_path}):\n{d.log_tail()}"
    )


def _router_installed() -> None:
    if not VLLM_ROUTER.exists():
        raise RuntimeError(
            f"{VLLM_ROUTER} is missing: run scripts/setup.sh (it installs "
            "vllm-router from requirements/tools.txt)"
        )


def _router(cmd_args: list[str], log_dir: Path) -> Dispatcher:
    _router_installed()
    port = free_port()
    cmd = [
        str(VLLM_ROUTER),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *cmd_args,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        os.environ.get("VMP_ROUTER_LOG_LEVEL", "info"),
    ]
    d = _start("vllm-router", cmd, port, log_dir)
    return _wait(
        d, lambda: CLIENT.get(d.url + "/health", timeout=2).is_success, "healthy"
    )


def vllm_router_workers(
    workers: list[Instance],
    log_dir: Path,
    policy: str = "round_robin",
    extra: Sequence[str] = (),
) -> Dispatcher:
    """vllm-router in its plain mode: each request to one of ``workers``."""
    return _router(
        ["--worker-urls", *(w.url for w in workers), "--policy", policy, *extra],
        log_dir,
    )


def vllm_router(
    prefill: Instance, decode: Instance, log_dir: Path, policy: str = "round_robin"
) -> Dispatcher:
    """vllm-router in PD mode with the Mooncake connector in front of P and D."""
    return _router(
        [
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "mooncake",
            "--prefill",
            prefill.url,
            str(prefill.bootstrap_port),
            "--decode",
            decode.url,
            "--policy",
            policy,
        ],
        log_dir,
    )


def upstream_proxy(prefill: Instance, decode: Instance, log_dir: Path) -> Dispatcher:
    """Upstream's example Mooncake proxy (from the selected release's tree)."""
    tree = selected().tree
    found = [tree / p for p in PROXIES_IN_TREE if (tree / p).exists()]
    if not found:
        raise RuntimeError(
            f"no mooncake_connector_proxy.py in {tree} (looked in "
            f"{', '.join(PROXIES_IN_TREE)}): run `python build.py apply`"
        )
    script = found[0]
    port = free_port()
    cmd = [
        sys.executable,
        str(script),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        prefill.url,
        str(prefill.bootstrap_port),
        "--decode",
        decode.url,
    ]
    d = _start("mooncake-proxy", cmd, port, log_dir)
    return _wait(
        d, lambda: PROXY_READY in d.log_path.read_text(errors="replace"), "ready"
    )


__all__ = ["Dispatcher", "upstream_proxy", "vllm_router"]


# releases whose KV events vllm-router 0.1.17's kv_aware policy cannot read, and why
KV_EVENTS_UNREADABLE = {
    "0.18.1": (
        "vllm-router 0.1.17 decodes a KV event only as a map; vLLM 0.18.1 sends "
        "each as an array (msgspec array_like), so kv_aware gets no prefix from it "
        "(docs/routers.md)"
    ),
}


def kv_events_args(port: int) -> list[str]:
    """vLLM publishes its KV events (BlockStored, BlockRemoved) on a ZMQ PUB socket
    that connects to 127.0.0.1:port (an endpoint without a wildcard: vLLM connects,
    not binds), where a forwarder to vllm-router's kv_aware policy binds
    (KVEventForwarder); with no forwarder, nothing is sent."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "",
    }
    return ["--kv-events-config", json.dumps(config)]


def kv_event_port(inst: Instance) -> int:
    """The port an instance started with kv_events_args() publishes to."""
    args = inst.spec.extra_args
    config = json.loads(args[args.index("--kv-events-config") + 1])
    return int(config["endpoint"].rsplit(":", 1)[1])


class KVEventForwarder:
    """A ZMQ forwarder on loopback between one instance's KV-event publisher and
    vllm-router's subscriber.

    vLLM's publisher binds only a wildcard endpoint (``tcp://*:PORT``: every
    interface) and connects to any other; vllm-router's kv_aware subscriber
    connects too. This binds both ends on 127.0.0.1 instead: the instance's PUB
    connects to ``inbound`` (its ``--kv-events-config`` endpoint), the router's
    SUB to ``outbound``, and every frame (and the subscription) is passed on
    unchanged. Events published before a subscriber is connected are lost (as
    with any ZMQ PUB)."""

    def __init__(self, inbound_port: int):
        import zmq

        self._zmq = zmq
        self.inbound_port = inbound_port
        self.outbound_port = free_port()
        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        try:
            self._xsub.bind(f"tcp://127.0.0.1:{inbound_port}")
            self._xpub.bind(f"tcp://127.0.0.1:{self.outbound_port}")
        except zmq.ZMQError as e:  # a port taken: nothing of this is left open
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)
            self._ctx.term()
            raise RuntimeError(
                f"KV-event forwarder: cannot bind 127.0.0.1:{inbound_port} or "
                f"127.0.0.1:{self.outbound_port} ({e})"
            ) from e
        self._thread = threading.Thread(
            target=self._run, name="kv-event-forwarder", daemon=True
        )
        self._thread.start()

    @property
    def outbound(self) -> str:
        return f"tcp://127.0.0.1:{self.outbound_port}"

    def _run(self) -> None:
        try:
            self._zmq.proxy(self._xsub, self._xpub)
        except self._zmq.ContextTerminated:
            pass
        finally:
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)

    def close(self) -> None:
        self._ctx.term()
        self._thread.join(5)

    def __enter__(self) -> KVEventForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def kv_aware_router(
    workers: list[Instance], log_dir: Path, model: str
) -> Iterator[Dispatcher]:
    """vllm-router's kv_aware policy in front of ``workers`` (each started with
    kv_events_args()), fed by their KV events through a loopback forwarder each;
    yielded once its subscriptions are up (ZMQ drops earlier events)."""
    extra = ["--router-temperature", "0", "--kv-event-block-size", str(BLOCK)]
    extra += ["--kv-event-model", model]
    with contextlib.ExitStack() as stack:
        for inst in workers:
            fwd = stack.enter_context(KVEventForwarder(kv_event_port(inst)))
            extra += ["--kv-event-source", f"{inst.url}={fwd.outbound}"]
        router = stack.enter_context(
            vllm_router_workers(workers, log_dir, "kv_aware", extra)
        )
        time.sleep(2)
        yield router
