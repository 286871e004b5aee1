"""How often does a GPU expert cache hit, per replacement policy, on a trained model's routing?

Runs a model over a text on the CPU (the reference path with the C core), records every token's
top-k experts at every MoE layer, and replays that routing through the expert cache
(pyruntime/offload/cache.py, demand caching: every miss is admitted) at several cache sizes, for
each replacement policy. Slots are model-wide; a size is given as the fraction of all routed
experts of the model that fit. Random-weight models route almost uniformly (hit rate ~ the cached
fraction), so use a trained checkpoint: ../shared/models/tiny-olmoe64 has OLMoE-1B-7B's 64
experts and top-8.

    python bench/expert_cache.py ../shared/models/tiny-olmoe64 -f ../shared/data/eval-jargon.txt

prints one row per (policy, fraction): hit rate, evictions per token.

--prefill replays the text's windows as prefills instead: each window one pass that looks up,
layer after layer, every expert its tokens use (as the hybrid's prefill does), each miss
admitted; once with the policy's victims (recency) and once in the sweep order the hybrid's
prefill admits by (pyruntime/offload/cache.py). `--repeat R` runs each window R times in a row
(pyruntime bench's pp: the same prompt again), the hit rate then counting the repeats only.

    python bench/expert_cache.py ../shared/models/tiny-olmoe64 -f TEXT --prefill --window 512 \
        --repeat 3 --fractions 0.25,0.6
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime

from pyruntime.converter import convert  # noqa: E402
from pyruntime.cpu.executor import CpuExecutor  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402
from pyruntime.offload.cache import ExpertCache, replay_hit_rate  # noqa: E402
from pyruntime.offload.policy import LFRU, LRU  # noqa: E402
from pyruntime.text.tokenizer import Tokenizer  # noqa: E402


def record_routing(gguf: Path, text: str, max_tokens: int, window: int) -> tuple[list, int, int]:
    """[(layer, experts of one token)] in token order, layers in order; n_layer; n_expert."""
    f = open_gguf(gguf)
    net = CpuExecutor.from_gguf(f)
    ids = Tokenizer.from_gguf(f).encode(text, add_special=False)[:max_tokens]
    per_token: dict[int, list[tuple[int, list[int]]]] = {}
    offset = 0

    def observe(layer, store, x, topk, act) -> None:  # the gate observer's signature
        for t, row in enumerate(topk.tolist()):
            per_token.setdefault(offset + t, []).append((layer, row))

    net.gate_observer = observe
    for start in range(0, len(ids), window):
        offset = start
        chunk = ids[start : start + window]
        net.forward(chunk, net.new_cache(len(chunk)))
    routing = [lr for t in sorted(per_token) for lr in per_token[t]]
    return routing, net.config.n_layer, net.config.n_expert


def prefill_passes(routing: list, n_moe: int, window: int) -> list[list[tuple[int, list[int]]]]:
    """The routing as prefills of `window` tokens: per pass, per layer in order, (layer, the
    experts its tokens use)."""
    tokens = [routing[t : t + n_moe] for t in range(0, len(routing), n_moe)]
    passes = []
    for start in range(0, len(tokens), window):
        chunk = tokens[start : start + window]
        passes.append([(layer, sorted({e for tok in chunk for e in tok[j][1]}))
                       for j, (layer, _) in enumerate(chunk[0])])  # fmt: skip
    return passes


def replay_prefills(passes: list, repeat: int, n_layer: int, n_expert: int, slots: int,
                    policy, sweep: bool) -> float:  # fmt: skip
    """Hit rate of the repeats (each pass run `repeat` times in a row; all of it when 1), every
    miss admitted with its layer's experts protected, by sweep order or the policy's victim."""
    cache = ExpertCache(n_layer, n_expert, slots, policy)
    hits = lookups = 0
    for one in passes:
        for r in range(repeat):
            before = cache.stats.hits, cache.stats.misses
            for layer, used in one:
                for e in cache.lookup(layer, used):
                    cache.admit(layer, e, protect=used, sweep=sweep)
            if r or repeat == 1:
                hits += cache.stats.hits - before[0]
                lookups += cache.stats.hits - before[0] + cache.stats.misses - before[1]
    return hits / lookups if lookups else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path, help="HF checkpoint folder or GGUF file")
    ap.add_argument("-f", "--file", type=Path, required=True, help="text to route (UTF-8)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="tokens of the text (8192)")
    ap.add_argument("--window", type=int, default=256, help="tokens per forward pass (256)")
    ap.add_argument(
        "--fractions", default="0.125,0.25,0.5", help="cache sizes as fractions of all experts"
    )
    ap.add_argument(
        "--half-lives", default="64,256,1024", help="LFRU half-lives in routed token-layers"
    )
    ap.add_argument(
        "--prefill", action="store_true", help="replay each window as a prefill pass (module doc)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="--prefill: runs of each window (1)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.model
        if args.model.is_dir():
            gguf = convert(args.model, Path(tmp) / "m.gguf", "f32", progress=False)
        text = args.file.read_text(encoding="utf-8")
        routing, n_layer, n_expert = record_routing(gguf, text, args.max_tokens, args.window)
    n_moe = len({layer for layer, _ in routing})
    n_tokens = len(routing) // max(n_moe, 1)
    print(f"{args.model.name}: {n_tokens} tokens, {n_moe} MoE layers x {n_expert} experts",
          file=sys.stderr)  # fmt: skip
    policies = [("lru", LRU)] + [
        (f"lfru(h={h})", lambda h=float(h): LFRU(half_life=h)) for h in args.half_lives.split(",")
    ]
    if args.prefill:
        passes = prefill_passes(routing, n_moe, args.window)
        print("| policy | cached fraction | slots | prefill hit rate, recency | sweep order |")
        print("|---|---|---|---|---|")
        for frac in (float(x) for x in args.fractions.split(",")):
            slots = round(frac * n_moe * n_expert)
            for name, make in policies:
                rates = [replay_prefills(passes, args.repeat, n_layer, n_expert, slots, make(),
                                         sweep) for sweep in (False, True)]  # fmt: skip
                print(f"| {name} | {frac:g} | {slots} | {rates[0]:.3f} | {rates[1]:.3f} |")
        return 0
    print("| policy | cached fraction | slots | hit rate | evictions per token |")
    print("|---|---|---|---|---|")
    for frac in (float(x) for x in args.fractions.split(",")):
        slots = round(frac * n_moe * n_expert)
        for name, make in policies:
            stats = replay_hit_rate(routing, n_layer, n_expert, slots, make())
            print(f"| {name} | {frac:g} | {slots} | {stats.hit_rate:.3f} | "
                  f"{stats.evictions / max(n_tokens, 1):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
