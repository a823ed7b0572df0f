"""Random token-id prompts for the default model's word-level vocabulary."""

from __future__ import annotations

import random

from harness.model import SPECIAL_TOKENS, ModelShape


class PromptSource:
    """Fresh random token-id prompts: every call gives a prompt no cache has seen."""

    def __init__(self, vocab_size: int = ModelShape().vocab_size, seed: int = 0):
        self.low = len(SPECIAL_TOKENS)
        self.high = vocab_size - 1
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randint(self.low, self.high) for _ in range(n)]


def random_prompt(
    n: int, seed: int, vocab_size: int = ModelShape().vocab_size
) -> list[int]:
    """A deterministic prompt of n tokens for this seed."""
    return PromptSource(vocab_size, seed)(n)
