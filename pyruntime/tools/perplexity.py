"""Perplexity over consecutive, non-overlapping windows of a token sequence.

The tokens are cut into windows of `ctx` tokens: [0, ctx), [ctx, 2 ctx), ... Each window is
evaluated with a fresh KV cache, and every token after its first is scored by the natural-log
negative log-likelihood of the model's prediction from the tokens before it (in that window).
A final partial window is scored if it holds at least 2 tokens, and dropped otherwise.
ppl = exp(mean NLL over all scored tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pyruntime.errors import UsageError


class _Scorer(Protocol):
    def logits(self, token_ids: Sequence[int]) -> np.ndarray: ...


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float  # exp(nll)
    nll: float  # mean natural-log negative log-likelihood per scored token
    tokens_scored: int
    windows: int
    ctx: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "ppl": self.ppl,
            "nll": self.nll,
            "tokens_scored": self.tokens_scored,
            "windows": self.windows,
            "ctx": self.ctx,
        }


def split_windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """[start, end) of each window; a tail shorter than 2 tokens has nothing to score."""
    if ctx < 2:
        raise UsageError(f"the perplexity context must be >= 2 tokens, got {ctx}")
    windows = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens, ctx)]
    return [(s, e) for s, e in windows if e - s >= 2]


def window_nll(logits: torch.Tensor, window: Sequence[int]) -> torch.Tensor:
    """NLL [len(window) - 1] float64 of window[1:] given logits [len(window), n_vocab]."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.as_tensor(window[1:], dtype=torch.long)
    return -logprobs.gather(1, targets[:, None])[:, 0]


def perplexity(
    model: _Scorer,
    token_ids: Sequence[int],
    ctx: int = 512,
    progress: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Score `token_ids` with `model.logits` (a fresh cache per window).

    progress(window_index, n_windows, running_ppl) is called after each window.
    """
    windows = split_windows(len(token_ids), ctx)
    if not windows:
        raise UsageError(
            f"the text has {len(token_ids)} tokens: at least 2 are needed to score perplexity"
        )
    total = 0.0
    count = 0
    for i, (start, end) in enumerate(windows):
        window = list(token_ids[start:end])
        logits = torch.from_numpy(np.asarray(model.logits(window)))
        nll = window_nll(logits, window)
        total += float(nll.sum())
        count += nll.numel()
        if progress is not None:
            progress(i, len(windows), math.exp(total / count))
    mean = total / count
    return PerplexityResult(
        ppl=math.exp(mean), nll=mean, tokens_scored=count, windows=len(windows), ctx=ctx
    )
