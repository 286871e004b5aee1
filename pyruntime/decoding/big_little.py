"""Big/little decoding (MoBiLE): decode with few experts, redo the unsure tokens with all of them.

The little model is the same network with k_little experts per token (the top k_little of the
same routers, weights renormalised by the architecture's own rule: pyruntime.model.reference.
route); the big model uses k_big (the model's top-k). Two strategies, siblings of
plain_decoding (decoding/plain.py):

- `BigLittle` (lossy): every forward pass that predicts a token runs little first. When the
  little distribution's largest probability (softmax of the raw logits, before any sampling
  filter) is under the threshold γ, the pass is thrown away (the session is rewound over it) and
  redone big, after `prefetch`ing, for every MoE layer at once, the experts the little pass's
  router ranked top-k_big; the token is then sampled from the big distribution and the cache
  holds the big pass's keys and values for it. The prompt is one such pass: little, redone big
  when the first token is unsure. So γ = 0 never falls back (exactly little-only decoding, the
  plain strategy with k_little), and γ = 1 always does (exactly plain decoding with k_big).
- `DraftVerify` (lossless): the little model drafts up to `draft` tokens one at a time; the big
  model scores them all in one batched forward (the union of their experts read once), and the
  standard speculative acceptance rule keeps each draft token with probability
  min(1, p_big / p_little), else resamples from the normalised residual max(0, p_big - p_little)
  and ends the round; when every draft is kept, one more token comes from the big model's last
  row. The output is distributed exactly as big-only decoding's; greedy output is big-only's.
  With `resident` (hybrid executor only) the draft is instead the big model restricted to the
  routed experts already in GPU slots (`resident_experts_only`: misses are dropped, not staged
  or computed on the CPU), a draft that moves no bytes; the verify pass is unchanged, so the
  output is still big-only's.

Both fill a BigLittleStats.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pyruntime.decoding.plain import PromptStats
from pyruntime.decoding.sampling import Sampler
from pyruntime.decoding.session import Session
from pyruntime.errors import UsageError
from pyruntime.model.executor import RoutingTrace


@dataclass
class BigLittleStats:
    """What big/little decoding did, accumulated over calls."""

    passes: int = 0  # forward passes that predicted a token (prompt and decode steps)
    fallbacks: int = 0  # of those, redone by the big model (lossy)
    little_seconds: float = 0.0  # little passes (lossy: all; verify: the drafts)
    big_seconds: float = 0.0  # big passes (lossy: the fallbacks; verify: the verifications)
    prefetched_hits: int = 0  # big-pass (layer, expert) routings the little pass had prefetched
    big_routings: int = 0  # all big-pass (layer, expert) routings after a prefetch
    rounds: int = 0  # verify rounds
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept

    @property
    def fallback_ratio(self) -> float:
        return self.fallbacks / self.passes if self.passes else 0.0

    @property
    def prefetch_hit_rate(self) -> float:
        """Share of the big passes' experts that the little pass had prefetched."""
        return self.prefetched_hits / self.big_routings if self.big_routings else 0.0

    @property
    def acceptance_length(self) -> float:
        """Draft tokens kept per verify round (each round also yields one big-model token)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "passes": self.passes,
            "fallback_ratio": self.fallback_ratio,
            "little_seconds": self.little_seconds,
            "big_seconds": self.big_seconds,
            "prefetch_hit_rate": self.prefetch_hit_rate,
            "verify_rounds": self.rounds,
            "acceptance_length": self.acceptance_length,
        }


def check_big_little(k_little: int, k_big: int, n_expert: int, threshold: float = 0.7) -> None:
    """UsageError unless 1 <= k_little < k_big <= n_expert and threshold in [0, 1]."""
    if k_big < 2:
        raise UsageError(
            f"big/little decoding needs a model with top-k >= 2 (this one routes {k_big} "
            "expert per token): there is no smaller little model"
        )
    if not 1 <= k_little < k_big:
        raise UsageError(f"--little-experts must be in 1..{k_big - 1} (< top-k), got {k_little}")
    if k_big > n_expert:
        raise UsageError(f"--experts-per-token {k_big} > the model's {n_expert} experts")
    if not 0.0 <= threshold <= 1.0:
        raise UsageError(f"--fallback-threshold must be in [0, 1], got {threshold}")


def falls_back(logits: torch.Tensor, threshold: float) -> bool:
    """True when the little pass is unsure: its largest token probability is under the
    threshold (always at threshold >= 1, never at 0)."""
    if threshold >= 1.0:
        return True
    return float(torch.softmax(logits.float(), dim=-1).max()) < threshold


def resident_experts_only(net):
    """The executor's resident_experts_only (the hybrid's); a UsageError for any other."""
    only = getattr(net, "resident_experts_only", None)
    if only is None:
        raise UsageError("--draft-experts resident drafts from the experts in GPU slots: it "
                         "needs a model running hybrid (bigger than --gpu-mem)")  # fmt: skip
    return only


def top_experts(trace: RoutingTrace, k: int) -> list[tuple[int, list[int]]]:
    """(layer, the k experts its router logits rank highest) for each MoE layer of a trace."""
    if trace.logits is None:
        return []
    top = torch.topk(trace.logits, k, dim=-1).indices.tolist()
    return list(zip(trace.layers, top, strict=True))


class BigLittle:
    """Lossy big/little decoding (see the module doc); a DecodingStrategy."""

    def __init__(
        self, k_little: int, k_big: int, threshold: float = 0.7, stats: BigLittleStats | None = None
    ) -> None:
        self.k_little, self.k_big, self.threshold = k_little, k_big, threshold
        self.stats = stats if stats is not None else BigLittleStats()

    def _redo_big(self, session: Session, little: RoutingTrace, run) -> torch.Tensor:
        """Prefetch what the little pass ranked top-k_big, run the big pass, count the hits."""
        wanted = top_experts(little, self.k_big)
        for layer, experts in wanted:
            session.net.prefetch(layer, experts)
        big = RoutingTrace(layers=[])
        t0 = time.perf_counter()
        logits = run(big)
        self.stats.big_seconds += time.perf_counter() - t0
        self.stats.fallbacks += 1
        if big.ids is not None:
            for (_, fetched), used in zip(wanted, big.ids.tolist(), strict=True):
                self.stats.prefetched_hits += len(set(fetched) & set(used))
                self.stats.big_routings += len(used)
        return logits

    def __call__(
        self, session: Session, prompt_ids: Sequence[int], sampler: Sampler, prompt: PromptStats
    ) -> Iterator[int]:
        start = time.perf_counter()
        little = RoutingTrace(layers=[])
        logits, evaluated = session.prefill(prompt_ids, k=self.k_little, routing=little)
        self.stats.little_seconds += time.perf_counter() - start
        self.stats.passes += 1
        if falls_back(logits, self.threshold):
            session.rewind(evaluated)

            def prefill_big(trace: RoutingTrace) -> torch.Tensor:
                return session.prefill(prompt_ids, k=self.k_big, routing=trace)[0]

            logits = self._redo_big(session, little, prefill_big)
        prompt.evaluated, prompt.seconds = evaluated, time.perf_counter() - start
        history = list(prompt_ids)
        while True:
            token = sampler.sample(logits, history)
            history.append(token)
            yield token
            little = RoutingTrace(layers=[])
            t0 = time.perf_counter()
            logits = session.feed(token, k=self.k_little, routing=little)
            self.stats.little_seconds += time.perf_counter() - t0
            self.stats.passes += 1
            if falls_back(logits, self.threshold):
                session.rewind(1)

                def feed_big(trace: RoutingTrace, token: int = token) -> torch.Tensor:
                    return session.feed(token, k=self.k_big, routing=trace)

                logits = self._redo_big(session, little, feed_big)


class DraftVerify:
    """Lossless draft-and-verify decoding (see the module doc); a DecodingStrategy."""

    def __init__(
        self, k_little: int, k_big: int, draft: int = 4, stats: BigLittleStats | None = None,
        resident: bool = False,
    ) -> None:  # fmt: skip
        if draft < 1:
            raise UsageError(f"--draft must be >= 1, got {draft}")
        self.k_little, self.k_big, self.draft = k_little, k_big, draft
        self.stats = stats if stats is not None else BigLittleStats()
        self.resident = resident  # drafts from the GPU-resident experts of the top-k_big

    def _draft_pass(self, session: Session):
        """(context of a draft pass, its k): the little model, or the big model restricted to
        the experts in GPU slots (the hybrid executor's resident_experts_only)."""
        if not self.resident:
            return contextlib.nullcontext(), self.k_little
        return resident_experts_only(session.net)(), self.k_big

    def __call__(
        self, session: Session, prompt_ids: Sequence[int], sampler: Sampler, prompt: PromptStats
    ) -> Iterator[int]:
        start = time.perf_counter()
        logits, prompt.evaluated = session.prefill(prompt_ids, k=self.k_big)
        prompt.seconds = time.perf_counter() - start
        history = list(prompt_ids)
        token = sampler.sample(logits, history)  # decided, not yet fed
        while True:
            history.append(token)
            yield token
            room = session.max_tokens - len(session.ids)  # positions left for token + drafts
            n = min(self.draft, room - 1)
            if n < 1:  # no room to draft: one plain big step
                logits = session.feed(token, k=self.k_big)
                token = sampler.sample(logits, history)
                continue
            drafts, q = self._draft(session, sampler, token, history, n)
            t0 = time.perf_counter()
            session.rewind(n)  # the little pass's keys and values of token, d1 .. d(n-1)
            big = session.extend([token, *drafts], k=self.k_big)  # [n + 1, n_vocab]
            self.stats.big_seconds += time.perf_counter() - t0
            self.stats.rounds += 1
            self.stats.drafted += n
            kept, token = self._accept(sampler, drafts, q, big, history)
            self.stats.accepted += kept
            session.rewind(n - kept)  # keep token and the kept drafts; the next token is pending
            for d in drafts[:kept]:
                history.append(d)
                yield d

    def _draft(self, session, sampler, token, history, n):
        """n draft tokens from the little model after `token`, and the distribution each was
        drawn from ([n] float64 [n_vocab] tensors)."""
        t0 = time.perf_counter()
        drafts: list[int] = []
        q: list[torch.Tensor] = []
        last = token
        context, k = self._draft_pass(session)
        with context:
            for _ in range(n):
                logits = session.feed(last, k=k)
                probs = sampler.distribution(logits, [*history, *drafts])
                last = sampler.draw(probs)
                drafts.append(last)
                q.append(probs)
        self.stats.little_seconds += time.perf_counter() - t0
        return drafts, q

    @staticmethod
    def _accept(sampler, drafts, q, big, history) -> tuple[int, int]:
        """(draft tokens kept, the next token): the speculative acceptance rule over the big
        model's rows big[i] (the distribution at drafts[i]'s position)."""
        for i, d in enumerate(drafts):
            p = sampler.distribution(big[i], [*history, *drafts[:i]])
            if sampler.uniform() < float(p[d]) / float(q[i][d]):
                continue
            residual = torch.clamp(p - q[i], min=0.0)
            total = float(residual.sum())
            # total == 0 only when p == q where the draft was refused, which the rule above
            # makes impossible up to rounding; then p itself is the right distribution.
            return i, sampler.draw(residual / total if total > 0 else p)
        n = len(drafts)
        return n, sampler.draw(sampler.distribution(big[n], [*history, *drafts]))
