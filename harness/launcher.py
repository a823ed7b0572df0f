"""Start vLLM instances with MooncakeConnector and always tear them down.

Used by the integration tests and the microbenchmarks:

    specs = [InstanceSpec("prefill", role="kv_producer", model=m, cores="0"),
             InstanceSpec("decode", role="kv_consumer", model=m, cores="1")]
    with Cluster(specs, log_dir=Path("results/logs")) as cluster:
        p, d = cluster["prefill"], cluster["decode"]
        ...

Each instance is a `vllm serve` process in its own process group with its log
in a file. By default every instance runs on loopback in the test's namespace;
``Cluster(..., hosts=True)`` or ``VMP_TOPOLOGY=netns`` (the switch for every
existing integration test) gives each instance a host of its own: a network
namespace on a bridge (harness/netns.py), so every byte between instances
(HTTP, ZMQ, the transfer engine) crosses a link that can fail. Start-up waits for /health with a timeout; a failure raises an error
that carries the tail of the failing instance's log. Tear-down (on exit,
exception, Ctrl-C, SIGTERM or interpreter exit) terminates every process group,
escalating to SIGKILL, so no instance outlives its owner.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.netns import Topology
from harness.runtime_env import vllm_env

TOKEN_ENV = "MOONCAKE_BOOTSTRAP_TOKEN"
# The CPU backend's block size (its default too): every instance is started with
# it (--block-size) unless its spec says otherwise; tests and benchmarks count
# prompt blocks with it.
BLOCK = 128
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("VMP_STARTUP_TIMEOUT_S", "300"))


# Ports free_port() hands out: below the kernel's ephemeral range (32768-60999 by
# default), so the source port of some process's outgoing connection cannot take one
# between our pick and the instance's bind (seen: a bootstrap port taken that way),
# and above Mooncake's RPC ports (15000-17000).
PICK_PORTS = range(20000, 32768)
_handed_out: set[int] = set()
_pick_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(
            Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        )
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, below the ephemeral
    range and not handed out before by this process."""
    top = min(PICK_PORTS.stop, _ephemeral_low())
    with _pick_lock:
        for _ in range(200):
            port = random.randrange(PICK_PORTS.start, top)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, or "(no log)" if it cannot be read."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


@dataclass
class InstanceSpec:
    """One vLLM instance. role: kv_producer, kv_consumer, kv_both, or None (no connector)."""

    name: str
    model: str
    role: str | None = None
    port: int = 0  # 0: pick a free port
    bootstrap_port: int = 0  # 0: pick a free port (producers and kv_both only)
    protocol: str = "tcp"
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-1"
    max_model_len: int = 16384
    block_size: int = BLOCK
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    extra_args: list[str] = field(default_factory=list)
    extra_config: dict = field(default_factory=dict)  # kv_connector_extra_config
    env: dict[str, str] = field(default_factory=dict)
    # push sources this instance accepts besides the cluster's own (MOONCAKE_PUSH_SOURCES)
    extra_push_sources: list[str] = field(default_factory=list)
    # where it runs: loopback, or a host of its own (set by Cluster(hosts=True))
    ip: str = "127.0.0.1"
    netns: str | None = None
    # kernel settings of its own host (net.*, per network namespace): only with
    # Cluster(hosts=True), set before the instance starts
    sysctls: dict[str, int] = field(default_factory=dict)

    def kv_transfer_config(self) -> dict | None:
        if self.role is None:
            return None
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": self.role,
            "kv_connector_extra_config": {
                "mooncake_protocol": self.protocol,
                **self.extra_config,
            },
        }


class InstanceStartError(RuntimeError):
    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log  # the instance's whole log of this start, where known


def port_taken(error: InstanceStartError) -> bool:
    """The start-up failure is a port another process took: said in the message or
    anywhere in the instance's log of this start (vLLM's API server prints a long
    traceback of its own after its engine core's EADDRINUSE, past the message's
    tail of the log)."""
    text = f"{error}\n{getattr(error, 'log', '')}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


@dataclass
class Instance:
    spec: InstanceSpec
    port: int
    bootstrap_port: int | None
    log_path: Path
    proc: subprocess.Popen | None = None
    # where log_text() starts reading: moved on when a cluster passes to another user
    log_mark: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.spec.ip}:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        if self.bootstrap_port is None:
            raise ValueError(f"instance {self.spec.name} has no bootstrap server")
        return f"http://{self.spec.ip}:{self.bootstrap_port}"

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def whole_log(self) -> str:
        """The log from this start's mark on, or "" if it cannot be read."""
        try:
            return self.log_text()
        except OSError:
            return ""

    def log_text(self) -> str:
        """The instance's log from its mark on (the whole log unless mark_log moved it)."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_mark)
            return f.read().decode(errors="replace")

    def mark_log(self) -> None:
        """From now on log_text() shows only what the instance logs after this call."""
        self.log_mark = self.log_path.stat().st_size

    def command(self) -> list[str]:
        s = self.spec
        cmd = ["ip", "netns", "exec", s.netns] if s.netns else []
        cmd += [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            s.model,
            "--host",
            s.ip,
            "--port",
            str(self.port),
            "--dtype",
            s.dtype,
            "--max-model-len",
            str(s.max_model_len),
            "--block-size",
            str(s.block_size),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]
        cmd.append(
            "--enable-prefix-caching"
            if s.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
        if s.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if (kvc := s.kv_transfer_config()) is not None:
            cmd += ["--kv-transfer-config", json.dumps(kvc)]
        return cmd + list(s.extra_args)

    def environment(self, push_sources: str = "") -> dict[str, str]:
        s = self.spec
        over = {
            "VLLM_CPU_KVCACHE_SPACE": str(int(s.kv_cache_gib)),
            # every server and engine of ours on one explicit address (loopback,
            # or the instance's own host): the bootstrap server (upstream binds
            # 0.0.0.0), the transfer engine and ZMQ (upstream picks an interface)
            "MOONCAKE_BOOTSTRAP_HOST": s.ip,
            "VLLM_HOST_IP": s.ip,
            # D may take prefix pushes from the cluster's own instances only
            "MOONCAKE_PUSH_SOURCES": ",".join(
                [push_sources, *s.extra_push_sources]
            ).strip(","),
        }
        if s.cores is not None:
            over["VLLM_CPU_OMP_THREADS_BIND"] = s.cores
        if self.bootstrap_port is not None:
            over["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        over.update(s.env)
        return vllm_env(**over)

    def start(self, push_sources: str = "") -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_mark = 0  # a new log
        with open(self.log_path, "w") as log:  # the instance keeps its own copy
            log.write("# " + " ".join(self.command()) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(push_sources),
                # A process group of its own (stopped with killpg), in this
                # process's session: a new session would put the instance in a
                # scheduling group of its own (autogroup), whose weight on a
                # core it barely uses is tiny. Its transfer threads on another
                # instance's core (MOONCAKE_IO_CPUS) then starve whenever that
                # instance spins (vLLM 0.32.0's worker waits for its engine by
                # spinning), holding the GIL its compute thread needs
                # (tests/integration/test_io_cpus.py).
                process_group=0,
            )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InstanceStartError(
                    f"vLLM instance '{self.spec.name}' exited with code {self.proc.returncode} "
                    f"during start-up (log: {self.log_path}). Last lines:\n{self.log_tail()}",
                    self.whole_log(),
                )
            if self.healthy():
                return
            time.sleep(1.0)
        raise InstanceStartError(
            f"vLLM instance '{self.spec.name}' neither healthy nor exited by its "
            f"start-up deadline (log: {self.log_path}). Last lines:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the whole instance (API server and engine core) at once: a crash."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def restart(
        self, push_sources: str, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    ) -> None:
        """Stop (if running) and start again on the same ports; wait until healthy."""
        self.stop()
        self.start(push_sources)
        self.wait_ready(time.monotonic() + timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        # the group may hold children (EngineCore) even after the parent exits
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


_LIVE: set[Cluster] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        clusters = list(_LIVE)
    for c in clusters:
        c.stop()


atexit.register(_stop_all)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            _stop_all()
            if callable(prev):
                prev(signum, frame)
            else:
                raise SystemExit(128 + signum)

        if getattr(prev, "_vmp", False):
            continue
        handler._vmp = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)


class Cluster:
    """A set of vLLM instances started together; a context manager."""

    def __init__(
        self,
        specs: list[InstanceSpec],
        log_dir: Path,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        hosts: bool | None = None,
        token: str | None = None,
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique: {names}")
        self.startup_timeout_s = startup_timeout_s
        if hosts is None:
            hosts = os.environ.get("VMP_TOPOLOGY", "loopback") == "netns"
        # one network namespace per instance, created in start(), removed in stop()
        self.topology = Topology(names) if hosts else None
        if self.topology is None and any(s.sysctls for s in specs):
            raise ValueError(
                "InstanceSpec.sysctls needs hosts of their own (Cluster(hosts=True)): "
                "this machine's settings are not the cluster's to change"
            )
        if self.topology is not None:
            # off loopback our bootstrap endpoints need a token (connector/common/auth.py)
            token = token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
            specs = [
                replace(
                    s,
                    ip=self.topology.host(s.name).ip,
                    netns=self.topology.host(s.name).netns,
                )
                for s in specs
            ]
        # one token per cluster (``token``, or made for hosts off loopback), in every
        # instance's environment and in this process's (for the harness's clients,
        # pd_client.bootstrap_headers) only while the cluster runs
        self.token = token
        if token is not None:
            specs = [replace(s, env={TOKEN_ENV: token, **s.env}) for s in specs]
        self.instances: dict[str, Instance] = {
            s.name: Instance(
                spec=s,
                port=0,
                bootstrap_port=None,
                log_path=Path(log_dir) / f"{s.name}.log",
            )
            for s in specs
        }
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Free ports for what the specs leave at 0 (the specs' own ports are kept),
        and the push sources made of them."""
        for inst in self.instances.values():
            s = inst.spec
            inst.port = s.port or free_port()
            inst.bootstrap_port = None
            if s.role in ("kv_producer", "kv_both"):
                inst.bootstrap_port = s.bootstrap_port or free_port()
        self.push_sources = ",".join(
            i.bootstrap_url
            for i in self.instances.values()
            if i.bootstrap_port is not None
        )

    def __getitem__(self, name: str) -> Instance:
        return self.instances[name]

    def start(self) -> Cluster:
        """Start every instance and wait until all serve. An instance that died at
        start-up because a port was taken meanwhile (vLLM picks torch.distributed's
        port itself, after our free_port() checks: seen once in mb7 when a second
        cluster started; our own picks can be taken too, e.g. as the source port of an
        outgoing connection) is retried once, the whole cluster with it, on ports
        picked anew."""
        for attempt in (1, 2):
            try:
                return self._start_once()
            except InstanceStartError as e:
                if attempt == 2 or not port_taken(e):
                    raise
                print(
                    "[launcher] a port was taken during start-up (EADDRINUSE); "
                    "starting the cluster again on other ports",
                    flush=True,
                )
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start_once(self) -> Cluster:
        _install_signal_handlers()
        with _LIVE_LOCK:
            _LIVE.add(self)
        t0 = time.monotonic()
        try:
            if self.token is not None:
                self._token_before = os.environ.get(TOKEN_ENV)
                os.environ[TOKEN_ENV] = self.token
            if self.topology is not None:
                self.topology.create()
                for inst in self.instances.values():
                    for name, value in inst.spec.sysctls.items():
                        self.topology.host(inst.spec.name).sysctl(name, value)
            for inst in self.instances.values():
                inst.start(self.push_sources)
            deadline = t0 + self.startup_timeout_s
            for inst in self.instances.values():
                inst.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        print(
            f"[launcher] {', '.join(self.instances)} ready in {time.monotonic() - t0:.0f}s",
            flush=True,
        )
        return self

    def stop(self) -> None:
        for inst in self.instances.values():
            inst.stop()
        if self.topology is not None:
            self.topology.destroy()
        if getattr(self, "_token_before", "unset") != "unset":
            if self._token_before is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = self._token_before
            del self._token_before
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
