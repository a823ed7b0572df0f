"""connector/common/fingerprint.py: the KV fingerprint names the model, not only its shape.

Two instances may exchange KV only if the bytes one writes mean the same in the
other's cache: same configuration (RoPE included), same weights, same runtime
settings (dtypes, quantization, KV scales) and, between workers, the same KV
layout. Model folders are generated here (tiny config.json + safetensors) and
fingerprinted with a stand-in of vLLM's configuration object. The second half
checks the same fingerprint at the layer-wise handshake: P refuses a decode
instance whose KV cache differs from its own (WorkerExtension.serve_xfer_request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.fingerprint import (
    local_fingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.vllm_compat import (
    pull_request_blocks,
    send_layout_on_every_pull,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.worker_extension import (
    WorkerExtension,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.xfer import (
    ExtXferMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)

# ---- generated model folders ----------------------------------------------------------

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": True,
}
TENSOR_ELEMS = (
    1 << 18
)  # 1 MiB of float32 each: the middle tensors lie beyond the first/last MiB


def weights(seed: int = 0, changed: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        name: torch.randn(TENSOR_ELEMS, generator=g)
        for name in ("a.embed", "b.layer0", "c.layer1", "d.norm")
    }
    if changed is not None:  # a fine-tune that trained one tensor only
        out[changed] = out[changed] + 0.01
    return out


def model_dir(
    root: Path,
    name: str,
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    from safetensors.torch import save_file

    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    save_file(
        tensors if tensors is not None else weights(), str(d / "model.safetensors")
    )
    return d


def vllm_config(
    path: Path,
    *,
    quantization=None,
    cache_dtype="auto",
    calculate_kv_scales=False,
    block_size=16,
):
    """The parts of vllm.config.VllmConfig a fingerprint reads."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(path))  # records its path in _name_or_path
    model = SimpleNamespace(
        model=str(path),
        model_weights="",
        revision=None,
        hf_config=hf,
        hf_text_config=hf,
        dtype=torch.float32,
        quantization=quantization,
        override_attention_dtype=None,
        disable_sliding_window=False,
        model_impl="auto",
    )
    cache = SimpleNamespace(
        cache_dtype=cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        block_size=block_size,
        sliding_window=None,
        kv_sharing_fast_prefill=False,
        enable_prefix_caching=True,
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=cache,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        attention_config=SimpleNamespace(backend=None),
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
    )


def model_of(cfg) -> str:
    return local_fingerprint(cfg).model


# ---- the model's identity ------------------------------------------------------------


def test_the_same_model_on_two_paths_has_one_fingerprint(tmp_path):
    a = model_dir(tmp_path / "host-a" / "models", "llama")
    b = tmp_path / "host-b" / "elsewhere" / "copy-of-llama"
    shutil.copytree(a, b)
    assert local_fingerprint(vllm_config(a)) == local_fingerprint(vllm_config(b))


def test_rope_scaling_alone_changes_the_fingerprint(tmp_path):
    """Llama-3-8B and Llama-3.1-8B have the same shape; 3.1 adds RoPE scaling."""
    plain = model_dir(tmp_path, "llama-3", tensors=weights())
    scaled = model_dir(
        tmp_path,
        "llama-3.1",
        tensors=weights(),
        config={
            **CONFIG,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    )
    assert model_of(vllm_config(plain)) != model_of(vllm_config(scaled))


def test_other_weights_of_the_same_shape_change_the_fingerprint(tmp_path):
    base = model_dir(tmp_path, "base", tensors=weights(seed=0))
    other = model_dir(tmp_path, "other", tensors=weights(seed=1))
    assert model_of(vllm_config(base)) != model_of(vllm_config(other))


@pytest.mark.parametrize("tensor", ["a.embed", "b.layer0", "c.layer1", "d.norm"])
def test_a_fine_tune_of_one_tensor_changes_the_fingerprint(tmp_path, tensor):
    """Not only the first and last MiB: every tensor is sampled."""
    base = model_dir(tmp_path, "base", tensors=weights())
    tuned = model_dir(tmp_path, "tuned", tensors=weights(changed=tensor))
    assert model_of(vllm_config(base)) != model_of(vllm_config(tuned))


@pytest.mark.parametrize(
    "setting",
    [
        dict(quantization="fp8"),
        dict(calculate_kv_scales=True),
        dict(cache_dtype="fp8_e4m3"),
    ],
)
def test_runtime_settings_that_change_kv_bytes_change_the_fingerprint(
    tmp_path, setting
):
    d = model_dir(tmp_path, "m")
    assert local_fingerprint(vllm_config(d)) != local_fingerprint(
        vllm_config(d, **setting)
    )


def test_the_operators_model_id_replaces_the_weights_identity(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.fingerprint import (
        local_fingerprint,
    )

    a = vllm_config(model_dir(tmp_path, "a", tensors=weights(seed=0)))
    b = vllm_config(model_dir(tmp_path, "b", tensors=weights(seed=1)))
    v7 = ExtConfig.from_env({"MOONCAKE_MODEL_ID": "acme/llama-ft@v7"})
    v8 = ExtConfig.from_env({"MOONCAKE_MODEL_ID": "acme/llama-ft@v8"})
    assert v7.model_id == "acme/llama-ft@v7" and ExtConfig.from_env({}).model_id is None
    assert local_fingerprint(a, v7) == local_fingerprint(b, v7)
    assert "acme/llama-ft@v7" in local_fingerprint(a, v7).model
    assert local_fingerprint(a, v7) != local_fingerprint(a, v8)
    # the configuration still counts
    c = vllm_config(model_dir(tmp_path, "c", config={**CONFIG, "rope_theta": 10000.0}))
    assert local_fingerprint(a, v7) != local_fingerprint(c, v7)


@pytest.mark.parametrize("bad", ["has space", "x" * 300, "tab\there", "ünïcode"])
def test_a_model_id_that_cannot_be_named_in_one_line_is_refused_at_start(bad):
    with pytest.raises(ConfigError, match="MOONCAKE_MODEL_ID"):
        ExtConfig.from_env({"MOONCAKE_MODEL_ID": bad})


def test_a_huge_weights_file_is_sampled_not_read(tmp_path):
    """A 16 GiB safetensors file (sparse): its fingerprint reads a few MiB."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.fingerprint import (
        weights_identity,
    )

    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    size = 16 << 30
    header = json.dumps(
        {
            f"t{i}": {
                "dtype": "F32",
                "shape": [size // 4 // 64],
                "data_offsets": [i * size // 64, (i + 1) * size // 64],
            }
            for i in range(64)
        }
    ).encode()
    with open(d / "model-00001-of-00001.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    start = time.monotonic()
    ident = weights_identity(str(d), None, None)
    assert time.monotonic() - start < 3.0
    with open(d / "model-00001-of-00001.safetensors", "r+b") as f:
        f.seek(
            8 + len(header) + 40 * size // 64 + size // 128
        )  # the middle of tensor t40
        f.write(b"\x01" * 4096)
    assert weights_identity(str(d), None, None) != ident


def test_the_worker_side_names_the_kv_layout():
    """Equal bytes per block are not equal KV: the order of the dimensions counts."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.fingerprint import (
        kv_layout,
    )

    nhd = torch.zeros(2, 10, 16, 4, 32)  # K/V, blocks, tokens, heads, head_dim
    hnd = torch.zeros(2, 10, 4, 16, 32)
    permuted = torch.zeros(2, 10, 4, 16, 32).permute(
        0, 1, 3, 2, 4
    )  # NHD shape, HND memory
    layouts = {
        kv_layout({"l0": t, "l1": t}, split_k_and_v=True, backend="CPU_ATTN")
        for t in (nhd, hnd, permuted)
    }
    assert len(layouts) == 3
    more_blocks = torch.zeros(
        2, 99, 16, 4, 32
    )  # the number of blocks is not part of it
    assert kv_layout({"l0": more_blocks}, True, "CPU_ATTN") == kv_layout(
        {"l0": nhd}, True, "CPU_ATTN"
    )
    assert kv_layout({"l0": nhd}, True, "CPU_ATTN") != kv_layout(
        {"l0": nhd}, True, "FLASH_ATTN"
    )


# ---- layer-wise handshake: P checks D's fingerprint --------------------------------------

# P's worker-side fingerprint (D's alike unless a test changes a field)
P_FIELDS = dict(
    model="Qwen3ForCausalLM cfg=0123456789abcdef",
    dtype="float32/auto",
    block_size=16,
    tp_size=1,
    block_len=65536,
    num_kv_tensors=4,
    layout="CPU_ATTN split float32 [2,N,4,16,32] order=0,1,2,3,4",
)


def fp(**over) -> KVFingerprint:
    return KVFingerprint(**{**P_FIELDS, **over})


# both instances' configuration: layer-wise, defaults otherwise
CONFIG_LW = ExtConfig.from_env(
    {"MOONCAKE_LAYERWISE": "1", "MOONCAKE_BOOTSTRAP_HOST": "127.0.0.1"}
)


class FakeSender:
    def __init__(self):
        self.served: list[tuple] = []

    async def serve(self, session, bases, req_blocks, reply):
        self.served.append((session, bases, req_blocks))


def worker(role: str, fingerprint: KVFingerprint | None = None) -> WorkerExtension:
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
    )
    w = WorkerExtension(cfg, CONFIG_LW)
    w.fingerprint = fingerprint or fp()
    if role == "kv_producer":
        w.sender = FakeSender()
    return w


def pull_request(fields, n_tensors: int = 4) -> ExtXferMetadata:
    """D's pull request as P decodes it from the wire."""
    block_ids, per_region = pull_request_blocks(
        [3, 4], P_FIELDS["block_len"], n_tensors
    )
    meta = ExtXferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=7000,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"d-1": ("xfer-1", block_ids)},
        kv_caches_base_addr=[(i + 1) << 32 for i in range(n_tensors)],
        ext=fields,
        **per_region,
    )
    wire = msgspec.msgpack.encode(meta)
    return msgspec.msgpack.Decoder(ExtXferMetadata).decode(wire)


def serve(p: WorkerExtension, meta) -> list[MooncakeXferResponse]:
    sent: list[MooncakeXferResponse] = []

    async def send(resp):
        sent.append(resp)

    async def run():
        await p.serve_xfer_request(meta, 1, send)
        await asyncio.sleep(0)  # let the serving task start

    asyncio.run(run())
    return sent


def d_fields(**fp_over):
    d = worker("kv_consumer", fp(**fp_over))
    return d.xfer_request_fields()


def test_decode_sends_its_fingerprint_with_each_pull_request():
    fields = worker("kv_consumer").xfer_request_fields()
    assert fields["fingerprint"] == fp().model_dump()
    assert fields["pull_give_up_s"] == CONFIG_LW.pull_give_up_s


def test_an_equal_decode_instance_is_served():
    p = worker("kv_producer")
    assert serve(p, pull_request(d_fields())) == []
    # the sender gets one list of block ids, whichever shape the release sends
    assert [served[2] for served in p.sender.served] == [{"d-1": ("xfer-1", [3, 4])}]


@pytest.mark.skipif(
    "block_lens" not in ExtXferMetadata.__struct_fields__,
    reason="vLLM 0.18.1 sends one list of block ids per request (no KV cache groups)",
)
def test_a_request_spanning_two_kv_cache_groups_is_refused_by_name():
    p = worker("kv_producer")
    meta = pull_request(d_fields())
    meta.req_blocks["d-2"] = ("xfer-2", [[5], [6]])
    [answer] = serve(p, meta)
    assert answer.err_reqs == ["d-2"] and "one KV cache group" in answer.err_msg
    assert [served[2] for served in p.sender.served] == [{"d-1": ("xfer-1", [3, 4])}]


MISMATCHES = {
    # D's blocks hold 128 tokens, P's 16: P would write its blocks at D's strides
    "block size": (
        dict(block_size=128, block_len=8 * 65536),
        ["16", "128", "block_size"],
    ),
    "bytes per block": (dict(block_len=32768), ["65536", "32768"]),
    "KV tensors": (dict(num_kv_tensors=2), ["num_kv_tensors"]),
    "model": (
        dict(model="Qwen3ForCausalLM cfg=fedcba9876543210"),
        ["fedcba9876543210", "0123456789abcdef"],
    ),
    "dtype": (dict(dtype="bfloat16/auto"), ["bfloat16/auto", "float32/auto"]),
    "layout": (
        dict(layout="CPU_ATTN split float32 [2,N,16,4,32] order=0,1,2,3,4"),
        ["layout", "[2,N,16,4,32]", "[2,N,4,16,32]"],
    ),
}


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_a_decode_instance_with_another_kv_cache_is_refused_naming_both_values(
    what, caplog
):
    over, named = MISMATCHES[what]
    if "num_kv_tensors" in over:
        meta = pull_request(d_fields(**over), n_tensors=over["num_kv_tensors"])
    else:
        meta = pull_request(d_fields(**over))
    p = worker("kv_producer")
    with caplog.at_level(logging.WARNING):
        (resp,) = serve(p, meta)
        (again,) = serve(p, meta)
    assert (
        resp.status == MooncakeXferResponseStatus.ERROR and again.status == resp.status
    )
    for word in named:
        assert word in resp.err_msg, (word, resp.err_msg)
    assert p.sender.served == [], "P served a decode instance whose KV cache differs"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and named[0] in warned[0], warned


def test_a_decode_instance_of_another_tp_size_is_refused_naming_both(caplog):
    meta = pull_request(d_fields())
    meta.remote_tp_size = 2  # P serves at TP 1
    p = worker("kv_producer")
    with caplog.at_level(logging.WARNING):
        (resp,) = serve(p, meta)
        (again,) = serve(p, meta)
    assert resp.status == again.status == MooncakeXferResponseStatus.ERROR
    assert "prefill 1, decode 2" in resp.err_msg, resp.err_msg
    assert p.sender.served == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "prefill 1, decode 2" in warned[0], warned


def fp_raw(**over):
    return {**P_FIELDS, **over}


MALFORMED = {
    "not a dict": "same",
    "a list": [1, 2],
    "string block size": fp_raw(block_size="16"),
    "float block size": fp_raw(block_size=16.0),
    "bool block size": fp_raw(block_size=True),
    "zero block size": fp_raw(block_size=0),
    "negative block_len": fp_raw(block_len=-65536),
    "huge block size": fp_raw(block_size=1 << 40),
    "no block_len": fp_raw(block_len=None),
    "no layout": fp_raw(layout=None),
    "missing model": {k: v for k, v in P_FIELDS.items() if k != "model"},
    "extra field": fp_raw(x=1),
    "100 kB model": fp_raw(model="m" * 100_000),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_fingerprint_is_refused_without_serving(what):
    p = worker("kv_producer")
    fields = {
        "pull_give_up_s": CONFIG_LW.pull_give_up_s,
        "fingerprint": MALFORMED[what],
    }
    (resp,) = serve(p, pull_request(fields))
    assert resp.status == MooncakeXferResponseStatus.ERROR
    assert "fingerprint" in resp.err_msg and len(resp.err_msg) < 2000
    assert p.sender.served == []


def test_a_decode_instance_of_this_series_without_a_fingerprint_is_refused():
    p = worker("kv_producer")
    (resp,) = serve(p, pull_request({"pull_give_up_s": CONFIG_LW.pull_give_up_s}))
    assert (
        resp.status == MooncakeXferResponseStatus.ERROR
        and "fingerprint" in resp.err_msg
    )
    assert p.sender.served == []


def test_kv_tensors_must_match_the_addresses_sent():
    p = worker("kv_producer")
    (resp,) = serve(p, pull_request(d_fields(), n_tensors=3))
    assert resp.status == MooncakeXferResponseStatus.ERROR and "3" in resp.err_msg
    assert p.sender.served == []


def test_refusal_warnings_are_rate_limited_per_key_and_in_all():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.fingerprint import (
        WarnLimiter,
    )

    logged: list[str] = []
    now = [0.0]
    lim = WarnLimiter(
        SimpleNamespace(warning=lambda msg, *a: logged.append(msg % a)),
        interval_s=60,
        max_keys=4,
        clock=lambda: now[0],
    )
    assert lim.warn("a", "a %s", 1) and not lim.warn("a", "a %s", 2)
    for i in range(
        100
    ):  # a peer varying what it sends: 3 more keys, then one shared budget
        lim.warn(f"k{i}", "k%d", i)
    assert logged == ["a 1", "k0", "k1", "k2", "k3"]
    now[0] = 61.0  # an interval later: each warns again
    assert lim.warn("a", "a %s", 3) and logged[-1] == "a 3"


def test_a_pull_request_naming_a_cached_layout_is_asked_for_the_layout():
    """vLLM 0.33.0's D may send a layout id instead of its KV addresses once P
    cached them; layer-wise writes at the addresses the request carries, so P
    asks for them (LAYOUT_MISS: upstream's D sends the request again with its
    layout) and writes nothing."""
    p = worker("kv_producer")
    wire = pull_request(d_fields())
    fields = {n: getattr(wire, n) for n in wire.__struct_fields__}
    meta = SimpleNamespace(**{**fields, "layout_id": 7, "kv_caches_base_addr": []})
    [answer] = serve(p, meta)
    assert answer.status == getattr(
        MooncakeXferResponseStatus, "LAYOUT_MISS", MooncakeXferResponseStatus.ERROR
    )
    assert "KV layout" in answer.err_msg
    assert p.sender.served == []


def test_a_decode_instance_sends_its_layout_with_every_pull():
    class Worker033:
        _kv_layout_id = 0x1235

    class Worker032:
        pass

    w = Worker033()
    send_layout_on_every_pull(w)
    assert w._kv_layout_id == 0  # upstream's "layout on every pull"
    old = Worker032()
    send_layout_on_every_pull(old)
    assert not hasattr(old, "_kv_layout_id")
