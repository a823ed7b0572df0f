"""Faults on a two-host cluster, each at a moment the connector itself marks.

P (prefill, also the push source C) and D (decode) run on hosts of their own
(network namespaces on a bridge, harness/netns.py): every byte between them, and
between the client and them, crosses links this module can cut, throttle or
lose. The moment of a fault comes from the connector, not from a sleep:
``MOONCAKE_FAULT_HOLD_WRITE=N:W:S`` makes P's writer wait S seconds after the
W-th write of any transfer of an N-token prompt, and the fault is applied once
``GET /layerwise/transfers`` shows that transfer at W writes.

After every fault these must hold (each scenario measures them; the tests assert):
every request ends (success, or a clear error) within its deadline; every
successful answer matches a from-scratch reference (KV-sensitive logprobs);
KV usage of every surviving instance returns to 0; the cluster serves a new
P->D request afterwards, a restarted peer without restarting the other side.

The cut rows (``CUT_SCENARIOS``) also look at the blocks D reuses afterwards.
They run on a cluster of their own whose hosts keep the kernel's default
``net.ipv4.tcp_orphan_retries``: there a connection the transport dropped during a
cut keeps retransmitting what it had queued once the link is back, so a failed
write's bytes can still land (docs/results/2026-11-27-cut-for-good.md). Right
after the faulted request ends, D is filled: local requests that together take
every block D can hand out, once each, in the order D hands them out. After the
late-byte window every filler is read back through D's prefix cache and compared
with a from-scratch reference, so a late byte in any reused block shows up as a
wrong answer.

The scenarios run from ``python -m microbench.faults`` (the whole matrix) and
from tests/integration/test_faults.py and test_faults_cut.py (the CI subset).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.correctness import compare, reference_completion
from harness.kv_usage import wait_no_blocks_in_use
from harness.late_bytes import sockets
from harness.launcher import BLOCK, Cluster, Instance, InstanceSpec
from harness.model import ModelShape, ensure_model
from harness.netns import netem_available
from harness.pd_client import (
    Completion,
    RequestFailed,
    complete,
    engine_id,
    layerwise_transfers,
    model_name,
    pd_generate,
    push_stats,
    wait_for_matched_blocks,
)
from harness.prompts import random_prompt
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    cached_tokens_of_whole_prompt,
)

HOLD_LEN = 1536  # prompts of this length hold P's writer ...
HOLD_AFTER = 10  # ... after this many layer writes ...
HOLD_S = 3.0  # ... for this long: the moment faults are applied
PUSH_TURN1, PUSH_TURN2 = 640, 700  # push: C's writes of a 700-token turn 2 are late
PUSH_DELAY_S = 6.0
NORMAL_LEN = 1024  # layer-wise, no fault hook
LAYERWISE_MIN_TOKENS = 256
POSTHOC_LEN = 200  # below LAYERWISE_MIN_TOKENS: upstream's post-hoc pull
LAYERWISE_TIMEOUT_S = 20.0
ENGINE_TIMEOUT_S = 5  # MC_TRANSFER_TIMEOUT: the engine's sync call gives up after this
# Each host's kernel gives up on an orphaned connection after one retransmission
# (net.ipv4.tcp_orphan_retries), so the bound on a write is the engine's floor:
# 5 + 5 + 61 s (connector/common/config.py, stalled_delivery_bound_s); with the
# kernel's default (205.4 s instead of 61) D's pull give-up would have to be minutes.
ORPHAN_RETRIES = 1
# ... and on a connect after two SYN retransmissions past the linear ones
# (net.ipv4.tcp_syn_retries; 11 s with 4 linear ones instead of 131): the
# transport's reconnect for a write's queued slices after its watchdog
# (config.engine_reconnect_s, 16 s) ends within those 61 s.
SYN_RETRIES = 2
# VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: D's pull gives up 60 s after it, which must
# come after P's LAYERWISE_TIMEOUT_S + the bound on a write (20 + 71 s)
ABORT_TIMEOUT_S = 35
PUSH_TIMEOUT_S = 10.0
# the longest any request may take under these faults: D's pull socket gives up at
# ABORT_TIMEOUT_S + 60 s (connector/common/config.py), plus a prefill and a decode
REQUEST_DEADLINE_S = ABORT_TIMEOUT_S + 60 + 60
# The cut rows' cluster: the kernel's default orphan retries (0, i.e. 8), so the bound
# on a write is 5 + 5 + 205.4 s and D's pull must wait longer than P's timeout plus
# that (20 + 215.4 s): its give-up is CUT_ABORT_TIMEOUT_S + 60.
CUT_ABORT_TIMEOUT_S = 180
CUT_REQUEST_DEADLINE_S = CUT_ABORT_TIMEOUT_S + 60 + 60
# The cut row with P's fence blind: P holds its failed write 205.4 s (the kernel's
# default orphan retries) from the failure, which comes up to ~40 s into the cut:
# D's pull must wait past that (give-up at this + 60 s).
BLIND_ABORT_TIMEOUT_S = 240
BLIND_REQUEST_DEADLINE_S = BLIND_ABORT_TIMEOUT_S + 60 + 60
# > the transport's 30 s no-progress watchdog (after the writer resumes): every
# task of the write in flight turns FAILED while the data network is still cut
CUT_PAST_S = 45.0
# C's push write starts PUSH_DELAY_S into the cut and stalls; the transport's watchdog
# drops its connections ~36 s into the cut, the kernel retransmits their queues until
# ~57 s (51 s after the stall) and gives up on them after ~108 s. Measured here, the
# engine reported the write FAILED only after the data network was back (12-19 s
# after the watchdog), so on this stack the push's late bytes land before C answers
# even without the fence (docs/results/2026-11-27-faults-cut.md).
PUSH_CUT_PAST_S = 52.0
# after the data network is back, a dropped connection retransmits what it had
# queued at its next backed-off timer (up to ~50 s later after a cut this long):
# fillers are read back once P's kernel holds no unsent byte for D (observed),
# at least LATE_MIN_S and at most LATE_MAX_S after the cut ended
LATE_MIN_S = 5.0
LATE_MAX_S = 150.0
# D's KV cache on the cut rows' cluster: small, so that the fillers take every block
CUT_D_BLOCKS = 80
FIRST_FILLER_BLOCKS = 16  # not read back: its blocks are taken by the read-backs
FILLER_BLOCKS = 8
IDLE_GAPS_S = (5.0, 30.0, 100.0)  # tcp_idle_gap: transfers after this long idle
SHORT_DOWN_S = 4.0  # < ENGINE_TIMEOUT_S: the writes resume where they stopped
LONG_DOWN_S = 30.0  # > ENGINE_TIMEOUT_S and > LAYERWISE_TIMEOUT_S: the transfer fails
# > ENGINE_TIMEOUT_S, < the transport's 30 s no-progress watchdog, and short enough that
# the transfer still ends within LAYERWISE_TIMEOUT_S (TCP's retransmission back-off
# adds up to ~4 s after the link is up): the window in which the engine's own call
# returned -1 while its bytes were still on their way.
ENGINE_TIMEOUT_DOWN_S = 9.0

# vLLM's API server closes a keep-alive connection idle for this long (its default
# is 5 s). An answer it "sent" during a cut is still queued in P's kernel then, and
# closing the socket makes it an orphan, which ORPHAN_RETRIES=1 kills at once: the
# client never gets P's answer (seen on link_down_engine_timeout: P's one-token
# answer queued 4 s into the 9 s cut, the socket closed 5 s later and was gone a
# second after). Kept open, the socket retransmits until the link is back.
HTTP_KEEP_ALIVE_S = 300

FAULT_ENV = {
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(HTTP_KEEP_ALIVE_S),
    "MOONCAKE_LAYERWISE": "1",
    "MOONCAKE_LAYERWISE_MIN_TOKENS": str(LAYERWISE_MIN_TOKENS),
    "MOONCAKE_FAULT_HOLD_WRITE": f"{HOLD_LEN}:{HOLD_AFTER}:{HOLD_S}",
    "MOONCAKE_FAULT_DELAY_WRITE": f"{PUSH_TURN2}:{PUSH_DELAY_S}",
    "MOONCAKE_LAYERWISE_TIMEOUT_S": str(LAYERWISE_TIMEOUT_S),
    "MC_TRANSFER_TIMEOUT": str(ENGINE_TIMEOUT_S),
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S),
    "MOONCAKE_PUSH_TIMEOUT_S": str(PUSH_TIMEOUT_S),
    "MOONCAKE_PUSH_CLOCK_SKEW_S": "1",
}


def cluster_specs(
    model: str, kernel_defaults: bool = False, fence_blind: bool = False
) -> list[InstanceSpec]:
    """P and D, armed with the fault hooks above. ``kernel_defaults``: the cut rows'
    cluster (the kernel's own orphan and SYN retries, D's pull waiting accordingly,
    and a small KV cache on D). ``fence_blind``: P's send-queue fence reads nothing,
    as where the kernel cannot be read; it must hold a failed write for the bound,
    past which D's pull must wait (BLIND_ABORT_TIMEOUT_S)."""
    args = ["--enable-prompt-tokens-details"]
    common = dict(
        model=model,
        kv_cache_gib=2,
        max_model_len=4096,
        env=dict(FAULT_ENV),
        sysctls={
            "net.ipv4.tcp_orphan_retries": ORPHAN_RETRIES,
            "net.ipv4.tcp_syn_retries": SYN_RETRIES,
        },
        extra_args=args,
    )
    decode_args = args
    if kernel_defaults:
        common["env"]["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(CUT_ABORT_TIMEOUT_S)
        common["sysctls"] = {}
        decode_args = [*args, "--num-gpu-blocks-override", str(CUT_D_BLOCKS)]
    if fence_blind:
        common["env"]["MOONCAKE_FAULT_FENCE_BLIND"] = "1"
        common["env"]["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(
            BLIND_ABORT_TIMEOUT_S
        )
    return [
        InstanceSpec("prefill", role="kv_producer", cores="0", **common),
        InstanceSpec(
            "decode",
            role="kv_consumer",
            cores="1",
            **{**common, "extra_args": decode_args},
        ),
    ]


def fault_cluster(
    log_dir: Path, kernel_defaults: bool = False, fence_blind: bool = False
) -> Cluster:
    """P and D, each on a host of its own, armed with the fault hooks above."""
    return Cluster(
        cluster_specs(str(ensure_model(ModelShape())), kernel_defaults, fence_blind),
        log_dir,
        hosts=True,
    )


@dataclass
class Outcome:
    """What one fault did, over its runs: the result pages' and the tests' figures."""

    fault: str
    runs: int = 0
    requests: int = 0
    ok: int = 0  # answered and correct
    ended_with_error: int = 0  # ended with an error the client could see (not lost)
    lost: int = 0  # did not end within REQUEST_DEADLINE_S
    wrong: int = 0  # answered from wrong KV
    stranded_runs: int = 0  # runs after which some instance kept KV blocks
    recovery_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: str | None = None
    must_succeed: bool = False  # no request of this fault may end with an error
    # the cut rows: D's blocks reused after the fault, read back after the
    # late-byte window
    reused_blocks_checked: int = 0
    reused_wrong: int = 0  # read-backs that differ from the reference
    reused_unchecked: int = 0  # read-backs that did not come from the fillers' blocks
    ended_after_cut_s: list[float] = field(default_factory=list)

    def record(self, status: str, detail: str = "") -> None:
        self.requests += 1
        if status == "ok":
            self.ok += 1
        elif status == "error":
            self.ended_with_error += 1
            if detail and len(self.errors) < 5:
                self.errors.append(detail[:300])
        elif status == "lost":
            self.lost += 1
            self.errors.append(detail[:300])
        else:
            self.wrong += 1
            self.errors.append(detail[:300])

    @property
    def holds(self) -> bool:
        return self.skipped is not None or (
            self.lost == 0
            and self.wrong == 0
            and self.stranded_runs == 0
            and self.reused_wrong == 0
            and self.reused_unchecked == 0
            and len(self.recovery_s) == self.runs
            and self.requests > 0
            and (not self.must_succeed or self.ok == self.requests)
        )


class FaultBench:
    """Runs fault scenarios on one two-host cluster; owns the cluster's recovery."""

    def __init__(
        self, cluster: Cluster, request_deadline_s: float | None = None
    ) -> None:
        self.cluster = cluster
        # the longest a request may take on this cluster (REQUEST_DEADLINE_S by default)
        self.deadline_s = request_deadline_s or REQUEST_DEADLINE_S
        self.p: Instance = cluster["prefill"]
        self.d: Instance = cluster["decode"]
        self.topology = cluster.topology
        assert self.topology is not None, "FaultBench needs Cluster(hosts=True)"
        self._seed = 50_000
        self.pool = cf.ThreadPoolExecutor(8)

    def prompt(self, n: int) -> list[int]:
        self._seed += 1
        return random_prompt(n, seed=self._seed)

    # -- measurements -----------------------------------------------------------

    def layerwise_transfers(self) -> dict[str, dict]:
        got = layerwise_transfers(self.p.bootstrap_url, timeout=5)
        return {t["transfer_id"]: t for t in got["transfers"]}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def wait_writes(self, transfer_id: str, at_least: int, timeout: float = 60) -> None:
        """Until P's transfer has done ``at_least`` writes (the hold's moment)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.layerwise_transfers().get(transfer_id)
            if t and t["writes"] >= at_least:
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"transfer {transfer_id} never reached {at_least} writes on P"
        )

    def start_pd(self, ids: list[int], transfer_id: str) -> cf.Future:
        return self.pool.submit(
            pd_generate,
            self.p.url,
            self.p.bootstrap_url,
            self.d.url,
            ids,
            max_tokens=4,
            logprobs=5,
            transfer_id=transfer_id,
            timeout=self.deadline_s,
        )

    def settle(
        self, out: Outcome, fut: cf.Future, ids: list[int], from_peer: bool = False
    ) -> None:
        """The request's end: ok and correct, a clear error, lost, or wrong.
        ``from_peer``: ok also needs D's KV to have come from P (all but the last
        token cached on D, and P's transfer completed), not from a local recompute."""
        try:
            res = fut.result(timeout=self.deadline_s + 10)
        except cf.TimeoutError:
            out.record("lost", f"no answer within {self.deadline_s + 10:.0f} s")
            return
        except RequestFailed as exc:
            out.record("error", str(exc))
            return
        if (
            from_peer and len(ids) >= LAYERWISE_MIN_TOKENS
        ):  # layer-wise (post-hoc: no entry)
            done = self.layerwise_transfers().get(res.transfer_id, {}).get("outcome")
            if done != "completed":
                out.record(
                    "wrong", f"P's transfer ended {done!r}, yet D answered as if not"
                )
                return
        self.check(
            out,
            res.decode,
            ids,
            self.d,
            expected_cached=cached_tokens_of_whole_prompt(len(ids))
            if from_peer
            else None,
        )

    def check(
        self,
        out: Outcome,
        got,
        ids: list[int],
        inst: Instance,
        expected_cached: int | None = None,
    ) -> None:
        ref = reference_completion(inst.url, ids, max_tokens=len(got.token_ids) or 4)
        verdict = compare(got, ref, expected_cached_tokens=expected_cached)
        out.record("ok" if verdict.ok else "wrong", "; ".join(verdict.problems))

    def baseline(self, out: Outcome, *instances: Instance) -> None:
        usage = wait_no_blocks_in_use(*(i.url for i in instances), timeout=180)
        if any(u != 0.0 for u in usage):
            out.stranded_runs += 1
            out.errors.append(f"KV blocks still in use after the fault: {usage}")

    def recover(self, out: Outcome, since: float, deadline_s: float = 240) -> None:
        """Time from ``since`` until a fresh P->D request succeeds and is correct."""
        end = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < end:
            ids = self.prompt(NORMAL_LEN)
            try:
                res = pd_generate(
                    self.p.url,
                    self.p.bootstrap_url,
                    self.d.url,
                    ids,
                    max_tokens=4,
                    logprobs=5,
                    timeout=120,
                )
            except (RequestFailed, httpx.HTTPError) as exc:
                last = str(exc)
                time.sleep(1)
                continue
            ref = reference_completion(self.d.url, ids, max_tokens=4)
            if compare(res.decode, ref, expected_cached_tokens=None).ok:
                out.recovery_s.append(round(time.monotonic() - since, 2))
                return
            last = "answer after the fault did not match the reference"
        out.errors.append(f"not recovered within {deadline_s:.0f} s: {last[:200]}")

    # -- scenarios ----------------------------------------------------------------

    def no_fault(self, out: Outcome) -> None:
        """The three capabilities across the link: post-hoc pull, layer-wise, push."""
        t0 = time.monotonic()
        out.must_succeed = True
        for n in (POSTHOC_LEN, NORMAL_LEN):
            ids = self.prompt(n)
            self.settle(
                out, self.start_pd(ids, f"xfer-{uuid.uuid4().hex}"), ids, from_peer=True
            )
        turn2, got = self.push_turn2()
        if (got.cached_tokens or 0) < (PUSH_TURN1 // BLOCK) * BLOCK:
            out.record(
                "wrong", f"push moved nothing: cached_tokens {got.cached_tokens}"
            )
        else:
            self.check(out, got, turn2, self.d)
        self.baseline(out, self.p, self.d)
        out.recovery_s.append(round(time.monotonic() - t0, 2))

    def _link_down(
        self, out: Outcome, down_s: float, resumes: bool, nic: bool = False
    ) -> None:
        """P's link cut for ``down_s`` at the hold's moment, then restored;
        ``nic``: P's NIC loses its carrier instead of the link failing beyond it."""
        ids, xfer = self.prompt(HOLD_LEN), f"xfer-{uuid.uuid4().hex}"
        fut = self.start_pd(ids, xfer)
        self.wait_writes(xfer, HOLD_AFTER)
        (self.topology.nic_down if nic else self.topology.link_down)("prefill")
        time.sleep(down_s)
        self.topology.link_up("prefill")
        up = time.monotonic()
        out.must_succeed = resumes
        self.settle(out, fut, ids, from_peer=resumes)
        # P reports a transfer's end only after its last write returned
        t = self.layerwise_transfers().get(xfer, {})
        if t.get("ended_at") is None or (t.get("last_write_end") or 0) > t["ended_at"]:
            out.record(
                "wrong", f"P reported the transfer's end before its last write: {t}"
            )
        self.baseline(out, self.p, self.d)
        self.recover(out, up)

    def link_down_short(self, out: Outcome) -> None:
        """P's link down for SHORT_DOWN_S while it writes a transfer, then up."""
        self._link_down(out, SHORT_DOWN_S, resumes=True)

    def nic_down_short(self, out: Outcome) -> None:
        """P's NIC without carrier for SHORT_DOWN_S while it writes, then back: P's
        own stack drops what it sends meanwhile (docs/faults.md: on vLLM 0.32.0
        Mooncake's TCP transport can leave P's connections to D without progress
        until its 30 s watchdog, and the request then ends with an error)."""
        self._link_down(out, SHORT_DOWN_S, resumes=True, nic=True)

    def link_down_engine_timeout(self, out: Outcome) -> None:
        """P's link down for ENGINE_TIMEOUT_DOWN_S: longer than MC_TRANSFER_TIMEOUT,
        shorter than the transport's no-progress watchdog. A write is in flight
        until the engine reports it done or failed, never just because the call's
        own timeout passed: the writes resume once the link is up, the transfer
        completes and D decodes from P's KV. (Ended on the engine's -1 instead, P
        would answer D "failed" while the bytes were still on their way.)"""
        self._link_down(out, ENGINE_TIMEOUT_DOWN_S, resumes=True)

    def link_down_long(self, out: Outcome) -> None:
        """P's link down for LONG_DOWN_S (past the engine's and the transfer's timeouts)."""
        self._link_down(out, LONG_DOWN_S, resumes=False)

    def _degraded_link(self, out: Outcome, degrade: Callable[[], None]) -> None:
        """One layer-wise transfer over P's degraded link, then the link restored."""
        degrade()
        out.must_succeed = True
        try:
            ids = self.prompt(NORMAL_LEN)
            self.settle(
                out, self.start_pd(ids, f"xfer-{uuid.uuid4().hex}"), ids, from_peer=True
            )
        finally:
            self.topology.clear("prefill")
        up = time.monotonic()
        self.baseline(out, self.p, self.d)
        self.recover(out, up)

    def bandwidth_limit(self, out: Outcome) -> None:
        """P's link throttled to 200 Mbit/s (tc tbf) for a layer-wise transfer."""
        self._degraded_link(out, lambda: self.topology.limit("prefill", mbit=200))

    def kill_prefill(self, out: Outcome) -> None:
        """SIGKILL P while it writes a layer-wise transfer; restart it; D untouched."""
        ids, xfer = self.prompt(HOLD_LEN), f"xfer-{uuid.uuid4().hex}"
        fut = self.start_pd(ids, xfer)
        self.wait_writes(xfer, HOLD_AFTER)
        self.p.kill()
        self.settle(out, fut, ids)
        self.baseline(out, self.d)
        self.p.restart(self.cluster.push_sources)
        self.recover(out, time.monotonic())

    def kill_decode(self, out: Outcome) -> None:
        """SIGKILL D while P writes into it; restart it; P untouched."""
        ids, xfer = self.prompt(HOLD_LEN), f"xfer-{uuid.uuid4().hex}"
        fut = self.start_pd(ids, xfer)
        self.wait_writes(xfer, HOLD_AFTER)
        self.d.kill()
        try:  # D's client connection dies with D: a clear error, never an answer
            fut.result(timeout=self.deadline_s)
            out.record("wrong", "D answered although it was killed")
        except RequestFailed as exc:
            out.record("error", str(exc))
        except cf.TimeoutError:
            out.record("lost", "the P/D request never ended after D was killed")
        self.baseline(out, self.p)
        self.d.restart(self.cluster.push_sources)
        self.recover(out, time.monotonic())

    def push_turn2(self) -> tuple[list[int], Completion]:
        """A session's turn 1 on C (= P), then turn 2 on D with push_from C (not
        delayed by the fault hooks): (turn 2, D's answer)."""
        turn1 = self.prompt(PUSH_TURN1)
        complete(self.p.url, turn1, max_tokens=1, logprobs=None, timeout=120)
        wait_for_matched_blocks(self.p.bootstrap_url, turn1, PUSH_TURN1 // BLOCK)
        turn2 = turn1 + self.prompt(40)
        return turn2, complete(
            self.d.url,
            turn2,
            max_tokens=4,
            logprobs=5,
            timeout=120,
            kv_transfer_params={"push_from": self.p.bootstrap_url},
        )

    def _push_in_delayed_write(self) -> tuple[list[int], cf.Future]:
        """Turn 1 on C (= P), then turn 2 on D with push_from C; returns once C took
        the push and sits in its write's fault delay (PUSH_DELAY_S before the
        engine call): (turn 2, D's pending answer)."""
        turn1 = self.prompt(PUSH_TURN1)
        complete(self.p.url, turn1, max_tokens=1, logprobs=None, timeout=120)
        wait_for_matched_blocks(self.p.bootstrap_url, turn1, PUSH_TURN1 // BLOCK)
        turn2 = turn1 + self.prompt(PUSH_TURN2 - PUSH_TURN1)
        pushes = push_stats(self.p.bootstrap_url, timeout=5)["pushes"]
        fut = self.pool.submit(
            complete,
            self.d.url,
            turn2,
            max_tokens=4,
            logprobs=5,
            timeout=self.deadline_s,
            kv_transfer_params={"push_from": self.p.bootstrap_url},
        )
        deadline = time.monotonic() + PUSH_DELAY_S
        # until C took the push: then it sits in its (delayed) write
        while push_stats(self.p.bootstrap_url, timeout=5)["pushes"] == pushes:
            if time.monotonic() > deadline:
                raise TimeoutError("C never started the push")
            time.sleep(0.05)
        return turn2, fut

    def _push_answer(
        self, out: Outcome, fut: cf.Future, when: str
    ) -> Completion | None:
        """D's answer to the pushed turn, or None once its end was recorded (lost
        past the deadline, or a clear error)."""
        try:
            return fut.result(timeout=self.deadline_s + 10)
        except cf.TimeoutError:
            out.record("lost", f"D's push request never ended {when}")
        except RequestFailed as exc:
            out.record("error", str(exc))
        return None

    def kill_push_source(self, out: Outcome) -> None:
        """SIGKILL C (= P) while D waits for its /push_blocks; D must fall back."""
        out.must_succeed = True  # D prefills locally
        turn2, fut = self._push_in_delayed_write()
        self.p.kill()
        got = self._push_answer(out, fut, "after C was killed")
        if got is not None:
            self.check(out, got, turn2, self.d)
        self.baseline(out, self.d)
        self.p.restart(self.cluster.push_sources)
        self.recover(out, time.monotonic())

    def push_link_down_engine_timeout(self, out: Outcome) -> None:
        """C's link down from inside its /push_blocks (during the write's fault delay)
        until past MC_TRANSFER_TIMEOUT after the engine write started: the write is
        in flight until the engine reports it done or failed, so it resumes once the
        link is up and C answers ok. (Ended on the engine's -1, C would answer
        "failed" while its bytes were still on their way.) The window is longer
        than the push's budget: D prefills the turn itself meanwhile, in other
        blocks, and keeps the pushed ones until C answered; its answer must be
        right either way."""
        out.must_succeed = True
        # C's engine has a connection to D before the cut (a first write opens the
        # segment; a handshake over a cut link fails at once, before any byte moves)
        self.push_turn2()
        before = push_stats(self.p.bootstrap_url, timeout=5)
        turn2, fut = self._push_in_delayed_write()
        self.topology.link_down("prefill")
        time.sleep(PUSH_DELAY_S + ENGINE_TIMEOUT_S + 2)
        self.topology.link_up("prefill")
        up = time.monotonic()
        got = self._push_answer(out, fut, "after C's link came back")
        if got is not None:
            self.check(out, got, turn2, self.d)
        ended = before["ok"] + before["failed"]
        deadline = time.monotonic() + self.deadline_s
        while True:
            after = push_stats(self.p.bootstrap_url, timeout=5)
            if after["ok"] + after["failed"] > ended or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if after["ok"] == before["ok"] or after["failed"] > before["failed"]:
            out.record(
                "wrong",
                f"C's push did not end ok once its link was back (ok {before['ok']} -> "
                f"{after['ok']}, failed {before['failed']} -> {after['failed']}): "
                "it ended on the engine's -1 while its bytes were on their way",
            )
        self.baseline(out, self.p, self.d)
        self.recover(out, up)

    def abort_decode(self, out: Outcome, times: int = 20) -> None:
        """The client drops D's request mid layer-wise transfer, ``times`` in a row."""
        d_host, d_port = self.d.spec.ip, self.d.port
        model = model_name(self.d.url)
        for _ in range(times):
            ids, xfer = self.prompt(HOLD_LEN), f"xfer-{uuid.uuid4().hex}"
            p_fut = self.pool.submit(
                complete,
                self.p.url,
                ids,
                max_tokens=1,
                logprobs=None,
                timeout=self.deadline_s,
                kv_transfer_params={"do_remote_decode": True, "transfer_id": xfer},
            )
            body = json.dumps(
                {
                    "model": model,
                    "prompt": ids,
                    "max_tokens": 4,
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "transfer_id": xfer,
                        "remote_bootstrap_addr": self.p.bootstrap_url,
                        "remote_engine_id": engine_id(self.p.bootstrap_url),
                    },
                }
            )
            conn = http.client.HTTPConnection(d_host, d_port, timeout=self.deadline_s)
            conn.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            self.wait_writes(xfer, HOLD_AFTER)
            conn.sock.close()  # the client disconnects: vLLM aborts D's request
            conn.close()
            try:
                p_fut.result(timeout=self.deadline_s)
                out.record(
                    "error", ""
                )  # aborted on purpose: it ended, no answer wanted
            except (cf.TimeoutError, RequestFailed) as exc:
                out.record(
                    "lost", f"P's side of an aborted request did not end: {exc!r}"
                )
        up = time.monotonic()
        self.baseline(out, self.p, self.d)
        ended = [
            t
            for t in self.layerwise_transfers().values()
            if t["prompt_len"] == HOLD_LEN
        ]
        if any(t["ended_at"] is None for t in ended):
            out.stranded_runs += 1
            out.errors.append("a transfer of an aborted request never ended on P")
        self.recover(out, up)

    def packet_loss(self, out: Outcome) -> None:
        """5% loss on P's link (tc netem) during a layer-wise transfer."""
        self._degraded_link(out, lambda: self.topology.netem("prefill", "loss", "5%"))

    def link_delay(self, out: Outcome) -> None:
        """20 ms each way on P's link (tc netem) during a layer-wise transfer."""
        self._degraded_link(
            out, lambda: self.topology.netem("prefill", "delay", "20ms")
        )

    # -- the cut rows: D's reused blocks, read back after the late-byte window -----

    def fill_decode(self) -> list[list[int]]:
        """Local requests on D, one after another, that together take CUT_D_BLOCKS - 1
        blocks (all D can hand out) in the order D hands them out: every free block
        once, the ones freed last (the faulted request's) by the last fillers. Each
        is a whole number of blocks, so all its blocks are cached. Returns the
        prompts, the first (FIRST_FILLER_BLOCKS, never read back) first."""
        left = CUT_D_BLOCKS - 1
        fillers = []
        while left > 0:
            n = min(left, FIRST_FILLER_BLOCKS if not fillers else FILLER_BLOCKS)
            ids = self.prompt(n * BLOCK)
            complete(self.d.url, ids, max_tokens=1, logprobs=None, timeout=120)
            fillers.append(ids)
            left -= n
        return fillers

    def read_back(self, out: Outcome, fillers: list[list[int]]) -> None:
        """Every filler but the first, newest first, read through D's prefix cache (one
        token more, so D reads all its blocks), against a from-scratch reference.
        Each read-back takes one new block: the oldest free ones, the first
        filler's."""
        extra = self.prompt(1)
        got = {}
        for i in range(len(fillers) - 1, 0, -1):
            got[i] = complete(
                self.d.url, fillers[i] + extra, max_tokens=2, logprobs=5, timeout=120
            )
        for i, answer in got.items():
            ids = fillers[i] + extra
            if (answer.cached_tokens or 0) != len(fillers[i]):
                out.reused_unchecked += 1
                out.errors.append(
                    f"filler {i} was not read from D's cache ({answer.cached_tokens} of "
                    f"{len(fillers[i])} tokens cached): its blocks were not checked"
                )
                continue
            ref = reference_completion(self.d.url, ids, max_tokens=2)
            verdict = compare(answer, ref, expected_cached_tokens=None)
            out.reused_blocks_checked += len(fillers[i]) // BLOCK
            if not verdict.ok:
                out.reused_wrong += 1
                out.errors.append(
                    f"reused blocks of filler {i} changed after the fault: "
                    + "; ".join(verdict.problems)
                )

    def _cut_data_network(self) -> float:
        """The transfer engines' traffic between P and D cut both ways (HTTP and ZMQ
        still flow, as when the RDMA fabric fails and the front-end network does
        not: the end of a failed write reaches the peer while the write's bytes
        cannot). Returns when (monotonic)."""
        self.topology.data_link_down("prefill")
        self.topology.data_link_down("decode")
        return time.monotonic()

    def _cut(
        self, out: Outcome, fut: cf.Future, cut: float, cut_s: float = CUT_PAST_S
    ) -> tuple[list, float]:
        """Until ``cut_s`` after ``cut``, then the data network restored. D is
        filled as soon as the faulted request ended (during the cut, or after
        it). Returns (the fillers, when the data network came back)."""

        def ended() -> list[list[int]]:
            out.ended_after_cut_s.append(round(time.monotonic() - cut, 1))
            return self.fill_decode()

        fillers = None
        while time.monotonic() - cut < cut_s:
            if fillers is None and fut.done():
                fillers = ended()
            time.sleep(0.1)
        self.topology.clear("prefill")
        self.topology.clear("decode")
        up = time.monotonic()
        if fillers is None:
            cf.wait([fut], timeout=self.deadline_s + 10)  # settled by the caller
            if fut.done():
                fillers = ended()
        return fillers or [], up

    def wait_nothing_queued_for_d(self, out: Outcome, up: float) -> None:
        """Until P's kernel holds no unsent byte on any connection to D (sampled
        with ss in P's namespace), LATE_MIN_S after ``up`` at the earliest."""
        p_host, d_ip = self.topology.host("prefill"), self.topology.host("decode").ip
        time.sleep(max(0.0, up + LATE_MIN_S - time.monotonic()))
        while time.monotonic() - up < LATE_MAX_S:
            if sum(s["send_q"] for s in sockets(p_host, d_ip)) == 0:
                return
            time.sleep(0.5)
        out.errors.append(
            f"P still held unsent bytes for D {LATE_MAX_S:.0f} s after the cut"
        )

    def _after_cut(self, out: Outcome, fillers: list, up: float) -> None:
        self.wait_nothing_queued_for_d(out, up)
        if fillers:
            self.read_back(out, fillers)
        self.baseline(out, self.p, self.d)
        self.recover(out, up)

    def link_cut_past_progress_deadline(self, out: Outcome) -> None:
        """The data network between P and D cut for CUT_PAST_S while P writes a
        layer-wise transfer: past the transport's no-progress watchdog, so every
        task in flight turns FAILED while bytes of it are still queued in P's
        kernel. The request ends (an error, or D recomputes); the blocks D reuses
        afterwards hold no byte of it."""
        ids, xfer = self.prompt(HOLD_LEN), f"xfer-{uuid.uuid4().hex}"
        fut = self.start_pd(ids, xfer)
        self.wait_writes(xfer, HOLD_AFTER)
        fillers, up = self._cut(out, fut, self._cut_data_network())
        self.settle(out, fut, ids)
        t = self.layerwise_transfers().get(xfer, {})
        if t.get("ended_at") is None or (t.get("last_write_end") or 0) > t["ended_at"]:
            out.record(
                "wrong", f"P reported the transfer's end before its last write: {t}"
            )
        self._after_cut(out, fillers, up)

    def push_link_cut_past_progress_deadline(self, out: Outcome) -> None:
        """The data network between C (= P) and D cut for PUSH_CUT_PAST_S from inside
        C's /push_blocks write, past the transport's watchdog (the engine reports
        the write FAILED, here once the network is back). D's request ends
        (prefilled locally when C answers failed); the blocks D reuses hold no byte
        of it."""
        self.push_turn2()  # C's engine connected to D before the cut
        turn2, fut = self._push_in_delayed_write()
        fillers, up = self._cut(out, fut, self._cut_data_network(), PUSH_CUT_PAST_S)
        got = self._push_answer(out, fut, "after C's link came back")
        if got is not None:
            self.check(out, got, turn2, self.d)
        self._after_cut(out, fillers, up)

    def tcp_idle_gap(self, out: Outcome, gaps: tuple[float, ...] = IDLE_GAPS_S) -> None:
        """A layer-wise P->D transfer after each idle gap on the engines' TCP
        connections (kvcache-ai/Mooncake#4209: after ~5 s idle, slices rejected as
        queue-full for ~90 s): each ends within its deadline, correct or with a
        clear error."""
        ids = self.prompt(NORMAL_LEN)  # the connections exist before the first gap
        self.settle(out, self.start_pd(ids, f"xfer-{uuid.uuid4().hex}"), ids)
        for gap in gaps:
            time.sleep(gap)
            ids = self.prompt(NORMAL_LEN)
            self.settle(
                out, self.start_pd(ids, f"xfer-{uuid.uuid4().hex}"), ids, from_peer=True
            )
        up = time.monotonic()
        self.baseline(out, self.p, self.d)
        self.recover(out, up)


NEEDS_NETEM = {"packet_loss", "link_delay"}
SCENARIOS: dict[str, Callable[[FaultBench, Outcome], None]] = {
    "no_fault": FaultBench.no_fault,
    "link_down_short": FaultBench.link_down_short,
    "nic_down_short": FaultBench.nic_down_short,
    "link_down_engine_timeout": FaultBench.link_down_engine_timeout,
    "link_down_long": FaultBench.link_down_long,
    "bandwidth_limit": FaultBench.bandwidth_limit,
    "packet_loss": FaultBench.packet_loss,
    "link_delay": FaultBench.link_delay,
    "kill_prefill": FaultBench.kill_prefill,
    "kill_decode": FaultBench.kill_decode,
    "kill_push_source": FaultBench.kill_push_source,
    "push_link_down_engine_timeout": FaultBench.push_link_down_engine_timeout,
    "abort_decode_x20": FaultBench.abort_decode,
    "tcp_idle_gap": FaultBench.tcp_idle_gap,
}
# on the cluster with the kernel's own orphan retries (fault_cluster(kernel_defaults=True))
CUT_SCENARIOS: dict[str, Callable[[FaultBench, Outcome], None]] = {
    "link_cut_past_progress_deadline": FaultBench.link_cut_past_progress_deadline,
    "push_link_cut_past_progress_deadline": (
        FaultBench.push_link_cut_past_progress_deadline
    ),
}


def assert_reused_blocks_intact(out: Outcome) -> None:
    """A cut row's verdict on the blocks D reused after the fault (the tests')."""
    assert out.holds, out
    assert out.lost == 0 and out.wrong == 0 and out.stranded_runs == 0, out
    # every block D hands out but the first filler's was read back, unchanged
    assert out.reused_unchecked == 0 and out.reused_wrong == 0, out
    assert out.reused_blocks_checked == CUT_D_BLOCKS - 1 - FIRST_FILLER_BLOCKS, out
    assert len(out.recovery_s) == out.runs, out


# on a cut cluster whose P cannot read its kernel's send queues
# (fault_cluster(kernel_defaults=True, fence_blind=True)): held for the bound
BLIND_SCENARIOS: dict[str, Callable[[FaultBench, Outcome], None]] = {
    "link_cut_fence_blind": FaultBench.link_cut_past_progress_deadline,
}


def run_fault(bench: FaultBench, name: str, runs: int = 1) -> Outcome:
    out = Outcome(name)
    if name in NEEDS_NETEM and (why := netem_available()):
        out.skipped = why
        return out
    scenario = SCENARIOS.get(name) or CUT_SCENARIOS.get(name) or BLIND_SCENARIOS[name]
    for _ in range(runs):
        out.runs += 1
        scenario(bench, out)
    return out
