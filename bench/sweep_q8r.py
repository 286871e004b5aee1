"""Variants of the q8_0r decode MoE kernels on a GPU, timed in one process.

For each real shape (bench/moe_layer.py SHAPES), Q8_0 experts repacked to q8_0r, batches 1, 4
(dense) and 1, 4, 16 (sparse at 0.85), CUDA graph + L2 flush per replay (moe_layer.Timer):
- old: _moe_gemv_kernel (dense decode and the SPARSE_PATHS path), a few BLOCK_H = H configs,
  and MODE 3 at threshold 0 (gate + up + store: no down rows, no atomics);
- q8r: _moe_q8r_kernel over (BLOCK_N, BA, num_warps, dp4a, atomic): atomic=0 stores instead
  of adding (a wrong sum: times the atomics' share);
- floor: the graph of the zeroed output buffer alone (launch + memset + event overhead);
- x quantization of the dp4a path against the torch reference, and the dp4a / fp32 kernels
  against moe_dense_ref (q8_x=True / False) on the routed experts.
Every fp32 variant is checked against a reference before it is timed.

  python bench/sweep_q8r.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer  # noqa: E402

md = importlib.import_module("kernels.moe_dense")
er = importlib.import_module("kernels.expert_rows")
ms = importlib.import_module("kernels.moe_sparse")
from kernels.dispatch import prepare_experts  # noqa: E402
from kernels.expert_formats import FMT_CODES  # noqa: E402

# (BLOCK_N, BA, num_warps, dp4a, atomic)
DENSE_CFGS = [(4, 1, 2, 0, 1), (4, 1, 4, 0, 1), (8, 1, 4, 0, 1), (8, 1, 8, 0, 1), (16, 1, 8, 0, 1),
              (16, 1, 16, 0, 1), (32, 1, 16, 0, 1), (8, 1, 4, 1, 1), (16, 1, 8, 1, 1),
              (8, 1, 4, 0, 0), (16, 1, 8, 0, 0)]  # fmt: skip
SPARSE_CFGS = [(8, 2, 4, 0, 1), (16, 2, 4, 0, 1), (16, 4, 4, 0, 1), (32, 4, 4, 0, 1),
               (32, 4, 8, 0, 1), (32, 8, 8, 0, 1), (64, 4, 8, 0, 1), (64, 8, 8, 0, 1),
               (16, 4, 2, 0, 1), (16, 4, 4, 1, 1), (32, 4, 8, 1, 1)]  # fmt: skip
OLD_DENSE = [(8, 2048, 4, False), (4, 2048, 4, False), (16, 2048, 8, False), (8, 2048, 8, True)]


@triton.jit
def _quantize_x_kernel(x_ptr, q_ptr, d_ptr, H, NB: tl.constexpr):
    """Diagnosis of quantize_x_lanes on the GPU: q words [NB, 8] int32, d [NB] f32."""
    x0, x1, x2, x3 = er.x_lanes(x_ptr, H, NB)
    xq, xd = er.quantize_x_lanes(x0, x1, x2, x3)
    b = tl.arange(0, NB)
    tl.store(q_ptr + b[:, None] * 8 + tl.arange(0, 8)[None, :], xq)
    tl.store(d_ptr + b, xd)


def check_quantize_x(dev):
    """Mismatches of the kernel's Q8 x quantization against the torch reference's."""
    H = 2048
    x = torch.randn(H, generator=torch.Generator().manual_seed(3)).to(dev, torch.bfloat16)
    q = torch.empty(H // 4, dtype=torch.int32, device=dev)
    d = torch.empty(H // 32, dtype=torch.float32, device=dev)
    _quantize_x_kernel[(1,)](x, q, d, H, NB=H // 32)
    xb = x.float().reshape(-1, 32)
    dr = xb.abs().amax(dim=1) / 127.0
    qr = torch.round(xb * torch.where(dr != 0, 1.0 / dr, 0.0)[:, None]).to(torch.int8)
    qk = q.view(torch.int8).reshape(-1, 32)
    print(f"# quantize_x: q mismatches {(qk != qr).sum().item()} of {H}, "
          f"max |d - d_ref| {(d - dr).abs().max().item():.2e}", flush=True)  # fmt: skip


def rel(y, ref):
    return ((y - ref).abs().max() / ref.abs().max()).item()


def run_batch(model, shape, w, fk, thr, T, args, dev, peak, rows, t_end):
    """Every variant at one (shape, batch): appends result rows."""
    H, E, K, F = shape
    rb = w.shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(device=dev, dtype=torch.bfloat16)
    routes = [moe_layer.routing(T, E, K, 100 * T + i, dev) for i in range(8)]
    ids, tw = routes[0][0].clone(), routes[0][1].clone()
    timer = moe_layer.Timer(dev, routes, ids, tw)
    gate = ms.moe_gate(x, w, fk, ids)
    b_dense, b_sparse, achieved = moe_layer.bytes_read(w, fk, H, ids, gate, float(thr),
                                                       "silu")  # fmt: skip
    ref_d = md.moe_dense(x, w, fk, ids, tw)
    ref_s, cnt_s = ms.moe_sparse(x, w, fk, ids, tw, thr, path="decode")

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
    if T <= 4:
        case("old_dense", "default", functools.partial(md.moe_dense, x, w, fk, ids, tw),
             ref_d, b_dense)  # fmt: skip
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
        for cfg in DENSE_CFGS:
            fn = functools.partial(md.moe_q8r_decode, x, w, ids, tw, dp4a=bool(cfg[3]),
                                   blocks=cfg[:3], atomic=bool(cfg[4]))  # fmt: skip
            kind = "q8r_" + ("dp4a" if cfg[3] else "f32") + ("" if cfg[4] else "_noat")
            case(kind, cfg, fn, ref_d if cfg[4] else None, b_dense)
    old_path = ms.sparse_path(fk, T)  # without n_embd: the _moe_gemv_kernel-based choice
    old_fn = functools.partial(ms.moe_sparse, x, w, fk, ids, tw, thr, path=old_path)
    case("old_sparse", old_path, old_fn, ref_s, b_sparse)
    for cfg in SPARSE_CFGS:
        fn = functools.partial(md.moe_q8r_decode, x, w, ids, tw, threshold=thr,
                               dp4a=bool(cfg[3]), blocks=cfg[:3])  # fmt: skip
        # dp4a changes which borderline neurons pass: no check against float x
        case("q8r_sp_dp4a" if cfg[3] else "q8r_sp_f32", cfg, fn,
             None if cfg[3] else ref_s, b_sparse)  # fmt: skip


def diag_dp4a(dev):
    """The dp4a kernel (instruction and integer twin, both compiled for the GPU) and the fp32
    one against moe_dense_ref on the routed experts of one qwen3-30b-a3b-shaped layer."""
    H, E, K, F = moe_layer.SHAPES["qwen3-30b-a3b"]
    w, fk = prepare_experts(moe_layer.make_experts(E, F, H, "q8_0", dev), "q8_0", H)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(5)).to(dev, torch.bfloat16)
    ids, tw = moe_layer.routing(1, E, K, 5, dev)
    uniq, remap = torch.unique(ids.long(), return_inverse=True)
    sub = w[uniq].contiguous()
    for dp, asm in ((True, True), (True, False), (False, False)):
        ref = md.moe_dense_ref(x, sub, fk, remap, tw, q8_x=dp)
        y = md.moe_q8r_decode(x, w, ids, tw, dp4a=dp, asm=asm, blocks=(8, 1, 4))
        print(f"# diag dp4a={dp} asm={asm}: rel err vs moe_dense_ref(q8_x={dp}) "
              f"{rel(y, ref):.2e}", flush=True)  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--diag-only", action="store_true", help="only diag_dp4a and quantize_x")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=400)
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    dev = torch.device("cuda")
    peak = moe_layer.hbm_read_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name()} peak {peak:.0f} GB/s triton {triton.__version__}")
    rows = []
    check_quantize_x(dev)
    diag_dp4a(dev)
    if args.diag_only:
        return
    for model, shape in moe_layer.SHAPES.items():
        H, E, K, F = shape
        w, fk = prepare_experts(moe_layer.make_experts(E, F, H, "q8_0", dev), "q8_0", H)
        thr = moe_layer.calibrated_threshold(w, fk, shape, 0.85, dev)
        for T in (1, 4, 16):
            if time.time() < t_end:
                run_batch(model, shape, w, fk, thr, T, args, dev, peak, rows, t_end)
        # strict check of the dp4a kernel against the Q8-x torch reference (b1, unique experts)
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(5)).to(dev, torch.bfloat16)
        ids, tw = moe_layer.routing(1, E, K, 5, dev)
        uniq, remap = torch.unique(ids.long(), return_inverse=True)
        ref = md.moe_dense_ref(x, w[uniq].contiguous(), fk, remap, tw, q8_x=True)
        ref_f = md.moe_dense_ref(x, w[uniq].contiguous(), fk, remap, tw)
        for cfg in ((8, 1, 4), (16, 1, 8)):
            for dp in (True, False):
                y = md.moe_q8r_decode(x, w, ids, tw, dp4a=dp, blocks=cfg)
                err = rel(y, ref if dp else ref_f)
                print(f"# strict {'dp4a' if dp else 'f32'} {model} {cfg}: rel err {err:.2e}")
                rows.append(dict(model=model, kind="strict", dp4a=dp, cfg=cfg, err=err))
        del w
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(dict(peak=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
