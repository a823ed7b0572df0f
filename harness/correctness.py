"""Did the transferred KV land byte-exact? A check that can go red.

A random-weight model often repeats one token whatever its KV holds, so equal
greedy tokens prove little. This check compares what the decode instance D
produced from the transferred KV with what an instance that computed the whole
prompt itself produced, on the log-probabilities of the first generated tokens
(top-k sets and values), which move when any transferred block is wrong. It also
requires that D actually took the prompt from the connector: D's cached tokens
equal the prompt length (or the expected number for a partial push).

tests/integration/test_pd_baseline.py shows it going red when one transferred
block is zeroed on D (fault injection through MOONCAKE_FAULT_ZERO_RECV_BLOCK).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from harness.pd_client import Completion, complete

# fp32 on the CPU: the same kernels, different batch shapes (D recomputes only
# the last prompt token) give differences around 1e-5; a wrong block moves the
# logprobs by far more than this.
DEFAULT_ATOL = 2e-3


@dataclass
class CheckResult:
    ok: bool
    problems: list[str] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    cached_tokens: int | None = None
    expected_cached_tokens: int | None = None
    compared_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "max_logprob_diff": self.max_logprob_diff,
            "cached_tokens": self.cached_tokens,
            "expected_cached_tokens": self.expected_cached_tokens,
            "compared_tokens": self.compared_tokens,
        }


def reference_completion(
    base_url: str, prompt, *, max_tokens: int, logprobs: int = 5
) -> Completion:
    """The prompt computed from scratch on one instance (a fresh cache_salt defeats prefix reuse)."""
    return complete(
        base_url,
        prompt,
        max_tokens=max_tokens,
        logprobs=logprobs,
        cache_salt=f"reference-{uuid.uuid4().hex}",
    )


def compare(
    got: Completion,
    reference: Completion,
    *,
    expected_cached_tokens: int | None,
    atol: float = DEFAULT_ATOL,
) -> CheckResult:
    problems: list[str] = []
    if (
        expected_cached_tokens is not None
        and got.cached_tokens != expected_cached_tokens
    ):
        problems.append(
            f"cached tokens {got.cached_tokens} != expected {expected_cached_tokens}: "
            "the KV did not (all) come from the connector"
        )
    if not reference.logprobs or not got.logprobs:
        problems.append("no logprobs to compare (request logprobs>0 on both sides)")
    n = min(len(got.logprobs), len(reference.logprobs))
    if got.token_ids[:n] != reference.token_ids[:n]:
        problems.append(
            f"generated tokens differ: {got.token_ids[:n]} vs reference {reference.token_ids[:n]}"
        )
    max_diff = 0.0
    for i in range(n):
        g, r = got.logprobs[i], reference.logprobs[i]
        if set(g) != set(r):
            problems.append(
                f"token {i}: top-k sets differ: {sorted(g)} vs reference {sorted(r)}"
            )
            # still measure the common part
        for tok in set(g) & set(r):
            max_diff = max(max_diff, abs(g[tok] - r[tok]))
    for a, b in zip(got.token_logprobs[:n], reference.token_logprobs[:n]):
        max_diff = max(max_diff, abs(a - b))
    if max_diff > atol:
        problems.append(
            f"logprobs differ from the reference by up to {max_diff:.3g} (> {atol:g})"
        )
    return CheckResult(
        ok=not problems,
        problems=problems,
        max_logprob_diff=max_diff,
        cached_tokens=got.cached_tokens,
        expected_cached_tokens=expected_cached_tokens,
        compared_tokens=n,
    )
