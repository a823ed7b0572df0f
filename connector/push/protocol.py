# SPDX-License-Identifier: Apache-2.0
"""Every message of prefix push: HTTP bodies (D -> C), scheduler -> worker jobs,
worker -> scheduler outcomes.

HTTP bodies are strict pydantic models on both sides (no coercion, unknown
fields refused); a shape error, or an inconsistency with the serving instance
(:func:`validate`), is a :class:`PushRequestError` naming the field, and nothing
is written. A push carries a deadline (D's wall clock) and a budget (from C's
receipt): C starts no write once either has passed, so a skewed clock cannot
extend the window. C's /match_blocks answer carries its clock and write bounds
(D's skew check and hold) and a per-process ``source_id`` the signed push names
back: C refuses (421) any other, so a captured push does not replay to another
source or to a restarted one. An "ok" push's ``push_id`` serves one /push_proof.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from ..common.fingerprint import KVFingerprint
from ..common.kv_reader import PROBE_BYTES

PushStatus = Literal["ok", "no_match", "failed"]
MAX_PROBES = 16  # probes in one proof
PUSH_ID_MAX_CHARS = 64
SOURCE_ID_MAX_CHARS = 64
SourceId = Annotated[StrictStr, Field(min_length=1, max_length=SOURCE_ID_MAX_CHARS)]

# C's own refusals: every non-200 answer C's routes produce (authentication,
# validation, a busy or unready server) is given before any write of the request
# started, and carries this header. D ends a push early only on such an answer;
# any other (a proxy's 502/504 while C's write still runs, a reset) keeps the
# push's blocks until its hold has passed.
SOURCE_REFUSAL_HEADER = "x-mooncake-source-refusal"
SOURCE_REFUSAL_NOTHING_WRITTEN = "nothing-written"
SOURCE_REFUSAL = {SOURCE_REFUSAL_HEADER: SOURCE_REFUSAL_NOTHING_WRITTEN}


def is_source_refusal(status: int, headers: dict[str, str]) -> bool:
    """An answer C's own code gave before writing anything (headers: lower-cased names)."""
    return (
        status != 200
        and headers.get(SOURCE_REFUSAL_HEADER) == SOURCE_REFUSAL_NOTHING_WRITTEN
    )


class PushRequestError(ValueError):
    """A malformed or inconsistent push request; ``field`` names the culprit.
    ``status``: 422 malformed, 409 refused for this pair of instances (mismatched
    configuration, an unauthorized destination), 413 too large."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status

    def detail(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MatchBlocksRequest(_Strict):
    """POST /match_blocks: which leading full blocks of a prompt does C hold?"""

    token_ids: list[StrictInt]
    cache_salt: StrictStr | None = None
    lora_name: StrictStr | None = None


class MatchBlocksResponse(_Strict):
    matched_blocks: StrictInt
    matched_tokens: StrictInt
    total_full_blocks: StrictInt
    fingerprint: (
        KVFingerprint  # C's: D compares it with its own before asking for a push
    )
    # what D's hold for a push from C needs: C's engine timeout (MC_TRANSFER_TIMEOUT
    # as C's engine reads it, s) and C's wall clock when it answered (ms since the
    # epoch; D measures the clock skew with it)
    engine_timeout_s: StrictInt
    now_unix_ms: StrictInt
    source_id: SourceId  # this C process's name; D puts it in its push request
    # C's kernel's net.ipv4.tcp_orphan_retries as applied (0 -> 8): how long bytes
    # of a write cut off mid-way can still be delivered (write_bounds.stalled_delivery_bound_s);
    # None: D assumes its own kernel's
    tcp_orphan_retries: StrictInt | None = None
    # how long C's transport lets a stalled connection keep its queued bytes before
    # it drops it (config.engine_no_progress_s, s); None: D assumes its own
    engine_no_progress_s: StrictInt | None = None
    # how long C's transport may then spend connecting to D again for a write's
    # queued slices (write_bounds.engine_reconnect_s, s); None: D assumes its own
    engine_reconnect_s: StrictInt | None = None
    # C's load when it answered (None: a source that does not say; D bounds each,
    # decode_scheduler.py): pushes it serves within their bound, every
    # destination's; how many it serves at once (MOONCAKE_PUSH_MAX_CONCURRENT,
    # 429 beyond); prompt tokens its scheduler admitted and has not computed, as
    # of its last step
    pushes_in_flight: StrictInt | None = None
    push_slots: StrictInt | None = None
    prefill_backlog_tokens: StrictInt | None = None
    # TP > 1: the port on which each of C's TP ranks serves /push_blocks and
    # /push_proof, rank 0's first (this server's); D's rank r asks C's rank r for
    # its shard, at the host D reached this server at. None: one rank, this server.
    rank_ports: list[StrictInt] | None = None


class PushBlocksRequest(_Strict):
    """POST /push_blocks: write C's cached blocks of a prompt prefix into D."""

    token_ids: list[StrictInt]
    cache_salt: StrictStr | None = None
    lora_name: StrictStr | None = None
    block_size: StrictInt
    dst_session: StrictStr  # D's transfer-engine session, "host:port"
    dst_kv_base_addrs: list[StrictInt]  # one per registered KV tensor, C's order
    # D's blocks for the prompt's full blocks first_block .. first_block+n-1
    # (D skips the leading blocks its own prefix cache already holds)
    dst_block_ids: list[StrictInt]
    first_block: StrictInt = 0
    block_len: StrictInt | None = (
        None  # bytes per block per KV tensor; checked if given
    )
    request_id: StrictStr | None = None
    # C starts no write after this instant (D's wall clock, ms since the epoch) ...
    deadline_unix_ms: StrictInt
    # ... nor this long after it received the request (None: the deadline alone)
    budget_ms: StrictInt | None = None
    # D's KV cache: every destination block id is below this, every destination
    # address inside [base, base + dst_num_blocks * block_len) of its tensor
    dst_num_blocks: StrictInt
    fingerprint: KVFingerprint  # D's; C refuses (409) unless equal to its own
    # the source this push is for (its /match_blocks answer's): C refuses (421)
    # any other, so a captured signed push does not replay to another source
    source_id: SourceId
    # D's TP rank: the shard it asks for, from C's rank of the same number (421
    # at any other rank)
    tp_rank: StrictInt = 0


class RankRegistration(_Strict):
    """POST /push/ranks, C's TP rank r >= 1 -> its rank 0, on this host: where rank r
    serves /push_blocks and /push_proof, and its transfer engine's port; the
    instance it belongs to (rank 0 refuses another's)."""

    tp_rank: StrictInt
    port: StrictInt
    engine_port: StrictInt
    engine_id: Annotated[StrictStr, Field(max_length=256)]
    dp_rank: StrictInt = 0


class RankRegistered(_Strict):
    source_id: SourceId  # the instance's name in every rank's answers
    # every rank's engine port, once all registered (None before): a push is never
    # written into any of them
    engine_ports: list[StrictInt] | None = None


def rank_urls(source: str, ports: list[int] | None, tp_size: int) -> tuple[str, ...]:
    """Where D's rank r asks C's rank r: ``source`` for rank 0, its scheme and host
    on C's rank r port for the others (never another host); () for one rank.
    ValueError naming what is wrong with C's ports."""
    if tp_size == 1:
        return ()
    if ports is None or len(ports) != tp_size:
        named = 0 if ports is None else len(ports)
        raise ValueError(f"it names {named} TP rank ports for TP size {tp_size}")
    if any(not 0 < p < 65536 for p in ports):
        raise ValueError(f"a TP rank port is out of range: {ports}")
    if not source.startswith("http://"):
        raise ValueError("the ranks' listeners serve plain HTTP, the source is not")
    base = source.rstrip("/").rpartition(":")[0]
    return (source, *(f"{base}:{p}" for p in ports[1:]))


class PushBlocksResponse(_Strict):
    status: PushStatus
    matched_blocks: StrictInt = 0  # leading full blocks of the prompt C holds
    matched_tokens: StrictInt = 0
    pushed_blocks: StrictInt = (
        0  # written into D: blocks first_block .. first_block+pushed-1
    )
    total_full_blocks: StrictInt = 0
    bytes: StrictInt = 0
    seconds: float = 0.0
    message: str = ""
    # an "ok" push C can prove: name it in POST /push_proof (None: C cannot)
    push_id: StrictStr | None = None


Probe = tuple[
    StrictInt, StrictInt, StrictInt
]  # (index among the pushed blocks, KV tensor, offset)


class PushProofRequest(_Strict):
    """POST /push_proof: C's source bytes at each probe of an answered push; D
    reveals the positions only after it read its own blocks there."""

    push_id: Annotated[StrictStr, Field(min_length=1, max_length=PUSH_ID_MAX_CHARS)]
    probes: Annotated[list[Probe], Field(min_length=1, max_length=MAX_PROBES)]


class PushProofResponse(_Strict):
    status: Literal[
        "ok", "failed"
    ]  # failed: a pushed source block changed since the write
    probe_values: list[
        StrictStr
    ] = []  # hex of C's source bytes at each probe, in order
    message: str = ""


def _parse(model: type[BaseModel], payload: Any) -> Any:
    try:
        if isinstance(payload, (bytes, str)):
            return model.model_validate_json(payload)
        return model.model_validate(payload)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc", ())
        field = str(loc[0]) if loc else "body"
        raise PushRequestError(field, err.get("msg", "invalid")) from None


def parse_push_request(payload: Any) -> PushBlocksRequest:
    """Build a request from a JSON body (bytes/str) or decoded JSON; errors name the field."""
    return _parse(PushBlocksRequest, payload)


def parse_match_request(payload: Any) -> MatchBlocksRequest:
    return _parse(MatchBlocksRequest, payload)


def parse_proof_request(payload: Any) -> PushProofRequest:
    return _parse(PushProofRequest, payload)


def _check_session(session: str) -> None:
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PushRequestError("dst_session", f"expected 'host:port', got {session!r}")


ADDRESS_LIMIT = 1 << 64


def validate(
    req: PushBlocksRequest,
    *,
    block_size: int,
    num_kv_tensors: int,
    block_len: int | None = None,
    fingerprint: KVFingerprint | None = None,
    max_tokens: int | None = None,
) -> None:
    """Check ``req`` against the serving instance; raise ``PushRequestError``."""
    if not req.token_ids:
        raise PushRequestError("token_ids", "must not be empty")
    if max_tokens is not None and len(req.token_ids) > max_tokens:
        raise PushRequestError(
            "token_ids",
            f"{len(req.token_ids)} tokens, more than this "
            f"instance serves in a push ({max_tokens})",
            413,
        )
    if fingerprint is not None:
        diff = fingerprint.differences(req.fingerprint, "source", "destination")
        if diff:
            raise PushRequestError(
                "fingerprint",
                "the two instances' KV caches differ: " + "; ".join(diff),
                409,
            )
        if not 0 <= req.tp_rank < fingerprint.tp_size:
            raise PushRequestError(
                "tp_rank",
                f"{req.tp_rank}: this instance's TP ranks are 0..{fingerprint.tp_size - 1}",
            )
    if any(t < 0 for t in req.token_ids):
        raise PushRequestError("token_ids", "token ids must be non-negative")
    if req.block_size != block_size:
        raise PushRequestError(
            "block_size", f"{req.block_size} != this instance's block size {block_size}"
        )
    total_full_blocks = len(req.token_ids) // block_size
    if total_full_blocks == 0:
        raise PushRequestError(
            "token_ids",
            f"{len(req.token_ids)} tokens hold no full block of {block_size}",
        )
    _check_session(req.dst_session)
    if len(req.dst_kv_base_addrs) != num_kv_tensors:
        raise PushRequestError(
            "dst_kv_base_addrs",
            f"{len(req.dst_kv_base_addrs)} addresses for {num_kv_tensors} KV tensors",
        )
    if any(a <= 0 for a in req.dst_kv_base_addrs):
        raise PushRequestError("dst_kv_base_addrs", "addresses must be positive")
    n = len(req.dst_block_ids)
    if n == 0:
        raise PushRequestError("dst_block_ids", "must not be empty")
    if req.first_block < 0:
        raise PushRequestError("first_block", "must be non-negative")
    if req.first_block + n > total_full_blocks:
        raise PushRequestError(
            "dst_block_ids",
            f"{n} destination blocks from block {req.first_block} for "
            f"{total_full_blocks} full prompt blocks",
        )
    if (
        block_len is not None
        and req.block_len is not None
        and req.block_len != block_len
    ):
        raise PushRequestError(
            "block_len",
            f"{req.block_len} != this instance's {block_len} bytes per block "
            "(different model, dtype or KV layout)",
        )
    if any(b < 0 for b in req.dst_block_ids):
        raise PushRequestError("dst_block_ids", "block ids must be non-negative")
    if len(set(req.dst_block_ids)) != n:
        raise PushRequestError("dst_block_ids", "duplicate block ids")
    if req.deadline_unix_ms <= 0:
        raise PushRequestError("deadline_unix_ms", "must be positive")
    if req.budget_ms is not None and req.budget_ms <= 0:
        raise PushRequestError("budget_ms", "must be positive")
    if req.dst_num_blocks <= 0:
        raise PushRequestError("dst_num_blocks", "must be positive")
    if max(req.dst_block_ids) >= req.dst_num_blocks:
        raise PushRequestError(
            "dst_block_ids",
            f"block id {max(req.dst_block_ids)} >= the "
            f"destination's {req.dst_num_blocks} blocks",
        )
    if block_len is not None:
        size = req.dst_num_blocks * block_len
        spans = sorted((a, a + size) for a in req.dst_kv_base_addrs)
        if spans[-1][1] > ADDRESS_LIMIT:
            raise PushRequestError("dst_kv_base_addrs", "a KV tensor ends beyond 2**64")
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise PushRequestError(
                "dst_kv_base_addrs", "the destination's KV tensors overlap"
            )


def validate_probes(
    probes: list[tuple[int, int, int]],
    *,
    pushed_blocks: int,
    num_kv_tensors: int,
    block_len: int,
) -> None:
    """Every probe lies inside one of the ``pushed_blocks`` blocks a push wrote;
    raise ``PushRequestError`` (422) naming the first that does not."""
    for i, slot, offset in probes:
        if not (
            0 <= i < pushed_blocks
            and 0 <= slot < num_kv_tensors
            and 0 <= offset <= block_len - PROBE_BYTES
        ):
            raise PushRequestError(
                "probes",
                f"probe ({i}, {slot}, {offset}) is outside the "
                f"{pushed_blocks} blocks of {num_kv_tensors} KV tensors of "
                f"{block_len} bytes this push wrote",
            )


# ---- inside D: scheduler <-> worker -------------------------------------------------


@dataclass(frozen=True)
class PushJob:
    """D's scheduler -> D's worker (connector metadata): ask C for this push."""

    req_id: str
    source: str  # C's bootstrap URL
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None
    first_block: int
    dst_block_ids: tuple[int, ...]
    # C's engine timeout from its /match_blocks answer (the hold is computed with
    # it); None only where no answer was asked for (then this instance's own)
    source_engine_timeout_s: int | None = None
    # C's name from its /match_blocks answer, sent back in the push request
    source_id: str = ""
    # C's kernel's orphan retries from the same answer (None: this instance's own)
    source_tcp_orphan_retries: int | None = None
    # C's transport's no-progress watchdog from the same answer (None: ours)
    source_engine_no_progress_s: int | None = None
    # C's transport's reconnect from the same answer (None: ours)
    source_engine_reconnect_s: int | None = None
    # this push's timeout, at most MOONCAKE_PUSH_TIMEOUT_S (None: that timeout)
    timeout_s: float | None = None
    # C's base URL per TP rank from the same answer (empty: one rank, ``source``)
    rank_urls: tuple[str, ...] = ()

    def source_of(self, tp_rank: int) -> str:
        """Where D's rank ``tp_rank`` asks for its shard."""
        return self.rank_urls[tp_rank] if self.rank_urls else self.source


@dataclass
class PushOutcome(KVConnectorWorkerMetadata):
    """D's worker -> D's scheduler: leading blocks that landed, per ended push;
    the pushes past their budget with no answer yet (once each). With several
    workers (TP > 1) each ends its own rank's push, in a step of its own: vLLM
    aggregates one step's outcomes, and the scheduler counts the workers."""

    landed: dict[str, int] = field(default_factory=dict)
    # of those, the pushes the source refused (or was busy for), nothing written
    refused: frozenset[str] = frozenset()
    # still running, past their budget (PushJob.timeout_s) with no answer: their
    # requests may take other blocks (decode_scheduler.py)
    due: frozenset[str] = frozenset()
    # how many workers' ends each ``landed`` entry holds (absent: one)
    workers: dict[str, int] = field(default_factory=dict)

    def workers_of(self, rid: str) -> int:
        return self.workers.get(rid, 1)

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PushOutcome)
        landed, workers = dict(self.landed), {}
        for rid in self.landed.keys() | other.landed.keys():
            mine, theirs = rid in self.landed, rid in other.landed
            workers[rid] = mine * self.workers_of(rid) + theirs * other.workers_of(rid)
            if theirs:  # a block is valid on all workers or on none
                landed[rid] = min(other.landed[rid], landed.get(rid, other.landed[rid]))
        return PushOutcome(
            landed, self.refused | other.refused, self.due | other.due, workers
        )
