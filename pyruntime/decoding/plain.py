"""Plain decoding: one forward pass of the full model per token.

A decoding strategy turns a prompt into a stream of token ids over a Session: it evaluates the
prompt, samples, feeds what it sampled, and repeats; TextStream (stream.py) consumes the ids and
owns everything about text (detokenizing, stop strings, max_tokens, timings). Strategies sit side
by side as siblings of this one (big/little decoding and draft-and-verify come next), the way
mlx-lm keeps generate_step beside speculative_generate_step; each is a generator with this
signature (DecodingStrategy), and a token is fed to the model only when the consumer asks for
the next one, so the last token of a generation is never evaluated for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pyruntime.decoding.sampling import Sampler
from pyruntime.decoding.session import Session


@dataclass
class PromptStats:
    """What evaluating the prompt cost: filled by a strategy before it yields its first token."""

    evaluated: int = 0  # prompt tokens run through the model (the rest came from the cache)
    seconds: float = 0.0


class DecodingStrategy(Protocol):
    def __call__(
        self, session: Session, prompt_ids: Sequence[int], sampler: Sampler, prompt: PromptStats
    ) -> Iterator[int]: ...


def plain_decoding(
    session: Session,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    prompt: PromptStats,
    k: int | None = None,
) -> Iterator[int]:
    """Prefill `prompt_ids` (reusing the session's cached prefix), then forever: sample the next
    token from the logits (the repeat penalty sees prompt + generated ids), yield it, and once
    resumed feed it to get the next logits. k: experts per token (None: the model's top-k)."""
    start = time.perf_counter()
    logits, prompt.evaluated = session.prefill(prompt_ids, k=k)
    prompt.seconds = time.perf_counter() - start
    history = list(prompt_ids)
    while True:
        token = sampler.sample(logits, history)
        history.append(token)
        yield token
        logits = session.feed(token, k=k)
