"""The measurements of microbench.push_index: fill a HolderIndex, time its lookups.

Every index here is filled the way D's feed threads fill it: pages of at most
FEED_SNAPSHOT_MAX_KEYS events, each decoded from JSON by FeedPage (the
follower's ``model_validate_json``) and handed to ``HolderIndex.apply`` (which
takes the index's lock once per APPLY_SLICE keys). The keys are real block-pool
keys: ``to_pool_key`` of ``hash_prompt_blocks`` over random prompts, with each
source's own hash configuration (algorithm, NONE_HASH).

``best()`` hashes the prompt one block at a time (``iter_prompt_block_hashes``)
per distinct configuration among the sources and stops at the first block no
source of that configuration still holds: a run of ``r`` held blocks costs
``min(r + 1, full blocks)`` blocks' hashing, a miss at block 0 one. A lookup is
timed four ways in the same iteration, so the samples share the machine's state
at that moment: ``best()`` itself; the hashing it does (exactly those blocks per
configuration, drawn the same way, each made ``hash(to_pool_key(h, 0))``); the
walk (best()'s loop, held_runs, over the sets best() reads with those hashes
already made); and, as a reference best() does not run, the hashing of every
full block of the prompt per configuration (what stopping early saves). Each
row checks the decomposition against the code: the blocks best() itself draws
(counted by wrapping its ``iter_prompt_block_hashes``, one untimed call) and the
walk's answer against best()'s.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.feed_protocol import (
    FEED_SNAPSHOT_MAX_KEYS,
    FeedPage,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    hash_prompt_blocks,
    iter_prompt_block_hashes,
    to_pool_key,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push import (
    decode_index,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_index import (
    DEFAULT_MAX_BLOCKS,
    HeldPrefix,
    HolderIndex,
    held_runs,
)

BLOCK_SIZE = 16
VOCAB = 32_000  # token ids of the random prompts are drawn below this
FILL_PROMPT_TOKENS = 1_024  # the random prompts whose blocks fill the index
HOLDER = 0  # the source that holds the hit prompt
OWN_SCHEDULER_ID = "bench-decode"

Config = tuple[str, bytes]  # (hash algorithm, NONE_HASH), as HolderIndex keys it
Groups = dict[Config, list[tuple[str, set[int]]]]  # best()'s sources per configuration


@dataclass(frozen=True)
class Layout:
    """``sources`` push sources over ``configs`` distinct hash configurations
    (1: PYTHONHASHSEED shared by the sources; one per source: vLLM's default, a
    random NONE_HASH per process)."""

    sources: int
    configs: int

    def __post_init__(self):
        if not 1 <= self.configs <= self.sources:
            raise ValueError(
                f"a layout of {self.sources} sources, {self.configs} configs"
            )

    @property
    def name(self) -> str:
        return f"{self.sources} src / {self.configs} cfg"

    def config_of(self, source: int) -> int:
        return source % self.configs


@dataclass
class Plan:
    sizes: Sequence[int]  # indexed blocks over all sources
    layouts: Sequence[Layout]
    prompts: Sequence[int]  # prompt tokens of the lookups
    calls: int  # timed lookups per row
    warmup: int  # untimed lookups before them
    fill_repeats: int  # timed fills per index (the last one is looked up)
    traced_sizes: Sequence[int] | None = None  # tracemalloc's fill at these (None: all)
    hash_algo: str = "sha256"
    page_events: int = FEED_SNAPSHOT_MAX_KEYS
    seed: int = 0


def spread(xs: Sequence[float]) -> dict:
    """median, p10, p90, min, max and count of ``xs``."""
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    if len(xs) == 1:
        p10 = p90 = xs[0]
    else:
        deciles = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return {
        "median": statistics.median(xs),
        "p10": p10,
        "p90": p90,
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


class Keys:
    """Per hash configuration: its NONE_HASH, a hit prompt whose blocks the holder
    source indexes, and a pool of further keys from random prompts, made once and
    sliced by every index that needs them."""

    def __init__(self, plan: Plan, progress: Callable[[str], None]):
        self.plan = plan
        self.rng = np.random.default_rng(plan.seed)
        self.progress = progress
        self.hit_tokens = self.tokens(max(plan.prompts))
        self.miss_tokens = self.tokens(max(plan.prompts))
        self.hit_blocks = len(self.hit_tokens) // BLOCK_SIZE
        self.configs: list[Config] = []
        self._pool: list[list[bytes]] = []
        self._hit: list[list[bytes]] = []
        self.made_s = 0.0

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, VOCAB, size=n).tolist()

    def config(self, i: int) -> Config:
        while len(self.configs) <= i:
            none_hash = self.rng.bytes(32)
            self.configs.append((self.plan.hash_algo, none_hash))
            self._pool.append([])
            self._hit.append(self.pool_keys(self.hit_tokens, self.configs[-1]))
        return self.configs[i]

    def pool_keys(self, tokens: Sequence[int], config: Config) -> list[bytes]:
        return [
            to_pool_key(h, 0)
            for h in hash_prompt_blocks(tokens, BLOCK_SIZE, config[0], config[1])
        ]

    def hit_keys(self, i: int) -> list[bytes]:
        self.config(i)
        return self._hit[i]

    def pool(self, i: int, n: int) -> list[bytes]:
        """The first ``n`` further keys of configuration ``i`` (made on demand)."""
        config = self.config(i)
        pool = self._pool[i]
        if len(pool) < n:
            t0 = time.perf_counter()
            need = n - len(pool)
            self.progress(f"making {need:,} block keys of configuration {i}")
            while len(pool) < n:
                pool.extend(self.pool_keys(self.tokens(FILL_PROMPT_TOKENS), config))
            self.made_s += time.perf_counter() - t0
        return pool[:n]


def source_keys(keys: Keys, layout: Layout, size: int) -> list[list[bytes]]:
    """The keys each source indexes: ``size`` over all sources (split evenly, the
    first sources take the remainder); the holder's include the hit prompt's blocks.
    Sources sharing a configuration get disjoint slices of its pool."""
    share = [
        size // layout.sources + (s < size % layout.sources)
        for s in range(layout.sources)
    ]
    if share[HOLDER] < keys.hit_blocks:
        raise ValueError(
            f"{size:,} blocks over {layout.sources} sources leave fewer than the "
            f"hit prompt's {keys.hit_blocks} to its holder"
        )
    out: list[list[bytes]] = []
    used = [0] * layout.configs
    for s, n in enumerate(share):
        c = layout.config_of(s)
        hit = keys.hit_keys(c) if s == HOLDER else []
        take = n - len(hit)
        pool = keys.pool(c, used[c] + take)[used[c] :]
        used[c] += take
        out.append(hit + pool)
    return out


def origin(s: int) -> str:
    return f"http://source-{s}:8998"


def page_json(
    keys: Sequence[bytes], config: Config, s: int, seq: int, first: bool, more: bool
) -> bytes:
    """One feed page as its source sends it (FeedPage's JSON)."""
    return json.dumps(
        {
            "epoch": f"epoch-{s}",
            "seq": seq,
            "reset": first,
            "events": ["+" + k.hex() for k in keys],
            "more": more,
            "hash_algo": config[0],
            "none_hash": config[1].hex(),
            "scheduler_id": f"scheduler-{s}",
            "block_size": BLOCK_SIZE,
        }
    ).encode()


@dataclass
class Fill:
    keys: int = 0
    pages: int = 0
    validate_s: float = 0.0  # FeedPage.model_validate_json of the pages
    apply_s: float = 0.0  # HolderIndex.apply of them
    stats: dict = field(default_factory=dict)


def fill(
    layout: Layout,
    per_source: list[list[bytes]],
    keys: Keys,
    plan: Plan,
    *,
    traced: bool = False,
) -> tuple[HolderIndex, Fill, dict | None]:
    """A new index with every source's keys applied page by page; the timings and,
    ``traced``, what tracemalloc saw the index keep (the pages are dropped after
    each apply, so the retained bytes are the index's own)."""
    total = sum(len(k) for k in per_source)
    index = HolderIndex(
        [origin(s) for s in range(layout.sources)],
        BLOCK_SIZE,
        max_blocks=max(DEFAULT_MAX_BLOCKS, total),
        own_scheduler_id=OWN_SCHEDULER_ID,
    )
    f = Fill()
    mem = None
    gc.collect(1)
    if traced:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    try:
        for s, ks in enumerate(per_source):
            config = keys.config(layout.config_of(s))
            starts = range(0, len(ks), plan.page_events)
            for i, a in enumerate(starts):
                chunk = ks[a : a + plan.page_events]
                body = page_json(
                    chunk, config, s, a + len(chunk), i == 0, i + 1 < len(starts)
                )
                t0 = time.perf_counter()
                page = FeedPage.model_validate_json(body)
                t1 = time.perf_counter()
                index.apply(origin(s), page)
                t2 = time.perf_counter()
                del page, body
                f.validate_s += t1 - t0
                f.apply_s += t2 - t1
                f.keys += len(chunk)
                f.pages += 1
        if traced:
            gc.collect(1)
            current, peak = tracemalloc.get_traced_memory()
            mem = {"retained_bytes": current - base, "peak_bytes": peak - base}
    finally:
        if traced:
            tracemalloc.stop()
    f.stats = dict(index.stats)
    return index, f, mem


def key_sets(index: HolderIndex) -> list[set[int]]:
    """The per-source sets best() walks (read only)."""
    return [s.keys for s in index._sources.values()]


def getsizeof_bytes(index: HolderIndex) -> int:
    """sys.getsizeof of each source's set (its table) plus of every int in it."""
    return sum(
        sys.getsizeof(keys) + sum(map(sys.getsizeof, keys)) for keys in key_sets(index)
    )


def groups(index: HolderIndex) -> Groups:
    """The sources best() reads, grouped by configuration as best() groups them
    (none is demoted or itself here)."""
    out: Groups = {}
    for s in index._sources.values():
        if s.config is not None and not s.itself and s.keys:
            out.setdefault(s.config, []).append((s.origin, s.keys))
    return out


def hash_blocks(tokens: Sequence[int], counts: dict[Config, int]) -> dict:
    """Per configuration, the first ``counts[config]`` full blocks of the prompt
    hashed as best() hashes them: drawn one at a time from
    ``iter_prompt_block_hashes``, each made ``hash(to_pool_key(h, 0))``."""
    hashed = {}
    for config, n in counts.items():
        blocks = iter_prompt_block_hashes(
            tokens, BLOCK_SIZE, config[0], config[1], None, None
        )
        hashed[config] = [hash(to_pool_key(h, 0)) for h in itertools.islice(blocks, n)]
    return hashed


def held_run(hashes: Sequence[int], keys: set[int]) -> int:
    """How many leading blocks of ``hashes`` are in ``keys``."""
    n = 0
    for h in hashes:
        if h not in keys:
            break
        n += 1
    return n


def blocks_best_hashes(grouped: Groups, whole: dict) -> dict[Config, int]:
    """Per configuration, the blocks best() hashes: the longest run a source of it
    holds, plus one when the prompt has more full blocks (1 on a miss at block 0).
    ``whole``: every full block's hash per configuration (hash_blocks)."""
    return {
        config: min(
            len(whole[config]),
            max(held_run(whole[config], keys) for _, keys in members) + 1,
        )
        for config, members in grouped.items()
    }


def walk(grouped: Groups, hashed: dict, have_blocks: int = 0) -> HeldPrefix | None:
    """best()'s loop (its held_runs), with the hashes made (``hashed``: the blocks best()
    hashes per configuration): block by block, the sources of a configuration that
    still hold the prompt, until none does; the longest run wins."""
    best: HeldPrefix | None = None
    for config, members in grouped.items():
        for origin, run in held_runs(members, hashed[config]).items():
            if run > have_blocks and (best is None or run > best.blocks):
                best = HeldPrefix(origin, run)
    return best


def set_lookups(grouped: Groups, hashed: dict) -> int:
    """The set lookups of best()'s loop: per block hashed, one per source of the
    configuration still holding the prompt."""
    lookups = 0
    for config, members in grouped.items():
        alive = [keys for _, keys in members]
        for h in hashed[config]:
            lookups += len(alive)
            alive = [keys for keys in alive if h in keys]
            if not alive:
                break
    return lookups


def best_counted(
    index: HolderIndex, tokens: list[int]
) -> tuple[HeldPrefix | None, int]:
    """best() once, untimed, with the ``iter_prompt_block_hashes`` it calls wrapped
    to count the blocks it draws: its answer and that count."""
    drawn = 0
    real = decode_index.iter_prompt_block_hashes

    def counting(*args, **kwargs):
        nonlocal drawn
        for h in real(*args, **kwargs):
            drawn += 1
            yield h

    decode_index.iter_prompt_block_hashes = counting
    try:
        got = index.best(tokens, None, None, 0)
    finally:
        decode_index.iter_prompt_block_hashes = real
    return got, drawn


def as_dict(answer: HeldPrefix | None) -> dict | None:
    return (
        None if answer is None else {"origin": answer.origin, "blocks": answer.blocks}
    )


def time_lookups(
    index: HolderIndex,
    tokens: list[int],
    expect: HeldPrefix | None,
    plan: Plan,
) -> dict:
    """``plan.calls`` timed iterations (after ``plan.warmup``) of best(), the
    hashing it does, the walk, and the whole-prompt hashing (a reference); their
    spreads, in seconds."""
    grouped = groups(index)
    blocks = len(tokens) // BLOCK_SIZE
    every = {config: blocks for config in grouped}
    whole = hash_blocks(tokens, every)
    counts = blocks_best_hashes(grouped, whole)
    hashed = hash_blocks(tokens, counts)
    lookups = set_lookups(grouped, hashed)
    walked = walk(grouped, hashed)
    got, drawn = best_counted(index, tokens)
    best_s, hash_s, walk_s, whole_s, diff_s = [], [], [], [], []
    clock = time.perf_counter_ns
    gc.collect(1)
    for i in range(plan.warmup + plan.calls):
        t0 = clock()
        index.best(tokens, None, None, 0)
        t1 = clock()
        hash_blocks(tokens, counts)
        t2 = clock()
        walk(grouped, hashed)
        t3 = clock()
        hash_blocks(tokens, every)
        t4 = clock()
        if i >= plan.warmup:
            best_s.append((t1 - t0) * 1e-9)
            hash_s.append((t2 - t1) * 1e-9)
            walk_s.append((t3 - t2) * 1e-9)
            whole_s.append((t4 - t3) * 1e-9)
            diff_s.append((t1 - t0 - (t2 - t1)) * 1e-9)
    blocks_hashed = sum(counts.values())
    return {
        "answer": as_dict(got),
        "expected": as_dict(expect),
        "walk_answer": as_dict(walked),
        "answer_correct": got == expect,
        # the bench hashes and walks what best() does
        "decomposition_matches": walked == got and drawn == blocks_hashed,
        "correct": got == expect and walked == got and drawn == blocks_hashed,
        "configs_hashed": len(grouped),
        "blocks_hashed": blocks_hashed,
        "blocks_hashed_per_config": list(counts.values()),
        "blocks_hashed_by_best": drawn,
        "whole_prompt_blocks": blocks * len(grouped),
        "lookups": lookups,
        "best_s": spread(best_s),
        "hash_s": spread(hash_s),
        "walk_s": spread(walk_s),
        "whole_prompt_hash_s": spread(whole_s),
        "best_minus_hash_s": spread(diff_s),
    }


def measure_index(
    layout: Layout,
    size: int,
    keys: Keys,
    plan: Plan,
    progress: Callable[[str], None],
) -> tuple[dict, list[dict]]:
    """One index (layout, size): its fill and memory row, and its lookup rows."""
    per_source = source_keys(keys, layout, size)
    fills = []
    index = None
    for r in range(plan.fill_repeats):
        index = None  # the previous fill's index goes before the next is made
        index, f, _ = fill(layout, per_source, keys, plan)
        fills.append(f)
        progress(
            f"{size:,} blocks, {layout.name}: fill {r + 1}/{plan.fill_repeats} "
            f"{f.keys / f.apply_s:,.0f} keys/s through apply(), "
            f"{f.keys / f.validate_s:,.0f} keys/s through FeedPage ({f.pages} pages)"
        )
    assert index is not None
    mem = None
    if plan.traced_sizes is None or size in plan.traced_sizes:
        # a further fill of a fresh index under tracemalloc (several times slower)
        _, _, mem = fill(layout, per_source, keys, plan, traced=True)
    sizeof = getsizeof_bytes(index)
    held = [len(k) for k in key_sets(index)]
    stats = fills[-1].stats
    index_row = {
        "size": size,
        "sources": layout.sources,
        "configs": layout.configs,
        "layout": layout.name,
        "held": held,
        "pages": fills[-1].pages,
        "page_events_max": plan.page_events,
        "apply_keys_per_s": spread([f.keys / f.apply_s for f in fills]),
        "validate_keys_per_s": spread([f.keys / f.validate_s for f in fills]),
        "apply_s": [f.apply_s for f in fills],
        "validate_s": [f.validate_s for f in fills],
        "getsizeof_bytes": sizeof,
        "getsizeof_bytes_per_block": sizeof / size,
        "tracemalloc_retained_bytes": mem and mem["retained_bytes"],
        "tracemalloc_peak_bytes": mem and mem["peak_bytes"],
        "tracemalloc_bytes_per_block": mem and mem["retained_bytes"] / size,
        "stats": stats,
        "correct": sum(held) == size
        and stats["keys_stored"] == size
        and stats["keys_dropped_full"] == 0
        and stats["pages_malformed"] == 0,
    }
    progress(
        f"{size:,} blocks, {layout.name}: {sizeof / size:.1f} B/block (getsizeof)"
        + (f", {mem['retained_bytes'] / size:.1f} B/block (tracemalloc)" if mem else "")
    )
    rows = []
    for tokens_n in plan.prompts:
        blocks = tokens_n // BLOCK_SIZE
        for case, tokens, expect in (
            ("hit", keys.hit_tokens[:tokens_n], HeldPrefix(origin(HOLDER), blocks)),
            ("miss", keys.miss_tokens[:tokens_n], None),
        ):
            t = time_lookups(index, tokens, expect, plan)
            row = {
                "size": size,
                "sources": layout.sources,
                "configs": layout.configs,
                "layout": layout.name,
                "prompt_tokens": tokens_n,
                "blocks": blocks,
                "case": case,
                **t,
                "walk_ns_per_lookup": t["walk_s"]["median"] * 1e9 / t["lookups"],
                "hash_us_per_block": t["hash_s"]["median"] * 1e6 / t["blocks_hashed"],
                "whole_prompt_hash_us_per_block": t["whole_prompt_hash_s"]["median"]
                * 1e6
                / t["whole_prompt_blocks"],
            }
            rows.append(row)
            progress(
                f"{size:,} blocks, {layout.name}, {tokens_n:,} tokens {case}: best() "
                f"{t['best_s']['median'] * 1e6:,.1f} us (hashing "
                f"{t['blocks_hashed']} blocks {t['hash_s']['median'] * 1e6:,.1f}, walk "
                f"{t['walk_s']['median'] * 1e6:,.2f}; whole prompt "
                f"{t['whole_prompt_hash_s']['median'] * 1e6:,.1f})"
                + ("" if t["answer_correct"] else f" WRONG ANSWER {t['answer']}")
                + (
                    ""
                    if t["decomposition_matches"]
                    else f" DECOMPOSITION DIFFERS (best() drew "
                    f"{t['blocks_hashed_by_best']} blocks, walk {t['walk_answer']})"
                )
            )
    del index
    return index_row, rows


def run(plan: Plan, progress: Callable[[str], None]) -> dict:
    """Every (size, layout) of ``plan``: {"indexes": [...], "lookups": [...]}."""
    keys = Keys(plan, progress)
    indexes, lookups = [], []
    for size in plan.sizes:
        for layout in plan.layouts:
            index_row, rows = measure_index(layout, size, keys, plan, progress)
            indexes.append(index_row)
            lookups.extend(rows)
    return {"indexes": indexes, "lookups": lookups, "keys_made_s": keys.made_s}
