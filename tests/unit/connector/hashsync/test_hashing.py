"""connector/hashsync/hashing.py: prompt block hashes equal the scheduler's Request.block_hashes."""

import inspect
import os

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hash_config import (
    RESET_KEY,
    SCHEDULER_ID,
    HashConfig,
    HashConfigMismatchError,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hashsync.hashing import (
    from_pool_key,
    hash_prompt_blocks,
    scheduler_hash_config,
    to_pool_key,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BS = 4
TOKENS = list(range(100, 100 + 4 * BS + 3))  # 4 full blocks + a partial tail

try:
    import xxhash  # noqa: F401

    ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
except ImportError:
    ALGOS = ["sha256", "sha256_cbor"]


@pytest.fixture
def scheduler_none_hash(monkeypatch, request):
    """Initialise the global NONE_HASH as EngineCore does (random: no seed)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"", raising=False)
    algo = getattr(request, "param", "sha256")
    init_none_hash(get_hash_fn_by_name(algo))
    return bytes(kv_cache_utils.NONE_HASH)


def scheduler_hashes(tokens, algo, cache_salt=None, lora_request=None):
    sp = SamplingParams(max_tokens=17)
    sp.update_from_generation_config({}, eos_token_id=100)
    req = Request(
        request_id="r",
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        lora_request=lora_request,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name(algo)),
    )
    return list(req.block_hashes)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("salt", [None, "salt-a"])
def test_equals_scheduler(monkeypatch, algo, salt):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", b"", raising=False)
    init_none_hash(get_hash_fn_by_name(algo))
    sched_none = bytes(kv_cache_utils.NONE_HASH)
    expected = scheduler_hashes(TOKENS, algo, cache_salt=salt)
    assert len(expected) == 4
    # The worker's own global differs (other process): must not matter.
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", os.urandom(32))
    got = hash_prompt_blocks(TOKENS, BS, algo, sched_none, cache_salt=salt)
    assert got == expected


def test_lora_name_keys_the_hash_as_the_scheduler_does(scheduler_none_hash):
    """0.18.1 keys a LoRA block by the adapter's name: equal to the scheduler's.
    0.32.0 keys it by name and path: a name alone matches no real adapter's block."""
    lora = LoRARequest("adapter-x", 1, "/nonexistent/adapter-x")
    expected = scheduler_hashes(TOKENS, "sha256", cache_salt="s", lora_request=lora)
    got = hash_prompt_blocks(
        TOKENS, BS, "sha256", scheduler_none_hash, cache_salt="s", lora_name="adapter-x"
    )
    if "lora_path" in inspect.getsource(kv_cache_utils):  # keyed by name and path
        assert all(a != b for a, b in zip(got, expected))
    else:
        assert got == expected
    plain = hash_prompt_blocks(
        TOKENS, BS, "sha256", scheduler_none_hash, cache_salt="s"
    )
    assert all(a != b for a, b in zip(got, plain))


def test_only_full_blocks(scheduler_none_hash):
    assert hash_prompt_blocks(TOKENS[: BS - 1], BS, "sha256", scheduler_none_hash) == []
    assert (
        len(hash_prompt_blocks(TOKENS[: 2 * BS], BS, "sha256", scheduler_none_hash))
        == 2
    )
    assert (
        len(hash_prompt_blocks(TOKENS[: 2 * BS + 1], BS, "sha256", scheduler_none_hash))
        == 2
    )


def test_prefix_property(scheduler_none_hash):
    full = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash)
    short = hash_prompt_blocks(TOKENS[: 2 * BS], BS, "sha256", scheduler_none_hash)
    assert full[:2] == short


def test_cache_salt_changes_every_block(scheduler_none_hash):
    a = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash, cache_salt="a")
    b = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash, cache_salt="b")
    none = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash)
    # Salt is only an extra key of block 0, but chaining spreads it to all blocks.
    assert all(x != y for x, y in zip(a, b))
    assert all(x != y for x, y in zip(a, none))


def test_none_hash_changes_every_block(scheduler_none_hash):
    a = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash)
    b = hash_prompt_blocks(TOKENS, BS, "sha256", os.urandom(32))
    assert all(x != y for x, y in zip(a, b))


def test_algo_matters(scheduler_none_hash):
    a = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash)
    b = hash_prompt_blocks(TOKENS, BS, "sha256_cbor", scheduler_none_hash)
    assert a != b


def test_rejects_bad_args():
    with pytest.raises(ValueError):
        hash_prompt_blocks(TOKENS, BS, "sha256", b"")
    with pytest.raises(ValueError):
        hash_prompt_blocks(TOKENS, 0, "sha256", b"x")
    with pytest.raises(ValueError):
        hash_prompt_blocks(TOKENS, BS, "md5", b"x")


def test_pool_key_roundtrip(scheduler_none_hash):
    h = hash_prompt_blocks(TOKENS, BS, "sha256", scheduler_none_hash)[0]
    key = to_pool_key(h, 3)
    assert key == kv_cache_utils.make_block_hash_with_group_id(h, 3)
    assert len(key) == len(h) + 4
    assert from_pool_key(key) == (h, 3)
    assert to_pool_key(h) != key  # default group 0


def test_scheduler_hash_config(monkeypatch, scheduler_none_hash):
    cfg = scheduler_hash_config("sha256")
    assert cfg == HashConfig("sha256", scheduler_none_hash, SCHEDULER_ID, RESET_KEY)
    with pytest.raises(ValueError):
        scheduler_hash_config("nope")
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH")
    with pytest.raises(RuntimeError):
        scheduler_hash_config("sha256")


def test_hash_config_check_same():
    a = HashConfig("sha256", b"\x01" * 32)
    a.check_same(HashConfig("sha256", b"\x01" * 32))
    with pytest.raises(HashConfigMismatchError):
        a.check_same(HashConfig("sha256", b"\x02" * 32))
    with pytest.raises(HashConfigMismatchError):
        a.check_same(HashConfig("sha256_cbor", b"\x01" * 32))
