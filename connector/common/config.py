# SPDX-License-Identifier: Apache-2.0
"""Every knob of this patch series, read from the environment once.

Our variables start with ``MOONCAKE_``; Mooncake's (``MC_*``) and vLLM's
(``VLLM_*``) are read only where a bound of ours depends on them. :func:`load`
reads the environment on first use and caches it, so one process sees one
configuration; tests build ``ExtConfig.from_env({...})``. The variables of ours are
one table, :data:`VARIABLES` (field, default, parser, help), as in ``vllm.envs``;
the README's Configuration table is held equal to it
(tests/unit/connector/common/test_readme_config.py); limits: docs/configuration.md.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .write_bounds import (
    DEFAULT_ENGINE_TRANSFER_TIMEOUT_S,
    ENGINE_HANDSHAKE_ALLOWANCE_S,
    ENGINE_NO_PROGRESS_S,
    ENGINE_NS_PER_BYTE,
    ENGINE_TIMEOUT_FLOOR_S,
    LINUX_ORPHAN_RETRIES,
    RDMA_FAILED_WRITE_HOLD_S,
    engine_no_progress_s,
    engine_reconnect_s,
    engine_timeout_s,
    stalled_delivery_bound_s,
    tcp_orphan_retries,
)

PREFIX = "MOONCAKE_"


class ConfigError(ValueError):
    """A variable of ours has a value we cannot use; the message names it."""


PUSH_POLICIES = ("measured", "always")  # the first is the default


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first when unset); ConfigError naming them else."""
    raw = env.get(name, "").strip().lower() or choices[0]
    if raw not in choices:
        raise ConfigError(f"{name}={env.get(name)!r}: one of {', '.join(choices)}")
    return raw


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _number(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    minimum: float = 0.0,
    integer: bool = False,
) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name} must be {kind}, got {raw!r}") from None
    if value < minimum or value != value:  # NaN
        raise ConfigError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


def parse_cpu_list(text: str, name: str = "MOONCAKE_IO_CPUS") -> frozenset[int]:
    """'0,2-3' -> {0, 2, 3}."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"{name}: bad CPU list {text!r}") from None
        if b < a:
            raise ConfigError(f"{name}: bad CPU range {part!r} in {text!r}")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for the project's tests (never set in production)."""

    # D: zero the K-th block of every request whose KV arrived from a peer
    zero_recv_block: int | None = None
    # P/C: every layer-wise or /push_blocks write of a prompt of exactly N tokens fails
    fail_write_prompt_len: int | None = None
    # ... on this TP rank only (None: every rank)
    fail_write_rank: int | None = None
    # P/C: writes of a prompt of exactly N tokens take S seconds longer
    # (the engine call returns, bytes landed, only after the delay)
    delay_write_prompt_len: int | None = None
    delay_write_s: float = 0.0
    # P: after W writes of a transfer of a prompt of exactly N tokens, hold its writer
    # S seconds before the next one (a fault test acts at that moment: link down, kill)
    hold_write_prompt_len: int | None = None
    hold_write_after: int = 0
    hold_write_s: float = 0.0
    # every writer's send-queue fence reads nothing, as where the kernel cannot be
    # read (it must then hold failed writes for the bound)
    fence_blind: bool = False
    # D: failed pushes from this source (a test's hostile source, asked many times)
    # neither cost nor count against it
    keep_asking_source: str | None = None

    @property
    def armed(self) -> bool:
        return (
            self.fence_blind
            or self.zero_recv_block is not None
            or self.fail_write_prompt_len is not None
            or self.delay_write_prompt_len is not None
            or self.hold_write_prompt_len is not None
        )


@dataclass(frozen=True)
class ExtConfig:
    layerwise: bool = False
    layerwise_min_tokens: int = 256
    layerwise_timeout_s: float = 294.0  # as from_env computes it with the defaults
    layerwise_unknown_timeout_s: float = 60.0
    # D: its pull socket gives up (and D frees the pull's blocks) this long after
    # asking (upstream: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s)
    pull_give_up_s: float = 540.0
    # D: pulls in flight into this instance at once (0: no bound), and the longest
    # a request waits for one before D prefills it itself (decode_admission.py)
    decode_max_pulls: int = 8
    decode_pull_wait_s: float = 120.0
    io_cpus: frozenset[int] | None = None
    push_match_timeout_s: float = 5.0
    push_timeout_s: float = 30.0
    push_clock_skew_s: float = 5.0
    engine_transfer_timeout_s: int = DEFAULT_ENGINE_TRANSFER_TIMEOUT_S
    # how long the transport lets a connection stall before it drops it
    # (engine_no_progress_s: MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC);
    # a push source reports its own in /match_blocks
    engine_no_progress_s: int = ENGINE_NO_PROGRESS_S
    # this host's net.ipv4.tcp_orphan_retries as the kernel applies it (0 -> 8);
    # a push source reports its own in /match_blocks (PushJob carries it to D's hold)
    tcp_orphan_retries: int = LINUX_ORPHAN_RETRIES
    # how long the transport may spend connecting to a peer again for a write's
    # queued slices once it dropped a stalled connection (engine_reconnect_s: its
    # lanes, one after the other, each up to the kernel's SYN span); a push source
    # reports its own in /match_blocks
    engine_reconnect_s: int = 136  # as from_env computes it with the defaults
    # D: a source's engine timeout beyond this is refused (its hold would be longer)
    push_source_timeout_max_s: int = 120
    # RDMA: how long a failed write is held before its transfer ends (no kernel
    # queue to read; RDMA_FAILED_WRITE_HOLD_S)
    rdma_failed_write_hold_s: float = RDMA_FAILED_WRITE_HOLD_S
    # empty engine steps while finished requests hold blocks: at most one per this
    idle_step_interval_s: float = 0.001
    push_sources: tuple[str, ...] = ()
    push_auto: bool = False
    push_index_max_blocks: int = 1 << 20
    push_min_tokens: int = 256
    push_policy: str = "measured"  # or "always" (PUSH_POLICIES)
    push_max_tokens: int = 131072
    push_max_concurrent: int = 4
    push_rank_port: int = 0
    bootstrap_host: str = "0.0.0.0"
    bootstrap_token: str | None = None
    bootstrap_insecure: bool = False
    model_id: str | None = None
    faults: FaultConfig = FaultConfig()

    @property
    def bootstrap_loopback(self) -> bool:
        return is_loopback(self.bootstrap_host)

    def reachable_bootstrap_host(self, upstream_host: str) -> str:
        """Where this instance's processes reach its bootstrap server: upstream's
        address, or the bind address when that is one non-loopback address."""
        bind = self.bootstrap_host
        if (
            bind not in ("0.0.0.0", "::")
            and is_loopback(upstream_host)
            and not is_loopback(bind)
        ):
            return bind
        return upstream_host

    @property
    def push_max_body_bytes(self) -> int:
        """A push body: the prompt (<= 21 bytes a token in JSON) and D's block list."""
        return 64 * 1024 + 48 * self.push_max_tokens

    def engine_write_bound_s(self, nbytes: int) -> float:
        """The one bound on a write of ``nbytes`` in flight: handshake, the call's
        timeout (+1 ns/byte), then the longer of :func:`stalled_delivery_bound_s` and
        watchdog + reconnect. A peer holding blocks for it uses the *writer's* values."""
        return (
            ENGINE_HANDSHAKE_ALLOWANCE_S
            + self.engine_transfer_timeout_s
            + nbytes * ENGINE_NS_PER_BYTE * 1e-9
            + max(
                stalled_delivery_bound_s(
                    self.tcp_orphan_retries, self.engine_no_progress_s
                ),
                self.engine_no_progress_s + self.engine_reconnect_s,
            )
        )

    def push_hold_for_s(
        self,
        nbytes: int,
        source_engine_timeout_s: int | None = None,
        source_tcp_orphan_retries: int | None = None,
        source_engine_no_progress_s: int | None = None,
        source_engine_reconnect_s: int | None = None,
    ) -> float:
        """How long D keeps a push's blocks when C never answers: C starts no write
        past the push's budget or deadline (push_timeout_s; clocks within
        push_clock_skew_s), and one started by then ends within C's
        engine_write_bound_s, from the ``source_*`` values C reported (None: ours)."""
        source = self
        if source_engine_timeout_s is not None:
            source = replace(source, engine_transfer_timeout_s=source_engine_timeout_s)
        if source_tcp_orphan_retries is not None:
            source = replace(source, tcp_orphan_retries=source_tcp_orphan_retries)
        if source_engine_no_progress_s is not None:
            source = replace(source, engine_no_progress_s=source_engine_no_progress_s)
        if source_engine_reconnect_s is not None:
            source = replace(source, engine_reconnect_s=source_engine_reconnect_s)
        return (
            self.push_timeout_s
            + source.engine_write_bound_s(nbytes)
            + self.push_clock_skew_s
        )

    def decode_limits(self) -> dict[str, float]:
        """D: what it tells P with each pull request (MooncakeXferMetadata.ext)."""
        return {"pull_give_up_s": float(self.pull_give_up_s)}

    def layerwise_refusal(
        self, decode_limits: Mapping[str, float] | None
    ) -> str | None:
        """P: why it cannot serve a decode instance with these limits layer-wise
        without risking a write after D gave up (None: it can, or D sent none)."""
        give_up = (decode_limits or {}).get("pull_give_up_s")
        if give_up is None:
            return None
        if (
            not isinstance(give_up, (int, float))
            or not math.isfinite(give_up)
            or give_up <= 0
        ):
            return f"the decode instance sent an invalid pull timeout {give_up!r}"
        needed = self.layerwise_timeout_s + self.engine_write_bound_s(0)
        if needed >= give_up:
            return (
                f"this prefill instance may answer up to {needed:g} s after a pull "
                f"(MOONCAKE_LAYERWISE_TIMEOUT_S={self.layerwise_timeout_s:g} + the bound on "
                f"an in-flight write, {self.engine_write_bound_s(0):g} s from its "
                f"MC_TRANSFER_TIMEOUT, its transport's {self.engine_no_progress_s} s "
                f"no-progress watchdog and {self.engine_reconnect_s} s reconnect), but "
                "the decode instance gives up after "
                f"{give_up:g} s (its VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60): lower the "
                "prefill's MOONCAKE_LAYERWISE_TIMEOUT_S or raise the decode's "
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
            )
        return None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExtConfig:
        env = os.environ if env is None else env
        abort_timeout = _number(
            env, "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", 480, minimum=1
        )
        # Mooncake's and the kernel's values first: defaults of ours derive from them.
        # D's pull socket gives up VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s after
        # asking (upstream) and frees the blocks; P must have answered by then.
        values: dict[str, Any] = {
            "engine_transfer_timeout_s": engine_timeout_s(env),
            "tcp_orphan_retries": tcp_orphan_retries(),
            "engine_no_progress_s": engine_no_progress_s(env),
            "engine_reconnect_s": engine_reconnect_s(env),
            "pull_give_up_s": abort_timeout + 60,
            "faults": _faults(env),
        }
        for name, var in VARIABLES.items():
            default = var.default(values) if callable(var.default) else var.default
            values[var.field] = var.read(env, name, default)
        cfg = cls(**values)
        write_bound = cfg.engine_write_bound_s(0)
        if cfg.layerwise_timeout_s + write_bound >= cfg.pull_give_up_s:
            raise ConfigError(
                f"MOONCAKE_LAYERWISE_TIMEOUT_S={cfg.layerwise_timeout_s:g} + the bound on an "
                f"in-flight write ({write_bound:g} s, from MC_TRANSFER_TIMEOUT, the "
                f"transport's {cfg.engine_no_progress_s} s no-progress watchdog, its "
                f"{cfg.engine_reconnect_s} s reconnect and net.ipv4.tcp_orphan_retries="
                f"{cfg.tcp_orphan_retries}) must stay below the decode side's "
                f"{cfg.pull_give_up_s:g} s (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60): "
                "lower it, shorten the bound (MC_TCP_LANES_PER_PEER, the kernel's "
                "tcp_syn_retries or tcp_orphan_retries), or raise "
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT on both instances"
            )
        # P holds a finished prefill's KV for D's pull MOONCAKE_LAYERWISE_TIMEOUT_S:
        # a pull that waited its whole turn on D must still find it
        if cfg.decode_pull_wait_s >= cfg.layerwise_timeout_s:
            raise ConfigError(
                f"MOONCAKE_DECODE_PULL_WAIT_S={cfg.decode_pull_wait_s:g} must stay below "
                f"MOONCAKE_LAYERWISE_TIMEOUT_S={cfg.layerwise_timeout_s:g} (how long the "
                "prefill instance keeps a finished prefill's KV for the decode "
                "instance's pull): lower it, or raise MOONCAKE_LAYERWISE_TIMEOUT_S"
            )
        return cfg


# -- the variables -------------------------------------------------------------------

Read = Callable[[Mapping[str, str], str, Any], Any]  # (env, name, default) -> value


@dataclass(frozen=True)
class Variable:
    """One variable of ours: the ExtConfig field it sets, its default (a value, or a
    function of the fields set before it), how its text is read, and its README row
    (the default as stated there, one line of help)."""

    field: str
    default: Any
    read: Read
    shown: str
    help: str


def _num(minimum: float = 0.0, integer: bool = False) -> Read:
    def read(env: Mapping[str, str], name: str, default: Any) -> Any:
        value = _number(env, name, default, minimum=minimum, integer=integer)
        return int(value) if integer else value

    return read


def _port(env: Mapping[str, str], name: str, default: Any) -> int:
    port = int(_number(env, name, default, integer=True))
    if port > 65535:
        raise ConfigError(f"{name} must be a port (0 to 65535), got {port}")
    return port


def _on(env: Mapping[str, str], name: str, default: Any) -> bool:
    return _flag(env, name)


def _text(env: Mapping[str, str], name: str, default: Any) -> Any:
    return env.get(name, "").strip() or default


def _layerwise_timeout(values: dict[str, Any]) -> float:
    """P's wait: the longest that still lets P answer before D gives up, its write
    in flight included (engine_write_bound_s), and no longer than D's abort timeout."""
    give_up = values["pull_give_up_s"]
    bound = ExtConfig(**{k: values[k] for k in ENGINE_FIELDS}).engine_write_bound_s(0)
    return max(0.1, min(give_up - 60, math.floor(give_up - bound - 5)))


def _pull_wait(values: dict[str, Any]) -> float:
    timeout = values["layerwise_timeout_s"]
    return min(120.0, timeout - 5) if timeout > 10 else timeout / 2


ENGINE_FIELDS = (
    "engine_transfer_timeout_s",
    "tcp_orphan_retries",
    "engine_no_progress_s",
    "engine_reconnect_s",
)

# Read in this order (a default may use the fields before it). The README's
# Configuration table is held equal to it (see the module docstring).
VARIABLES: dict[str, Variable] = {
    "MOONCAKE_LAYERWISE": Variable(
        "layerwise",
        False,
        _on,
        "off",
        "`1`: P pushes each layer's KV to D as soon as it is computed (set on both instances)",
    ),
    "MOONCAKE_LAYERWISE_MIN_TOKENS": Variable(
        "layerwise_min_tokens",
        256,
        _num(integer=True),
        "256",
        "shorter prompts take the post-hoc path",
    ),
    "MOONCAKE_LAYERWISE_TIMEOUT_S": Variable(
        "layerwise_timeout_s",
        _layerwise_timeout,
        _num(minimum=0.1),
        "294",
        "P's wait for D's request and for a transfer's writes (capped; a larger value is refused)",
    ),
    "MOONCAKE_LAYERWISE_UNKNOWN_TIMEOUT_S": Variable(
        "layerwise_unknown_timeout_s",
        60.0,
        _num(minimum=0.1),
        "60",
        "P fails D's request for a transfer P has neither scheduled nor received within this",
    ),
    "MOONCAKE_DECODE_MAX_PULLS": Variable(
        "decode_max_pulls",
        8,
        _num(integer=True),
        "8",
        "D: P->D transfers written into D at once; later ones wait in D's queue (`0`: no bound)",
    ),
    "MOONCAKE_DECODE_PULL_WAIT_S": Variable(
        "decode_pull_wait_s",
        _pull_wait,
        _num(minimum=0.1),
        "120",
        "D: the longest such a wait; after it D prefills the request itself",
    ),
    "MOONCAKE_IO_CPUS": Variable(
        "io_cpus",
        None,
        lambda env, name, _: _io_cpus(env, name),
        "unset",
        "CPU backend only: the transfer threads run on these CPUs",
    ),
    "MOONCAKE_PUSH_SOURCES": Variable(
        "push_sources",
        (),
        lambda env, name, _: _sources(env, name),
        "empty",
        "D: the `push_from` origins D accepts (`http://host:port,...`; empty: no prefix push)",
    ),
    "MOONCAKE_PUSH_MATCH_TIMEOUT_S": Variable(
        "push_match_timeout_s",
        5.0,
        _num(minimum=0.1),
        "5",
        "D's longest wait for C's `/match_blocks`; once D has timed local prefills "
        "it waits only as long as the prefill of the blocks the push would bring "
        "(1 s at least); then D prefills locally",
    ),
    "MOONCAKE_PUSH_TIMEOUT_S": Variable(
        "push_timeout_s",
        30.0,
        _num(minimum=0.1),
        "30",
        "a push's deadline and budget: C starts no write after it",
    ),
    "MOONCAKE_PUSH_CLOCK_SKEW_S": Variable(
        "push_clock_skew_s",
        5.0,
        _num(),
        "5",
        "the largest clock skew D accepts from a source",
    ),
    "MOONCAKE_PUSH_SOURCE_TIMEOUT_MAX_S": Variable(
        "push_source_timeout_max_s",
        lambda values: max(120, values["engine_transfer_timeout_s"]),
        _num(minimum=ENGINE_TIMEOUT_FLOOR_S, integer=True),
        "120",
        "D: the largest engine timeout (`MC_TRANSFER_TIMEOUT`) D accepts from a source",
    ),
    "MOONCAKE_PUSH_AUTO": Variable(
        "push_auto",
        False,
        _on,
        "off",
        '`1`: D treats every request without `push_from` as `"push_from": "auto"`',
    ),
    "MOONCAKE_PUSH_INDEX_MAX_BLOCKS": Variable(
        "push_index_max_blocks",
        1 << 20,
        _num(integer=True),
        "1048576",
        "D: blocks its index of the sources keeps, over all sources",
    ),
    "MOONCAKE_PUSH_MIN_TOKENS": Variable(
        "push_min_tokens",
        256,
        _num(integer=True),
        "256",
        "D: fewer held tokens beyond its own hit are prefilled locally",
    ),
    "MOONCAKE_PUSH_POLICY": Variable(
        "push_policy",
        PUSH_POLICIES[0],
        lambda env, name, _: _choice(env, name, PUSH_POLICIES),
        "measured",
        "D: `measured` pushes only when expected to be faster; `always` whenever enough is held",
    ),
    "MOONCAKE_PUSH_MAX_TOKENS": Variable(
        "push_max_tokens",
        131072,
        _num(minimum=1, integer=True),
        "131072",
        "C and D: the longest prompt a push may name",
    ),
    "MOONCAKE_PUSH_MAX_CONCURRENT": Variable(
        "push_max_concurrent",
        4,
        _num(minimum=1, integer=True),
        "4",
        "C: pushes served at once (429 beyond)",
    ),
    "MOONCAKE_PUSH_RANK_PORT": Variable(
        "push_rank_port",
        0,
        _port,
        "0",
        "C at TP > 1: first port of ranks 1 to N-1's push listeners (0: the kernel picks)",
    ),
    "MOONCAKE_BOOTSTRAP_HOST": Variable(
        "bootstrap_host",
        "0.0.0.0",
        _text,
        "0.0.0.0",
        "bind address of the bootstrap server (127.0.0.1 keeps it local)",
    ),
    "MOONCAKE_BOOTSTRAP_TOKEN": Variable(
        "bootstrap_token",
        None,
        lambda env, name, _: env.get(name) or None,
        "unset",
        "shared secret for this series' endpoints (same value everywhere); required off loopback",
    ),
    "MOONCAKE_BOOTSTRAP_INSECURE": Variable(
        "bootstrap_insecure",
        False,
        _on,
        "off",
        "`1`: serve the endpoints without a token on a non-loopback bind (trusted network only)",
    ),
    "MOONCAKE_MODEL_ID": Variable(
        "model_id",
        None,
        lambda env, name, _: _model_id(env),
        "unset",
        "names the weights in the KV fingerprint instead of the identity read from the weight files",
    ),
}


def _io_cpus(env: Mapping[str, str], name: str) -> frozenset[int] | None:
    raw = env.get(name, "").strip()
    if not raw or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = parse_cpu_list(raw)
    missing = cpus - set(range(os.cpu_count() or 1))
    if not cpus or missing:
        raise ConfigError(
            f"{name}={raw!r}: CPUs {sorted(missing)} do not exist on this host"
        )
    return cpus


def _sources(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(normalize_source(u) for u in env.get(name, "").split(",") if u.strip())


def _faults(env: Mapping[str, str]) -> FaultConfig:
    delay_raw = env.get("MOONCAKE_FAULT_DELAY_WRITE", "").strip()
    delay_len, delay_s = None, 0.0
    if delay_raw:
        length, _, secs = delay_raw.partition(":")
        try:
            delay_len, delay_s = int(length), float(secs)
        except ValueError:
            raise ConfigError(
                "MOONCAKE_FAULT_DELAY_WRITE must be PROMPT_LEN:SECONDS, got "
                f"{delay_raw!r}"
            ) from None
    hold_raw = env.get("MOONCAKE_FAULT_HOLD_WRITE", "").strip()
    hold = (None, 0, 0.0)
    if hold_raw:
        try:
            n, w, secs = hold_raw.split(":")
            hold = (int(n), int(w), float(secs))
        except ValueError:
            raise ConfigError(
                "MOONCAKE_FAULT_HOLD_WRITE must be PROMPT_LEN:WRITES:SECONDS, "
                f"got {hold_raw!r}"
            ) from None
    fail_raw = env.get("MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN", "").strip()
    fail_len, fail_rank = None, None
    if fail_raw:
        try:
            n, _, rank = fail_raw.partition("@")
            fail_len, fail_rank = int(n), int(rank) if rank else None
            if fail_len < 0 or (fail_rank or 0) < 0:
                raise ValueError(fail_raw)
        except ValueError:
            raise ConfigError(
                "MOONCAKE_FAULT_FAIL_WRITE_PROMPT_LEN must be PROMPT_LEN or "
                f"PROMPT_LEN@TP_RANK, got {fail_raw!r}"
            ) from None
    return FaultConfig(
        hold_write_prompt_len=hold[0],
        hold_write_after=hold[1],
        hold_write_s=hold[2],
        zero_recv_block=_opt_int(env, "MOONCAKE_FAULT_ZERO_RECV_BLOCK"),
        fail_write_prompt_len=fail_len,
        fail_write_rank=fail_rank,
        delay_write_prompt_len=delay_len,
        delay_write_s=delay_s,
        fence_blind=_flag(env, "MOONCAKE_FAULT_FENCE_BLIND"),
        keep_asking_source=env.get("MOONCAKE_FAULT_KEEP_ASKING_SOURCE") or None,
    )


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def normalize_source(url: str) -> str:
    """'HTTP://Host:9000/' -> 'http://host:9000' (allowlist comparison)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url.strip())
        port = u.port  # raises ValueError on a port that is not a number in range
    except ValueError:
        port = None
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or port is None:
        raise ConfigError(f"MOONCAKE_PUSH_SOURCES: {url!r} is not http(s)://host:port")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{u.scheme}://{host}:{port}"


MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")


def _model_id(env: Mapping[str, str]) -> str | None:
    """MOONCAKE_MODEL_ID: one printable word (shown in the fingerprint and warnings)."""
    raw = env.get("MOONCAKE_MODEL_ID", "").strip()
    if not raw:
        return None
    if not MODEL_ID_PATTERN.fullmatch(raw):
        raise ConfigError(
            f"MOONCAKE_MODEL_ID must be 1 to 128 characters of A-Z a-z 0-9 "
            f"._:/@+=- (no spaces), got {raw[:160]!r}"
        )
    return raw


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    return int(_number(env, name, 0, integer=True))


@functools.cache
def load() -> ExtConfig:
    """This process's configuration (the environment as of the first call)."""
    return ExtConfig.from_env()
