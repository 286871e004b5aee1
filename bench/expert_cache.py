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
from pyruntime.offload.cache import replay_hit_rate  # noqa: E402
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
    args = ap.parse_args(argv)
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
