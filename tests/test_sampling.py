"""Sampler: each filter exactly on hand-made logits, the chain order, greedy, seeds."""

import math

import pytest
import torch

from pyruntime.decoding.sampling import (
    Sampler,
    SamplingParams,
    apply_repeat_penalty,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)
from pyruntime.errors import UsageError

INF = math.inf


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def _kept(x: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(x)).flatten().tolist()


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.seed) == (1.0, 64, None)


def test_cli_defaults_match_sampling_params():
    from pyruntime.cli import build_parser

    args = build_parser().parse_args(["generate", "m.gguf", "-p", "x"])
    p = SamplingParams()
    assert (args.temp, args.top_k, args.top_p, args.min_p) == (p.temp, p.top_k, p.top_p, p.min_p)
    assert (args.repeat_penalty, args.repeat_last_n) == (p.repeat_penalty, p.repeat_last_n)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temp": -0.1},
        {"temp": math.nan},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -2},
        {"seed": -5},
    ],
)
def test_invalid_params_raise_usage_error(kwargs):
    with pytest.raises(UsageError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], penalty=2.0, last_n=64)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # input untouched
    # Only the last `last_n` tokens count; 0 disables; -1 = the whole history.
    assert apply_repeat_penalty(logits, [0, 1], 2.0, last_n=1).tolist() == [2.0, -2.0, 0.5, 3.0]
    assert apply_repeat_penalty(logits, [0, 1], 2.0, last_n=0).tolist() == logits.tolist()
    assert apply_repeat_penalty(logits, [3, 0, 1], 2.0, -1).tolist() == [1.0, -2.0, 0.5, 1.5]


def test_top_k_keeps_exactly_k_largest():
    x = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    assert top_k_filter(x, 2).tolist() == [-INF, 4.0, 3.0, -INF, -INF]
    assert top_k_filter(x, 0).tolist() == x.tolist()  # 0 = off
    assert top_k_filter(x, 99).tolist() == x.tolist()


@pytest.mark.parametrize(
    "p, expected", [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])]
)
def test_top_p_keeps_smallest_set_reaching_p(p, expected):
    # probs 0.5, 0.3, 0.15, 0.05 in shuffled order, to check it sorts
    probs = [0.15, 0.5, 0.05, 0.3]
    order = [1, 3, 0, 2]  # ids by decreasing probability
    out = top_p_filter(_logits_of(probs), p)
    assert sorted(_kept(out)) == sorted(order[i] for i in expected)


def test_min_p_threshold_is_relative_to_the_top_token():
    x = _logits_of([0.5, 0.3, 0.15, 0.05])
    assert _kept(min_p_filter(x, 0.2)) == [0, 1, 2]  # 0.05 < 0.2 * 0.5
    assert _kept(min_p_filter(x, 0.61)) == [0]  # 0.3 < 0.305
    assert _kept(min_p_filter(x, 0.0)) == [0, 1, 2, 3]


def test_chain_order_top_k_before_top_p_and_temperature_last():
    # top-k=2 leaves {0.4, 0.3} -> renormalized {0.571, 0.429}: top-p 0.5 keeps one token.
    # (top-p on the full distribution would have kept two.)
    x = _logits_of([0.4, 0.3, 0.2, 0.1])
    s = Sampler(SamplingParams(temp=1.0, top_k=2, top_p=0.5, min_p=0.0, seed=0))
    assert _kept(s.filtered_logits(x)) == [0]
    # temperature divides the surviving logits after the filters
    s = Sampler(SamplingParams(temp=0.5, top_k=3, top_p=1.0, min_p=0.0, seed=0))
    out = s.filtered_logits(x)
    assert _kept(out) == [0, 1, 2]
    torch.testing.assert_close(out[:3], x[:3] / 0.5)


def test_repeat_penalty_applies_before_the_filters():
    x = torch.tensor([3.0, 2.9, -5.0])
    s = Sampler(SamplingParams(temp=1.0, top_k=1, repeat_penalty=2.0, seed=0))
    # token 0 is penalized to 1.5, so top-1 keeps token 1
    assert _kept(s.filtered_logits(x, history=[0])) == [1]
    assert all(s.sample(x, history=[0]) == 1 for _ in range(20))


def test_greedy_is_argmax_after_penalty():
    x = torch.tensor([0.1, 2.0, 1.9, -1.0])
    greedy = Sampler(SamplingParams(temp=0.0))
    assert greedy.sample(x) == 1
    penalized = Sampler(SamplingParams(temp=0.0, repeat_penalty=1.1))
    assert penalized.sample(x, history=[1]) == 2


def test_same_seed_same_draws_and_different_seed_differs():
    x = torch.zeros(50)  # uniform: every draw is pure RNG
    params = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = Sampler(SamplingParams(**params, seed=123))
    b = Sampler(SamplingParams(**params, seed=123))
    c = Sampler(SamplingParams(**params, seed=124))
    draws_a = [a.sample(x) for _ in range(40)]
    assert draws_a == [b.sample(x) for _ in range(40)]
    assert draws_a != [c.sample(x) for _ in range(40)]


@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_draw_frequencies_follow_the_tempered_distribution(temp):
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    s = Sampler(SamplingParams(temp=temp, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    n = 6000
    counts = torch.bincount(torch.tensor([s.sample(probs.log()) for _ in range(n)]), minlength=3)
    expected = probs ** (1 / temp) / (probs ** (1 / temp)).sum()
    # binomial standard deviation <= sqrt(0.25 / 6000) = 0.0065: 0.025 is ~4 sigma
    torch.testing.assert_close(counts.double() / n, expected, atol=0.025, rtol=0)


def test_filtered_tokens_are_never_drawn():
    x = _logits_of([0.3, 0.25, 0.2, 0.15, 0.1])
    s = Sampler(SamplingParams(temp=1.5, top_k=3, top_p=1.0, min_p=0.0, seed=1))
    assert {s.sample(x) for _ in range(300)} == {0, 1, 2}
