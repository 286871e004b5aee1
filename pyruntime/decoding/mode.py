"""Which decoding strategy a generation uses, from the user's options.

`DecodingMode` holds the decoding options (pyruntime.options: --experts-per-token,
--little-experts / --big-little, --fallback-threshold, --fallback, --draft, --draft-experts),
checks them against
the model once, and gives the strategy of a generation (`strategy`) and the logits a perplexity
run scores (`score`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pyruntime.decoding.big_little import (
    BigLittle,
    BigLittleStats,
    DraftVerify,
    check_big_little,
)
from pyruntime.decoding.plain import DecodingStrategy, plain_decoding
from pyruntime.errors import UsageError
from pyruntime.model.config import ModelConfig
from pyruntime.model.executor import Executor
from pyruntime.options import DEFAULTS

FALLBACKS = ("lossy", "verify")
DRAFT_EXPERTS = ("little", "resident")


@dataclass(frozen=True)
class DecodingMode:
    k_big: int  # experts per token of plain decoding and of the big model
    k_little: int = 0  # experts per token of the little model; 0 = plain decoding
    threshold: float = DEFAULTS.fallback_threshold
    fallback: str = DEFAULTS.fallback
    draft: int = DEFAULTS.draft
    draft_experts: str = DEFAULTS.draft_experts  # verify's draft: little or resident (hybrid)

    @classmethod
    def from_options(
        cls,
        cfg: ModelConfig,
        experts_per_token: int | None = None,
        little_experts: int = 0,
        big_little: bool = False,
        fallback_threshold: float = DEFAULTS.fallback_threshold,
        fallback: str = DEFAULTS.fallback,
        draft: int = DEFAULTS.draft,
        draft_experts: str = DEFAULTS.draft_experts,
    ) -> DecodingMode:
        """Checked against the model; a bare big_little means k_little = k_big // 2."""
        k_big = cfg.n_expert_used if experts_per_token is None else int(experts_per_token)
        if not 1 <= k_big <= cfg.n_expert:
            raise UsageError(
                f"--experts-per-token must be in 1..{cfg.n_expert} (the model's experts), "
                f"got {k_big}"
            )
        if little_experts < 0:
            raise UsageError(f"--little-experts must be >= 0 (0 = off), got {little_experts}")
        k_little = little_experts or (k_big // 2 if big_little else 0)
        if fallback not in FALLBACKS:
            raise UsageError(f"--fallback must be lossy or verify, got '{fallback}'")
        if draft < 1:
            raise UsageError(f"--draft must be >= 1, got {draft}")
        if draft_experts not in DRAFT_EXPERTS:
            raise UsageError(f"--draft-experts must be little or resident, got '{draft_experts}'")
        if k_little or big_little:
            check_big_little(k_little, k_big, cfg.n_expert, fallback_threshold)
        elif not 0.0 <= fallback_threshold <= 1.0:
            raise UsageError(f"--fallback-threshold must be in [0, 1], got {fallback_threshold}")
        return cls(k_big, k_little, float(fallback_threshold), fallback, int(draft),
                   draft_experts)  # fmt: skip

    @property
    def big_little(self) -> bool:
        return self.k_little > 0

    @property
    def resident_draft(self) -> bool:
        """Verify mode drafting from the GPU-resident experts (hybrid executors only)."""
        return self.big_little and self.fallback == "verify" and self.draft_experts == "resident"

    def describe(self) -> str:
        if not self.big_little:
            return f"plain, {self.k_big} experts per token"
        how = (
            f"fallback below p = {self.threshold:g}"
            if self.fallback == "lossy"
            else f"verify, {self.draft} draft tokens per round"
            + (", drafts from GPU-resident experts" if self.draft_experts == "resident" else "")
        )
        return f"big/little {self.k_little}/{self.k_big} experts, {how}"

    def strategy(self, stats: BigLittleStats, default_k: int) -> DecodingStrategy:
        """The strategy of one generation; stats collects what big/little decoding does.
        default_k: the model's own top-k (plain decoding then passes k=None)."""
        if not self.big_little:
            k = None if self.k_big == default_k else self.k_big
            return functools.partial(plain_decoding, k=k)
        if self.fallback == "verify":
            return DraftVerify(self.k_little, self.k_big, self.draft, stats,
                               resident=self.draft_experts == "resident")  # fmt: skip
        return BigLittle(self.k_little, self.k_big, self.threshold, stats)

    @torch.inference_mode()
    def score(self, net: Executor, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits float32 [n_tokens, n_vocab] a perplexity run scores, each window from a fresh
        cache: the model's with k_big experts; with big/little, each position takes the big
        model's logits where the little model's would fall back, else the little model's (the
        little and big passes each run over the whole window)."""
        ids = list(token_ids)
        big = net.forward(ids, net.new_cache(len(ids)), k=self.k_big)
        if not self.big_little:
            return big
        little = net.forward(ids, net.new_cache(len(ids)), k=self.k_little)
        if self.threshold >= 1.0:
            return big
        unsure = torch.softmax(little.float(), dim=-1).max(dim=-1).values < self.threshold
        return torch.where(unsure[:, None], big, little)
