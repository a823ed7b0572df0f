# SPDX-License-Identifier: Apache-2.0
"""D's worker side of prefix push: post ``/push_blocks`` to C, end each push once.

Each PushJob becomes a :class:`PushTransfer`, ended once in ``finished_recving``
with the leading blocks that landed (PushOutcome). No byte after the end: C
starts no write past the deadline or budget sent with the request, and a push
ends only when C answered (its write returned), when it was never sent, or when
its hold (config.ExtConfig.push_hold_for_s) passed; until then its blocks stay
out of use. Proof of write: D plants random canaries at ``num_probes`` secret
positions and counts C's "ok" only if, after D read its own bytes there,
/push_proof answers the same bytes. Not covered: a small gap in a large push
may pass the sampling, written but wrong KV passes (D trusts its allowlisted
sources for content), and bytes landing after the proof.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vllm.logger import init_logger

from ..common.auth import request_headers
from ..common.config import ExtConfig
from ..common.gpu_order import (
    ComputeEvent,
    EventFactory,
    record_after_compute,
    wait_all,
)
from ..common.kv_reader import PROBE_BYTES, KVReader
from ..common.peer_client import SourceLanes
from .protocol import (
    MAX_PROBES,
    KVFingerprint,
    PushBlocksRequest,
    PushBlocksResponse,
    PushJob,
    PushOutcome,
    PushProofRequest,
    PushProofResponse,
    is_source_refusal,
)

logger = init_logger(__name__)

PUSH_THREADS_PER_SOURCE = 4


@dataclass
class PushTransfer:
    """One push into this instance's blocks: the owner of its end."""

    job: PushJob
    started: float  # monotonic
    deadline_unix_ms: int  # C starts no write after this (sent to C)
    hold_until: float  # monotonic: no write of C can land after this
    send_by: float = float("inf")  # monotonic: the request is not sent after this
    landed: int | None = None  # C's answer: leading blocks written (0: none)
    ended: bool = False
    due_told: bool = False  # told the scheduler it is past its budget
    # proof of write: secret positions (index into the job's blocks, KV tensor,
    # offset), the canaries planted there, and an event after their copies
    probes: list[tuple[int, int, int]] = field(default_factory=list)
    canaries: list[bytes] = field(default_factory=list)
    planted: ComputeEvent | None = None

    def answered(self, landed: int) -> None:
        if self.landed is None:
            self.landed = landed

    def try_end(self, now: float) -> int | None:
        """If the push can end now, end it (once) and return the blocks that landed."""
        if self.ended:
            return None
        if self.landed is not None:
            self.ended = True
            return self.landed
        if now >= self.hold_until:
            self.ended = True
            logger.warning(
                "push for %s from %s: no answer from the source within %.1f s; "
                "its blocks are recomputed locally",
                self.job.req_id,
                self.job.source,
                now - self.started,
            )
            return 0
        return None


class PushReceiver:
    def __init__(
        self,
        session: str,
        base_addrs: list[int],
        block_len: int,
        block_size: int,
        num_blocks: int,
        fingerprint: KVFingerprint,
        config: ExtConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        kv: KVReader | None = None,
        num_probes: int = MAX_PROBES,
        event_factory: EventFactory = record_after_compute,
        tp_rank: int = 0,
    ):
        self.session = session
        # this worker's rank: it asks the source's rank of the same number for its shard
        self.tp_rank = tp_rank
        self.base_addrs = list(base_addrs)
        self.block_len = block_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint
        self.config = config
        # proof of write (kv_reader.py); None only in tests that fake the bytes' path
        self.kv = kv
        self.num_probes = min(num_probes, MAX_PROBES)
        self._event_factory = event_factory  # CUDA: ordered after the canary copies
        self._rng = random.SystemRandom()
        self._clock = clock
        self._wall_clock = wall_clock
        # per source: its threads and connections; every call bounded in time and bytes
        self._lanes = SourceLanes("mooncake-push-recv", PUSH_THREADS_PER_SOURCE)
        self._lock = threading.Lock()
        self._transfers: dict[str, PushTransfer] = {}
        self._outcome: dict[
            str, int
        ] = {}  # reported in finished_recving, not yet in meta
        self._refused: set[str] = set()  # pushes the source refused, not yet in meta
        self._due: set[str] = set()  # past their budget with no answer, not yet in meta
        # the scheduler's push decisions by reason, as it last sent them (/metrics)
        self.decisions: dict[str, int] = {}

    def timeout_s(self, job: PushJob) -> float:
        """The push's timeout: the scheduler's, within MOONCAKE_PUSH_TIMEOUT_S."""
        cap = self.config.push_timeout_s
        return cap if job.timeout_s is None else min(cap, job.timeout_s)

    def hold_s(self, job: PushJob) -> float:
        """How long this push's blocks are kept if C never answers."""
        nbytes = len(job.dst_block_ids) * self.block_len * len(self.base_addrs)
        config = replace(self.config, push_timeout_s=self.timeout_s(job))
        return config.push_hold_for_s(
            nbytes,
            job.source_engine_timeout_s,
            job.source_tcp_orphan_retries,
            job.source_engine_no_progress_s,
            job.source_engine_reconnect_s,
        )

    def start(self, jobs: list[PushJob]) -> None:
        if not jobs:
            return
        now, wall = self._clock(), self._wall_clock()
        for job in jobs:
            timeout = self.timeout_s(job)
            t = PushTransfer(
                job,
                now,
                int((wall + timeout) * 1000),
                now + self.hold_s(job),
                now + timeout,
                probes=self.make_probes(job),
            )
            t.canaries = self.plant_canaries(job, t.probes)
            if t.probes and self.kv is not None:
                t.planted = self._event_factory(self.kv.tensor)
            with self._lock:
                self._transfers[job.req_id] = t
            try:
                self._lanes.submit(job.source_of(self.tp_rank), self._run, t)
            except RuntimeError as e:  # shut down: never sent
                logger.warning(
                    "push for %s from %s not sent: %s",
                    job.req_id,
                    job.source_of(self.tp_rank),
                    e,
                )
                with self._lock:
                    t.answered(0)

    def shutdown(self) -> None:
        """Cancel queued pushes, abort running calls, close the connections."""
        self._lanes.shutdown()

    def make_probes(self, job: PushJob) -> list[tuple[int, int, int]]:
        """Distinct random positions in the blocks asked for, the first block always
        among them; they leave this instance only after D read its bytes (_proof)."""
        if self.kv is None or not job.dst_block_ids:
            return []
        n, slots = len(job.dst_block_ids), len(self.base_addrs)
        words = self.block_len // PROBE_BYTES
        want = min(self.num_probes, n * slots * words)
        rng = self._rng
        probes: list[tuple[int, int, int]] = []
        while len(probes) < want:
            p = (
                rng.randrange(n) if probes else 0,
                rng.randrange(slots),
                PROBE_BYTES * rng.randrange(words),
            )
            if p not in probes:
                probes.append(p)
        return probes

    def plant_canaries(
        self, job: PushJob, probes: list[tuple[int, int, int]]
    ) -> list[bytes]:
        """Random bytes at the probes, in blocks this request owns and nothing reads
        before the push ended: a source that does not write cannot know them."""
        canaries = []
        for i, slot, off in probes:
            c = self._rng.getrandbits(8 * PROBE_BYTES).to_bytes(PROBE_BYTES, "little")
            assert self.kv is not None
            self.kv.write(slot, job.dst_block_ids[i], off, c)
            canaries.append(c)
        return canaries

    def request(self, t: PushTransfer, budget_ms: int) -> PushBlocksRequest:
        job = t.job
        return PushBlocksRequest(
            token_ids=list(job.token_ids),
            cache_salt=job.cache_salt,
            lora_name=job.lora_name,
            block_size=self.block_size,
            dst_session=self.session,
            dst_kv_base_addrs=self.base_addrs,
            dst_block_ids=list(job.dst_block_ids),
            first_block=job.first_block,
            block_len=self.block_len,
            request_id=job.req_id,
            deadline_unix_ms=t.deadline_unix_ms,
            budget_ms=budget_ms,
            dst_num_blocks=self.num_blocks,
            fingerprint=self.fingerprint,
            source_id=job.source_id,
            tp_rank=self.tp_rank,
        )

    def _run(self, t: PushTransfer) -> None:
        job, landed = t.job, 0
        try:
            # The canaries are in memory before C may write (their copies were
            # queued on the compute stream, CUDA): else C's write could land
            # first, or a canary overwrite pushed KV after the proof.
            wait_all([t.planted])
        except Exception as e:  # not sent: nothing of C can land
            logger.warning(
                "push for %s from %s not sent: waiting for its canaries failed: %r",
                job.req_id,
                job.source_of(self.tp_rank),
                e,
            )
            with self._lock:
                t.answered(0)
            return
        with self._lock:
            now = self._clock()
            budget_ms = int((t.send_by - now) * 1000)
            if t.ended or budget_ms <= 0:
                # It waited for a thread (its source's other pushes are slow) until
                # its start deadline, or its end: C is never asked, nothing lands.
                t.answered(0)
                if not t.ended:  # busy here: reported as a refusal, not a failure
                    self._refused.add(job.req_id)
                logger.warning(
                    "push for %s from %s not sent: %s",
                    job.req_id,
                    job.source_of(self.tp_rank),
                    "it already ended"
                    if t.ended
                    else f"its start deadline passed {-budget_ms} ms ago while it "
                    "waited for the source's earlier pushes",
                )
                return
        # the call's deadline is the hold: past it the push has ended anyway
        deadline = time.monotonic() + max(0.0, t.hold_until - now)
        resp: PushBlocksResponse | None = None
        try:
            # at rank 0 as before, so a source of an earlier release takes it
            first = {"tp_rank"} if self.tp_rank == 0 else None
            content = self.request(t, budget_ms).model_dump_json(exclude=first).encode()
            r = self._lanes.post(
                job.source_of(self.tp_rank),
                "/push_blocks",
                content,
                request_headers(self.config, "POST", "/push_blocks", content),
                deadline,
            )
            if r.status == 200:
                resp = PushBlocksResponse.model_validate_json(r.body)
                if resp.status != "ok":
                    logger.warning(
                        "push for %s from %s: %s %s",
                        job.req_id,
                        job.source_of(self.tp_rank),
                        resp.status,
                        resp.message,
                    )
            elif is_source_refusal(r.status, r.headers):
                with self._lock:
                    self._refused.add(job.req_id)
                logger.warning(
                    "push for %s from %s: refused, nothing written: HTTP %d %s",
                    job.req_id,
                    job.source_of(self.tp_rank),
                    r.status,
                    r.text(),
                )
            else:
                # Not the source's own answer (a proxy's 502/504, say, while the
                # source's write may still run): the blocks stay until the hold.
                logger.warning(
                    "push for %s from %s: HTTP %d %s, not an answer of the source's "
                    "own; its blocks are kept until the push's hold has passed "
                    "(%.0f s from its start), then recomputed locally",
                    job.req_id,
                    job.source_of(self.tp_rank),
                    r.status,
                    r.text(),
                    t.hold_until - t.started,
                )
                return
        except Exception as e:
            # No answer, or one we cannot read: C may still be writing. The
            # push ends when its hold has passed (try_end), not now.
            logger.warning(
                "push for %s from %s failed: %r",
                job.req_id,
                job.source_of(self.tp_rank),
                e,
            )
            return
        if resp is not None and resp.status == "ok":  # C's write has returned: prove it
            landed = self.proven_blocks(job, resp, t, deadline)
            logger.debug(
                "push for %s: %d blocks in %.3f s", job.req_id, landed, resp.seconds
            )
        with self._lock:
            t.answered(landed)

    def proven_blocks(
        self,
        job: PushJob,
        resp: PushBlocksResponse,
        t: PushTransfer | None = None,
        deadline: float | None = None,
    ) -> int:
        """Blocks an "ok" answer accounts for: never more than asked, only if its
        bytes match them, and, with canaries planted (``t``), only if C proves
        its write; else none. ``deadline``: monotonic, the push's hold."""
        n = resp.pushed_blocks
        expected_bytes = n * self.block_len * len(self.base_addrs)
        if not 0 <= n <= len(job.dst_block_ids) or resp.bytes != expected_bytes:
            logger.warning(
                "push for %s from %s: the answer claims %d blocks and %d bytes "
                "(%d blocks asked, %d bytes each); not trusted, prefilling locally",
                job.req_id,
                job.source_of(self.tp_rank),
                n,
                resp.bytes,
                len(job.dst_block_ids),
                self.block_len * len(self.base_addrs),
            )
            return 0
        if n and t is not None and t.probes and self.kv is not None:
            try:
                why = self._proof(t, resp, n, deadline)
            except Exception as e:  # no proof, or one we cannot read
                why = f"asking it for the proof failed: {e!r}"
            if why is not None:
                logger.warning(
                    "push for %s from %s: the answer says %d blocks were written, "
                    "but %s; prefilling locally",
                    job.req_id,
                    job.source_of(self.tp_rank),
                    n,
                    why,
                )
                return 0
        return n

    def _proof(
        self, t: PushTransfer, resp: PushBlocksResponse, n: int, deadline: float | None
    ) -> str | None:
        """None if C proves it wrote the first ``n`` blocks, else why not."""
        assert self.kv is not None
        job = t.job
        # C's write has returned: the call needs no more than a match does, and the
        # push's blocks wait for it (never past the hold: the push has ended then)
        deadline = min(
            time.monotonic() + max(0.0, t.hold_until - self._clock())
            if deadline is None
            else deadline,
            time.monotonic() + self.config.push_match_timeout_s,
        )
        checked = [(p, c) for p, c in zip(t.probes, t.canaries) if p[0] < n]
        # D's bytes now, before any position leaves this instance: C's write has
        # returned, and nothing C does once it learns them can change what counts.
        held = [
            self.kv.read(slot, job.dst_block_ids[i], off)
            for (i, slot, off), _ in checked
        ]
        if any(h == c for h, (_, c) in zip(held, checked)):
            return "a canary planted in them is still there"
        if resp.push_id is None:
            return "it names no push to prove"
        content = (
            PushProofRequest(push_id=resp.push_id, probes=[p for p, _ in checked])
            .model_dump_json()
            .encode()
        )
        r = self._lanes.post(
            job.source_of(self.tp_rank),
            "/push_proof",
            content,
            request_headers(self.config, "POST", "/push_proof", content),
            deadline,
        )
        if r.status != 200:
            return f"/push_proof answered HTTP {r.status} {r.text()}"
        proof = PushProofResponse.model_validate_json(r.body)
        if proof.status != "ok":
            return f"/push_proof answered {proof.status}: {proof.message}"
        if proof.probe_values != [h.hex() for h in held]:
            return "this instance's blocks do not hold the source's bytes at the probed positions"
        return None

    def merge_finished(self, finished_recving: set[str] | None) -> set[str] | None:
        """Add the pushes that ended since the last step to vLLM's finished_recving;
        note those past their budget (``send_by``) with no answer yet."""
        now = self._clock()
        ended: dict[str, int] = {}
        with self._lock:
            for rid, t in list(self._transfers.items()):
                landed = t.try_end(now)
                if landed is not None:
                    ended[rid] = landed
                    del self._transfers[rid]
                elif not t.due_told and t.landed is None and now >= t.send_by:
                    t.due_told = True
                    self._due.add(rid)
        if not ended:
            return finished_recving
        self._outcome.update(ended)
        return (finished_recving or set()) | set(ended)

    def take_outcome(self) -> PushOutcome | None:
        if not self._outcome and not self._due:
            return None
        with self._lock:
            refused = frozenset(r for r in self._refused if r in self._outcome)
            # only pushes still running may yet be reported (a refusal recorded
            # after its push ended at its hold is dropped here)
            self._refused &= set(self._transfers)
            due, self._due = frozenset(self._due), set()
        out, self._outcome = PushOutcome(self._outcome, refused, due), {}
        return out
