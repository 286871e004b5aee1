"""Block-size / path sweep of the decode MoE kernels on a GPU (feeds the config tables).

For one real shape (default qwen3-30b-a3b), BF16 and Q8_0 (repacked to q8_0r by
prepare_experts), batches 1, 4, 16 and sparsity 0.85, times with bench/moe_layer.py's Timer
(CUDA graph, L2 flushed, fresh routing per replay):
- dense decode (_moe_gemv_kernel MODE 0) over (BLOCK_N, BLOCK_H, num_warps);
- sparse "fused" (MODE 2) over (BLOCK_N, BLOCK_H, num_warps, ACC2D);
- sparse "split": the down kernel over (BLOCK_N, BLOCK_H, SPLIT_N, num_warps), then the
  gate-up kernel (MODE 3) over its blocks with the best down blocks;
- sparse "decode" (gate GEMV + sparse_mask + compacted up-down) with its default blocks.
Every config is checked against the default path's output before it is timed.

  python bench/sweep_moe.py --json sweep.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer  # noqa: E402  (bench/moe_layer.py)

# the modules (kernels/__init__ re-exports functions of the same names)
md = importlib.import_module("kernels.moe_dense")
ms = importlib.import_module("kernels.moe_sparse")
from kernels.dispatch import prepare_experts  # noqa: E402
from kernels.expert_formats import act_ref  # noqa: E402


def close(y, ref) -> bool:
    return (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def sweep_case(model, fmt, T, sparsity, args, device, out):
    n_embd, n_expert, k, n_ff = moe_layer.SHAPES[model]
    w_gguf = moe_layer.make_experts(n_expert, n_ff, n_embd, fmt, device)
    w, fk = prepare_experts(w_gguf, fmt, n_embd)
    del w_gguf
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, n_embd, generator=gen).to(device=device, dtype=torch.bfloat16)
    routes = [moe_layer.routing(T, n_expert, k, 100 * T + i, device) for i in range(8)]
    ids, tw = routes[0][0].clone(), routes[0][1].clone()
    timer = moe_layer.Timer(device, routes, ids, tw)
    gate = ms.moe_gate(x, w, fk, ids)
    mags = act_ref(gate, "silu").abs().flatten().sort().values
    thr = mags[int(sparsity * (mags.numel() - 1))].reshape(1).clone()
    moe_layer.check_correct(x, w, fk, ids, tw, "silu")  # default paths vs the torch reference
    ref_d = md.moe_dense(x, w, fk, ids, tw)
    ref_s, _ = ms.moe_sparse(x, w, fk, ids, tw, thr, path="decode")

    def record(kind, cfg, fn, ref):
        y = fn()
        y = y[0] if isinstance(y, tuple) else y
        if not close(y, ref):
            print(f"  WRONG {kind} {cfg}", flush=True)
            return None
        t, _ = timer(fn, args.reps)
        row = dict(model=model, fmt=fk, batch=T, sparsity=sparsity, kind=kind, cfg=cfg, s=t)
        out.append(row)
        return t

    def best(kind):
        rows = [r for r in out if r["kind"] == kind and r["fmt"] == fk and r["batch"] == T]
        return min(rows, key=lambda r: r["s"]) if rows else None

    fam = md.format_family(fk)
    dense_grid = (
        [*itertools.product((8, 16, 32), (512, 1024, 2048), (4, 8)), (4, 1024, 4), (8, 512, 2)]
        if fam == "packed"
        else ((16, 512, 2), (16, 1024, 4), (8, 1024, 4), (32, 1024, 4))
    )
    for bn, bh, nw in dense_grid:
        fn = functools.partial(md.moe_dense_decode, x, w, fk, ids, tw, block_n=bn, block_h=bh)
        md.GEMV_CONFIGS[(0, fam)] = (bn, bh, nw, False)
        record("dense", (bn, bh, nw), fn, ref_d)
    for bn, bh, nw, a2 in itertools.product((8, 16, 32), (1024,), (4, 8), (False, True)):
        blocks = (bn, bh, nw, a2)
        fn = functools.partial(ms.moe_sparse_fused, x, w, fk, ids, tw, thr, blocks=blocks)
        record("fused", blocks, fn, ref_s)
    k1 = md.gemv_blocks(fk, 3, T * k)
    for down in itertools.product((32, 64), (512, 1024), (128, 256, 512), (4,)):
        if down[2] % down[0]:
            continue
        fn = functools.partial(ms.moe_sparse_split, x, w, fk, ids, tw, thr, blocks=k1, down=down)
        record("split_down", (k1, down), fn, ref_s)
    d_best = best("split_down")["cfg"][1]
    for bn, bh, nw, a2 in itertools.product((8, 16, 32), (1024,), (4, 8), (False, True)):
        blocks = (bn, bh, nw, a2)
        fn = functools.partial(
            ms.moe_sparse_split, x, w, fk, ids, tw, thr, blocks=blocks, down=tuple(d_best)
        )
        record("split", (blocks, tuple(d_best)), fn, ref_s)
    fn = functools.partial(ms.moe_sparse, x, w, fk, ids, tw, thr, path="decode")
    record("decode", None, fn, ref_s)
    for kind in ("dense", "fused", "split", "decode"):
        b = best(kind)
        if b:
            print(f"BEST {model} {fk} T={T} {kind}: {b['s'] * 1e6:.1f} us {b['cfg']}", flush=True)
    del w
    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"])
    ap.add_argument("--formats", nargs="+", default=["bf16", "q8_0"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--sparsity", type=float, default=0.85)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    out: list[dict] = []
    print(f"# sweep on {torch.cuda.get_device_name()}", flush=True)
    try:
        for model, fmt, T in itertools.product(args.models, args.formats, args.batches):
            sweep_case(model, fmt, T, args.sparsity, args, device, out)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=0))
    return out


if __name__ == "__main__":
    main()
