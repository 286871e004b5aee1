"""What does big/little decoding cost in quality, and how often does it fall back?

For one trained checkpoint (HF folder or GGUF), on the CPU:
- perplexity of a text for little-only (--experts-per-token K/2), big/little lossy at each
  threshold γ (each position scored by the big model where the little one would fall back), and
  big-only; the share of the little-to-big perplexity gap each γ recovers, and its fallback ratio
  (positions under γ);
- greedy decoding of chat prompts with each mode: the share of tokens equal to big-only's at the
  same position, the mean length of the common prefix with big-only, and the fallback ratio of
  the generation itself (lossy) or the verify acceptance length.

    python bench/big_little.py ../shared/models/tiny-olmoe64 -f ../shared/data/eval-jargon.txt

A random-weight model has meaningless confidence (it would fall back almost always): use a trained
one. tiny-olmoe64 has OLMoE-1B-7B's 64 experts and top-8 (little = 4).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime

from pyruntime.api import Model  # noqa: E402
from pyruntime.converter import convert  # noqa: E402
from pyruntime.tools.perplexity import perplexity  # noqa: E402

PROMPTS = [
    "Tell me a fortune.",
    "What is a list comprehension in Python?",
    "How do I quit vim?",
    "Who was Moses?",
    "Write a short poem about the sea.",
    "What does the os module do?",
    "Give me some advice about work.",
    "How do I search for a word in vim?",
]


def load(path: Path, ctx: int, **decoding) -> Model:
    return Model(path, n_ctx=ctx, device="cpu", seed=0, **decoding)


def ppl_of(path: Path, ids: list[int], ctx: int, **decoding) -> float:
    return perplexity(load(path, ctx, **decoding), ids, ctx).ppl


def fallback_share(path: Path, ids: list[int], ctx: int, k_little: int, gamma: float) -> float:
    """Share of the text's positions whose little-model top probability is under gamma."""
    m = load(path, ctx, experts_per_token=k_little)
    unsure = total = 0
    for start in range(0, len(ids) - 1, ctx):
        window = ids[start : start + ctx]
        if len(window) < 2:
            break
        logits = m.logits(window)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        top = (p / p.sum(-1, keepdims=True)).max(-1)
        unsure += int((top < gamma).sum())
        total += len(window)
    return unsure / total


def greedy(m: Model, max_tokens: int, **decoding) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        m.reset()
        reply = m.create_chat_completion([{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, temperature=0.0,
                                         **decoding)  # fmt: skip
        out.append(m.tokenize(reply["choices"][0]["message"]["content"], add_special=False))
    return out


def agreement(runs: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal to the reference's, mean common-prefix length)."""
    same = total = 0
    prefix = []
    for a, b in zip(runs, ref, strict=True):
        n = max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += n
        k = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        prefix.append(k)
    return same / max(total, 1), sum(prefix) / len(prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path, help="HF checkpoint folder or GGUF file")
    ap.add_argument("-f", "--file", type=Path, required=True, help="text for perplexity (UTF-8)")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity window (256)")
    ap.add_argument("--max-text-tokens", type=int, default=16384, help="of the text (16384)")
    ap.add_argument("--gammas", default="0.5,0.7,0.9", help="fallback thresholds")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per chat answer (48)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path.is_dir():
            path = convert(path, Path(tmp) / "m.gguf", "f32", progress=False)
        big = load(path, args.ctx)
        k_big = big.config.n_expert_used
        k_little = k_big // 2
        ids = big.tokenize(args.file.read_text(encoding="utf-8"))[: args.max_text_tokens]
        gammas = [float(g) for g in args.gammas.split(",")]
        print(f"{args.model.name}: top-{k_big}, little {k_little}; {len(ids)} tokens of "
              f"{args.file.name}, windows of {args.ctx}", file=sys.stderr)  # fmt: skip

        ppl_big = ppl_of(path, ids, args.ctx)
        ppl_little = ppl_of(path, ids, args.ctx, experts_per_token=k_little)
        gap = math.log(ppl_little) - math.log(ppl_big)
        print("| mode | perplexity | gap recovered | fallback ratio (text) |")
        print("|---|---|---|---|")
        print(f"| little-only ({k_little}) | {ppl_little:.2f} | 0% | 0 |")
        for g in gammas:
            p = ppl_of(path, ids, args.ctx, little_experts=k_little, fallback_threshold=g)
            rec = (math.log(ppl_little) - math.log(p)) / gap if gap else float("nan")
            share = fallback_share(path, ids, args.ctx, k_little, g)
            print(f"| big/little γ={g:g} | {p:.2f} | {rec:.0%} | {share:.3f} |")
        print(f"| big-only ({k_big}) | {ppl_big:.2f} | 100% | 1 |")

        ref = greedy(big, args.max_tokens)
        print()
        print("| chat, greedy | tokens equal to big-only's | mean common prefix | fallback ratio "
              "/ acceptance length |")  # fmt: skip
        print("|---|---|---|---|")
        modes = [("little-only", dict(experts_per_token=k_little), None)]
        modes += [(f"γ={g:g}", dict(little_experts=k_little, fallback_threshold=g), "lossy")
                  for g in gammas]  # fmt: skip
        modes += [("verify (draft 4)", dict(little_experts=k_little, fallback="verify"), "verify")]
        for name, decoding, kind in modes:
            m = load(path, 512)
            runs = greedy(m, args.max_tokens, **decoding)
            share, prefix = agreement(runs, ref)
            s = m.big_little_stats
            extra = (f"{s.fallback_ratio:.3f}" if kind == "lossy" else
                     f"{s.acceptance_length:.2f} of 4" if kind == "verify" else "-")  # fmt: skip
            print(f"| {name} | {share:.3f} | {prefix:.1f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
