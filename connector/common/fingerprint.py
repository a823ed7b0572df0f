# SPDX-License-Identifier: Apache-2.0
"""What this instance's KV bytes depend on, named so that two instances can compare.

KV written into a peer's blocks is valid only if the peer would have computed the
same bytes. :func:`local_fingerprint` names what decides them: ``model`` (the
architecture, the HF configuration without host-specific keys, what vLLM applies on
top, and ``id:<MOONCAKE_MODEL_ID>`` or a bounded digest of the weight files), dtypes,
block size, TP size and, worker side, the KV layout. A spurious mismatch costs a
local prefill, a missed one wrong KV: in doubt, a setting counts. Not named: LoRA,
multimodal inputs, prompt embeddings (push refuses those requests), nor weight bytes
no sample touches: set MOONCAKE_MODEL_ID for such fine-tunes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from vllm.logger import init_logger

from .config import ExtConfig, load

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig

logger = init_logger(__name__)

FINGERPRINT_SCHEME = 2  # part of every digest: a new scheme never equals an old one


class KVFingerprint(BaseModel):
    """What must be equal on both instances for one's KV to be valid in the other's
    blocks. A field the scheduler side cannot know is None there (not compared)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    dtype: StrictStr
    block_size: StrictInt
    tp_size: StrictInt
    block_len: StrictInt | None = None  # bytes per block per KV tensor (worker side)
    num_kv_tensors: StrictInt | None = None
    # the KV cache's layout as the worker allocated it: attention backend, split K/V,
    # element type, dimensions and their order in memory (fingerprint.kv_layout)
    layout: StrictStr | None = None

    def differences(
        self, peer: KVFingerprint, here: str = "here", there: str = "peer"
    ) -> list[str]:
        out = []
        for name in type(self).model_fields:
            a, b = getattr(self, name), getattr(peer, name)
            if a is not None and b is not None and a != b:
                out.append(f"{name} {a!r} ({here}) != {b!r} ({there})")
        return out


IGNORED_CONFIG_KEYS = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
    }
)
ROPE_KEYS = (
    "rope_scaling",
    "rope_theta",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "original_max_position_embeddings",
)

WEIGHT_SUFFIXES = (".safetensors",)
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
SAMPLE_BUDGET = 32 << 20  # bytes read from all weight files together
MAX_SAMPLE = 64 << 10  # bytes read from one tensor
MIN_SAMPLE = 256
MAX_SAMPLED_TENSORS = 50_000  # beyond: every k-th tensor, evenly spread
MAX_WEIGHT_FILES = 4096  # beyond: name and size only
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 16 << 20
EDGE_BYTES = 1 << 20  # non-safetensors files: the first and last MiB ...
EVEN_SAMPLES = 14  # ... and this many samples spread between them

# what a peer's fingerprint may hold (checked before it is compared)
MAX_FINGERPRINT_CHARS = 512
LIMITS = {
    "block_size": 1 << 20,
    "tp_size": 1 << 16,
    "block_len": 1 << 40,
    "num_kv_tensors": 1 << 20,
}
WORKER_FIELDS = ("block_len", "num_kv_tensors", "layout")


# ---- the model's identity --------------------------------------------------------------


def _digest(obj: Any) -> str:
    text = json.dumps([FINGERPRINT_SCHEME, obj], sort_keys=True, default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _json_default(o: Any) -> Any:
    """Stable across processes: never a repr that holds an address."""
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, frozenset)):
        return sorted(map(str, o))
    mod = type(o).__module__
    if (
        mod == "torch"
        or mod.startswith("enum")
        or hasattr(o, "name")
        and hasattr(o, "value")
    ):
        return str(o)
    return f"<{type(o).__qualname__}>"


def _config_view(value: Any) -> Any:
    """hf_config.to_dict() without ``_`` keys and IGNORED_CONFIG_KEYS: what differs
    across hosts and cannot change a byte of KV."""
    if isinstance(value, dict):
        return {
            str(k): _config_view(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k not in IGNORED_CONFIG_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_config_view(v) for v in value]
    return value


def config_digest(hf_config: Any) -> str:
    try:
        return _digest(_config_view(hf_config.to_dict()))
    except Exception as e:  # a configuration transformers cannot serialize
        # equal to no other instance's: this one neither sends nor receives KV
        logger.warning(
            "KV fingerprint: the model's configuration cannot be read (%r); this "
            "instance will match no peer",
            e,
        )
        return "unreadable-" + secrets.token_hex(4)


def runtime_digest(vllm_config: VllmConfig) -> str:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    attn = getattr(vllm_config, "attention_config", None)
    return _digest(
        {
            "dtype": str(mc.dtype).removeprefix("torch."),
            "quantization": mc.quantization,
            "override_attention_dtype": getattr(mc, "override_attention_dtype", None),
            "disable_sliding_window": getattr(mc, "disable_sliding_window", False),
            "model_impl": str(getattr(mc, "model_impl", "auto")),
            "cache_dtype": cc.cache_dtype,
            "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
            "sliding_window": getattr(cc, "sliding_window", None),
            "kv_sharing_fast_prefill": getattr(cc, "kv_sharing_fast_prefill", False),
            "mamba_cache_dtype": getattr(cc, "mamba_cache_dtype", None),
            "mamba_ssm_cache_dtype": getattr(cc, "mamba_ssm_cache_dtype", None),
            "attention_backend": str(getattr(attn, "backend", None)),
            "rope": {k: getattr(text, k, None) for k in ROPE_KEYS},
        }
    )


def model_identity(vllm_config: VllmConfig, config: ExtConfig) -> str:
    mc = vllm_config.model_config
    hf = mc.hf_config
    arch = (getattr(hf, "architectures", None) or ["?"])[0]
    if config.model_id is not None:
        weights = f"id:{config.model_id}"
    else:
        weights = weights_identity(
            getattr(mc, "model_weights", "") or mc.model,
            getattr(mc, "revision", None),
            getattr(hf, "_commit_hash", None),
        )
    return (
        f"{arch} cfg={config_digest(hf)} run={runtime_digest(vllm_config)} "
        f"weights={weights}"
    )


def local_fingerprint(
    vllm_config: VllmConfig,
    config: ExtConfig | None = None,
    block_len: int | None = None,
    num_kv_tensors: int | None = None,
    layout: str | None = None,
) -> KVFingerprint:
    """This instance's KV fingerprint; the worker side passes what it registered."""
    mc = vllm_config.model_config
    return KVFingerprint(
        model=model_identity(vllm_config, config or load()),
        dtype=f"{mc.dtype}/{vllm_config.cache_config.cache_dtype}".replace(
            "torch.", ""
        ),
        block_size=vllm_config.cache_config.block_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        block_len=block_len,
        num_kv_tensors=num_kv_tensors,
        layout=layout,
    )


# ---- the weights' identity ----------------------------------------------------------


def weights_identity(model: str, revision: str | None, commit: str | None) -> str:
    """``files:<hex>`` of the weight files of ``model`` (a folder, a file, or a hub id
    with a local snapshot); ``hub:<id>@<revision>`` when no file can be read;
    ``path:<hex>`` (equal only on the same path) when neither is known."""
    path = Path(model).expanduser()
    if not path.exists():
        snapshot = _hub_snapshot(model, revision or commit)
        if snapshot is None:
            if revision or commit:
                return f"hub:{model[:100]}@{(commit or revision)[:64]}"  # type: ignore[index]
            return f"path:{_digest(model)}"
        path = snapshot
    if path.is_file():
        return "files:" + _digest_files(path.parent, [path])
    files = sorted(
        p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )
    if not files:
        files = sorted(
            p
            for p in path.iterdir()
            if p.is_file() and p.name.endswith(OTHER_WEIGHT_SUFFIXES)
        )
    indexes = sorted(
        p for p in path.iterdir() if p.is_file() and p.name.endswith(".index.json")
    )
    return "files:" + _digest_files(path, files, indexes)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot of a hub model (no network)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(repo_id, revision=revision, local_files_only=True)
        )
    except Exception:
        return None


def _digest_files(
    root: Path, files: list[Path], indexes: list[Path] | None = None
) -> str:
    h = hashlib.sha256(f"weights v{FINGERPRINT_SCHEME}".encode())
    for p in indexes or ():
        with open(p, "rb") as f:
            h.update(b"index\0" + p.name.encode() + b"\0" + f.read(MAX_INDEX_BYTES))
    sampled, listed = files[:MAX_WEIGHT_FILES], files[MAX_WEIGHT_FILES:]
    headers = [_safetensors_header(p) for p in sampled]
    n_tensors = sum(len(t) if t is not None else EVEN_SAMPLES + 2 for _, t in headers)
    step = max(1, -(-n_tensors // MAX_SAMPLED_TENSORS))
    chunk = max(MIN_SAMPLE, min(MAX_SAMPLE, SAMPLE_BUDGET * step // max(1, n_tensors)))
    for p, (header, tensors) in zip(sampled, headers):
        size = p.stat().st_size
        h.update(
            b"file\0" + str(p.relative_to(root)).encode() + b"\0" + str(size).encode()
        )
        with open(p, "rb") as f:
            if tensors is not None:
                h.update(header)
                for start, end in tensors[::step]:
                    take = min(end - start, chunk)
                    f.seek(start + (end - start - take) // 2)
                    h.update(f.read(take))
            else:
                for off, take in _even_samples(size, chunk):
                    f.seek(off)
                    h.update(f.read(take))
    for p in listed:
        h.update(
            b"file\0"
            + str(p.relative_to(root)).encode()
            + b"\0"
            + str(p.stat().st_size).encode()
        )
    return h.hexdigest()[:16]


def _safetensors_header(p: Path) -> tuple[bytes, list[tuple[int, int]] | None]:
    """(header, tensors' byte ranges by name) of a safetensors file, else (b"", None)."""
    if not p.name.endswith(".safetensors"):
        return b"", None
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return b"", None
            header = f.read(n)
        meta = json.loads(header)
        ranges = []
        for name in sorted(k for k in meta if k != "__metadata__"):
            start, end = meta[name]["data_offsets"]
            if not (
                isinstance(start, int)
                and isinstance(end, int)
                and 0 <= start <= end <= size - 8 - n
            ):
                return b"", None
            ranges.append((8 + n + start, 8 + n + end))
        return header, ranges
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return b"", None


def _even_samples(size: int, chunk: int) -> list[tuple[int, int]]:
    """The first and last EDGE_BYTES and EVEN_SAMPLES chunks spread between them."""
    if size <= 2 * EDGE_BYTES:
        return [(0, size)]
    out = [(0, EDGE_BYTES), (size - EDGE_BYTES, EDGE_BYTES)]
    inner = size - 2 * EDGE_BYTES
    for i in range(EVEN_SAMPLES):
        off = EDGE_BYTES + (inner * (2 * i + 1)) // (2 * EVEN_SAMPLES)
        out.append((off, min(chunk, size - off)))
    return out


# ---- the KV layout (worker side) -----------------------------------------------------


def attention_backend_name(vllm_config: VllmConfig) -> str | None:
    """The attention backend of this worker's layers, as upstream finds it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backend,
        )

        return get_current_attn_backend(vllm_config).get_name()
    except Exception:
        return None


def kv_layout(
    kv_caches: Mapping[str, torch.Tensor | list[torch.Tensor]],
    split_k_and_v: bool,
    backend: str | None,
) -> str:
    """``"<backend> split|joint <dtype> [dims, N = blocks] order=<dims by stride>"``,
    one entry per distinct layer layout. The number of blocks is not part of it."""
    seen: list[str] = []
    for cache in kv_caches.values():
        if isinstance(cache, (list, tuple)):
            entries = [_tensor_layout(t, 0) for t in cache]
            desc = "list(" + ",".join(entries) + ")"
        else:
            desc = _tensor_layout(cache, 1 if split_k_and_v else 0)
        if desc not in seen:
            seen.append(desc)
    body = (
        " | ".join(seen) if len(seen) <= 4 else f"{len(seen)} layouts {_digest(seen)}"
    )
    return f"{backend or '?'} {'split' if split_k_and_v else 'joint'} {body}"


def _tensor_layout(t: torch.Tensor, blocks_dim: int) -> str:
    dims = ["N" if i == blocks_dim else str(d) for i, d in enumerate(t.shape)]
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
    return (
        f"{str(t.dtype).removeprefix('torch.')} [{','.join(dims)}] "
        f"order={','.join(map(str, order))}"
    )


# ---- a peer's fingerprint ----------------------------------------------------------------


def parse_peer_fingerprint(raw: Any) -> KVFingerprint:
    """A peer's fingerprint, types and bounds checked; ValueError does not echo it."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"expected an object, got {type(raw).__name__}")
    try:
        fp = KVFingerprint.model_validate(dict(raw))
    except ValidationError as e:
        problems = [
            f"{'.'.join(map(str, err['loc'])) or 'fingerprint'}: {err['msg']}"
            for err in e.errors()[:3]
        ]
        raise ValueError("; ".join(problems)) from None
    for name, value in fp.model_dump().items():
        if isinstance(value, str) and len(value) > MAX_FINGERPRINT_CHARS:
            raise ValueError(
                f"{name}: {len(value)} characters (at most {MAX_FINGERPRINT_CHARS})"
            )
        if isinstance(value, int) and name in LIMITS and not 0 < value <= LIMITS[name]:
            raise ValueError(f"{name}: {value} is outside 1 .. {LIMITS[name]}")
    return fp


def handshake_refusal(
    own: KVFingerprint | None, fields: Mapping[str, Any] | None, num_addrs: int
) -> str | None:
    """P: why a decode instance whose pull carries ``fields`` must not receive this
    instance's KV layer by layer; None: it may, or it sent none (built without this series)."""
    if fields is None:
        return None
    if own is None:
        return "this prefill instance has not registered its KV cache yet"
    raw = fields.get("fingerprint")
    if raw is None:
        return (
            "the decode instance sent no KV fingerprint (an older build of this "
            "connector): its KV cache cannot be checked against this prefill instance's; "
            "run the same build on both"
        )
    try:
        peer = parse_peer_fingerprint(raw)
    except ValueError as e:
        return f"the decode instance sent an invalid KV fingerprint: {e}"
    missing = [f for f in WORKER_FIELDS if getattr(peer, f) is None]
    if missing:
        return f"the decode instance's KV fingerprint lacks {', '.join(missing)}"
    if peer.num_kv_tensors != num_addrs:
        return (
            f"the decode instance's KV fingerprint names {peer.num_kv_tensors} KV tensors "
            f"but its pull request {num_addrs} KV tensor addresses"
        )
    diff = own.differences(peer, "this prefill instance", "the decode instance")
    if diff:
        return (
            "the decode instance's KV cache differs from this prefill instance's: "
            + "; ".join(diff)
            + ". Its KV would be wrong: start both with the same model, "
            "weights, dtypes, block size and attention backend (MOONCAKE_MODEL_ID names "
            "the weights where they cannot be read alike)"
        )
    return None


# ---- warnings ----------------------------------------------------------------------------


class WarnLimiter:
    """Warnings by key, each at most once per ``interval_s``; beyond ``max_keys`` keys
    new ones share one budget, so a peer varying what it sends cannot flood the log."""

    OVERFLOW = "\0overflow"

    def __init__(
        self,
        log: logging.Logger | Any,
        interval_s: float = 600.0,
        max_keys: int = 256,
        clock=time.monotonic,
    ):
        self._log = log
        self._interval = interval_s
        self._max = max_keys
        self._clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args: Any) -> bool:
        now = self._clock()
        with self._lock:
            if key not in self._last and len(self._last) >= self._max:
                self._last = {
                    k: t for k, t in self._last.items() if now - t < self._interval
                }
                if len(self._last) >= self._max:
                    key = self.OVERFLOW
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                return False
            self._last[key] = now
        self._log.warning(msg, *args)
        return True
