"""`pyruntime bench`: prompt and generation speed, llama-bench style."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyruntime import options
from pyruntime.cli.common import (
    load_model,
    model_or_demo,
    print_stats,
    sparsity_report,
    stats_flag,
)
from pyruntime.errors import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="prompt and generation speed (llama-bench style)",
        description="Time pp N (prefill of N random tokens) and tg N (N single-token decode "
        "steps), each from an empty cache, repeated -r times after a warm-up run; prints "
        "tokens/s mean ± std as a markdown table (or JSON with -o json).",
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens, 0 = skip (512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens, 0 = skip (128)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions (5)")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md", help="md or json")
    stats_flag(p)
    options.add_arguments(p, "bench")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pyruntime.tools.bench import markdown_table, result_rows, run_bench

    path = model_or_demo(args.model)
    counts = (args.n_prompt, args.n_gen)
    if min(counts) < 0 or max(counts) >= options.C_INT or sum(counts) == 0:
        raise UsageError("bench needs -p N and/or -n N in [1, 2^31) (0 skips that test)")
    if not 1 <= args.repetitions < options.C_INT:
        raise UsageError(f"-r/--repetitions must be in [1, 2^31), got {args.repetitions}")
    model = load_model(path, args, n_ctx=max(args.n_prompt, args.n_gen))
    print(
        f"bench: {Path(path).name} on {model.device}, {model.decoding.describe()}",
        file=sys.stderr,
    )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = run_bench(
        model.net, args.n_prompt, args.n_gen, args.repetitions, progress=progress,
        mode=model.decoding, stats=model.big_little_stats,
    )  # fmt: skip
    rows = result_rows(model, results, _cpu_threads(model))
    if args.output == "json":
        print(json.dumps(rows, indent=1))
    else:
        print(markdown_table(rows))
    if model.sparsity:
        print(sparsity_report(model).lstrip(" |"), file=sys.stderr)
    print_stats(model, args)
    return 0


def _cpu_threads(model) -> int:
    """CPU threads the model computes with: the C core's pool when it runs the experts (torch
    is then held to one thread so the two do not contend; the hybrid's CPU share), else
    torch's."""
    import torch

    net = model.net
    core = getattr(getattr(net, "expert_backend", None), "core", None) or getattr(net, "core", None)
    return core.threads if core is not None else torch.get_num_threads()
