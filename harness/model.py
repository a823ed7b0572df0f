"""Generate the project's default model: a small random-weight Qwen3.

No hub access is needed (or possible) here, so the default model is built
locally from a ``transformers`` config with fixed-seed random weights, plus a
word-level tokenizer built with the ``tokenizers`` package and saved beside it
so that vLLM's standard API works (text prompts, logprobs, detokenization).

The shape is chosen for what this project measures: many thin layers (a
layer-wise push can at best leave one layer's transfer on the critical path,
so its gain is bounded by the layer count) and a KV cache that is large per
token relative to the compute (full multi-head KV, wide heads), so moving the
KV is a measurable fraction of prefill time on a 2-core CPU.

The integration tests run TEST_SHAPE, the same model with 12 layers instead of
48: what they check (bytes land exact, every transfer ends, no block is left) does
not depend on the layer count, and each forward pass and each instance's start
costs about a quarter. The benchmarks and the README's recipe keep the default.

Any other model directory (a real model on a GPU host) can be used instead
everywhere a ``--model`` option is taken; this module only makes the default.

    python -m harness.model [--out DIR] [--layers N] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS_DIR = PROJECT_ROOT / ".cache" / "models"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 48
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 4096
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    seed: int = 1234

    @property
    def name(self) -> str:
        digest = hashlib.sha256(
            json.dumps(asdict(self), sort_keys=True).encode()
        ).hexdigest()[:8]
        return f"qwen3-rand-{self.num_layers}l-{self.hidden_size}h-{digest}"

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies in the KV cache, all layers."""
        elem = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


# The integration tests' model: the default's shape with 12 layers (still several
# layer writes per step for layer-wise push), a quarter of the compute per token.
TEST_SHAPE = ModelShape(num_layers=12)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def build_tokenizer(vocab_size: int):
    """A deterministic word-level tokenizer: tokens are w0, w1, ... plus specials.

    Text prompts like "w12 w7 w300" map one word to one token, so a prompt of a
    given token length is easy to write, and logprobs detokenize.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def generate(out_dir: Path, shape: ModelShape) -> Path:
    """Write config, random weights and tokenizer to out_dir (atomically)."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    torch.manual_seed(shape.seed)
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        torch_dtype=shape.dtype,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = Qwen3ForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(tmp, safe_serialization=True)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(shape.vocab_size),
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.model_max_length = shape.max_position_embeddings
    fast.save_pretrained(tmp)
    (tmp / "shape.json").write_text(json.dumps(asdict(shape), indent=2) + "\n")
    os.replace(tmp, out_dir)
    return out_dir


def ensure_model(
    shape: ModelShape | None = None, models_dir: Path | None = None
) -> Path:
    """Return the directory of the model of this shape (default: the default
    shape), generating it once. One folder per major version of transformers:
    the tokenizer files transformers 5 writes (vLLM 0.32.0's virtualenv) name a
    class transformers 4 (vLLM 0.18.1's) cannot load; the weights are the same."""
    import transformers

    shape = shape or ModelShape()
    models_dir = (
        Path(models_dir or os.environ.get("VMP_MODELS_DIR", DEFAULT_MODELS_DIR))
        / f"transformers-{transformers.__version__.split('.')[0]}"
    )
    path = models_dir / shape.name
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    models_dir.mkdir(parents=True, exist_ok=True)
    print(f"[model] generating random-weight model {shape.name} in {path}", flush=True)
    return generate(path, shape)


def main(argv: list[str] | None = None) -> int:
    defaults = ModelShape()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", type=Path, default=None)
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(p.parse_args(argv))
    models_dir = args.pop("models_dir")
    shape = ModelShape(**args)
    path = ensure_model(shape, models_dir)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
