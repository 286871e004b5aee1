"""A sequence being decoded: one KV cache and the token ids it holds.

`Session` remembers which ids its cache holds, so the next prompt (e.g. the next chat turn, whose
rendered history starts with the previous one) only evaluates the tokens after the common prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyruntime.errors import UsageError
from pyruntime.model.executor import Executor, RoutingTrace


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Session:
    """A KV cache of `max_tokens` positions plus the ids it holds (`ids[i]` at position i)."""

    def __init__(self, net: Executor, max_tokens: int) -> None:
        self.net = net
        self.cache = net.new_cache(max_tokens)
        self.ids: list[int] = []

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    @property
    def full(self) -> bool:
        return len(self.ids) >= self.cache.max_tokens

    def reset(self) -> None:
        self.cache.truncate(0)
        self.ids = []

    def rewind(self, n: int) -> None:
        """Forget the newest n tokens (0 <= n <= len(ids)): the cache and the ids then hold the
        sequence as it was n tokens ago, and the next feed continues from there."""
        if not 0 <= n <= len(self.ids):
            raise UsageError(f"cannot rewind {n} tokens of a session holding {len(self.ids)}")
        target = len(self.ids) - n
        self.cache.truncate(target)
        del self.ids[self.cache.n_tokens :]
        if self.cache.n_tokens != target:  # a recurrent state without a snapshot there
            raise UsageError(
                f"cannot rewind {n} tokens: this model's recurrent (DeltaNet) state only goes "
                "back to the end of a prompt; the session starts over"
            )

    def prefill(
        self,
        prompt_ids: Sequence[int],
        *,
        k: int | None = None,
        routing: RoutingTrace | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Evaluate the prompt, reusing the cached common prefix.

        Returns (logits [n_vocab] float32 for the next token, number of tokens evaluated).
        At least the last prompt token is always evaluated, to get its logits. k, routing: as
        the executor's forward (experts per token, what the last token routed).
        """
        if not prompt_ids:
            raise UsageError("the prompt is empty: give at least one token of text")
        if len(prompt_ids) > self.cache.max_tokens:
            raise UsageError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds "
                f"{self.cache.max_tokens}; use a larger context (n_ctx / --ctx-size) or a "
                "shorter prompt"
            )
        n_keep = min(common_prefix_length(self.ids, prompt_ids), len(prompt_ids) - 1)
        # Also repairs a cache left ahead of self.ids by an interrupted forward pass. A recurrent
        # state may go back further than asked (to 0): the cache says what it kept.
        self.cache.truncate(n_keep)
        n_keep = self.cache.n_tokens
        self.ids = self.ids[:n_keep]
        logits = self.net.forward(
            list(prompt_ids[n_keep:]), self.cache, last_only=True, k=k, routing=routing
        )
        self.ids = list(prompt_ids)
        return logits[-1], len(prompt_ids) - n_keep

    def feed(
        self, token_id: int, *, k: int | None = None, routing: RoutingTrace | None = None
    ) -> torch.Tensor:
        """Append one token; logits [n_vocab] for the one after it."""
        logits = self.net.forward([token_id], self.cache, last_only=True, k=k, routing=routing)
        self.ids.append(token_id)
        return logits[-1]

    def extend(self, token_ids: Sequence[int], *, k: int | None = None) -> torch.Tensor:
        """Append several tokens in one forward pass; logits [len(token_ids), n_vocab], row i
        for the token after token_ids[i] (a verifier scores a draft so)."""
        if self.cache.n_tokens + len(token_ids) > self.cache.max_tokens:
            raise UsageError(
                f"context is full: {self.cache.n_tokens} tokens cached + {len(token_ids)} new > "
                f"context size {self.cache.max_tokens}"
            )
        logits = self.net.forward(list(token_ids), self.cache, k=k)
        self.ids.extend(int(t) for t in token_ids)
        return logits
