"""Variants of the q8_0r decode MoE kernels on a GPU, timed in one process.

For each real shape (bench/moe_layer.py SHAPES), Q8_0 experts repacked to q8_0r, batches 1, 4
(dense) and 1, 4, 16 (sparse at 0.85), CUDA graph + L2 flush per replay (moe_layer.Timer):
- old: _moe_gemv_kernel (dense decode and the SPARSE_PATHS path), a few BLOCK_H = H configs,
  and MODE 3 at threshold 0 (gate + up + store: no down rows, no atomics);
- q8r dense: the pipelined kernels.moe_q8r_pipe over (BLOCK_N, num_warps, programs per SM);
- q8r sparse: _moe_q8r_kernel over (BLOCK_N, BA, num_warps, dp4a);
- floor: the graph of the zeroed output buffer alone (launch + memset + event overhead);
- a strict check of the dense q8r kernel against moe_dense_ref(q8_x=True) on the routed
  experts of one batch-1 routing per shape.
Every variant is checked against a reference before it is timed (fp32: the float-x results;
dp4a: the Q8-x references, dense and sparse).

  python bench/sweep_q8r.py --json out.json
  python bench/sweep_q8r.py --paths --json out.json   # shipped auto paths vs those they replaced
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer  # noqa: E402

from pyruntime.kernels import moe_dense as md
from pyruntime.kernels import moe_sparse as ms
from pyruntime.kernels.dispatch import prepare_experts  # noqa: E402
from pyruntime.kernels.expert_formats import FMT_CODES  # noqa: E402

# dp4a (the sparse configs' last field): 0 off (fp32 dots on x), 1 x quantized by a
# quantize_x_q8 launch first, 2 quantized inside the expert kernel
DP4A_NAMES = {0: "f32", 1: "dp4a", 2: "dp4a_ik"}
# dense: (BLOCK_N, num_warps, programs per SM) of the pipelined kernel; registers (sm_90,
# ptxas of triton 3.9) allow those programs per SM
DENSE_CFGS = [(2, 8, 2), (2, 4, 2), (1, 4, 3), (1, 8, 2), (1, 2, 4), (2, 4, 1), (4, 8, 1),
              (8, 16, 1)]  # fmt: skip
# sparse: (BLOCK_N, BA, num_warps, dp4a)
SPARSE_CFGS = [(8, 2, 4, 0), (16, 2, 4, 0), (16, 4, 4, 0), (32, 4, 4, 0), (32, 4, 8, 0),
               (32, 8, 8, 0), (64, 4, 8, 0), (64, 8, 8, 0), (16, 4, 2, 0), (16, 4, 4, 1),
               (32, 4, 8, 1)]  # fmt: skip
OLD_DENSE = [(8, 2048, 4, False), (4, 2048, 4, False), (16, 2048, 8, False), (8, 2048, 8, True)]
# --quick: the shipped dense config and two more, the shipped sparse configs (Q8R_CONFIGS)
# with x quantized first and inside, and one more
QUICK_DENSE_CFGS = [(2, 8, 2), (2, 4, 2), (1, 2, 4)]
# --stream: kernels.moe_q8r_stream (dense), (BLOCK_N, num_warps, programs per SM, STAGES);
# registers and shared memory (sm_90, triton 3.9) allow those programs per SM
STREAM_DENSE_CFGS = [(2, 8, 2, 3), (2, 8, 3, 3), (2, 8, 2, 4), (2, 4, 4, 4), (1, 4, 4, 4),
                     (4, 8, 2, 3), (2, 8, 1, 5), (4, 8, 1, 4)]  # fmt: skip
# --chain L: every case also as L layers in one graph (distinct weight copies, as a decode
# step runs them: one graph launch for all), time per layer
QUICK_SPARSE_CFGS = [(16, 4, 4, 1), (16, 4, 4, 2), (8, 2, 4, 1), (8, 2, 4, 2), (32, 4, 8, 2)]


def rel(y, ref):
    return ((y - ref).abs().max() / ref.abs().max()).item()


def run_batch(model, shape, w, fk, thr, T, args, dev, peak, rows, t_end):
    """Every variant at one (shape, batch): appends result rows."""
    H, E, K, F = shape
    rb = w.shape[-1]
    x, ids, tw, timer = moe_layer.case_inputs(T, shape, dev, torch.bfloat16, 8)
    gate = ms.moe_gate(x, w, fk, ids)
    b_dense, b_sparse, achieved = moe_layer.bytes_read(w, fk, H, ids, gate, float(thr),
                                                       "silu")  # fmt: skip
    ref_d = md.moe_dense(x, w, fk, ids, tw)
    ref_s, cnt_s = ms.moe_sparse(x, w, fk, ids, tw, thr, path="decode")
    # the Q8-x references of the dp4a variants, on the routed experts only
    uniq, remap = torch.unique(ids.long(), return_inverse=True)
    sub = w[uniq].contiguous()
    ref_dq = md.moe_dense_ref(x, sub, fk, remap, tw, q8_x=True)
    ref_sq, _ = ms.moe_sparse_ref(x, sub, fk, remap, tw, float(thr), q8_x=True)

    def case(kind, cfg, fn, ref, nbytes, tol=2e-2):
        if time.time() > t_end:
            return
        try:
            timer.set_routing(0)
            torch.cuda.synchronize()
            y = fn()
            y = y[0] if isinstance(y, tuple) else y
            err = rel(y, ref) if ref is not None else 0.0
            if err > tol:
                print(f"  WRONG {model} T={T} {kind} {cfg}: {err:.2e}", flush=True)
                return
            t, _ = timer(fn, args.reps)
        except Exception as exc:  # noqa: BLE001 - report and go on with the others
            print(f"  FAILED {model} T={T} {kind} {cfg}: {type(exc).__name__}: {exc}")
            return
        row = dict(model=model, batch=T, kind=kind, cfg=cfg, us=t * 1e6, err=err,
                   gbps=nbytes / t / 1e9, pct=100 * nbytes / t / 1e9 / peak,
                   achieved=achieved)  # fmt: skip
        rows.append(row)
        print(f"{model:22s} T={T:2d} {kind:14s} {str(cfg):22s} {t * 1e6:7.1f} us "
              f"{row['pct']:5.1f}% err {err:.1e}", flush=True)  # fmt: skip

    P = T * K
    case("floor", None, lambda: torch.zeros(T * H + P, device=dev), None, b_dense)
    case("dense", "auto", functools.partial(md.moe_dense, x, w, fk, ids, tw), ref_dq, b_dense)
    if args.paths:
        # what moe_q8r_decode ran before moe_q8r_stream / moe_q8r_sparse2 (quantize_in_kernel
        # given: the old dispatch); the auto rows above are the shipped paths
        in_k = T <= md.Q8R_QUANTIZE_IN_KERNEL_MAX_TOKENS
        case("sparse", "auto", functools.partial(ms.moe_sparse, x, w, fk, ids, tw, thr),
             ref_sq, b_sparse)  # fmt: skip
        case("dense", "pipe", functools.partial(md.moe_q8r_decode, x, w, ids, tw,
             quantize_in_kernel=in_k), ref_dq, b_dense)  # fmt: skip
        case("sparse", "one-wave", functools.partial(md.moe_q8r_decode, x, w, ids, tw,
             threshold=thr, quantize_in_kernel=in_k), ref_sq, b_sparse)  # fmt: skip
        return
    if args.stream:
        variants = [("sparse", "auto", lambda wi: functools.partial(ms.moe_sparse, x, wi, fk,
                                                                    ids, tw, thr),
                     ref_sq, b_sparse)]  # fmt: skip
        variants += [("stream_dense", c, lambda wi, c=c: functools.partial(
            md.moe_q8r_stream, x, wi, ids, tw, blocks=c), ref_dq, b_dense)
            for c in STREAM_DENSE_CFGS]  # fmt: skip
        for kind, cfg, make, ref, nbytes in variants:
            case(kind, cfg, make(w), ref, nbytes)
        if args.chain and T <= 4:
            ws = [w] + [w.clone() for _ in range(args.chain - 1)]

            def chain_of(make):
                fns = [make(wi) for wi in ws]
                return lambda: [f() for f in fns]

            def floor_fn():  # each layer's zeroed output (y and counts)
                return [torch.zeros(T * H + P, device=dev) for _ in ws]

            L = len(ws)
            case(f"chain{L}_floor", None, floor_fn, None, b_dense * L)
            case(f"chain{L}_dense", "auto", chain_of(
                lambda wi: functools.partial(md.moe_dense, x, wi, fk, ids, tw)),
                None, b_dense * L)  # fmt: skip
            for kind, cfg, make, _ref, nbytes in variants:
                case(f"chain{L}_" + kind, cfg, chain_of(make), None, nbytes * L)
            del ws
        return
    if T <= 4 and not args.quick:
        for cfg in OLD_DENSE:
            fn = functools.partial(md.moe_dense_decode, x, w, fk, ids, tw, blocks=cfg)
            case("old_dense", cfg, fn, ref_d, b_dense)
        hbuf = torch.empty(P, F, device=dev)
        cnt = torch.zeros(P, dtype=torch.int32, device=dev)
        zero = torch.zeros(1, device=dev)
        idsf, twf = ids.reshape(-1), tw.reshape(-1)

        def gate_up_only(bn=8, bh=1024, nw=4):
            md._moe_gemv_kernel[(P, triton.cdiv(F, bn))](
                x, w, idsf, twf, hbuf, zero, cnt, H, F, rb, K, x.stride(0),
                FMT=FMT_CODES[fk], ACT=0, MODE=3, BLOCK_N=bn, BLOCK_H=bh, ACC2D=False,
                num_warps=nw,
            )  # fmt: skip
            return hbuf

        case("old_gateup", (8, 1024, 4), gate_up_only, None, b_dense * 2 // 3)
    for cfg in QUICK_DENSE_CFGS if args.quick else DENSE_CFGS:
        fn = functools.partial(md.moe_q8r_decode, x, w, ids, tw, blocks=cfg)
        case("q8r_dense", cfg, fn, ref_dq, b_dense)
    old_path = ms.sparse_path(fk, T)  # without n_embd: the _moe_gemv_kernel-based choice
    old_fn = functools.partial(ms.moe_sparse, x, w, fk, ids, tw, thr, path=old_path)
    case("old_sparse", old_path, old_fn, ref_s, b_sparse)
    for cfg in QUICK_SPARSE_CFGS if args.quick else SPARSE_CFGS:
        fn = functools.partial(md.moe_q8r_decode, x, w, ids, tw, threshold=thr,
                               dp4a=bool(cfg[3]), blocks=cfg[:3],
                               quantize_in_kernel=cfg[3] == 2)  # fmt: skip
        case("q8r_sp_" + DP4A_NAMES[cfg[3]], cfg, fn,
             ref_sq if cfg[3] else ref_s, b_sparse)  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick",
        action="store_true",
        help="dense default and three q8r dense configs, the old sparse path, q8r sparse "
        "with x quantized first and inside",
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="dense and sparse auto vs kernels.moe_q8r_stream's configs (dense)",
    )
    ap.add_argument(
        "--chain",
        type=int,
        default=0,
        help="with --stream: also time each case as this many layers in one graph",
    )
    ap.add_argument(
        "--paths",
        action="store_true",
        help="dense and sparse auto (the shipped paths) vs the paths they replaced (pipelined "
        "dense, one-wave sparse), batches 1, 4, 8, 16",
    )
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=400)
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    dev = torch.device("cuda")
    peak = moe_layer.hbm_read_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name()} peak {peak:.0f} GB/s triton {triton.__version__}")
    rows = []
    for model, shape in moe_layer.SHAPES.items():
        H, E, K, F = shape
        w, fk = prepare_experts(moe_layer.make_experts(E, F, H, "q8_0", dev), "q8_0", H)
        thr = moe_layer.calibrated_threshold(w, fk, shape, 0.85, dev)
        for T in (1, 4, 8, 16) if args.paths else (1, 4, 16):
            if time.time() < t_end:
                run_batch(model, shape, w, fk, thr, T, args, dev, peak, rows, t_end)
        if args.stream or args.paths:
            del w
            torch.cuda.empty_cache()
            continue
        # strict check of the dp4a kernel against the Q8-x torch reference (b1, unique experts)
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(5)).to(dev, torch.bfloat16)
        ids, tw = moe_layer.routing(1, E, K, 5, dev)
        uniq, remap = torch.unique(ids.long(), return_inverse=True)
        ref = md.moe_dense_ref(x, w[uniq].contiguous(), fk, remap, tw, q8_x=True)
        for cfg in QUICK_DENSE_CFGS:
            err = rel(md.moe_q8r_decode(x, w, ids, tw, blocks=cfg), ref)
            print(f"# strict dense q8r {model} {cfg}: rel err {err:.2e}")
            rows.append(dict(model=model, kind="strict", cfg=cfg, err=err))
        del w
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(dict(peak=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
