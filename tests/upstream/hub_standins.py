"""Offline stand-ins for the Hugging Face hub models upstream's unit tests name.

Upstream's scheduler / KV-cache / connector unit tests build a ``ModelConfig``
from a hub name (``facebook/opt-125m``, ``Qwen/Qwen3-0.6B`` - ModelConfig's
default - and ``Qwen/Qwen1.5-7B``). Those tests only read the model's config
(and, unless ``skip_tokenizer_init``, its tokenizer); no weights are loaded.

``build_hf_home(root)`` writes, for each model below, the files the hub repo
would hold (config.json and generation_config.json with the real repos' values,
plus a small byte-level BPE tokenizer built with the ``tokenizers`` package)
into a Hugging Face cache layout::

    root/hub/models--ORG--NAME/refs/main               -> <fake commit hash>
    root/hub/models--ORG--NAME/snapshots/<hash>/...    -> the files
    root/hub/models--ORG--NAME/.no_exist/<hash>/FILE   -> "known absent" markers

so that with ``HF_HOME=root HF_HUB_OFFLINE=1`` transformers / huggingface_hub /
vLLM resolve the hub names locally and never touch the network. Nothing in the
vLLM tree is edited.

The tokenizers are NOT the real ones (the real vocabularies are 50265 / 151669
tokens): only the byte-level alphabet plus the special tokens at their real
ids. The tests exercised here pass token ids directly and never decode text.

Run as a script to (re)build a cache: ``python hub_standins.py DIR``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# --- the real hub repos' config.json / generation_config.json values ---------

OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "_remove_final_layer_norm": False,
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "enable_bias": True,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
OPT_125M_GENERATION = {
    "_from_model_config": True,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "transformers_version": "4.27.0.dev0",
}

QWEN3_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

QWEN15_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.37.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN15_7B_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": False,
    "eos_token_id": 151643,
    "max_new_tokens": 2048,
    "transformers_version": "4.37.0",
}

# --- tokenizers ----------------------------------------------------------------


def _added_tokens_decoder(specials: dict[str, int]) -> dict:
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in specials.items()
    }


OPT_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
OPT_TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_prefix_space": False,
    "bos_token": "</s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "</s>",
    "errors": "replace",
    "model_max_length": 1000000000000000019884624838656,
    "tokenizer_class": "GPT2Tokenizer",
}
OPT_SPECIAL_TOKENS_MAP = {
    "bos_token": "</s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "</s>",
}

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN_TOKENIZER_CONFIG = {
    "added_tokens_decoder": _added_tokens_decoder(QWEN_SPECIALS),
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "errors": "replace",
    "model_max_length": 131072,
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
}
QWEN15_TOKENIZER_CONFIG = dict(
    QWEN_TOKENIZER_CONFIG, eos_token="<|endoftext|>", model_max_length=32768
)


def _byte_level_tokenizer_files(
    specials: dict[str, int], first_byte_id: int, bos: str | None = None
) -> dict[str, str]:
    """A byte-level BPE (no merges) over the 256 byte symbols, ids from
    ``first_byte_id``, plus the given special tokens at the given (real) ids:
    tokenizer.json for the fast class, vocab.json + merges.txt for the slow one.

    The ``tokenizers`` package builds the pipeline; the ids are then set in its
    JSON form (its serializer warns about id gaps, which the real Qwen
    vocabularies have too) and the result is checked by loading it back."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: first_byte_id + i for i, sym in enumerate(alphabet)}
    assert not set(vocab.values()) & set(specials.values())
    # contiguous ids for the build; the real ones are set below
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials]
    )
    if bos is not None:  # prepend BOS, as the slow tokenizer's add_bos_token does
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, specials[bos])],
        )
    data = json.loads(tok.to_str())
    full_vocab = dict(vocab)
    full_vocab.update(specials)
    data["model"]["vocab"] = dict(sorted(full_vocab.items(), key=lambda kv: kv[1]))
    for entry in data["added_tokens"]:
        entry["id"] = specials[entry["content"]]
    text = json.dumps(data, ensure_ascii=False, indent=1)
    check = Tokenizer.from_str(text)
    for t, i in full_vocab.items():
        assert check.token_to_id(t) == i, (t, i, check.token_to_id(t))
    return {
        "tokenizer.json": text,
        "vocab.json": json.dumps(data["model"]["vocab"], ensure_ascii=False, indent=1),
        "merges.txt": "#version: 0.2\n",
    }


def _dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _opt_files() -> dict[str, str]:
    files = _byte_level_tokenizer_files(OPT_SPECIALS, first_byte_id=4, bos="</s>")
    files.update(
        {
            "config.json": _dumps(OPT_125M_CONFIG),
            "generation_config.json": _dumps(OPT_125M_GENERATION),
            "tokenizer_config.json": _dumps(OPT_TOKENIZER_CONFIG),
            "special_tokens_map.json": _dumps(OPT_SPECIAL_TOKENS_MAP),
        }
    )
    return files


def _qwen_files(config: dict, generation: dict, tok_config: dict) -> dict[str, str]:
    files = _byte_level_tokenizer_files(QWEN_SPECIALS, first_byte_id=0)
    files.update(
        {
            "config.json": _dumps(config),
            "generation_config.json": _dumps(generation),
            "tokenizer_config.json": _dumps(tok_config),
        }
    )
    return files


# hub name -> (why it is needed, files factory)
STANDINS = {
    "facebook/opt-125m": (
        "default model of tests/v1/core/utils.py and tests/v1/kv_connector/unit/utils.py",
        _opt_files,
    ),
    "Qwen/Qwen3-0.6B": (
        "vllm.config.ModelConfig's default `model` (ModelConfig(max_model_len=...) in test_kv_cache_utils)",
        lambda: _qwen_files(
            QWEN3_06B_CONFIG, QWEN3_06B_GENERATION, QWEN_TOKENIZER_CONFIG
        ),
    ),
    "Qwen/Qwen1.5-7B": (
        "test_kv_cache_utils.py::test_estimate_max_model_len / test_get_max_concurrency_for_kv_cache_config",
        lambda: _qwen_files(
            QWEN15_7B_CONFIG, QWEN15_7B_GENERATION, QWEN15_TOKENIZER_CONFIG
        ),
    ),
}

# Files vLLM / transformers probe for that these repos do not have: recording
# them as known-absent lets offline look-ups answer "no such file" at once
# instead of raising LocalEntryNotFoundError.
KNOWN_ABSENT = (
    "params.json",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "added_tokens.json",
    "tokenizer.model",
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "adapter_config.json",
    "hf_quant_config.json",
    "quant_config.json",
    "quantize_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
    "custom_generate/generate.py",
)


def build_hf_home(root: Path | str) -> Path:
    """Write every stand-in into ``root`` (an HF_HOME). Returns ``root``."""
    root = Path(root)
    hub = root / "hub"
    for name, (_why, factory) in STANDINS.items():
        files = factory()
        digest = hashlib.sha1()
        for fname in sorted(files):
            digest.update(fname.encode() + b"\0" + files[fname].encode() + b"\0")
        commit = digest.hexdigest()  # 40 hex chars, like a git commit id
        repo_dir = hub / ("models--" + name.replace("/", "--"))
        snap = repo_dir / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for fname, text in files.items():
            (snap / fname).write_text(text, encoding="utf-8")
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(commit)
        absent = repo_dir / ".no_exist" / commit
        for fname in KNOWN_ABSENT:
            if fname not in files:
                marker = absent / fname
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hub_standins.py HF_HOME_DIR")
    print(build_hf_home(sys.argv[1]))
