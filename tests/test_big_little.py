"""Big/little decoding (pyruntime.decoding.big_little) on the CPU executor.

Exactness first: γ = 0 is little-only decoding, γ = 1 is big-only (plain) decoding, verify mode's
greedy output is big-only's, and the KV cache after fallbacks is plain big decoding's. These use
the same backend on both sides (the torch reference, and the C core, whose decode step takes k
and reports the routing itself), so the two runs execute the same operations.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_fixtures import make_tiny_hf_model

from pyruntime.api import Model
from pyruntime.converter import convert
from pyruntime.decoding.big_little import BigLittleStats, DraftVerify
from pyruntime.decoding.mode import DecodingMode
from pyruntime.decoding.sampling import Sampler, SamplingParams
from pyruntime.errors import UsageError

PROMPT = [5, 17, 300, 42, 9, 1000, 77]


@pytest.fixture(scope="module")
def top4_gguf(tmp_path_factory) -> Path:
    """A tiny olmoe with 8 experts and top-4 (little = 2), weights large enough (init 0.3)
    that the little and big models choose different tokens."""
    tmp = tmp_path_factory.mktemp("bl")
    hf = make_tiny_hf_model("olmoe", tmp / "hf", num_experts_per_tok=4, initializer_range=0.3)
    return convert(hf, tmp / "m.gguf", "f32", progress=False)


def model(path: Path, backend: str = "torch", **kw) -> Model:
    return Model(path, n_ctx=64, device="cpu", expert_backend=backend, seed=0, **kw)


def tokens(m: Model, n: int = 12, temp: float = 0.0, **decoding) -> list[int]:
    m.reset()
    stream = m.generate(PROMPT, max_tokens=n, temp=temp, seed=3, ignore_eos=True, **decoding)
    list(stream)
    return stream.token_ids


@pytest.mark.parametrize("backend", ["torch", "c"])
@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_threshold_zero_is_little_only_and_one_is_big_only(top4_gguf, temp, backend):
    m = model(top4_gguf, backend)
    big = tokens(m, temp=temp)
    little = tokens(m, temp=temp, experts_per_token=2)
    assert tokens(m, temp=temp, little_experts=2, fallback_threshold=0.0) == little
    assert tokens(m, temp=temp, little_experts=2, fallback_threshold=1.0) == big
    assert big != little  # the two models differ, so the equalities above say something


def test_fallback_leaves_the_cache_of_big_decoding(top4_gguf):
    m = model(top4_gguf)
    tokens(m, n=10)
    plain = [t[:, :, : m.session.cache.n_tokens].clone() for t in m.session.cache.kv]
    stats_before = m.big_little_stats.fallbacks
    tokens(m, n=10, big_little=True, fallback_threshold=1.0)
    after = m.session.cache
    assert m.big_little_stats.fallbacks - stats_before == 10  # the prompt and 9 fed tokens
    for a, b in zip(plain, after.kv, strict=True):
        assert torch.equal(a, b[:, :, : after.n_tokens])


def test_verify_greedy_output_is_big_only(top4_gguf):
    m = model(top4_gguf)
    big = tokens(m, n=20)
    for draft in (1, 3, 5):
        assert tokens(m, n=20, big_little=True, fallback="verify", draft=draft) == big
    s = m.big_little_stats
    assert s.rounds > 0 and 0 <= s.acceptance_length <= 5


def test_verify_at_the_end_of_the_context(top4_gguf):
    m = Model(top4_gguf, n_ctx=len(PROMPT) + 6, device="cpu", expert_backend="torch")
    big = tokens(m, n=50)
    assert len(big) == 7  # the context fills up (the last token is never fed)
    assert tokens(m, n=50, big_little=True, fallback="verify", draft=4) == big


def test_mid_threshold_falls_back_on_some_tokens_and_prefetches(top4_gguf):
    m = model(top4_gguf, big_little=True, fallback_threshold=0.07)
    tokens(m, n=16)
    s = m.big_little_stats
    assert s.passes == 16  # the prompt and 15 fed tokens
    assert 0 < s.fallbacks < s.passes, s
    assert s.big_routings > 0 and 0.0 <= s.prefetch_hit_rate <= 1.0


def test_acceptance_rule_keeps_the_big_distribution():
    """One draft token from q, then the rule: the emitted token is distributed as p."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, dim=-1)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, dim=-1)
    sampler = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    sampler.distribution = lambda logits, history=(): logits  # rows are distributions already
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        d = sampler.draw(q)
        kept, nxt = DraftVerify._accept(sampler, [d], [q], torch.stack([p, p]), [])
        counts[d if kept else nxt] += 1
    assert torch.allclose(counts / n, p.float(), atol=0.015), (counts / n, p)


def test_score_mixes_per_position(top4_gguf):
    m = model(top4_gguf)
    ids = PROMPT * 3
    net = m.net
    cfg = m.config
    big = DecodingMode.from_options(cfg).score(net, ids)
    little = DecodingMode.from_options(cfg, experts_per_token=2).score(net, ids)
    mode = DecodingMode.from_options(cfg, little_experts=2, fallback_threshold=0.07)
    mixed = mode.score(net, ids)
    unsure = torch.softmax(little, dim=-1).max(dim=-1).values < 0.07
    assert 0 < int(unsure.sum()) < len(ids)
    assert torch.equal(mixed[unsure], big[unsure]) and torch.equal(mixed[~unsure], little[~unsure])
    zero = DecodingMode.from_options(cfg, little_experts=2, fallback_threshold=0.0)
    assert torch.equal(zero.score(net, ids), little)


def test_bad_options_are_one_line_errors(top4_gguf, tmp_path):
    m = model(top4_gguf)
    cfg = m.config
    for kw, msg in [
        (dict(little_experts=4), "--little-experts must be in 1..3"),
        (dict(little_experts=-1), "--little-experts must be >= 0"),
        (dict(big_little=True, fallback_threshold=1.5), "--fallback-threshold must be in"),
        (dict(big_little=True, draft=0), "--draft must be >= 1"),
        (dict(fallback="maybe"), "--fallback must be lossy or verify"),
        (dict(experts_per_token=9), "--experts-per-token must be in 1..8"),
    ]:
        with pytest.raises(UsageError, match=msg):
            DecodingMode.from_options(cfg, **kw)
    with pytest.raises(UsageError, match="unknown generation option"):
        m.generate(PROMPT, little=2)
    hf = make_tiny_hf_model("olmoe", tmp_path / "hf", num_experts_per_tok=1)
    top1 = convert(hf, tmp_path / "top1.gguf", "f32", progress=False)
    with pytest.raises(UsageError, match="top-k >= 2"):
        Model(top1, device="cpu", big_little=True)


def test_stats_of_a_plain_model_say_plain(top4_gguf):
    m = model(top4_gguf)
    tokens(m, n=3)
    assert m.stats()["decoding"] == "plain, 4 experts per token"
    bl = model(top4_gguf, big_little=True)
    assert "big/little 2/4" in bl.stats()["decoding"]
    assert set(BigLittleStats().as_dict()) <= set(bl.stats())


def test_draft_verify_sampling_runs_and_counts(top4_gguf):
    m = model(top4_gguf)
    random.seed(0)
    out = tokens(m, n=15, temp=0.8, big_little=True, fallback="verify", draft=3)
    assert len(out) == 15
    s = m.big_little_stats
    assert s.drafted >= s.accepted and s.rounds >= 1
