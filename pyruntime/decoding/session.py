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
    """A KV cache of `max_tokens` positions plus the ids it holds (`ids[i]` at position i).

    A prompt's last logits are kept with the cache: the same prompt again (a prefix of what the
    cache holds) returns them instead of evaluating its last token alone, so a repeated call
    continues exactly as the first did. Evaluated alone, the token would go through the
    one-token decode step, whose quantized kernels round otherwise than the prompt's batched
    pass: a greedy generation could then part from the first one's.
    """

    def __init__(self, net: Executor, max_tokens: int) -> None:
        self.net = net
        self.cache = net.new_cache(max_tokens)
        self.ids: list[int] = []
        # (n, logits [n_vocab]) after ids[:n] as a prefill computed them; None once the cache
        # no longer holds those n positions as that prefill left them
        self._prompt_end: tuple[int, torch.Tensor] | None = None

    @property
    def max_tokens(self) -> int:
        return self.cache.max_tokens

    @property
    def full(self) -> bool:
        return len(self.ids) >= self.cache.max_tokens

    def reset(self) -> None:
        self.cache.truncate(0)
        self.ids = []
        self._prompt_end = None

    def _truncate(self, n: int) -> None:
        """Cut the cache back to n positions (a recurrent state may go further back: the cache
        says what it kept); the kept prompt end goes with the positions it needs."""
        self.cache.truncate(n)
        if self._prompt_end is not None and self.cache.n_tokens < self._prompt_end[0]:
            self._prompt_end = None

    def rewind(self, n: int) -> None:
        """Forget the newest n tokens (0 <= n <= len(ids)): the cache and the ids then hold the
        sequence as it was n tokens ago, and the next feed continues from there."""
        if not 0 <= n <= len(self.ids):
            raise UsageError(f"cannot rewind {n} tokens of a session holding {len(self.ids)}")
        target = len(self.ids) - n
        self._truncate(target)
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
        plain = k is None and routing is None  # the model's own pass: its end may be kept
        common = common_prefix_length(self.ids, prompt_ids)
        end = self._prompt_end
        if plain and end is not None and end[0] == len(prompt_ids) <= common:
            self._truncate(end[0])  # the same prompt again: the cache back to its end
            if self.cache.n_tokens == end[0]:
                self.ids = list(prompt_ids)
                return end[1].clone(), 0
        n_keep = min(common, len(prompt_ids) - 1)
        # Also repairs a cache left ahead of self.ids by an interrupted forward pass. A recurrent
        # state may go back further than asked (to 0): the cache says what it kept.
        self._truncate(n_keep)
        n_keep = self.cache.n_tokens
        self.ids = self.ids[:n_keep]
        logits = self.net.forward(
            list(prompt_ids[n_keep:]), self.cache, last_only=True, k=k, routing=routing
        )
        self.ids = list(prompt_ids)
        self._prompt_end = (len(prompt_ids), logits[-1].clone()) if plain else None
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
