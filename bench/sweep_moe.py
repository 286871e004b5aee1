"""Block-size / path sweep of the decode MoE kernels on a GPU (feeds the config tables).

For one real shape (default qwen3-30b-a3b), BF16 and Q8_0 (repacked to q8_0r by
prepare_experts), batches 1, 4, 16 and sparsity 0.85, times with bench/moe_layer.py's Timer
(CUDA graph, L2 flushed, fresh routing per replay):
- dense decode (_moe_gemv_kernel MODE 0) over (BLOCK_N, BLOCK_H, num_warps);
- sparse "fused" (MODE 2) over (BLOCK_N, BLOCK_H, num_warps, ACC2D);
- sparse "split": the down kernel over (BLOCK_N, BLOCK_H, SPLIT_N, num_warps), then the
  gate-up kernel (MODE 3) over its blocks with the best down blocks;
- sparse "decode" (gate GEMV + sparse_mask + compacted up-down) with its default blocks.
Every config is checked against the default path's output before it is timed. The winners
are written into the kernels' config tables of this process (and --tuned-json), and
--then-bench runs bench/moe_layer.py with them (copy them into kernels/ to keep them).

  python bench/sweep_moe.py --json sweep.json --tuned-json tuned.json --then-bench --json full.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer  # noqa: E402  (bench/moe_layer.py)

# the modules (kernels/__init__ re-exports functions of the same names)
from pyruntime.kernels import moe_dense as md
from pyruntime.kernels import moe_sparse as ms
from pyruntime.kernels.dispatch import prepare_experts  # noqa: E402
from pyruntime.kernels.expert_formats import act_ref  # noqa: E402


def close(y, ref) -> bool:
    return (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def gmean(xs) -> float:
    return float(torch.tensor(xs).log().mean().exp())


def sweep_case(model, fmt, T, sparsity, args, device, out, deadline):
    shape = moe_layer.SHAPES[model]
    n_embd, n_expert, k, n_ff = shape
    w_gguf = moe_layer.make_experts(n_expert, n_ff, n_embd, fmt, device)
    w, fk = prepare_experts(w_gguf, fmt, n_embd)
    del w_gguf
    x, ids, tw, timer = moe_layer.case_inputs(T, shape, device, torch.bfloat16, 8)
    gate = ms.moe_gate(x, w, fk, ids)
    mags = act_ref(gate, "silu").abs().flatten().sort().values
    thr = mags[int(sparsity * (mags.numel() - 1))].reshape(1).clone()
    moe_layer.check_correct(x, w, fk, ids, tw, "silu")  # default paths vs the torch reference
    ref_d = md.moe_dense(x, w, fk, ids, tw)
    ref_s, _ = ms.moe_sparse(x, w, fk, ids, tw, thr, path="decode")

    def record(kind, cfg, fn, ref):
        if time.time() > deadline:
            return None
        timer.set_routing(0)  # the routing of ref (timing cycles the routing buffers)
        y = fn()
        y = y[0] if isinstance(y, tuple) else y
        if not close(y, ref):
            print(f"  WRONG {fk} T={T} {kind} {cfg}", flush=True)
            return None
        t, _ = timer(fn, args.reps)
        row = dict(model=model, fmt=fk, batch=T, sparsity=sparsity, kind=kind, cfg=cfg, s=t)
        out.append(row)
        return t

    fam = md.format_family(fk)
    dense_grid = (
        [*itertools.product((8, 16, 32), (512, 1024), (4, 8), (False, True)),
         (8, 2048, 4, False), (16, 2048, 4, False)]
        if fam == "packed"
        else [(16, 512, 2, False), (16, 1024, 4, False), (8, 1024, 4, False),
              (16, 1024, 4, True), (8, 1024, 4, True), (32, 1024, 4, False)]
    )  # fmt: skip
    for blocks in dense_grid:
        fn = functools.partial(md.moe_dense_decode, x, w, fk, ids, tw, blocks=blocks)
        record("dense", blocks, fn, ref_d)
    for blocks in itertools.product((8, 16, 32), (1024,), (4, 8), (False, True)):
        fn = functools.partial(ms.moe_sparse_fused, x, w, fk, ids, tw, thr, blocks=blocks)
        record("fused", blocks, fn, ref_s)
    k1 = md.gemv_blocks(fk, 3, T * k)
    for down in itertools.product((32, 64), (512, 1024), (128, 256, 512), (4,)):
        fn = functools.partial(ms.moe_sparse_split, x, w, fk, ids, tw, thr, blocks=k1, down=down)
        record("split_down", (k1, down), fn, ref_s)
    b = best(out, fk, T, "split_down")
    d_best = tuple(b["cfg"][1]) if b else ms.down_blocks(fk)
    for blocks in itertools.product((8, 16, 32), (1024,), (4, 8), (False, True)):
        fn = functools.partial(
            ms.moe_sparse_split, x, w, fk, ids, tw, thr, blocks=blocks, down=d_best
        )
        record("split", (blocks, d_best), fn, ref_s)
    fn = functools.partial(ms.moe_sparse, x, w, fk, ids, tw, thr, path="decode")
    record("decode", None, fn, ref_s)
    for kind in ("dense", "fused", "split_down", "split", "decode"):
        b = best(out, fk, T, kind)
        if b:
            print(f"BEST {model} {fk} T={T} {kind}: {b['s'] * 1e6:.1f} us {b['cfg']}", flush=True)
    del w
    torch.cuda.empty_cache()


def best(out, fmt, T, kind):
    rows = [r for r in out if r["kind"] == kind and r["fmt"] == fmt and r["batch"] == T]
    return min(rows, key=lambda r: r["s"]) if rows else None


def best_over(out, fmt, batches, kind):
    """The config of `kind` with the least geometric-mean time over `batches` (all timed)."""
    by_cfg: dict = {}
    for r in out:
        if r["kind"] == kind and r["fmt"] == fmt and r["batch"] in batches:
            by_cfg.setdefault(json.dumps(r["cfg"]), []).append(r["s"])
    full = {c: gmean(v) for c, v in by_cfg.items() if len(v) == len(batches)}
    return json.loads(min(full, key=full.get)) if full else None


def as_tuple(cfg):
    return tuple(as_tuple(c) if isinstance(c, list) else c for c in cfg)


def apply_best(out, fmts) -> dict:
    """Write the sweep's winners into the kernels' config tables (this process only) and
    return them: dense decode over T = 1, 4; fused at T = 1 and over T = 4, 16; the split
    path's kernels at T = 1; the sparse path per batch bucket (1, <= 4, <= 16)."""
    tuned = {}
    for fk in fmts:
        fam = md.format_family(fk)
        picks = {}
        if cfg := best_over(out, fk, (1, 4), "dense"):
            md.GEMV_CONFIGS[(0, fam)] = picks["dense"] = as_tuple(cfg)
        if b := best(out, fk, 1, "fused"):
            md.GEMV_CONFIGS[(2, fam, "one")] = picks["fused_one"] = as_tuple(b["cfg"])
        if cfg := best_over(out, fk, (4, 16), "fused"):
            md.GEMV_CONFIGS[(2, fam)] = picks["fused"] = as_tuple(cfg)
        if b := best(out, fk, 1, "split"):
            k1, down = as_tuple(b["cfg"])
            md.GEMV_CONFIGS[(3, fam)], ms.DOWN_CONFIGS[fam] = k1, down
            picks["split"] = (k1, down)
        paths = []
        for T in (1, 4, 16):
            cands = [best(out, fk, T, kind) for kind in ("fused", "split", "decode")]
            cands = [c for c in cands if c]
            if cands:
                paths.append((T, min(cands, key=lambda r: r["s"])["kind"]))
        if len(paths) == 3:
            ms.SPARSE_PATHS[fam] = picks["paths"] = (*paths, (1 << 62, "prefill"))
        tuned[fk] = picks
        print(f"TUNED {fk}: {picks}", flush=True)
    return tuned


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"])
    ap.add_argument("--formats", nargs="+", default=["bf16", "q8_0"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--sparsity", type=float, default=0.85)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=240, help="stop timing configs after")
    ap.add_argument("--json")
    ap.add_argument("--tuned-json", help="write the winning configs here")
    ap.add_argument("--then-bench", nargs=argparse.REMAINDER,
                    help="then bench/moe_layer.py with these arguments")  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    out: list[dict] = []
    deadline = time.time() + args.budget_s
    print(f"# sweep on {torch.cuda.get_device_name()}", flush=True)
    try:
        for model, fmt, T in itertools.product(args.models, args.formats, args.batches):
            sweep_case(model, fmt, T, args.sparsity, args, device, out, deadline)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=0))
    fmts = sorted({r["fmt"] for r in out})
    tuned = apply_best(out, fmts)
    if args.tuned_json:
        Path(args.tuned_json).write_text(json.dumps(tuned, indent=1))
    if args.then_bench is not None:
        moe_layer.main(args.then_bench)
    return out


if __name__ == "__main__":
    main()
