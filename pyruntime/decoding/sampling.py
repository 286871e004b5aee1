"""Token sampling, in llama.cpp's order and with its defaults (pyruntime.options).

Chain (each step sees the survivors of the previous one):
repeat penalty -> top-k -> top-p -> min-p -> temperature -> draw (seeded torch.Generator).
temp == 0 is greedy: the argmax of the (penalized) logits, no randomness.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pyruntime.errors import UsageError
from pyruntime.options import DEFAULTS, check_kind


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; invalid values raise UsageError at construction.

    temp: softmax temperature, 0 = greedy.  top_k: keep the k most likely, 0 = off.
    top_p: keep the smallest set whose probability reaches top_p, 1 = off.
    min_p: drop tokens less likely than min_p * p(most likely), 0 = off.
    repeat_penalty: divide positive (multiply negative) logits of tokens seen in the last
    repeat_last_n tokens (0 = off, -1 = the whole context); 1 = off.
    seed: None draws a random seed.
    """

    temp: float = DEFAULTS.temp
    top_k: int = DEFAULTS.top_k
    top_p: float = DEFAULTS.top_p
    min_p: float = DEFAULTS.min_p
    repeat_penalty: float = DEFAULTS.repeat_penalty
    repeat_last_n: int = DEFAULTS.repeat_last_n
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed"):
            check_kind(name, getattr(self, name), "invalid sampling parameter: ", name == "seed")
        checks = [
            (math.isfinite(self.temp) and self.temp >= 0, "temp must be >= 0 (0 = greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1] (1 = off)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1] (0 = off)"),
            (
                math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
                "repeat_penalty must be > 0 (1 = off)",
            ),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1 (-1 = whole context)"),
            (self.seed is None or 0 <= self.seed < 1 << 64, "seed must be in [0, 2^64)"),
        ]
        for ok, message in checks:
            if not ok:
                name = message.split()[0]
                raise UsageError(
                    f"invalid sampling parameter: {message}, got {getattr(self, name)!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def apply_repeat_penalty(
    logits: torch.Tensor, history: Sequence[int], penalty: float, last_n: int
) -> torch.Tensor:
    """llama.cpp's repetition penalty on logits [n_vocab] for the distinct ids in the window."""
    if penalty == 1.0 or last_n == 0 or not history:
        return logits
    window = history if last_n < 0 else history[-last_n:]
    ids = torch.tensor(sorted(set(window)), dtype=torch.long)
    ids = ids[ids < logits.shape[0]]
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen <= 0, seen * penalty, seen / penalty)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits to -inf (ties at the boundary: lowest ids kept)."""
    if k <= 0 or k >= logits.shape[0]:
        return logits
    keep = torch.topk(logits, k, sorted=False).indices
    out = torch.full_like(logits, -math.inf)
    out[keep] = logits[keep]
    return out


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their cumulative probability first reaches p."""
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits.double(), dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    cumulative = torch.cumsum(probs[order], dim=-1)
    # Number kept = index of the first cumulative >= p, plus one (llama.cpp keeps that token).
    n_keep = int(torch.searchsorted(cumulative, torch.tensor([p], dtype=torch.float64))) + 1
    n_keep = min(max(n_keep, 1), logits.shape[0])
    out = torch.full_like(logits, -math.inf)
    kept = order[:n_keep]
    out[kept] = logits[kept]
    return out


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    if min_p <= 0.0:
        return logits
    threshold = logits.max() + math.log(min_p)
    return torch.where(logits >= threshold, logits, torch.full_like(logits, -math.inf))


class Sampler:
    """Picks the next token from logits [n_vocab] with one SamplingParams and one RNG stream."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self.params = params
        if generator is None:
            generator = torch.Generator()
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator.manual_seed(seed)
        self.generator = generator

    def filtered_logits(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """Logits after penalty, top-k, top-p, min-p and temperature; removed tokens are -inf."""
        p = self.params
        x = logits.detach().reshape(-1).float()
        x = apply_repeat_penalty(x, history, p.repeat_penalty, p.repeat_last_n)
        if p.greedy:
            return x
        x = top_k_filter(x, p.top_k)
        x = top_p_filter(x, p.top_p)
        x = min_p_filter(x, p.min_p)
        return x / p.temp

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """One token id; `history` is the context so far (prompt + generated), for the penalty."""
        x = self.filtered_logits(logits, history)
        if self.params.greedy:
            return int(torch.argmax(x))
        probs = torch.softmax(x.double(), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The distribution `sample` draws from, float64 [n_vocab]: one-hot on the argmax when
        greedy (speculative acceptance then reduces to "the same token")."""
        x = self.filtered_logits(logits, history)
        if self.params.greedy:
            return torch.nn.functional.one_hot(torch.argmax(x), x.numel()).double()
        return torch.softmax(x.double(), dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """A token from a distribution (as `distribution` returns), with this sampler's RNG."""
        if self.params.greedy:
            return int(torch.argmax(probs))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A uniform draw in [0, 1) from this sampler's RNG (speculative acceptance tests)."""
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))
