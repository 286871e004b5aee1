# temporary tuning script (removed before hand-off)
import functools, sys, importlib.util, torch, triton
from kernels.moe_dense import (
    _moe_gemv_kernel,
    _prep,
    moe_align,
    _moe_gemm_gate_up_kernel,
    _moe_gemm_down_kernel,
)
from kernels.moe_sparse import moe_gate_mask, moe_sparse_up_down, moe_gate
from kernels.sparse_mask import sparse_mask
from kernels.expert_formats import FMT_CODES, act_ref

spec = importlib.util.spec_from_file_location("b", "bench/moe_layer.py")
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
dev = torch.device("cuda")
H, E, K, F = 2048, 128, 8, 768
what = sys.argv[1]


def top(label, res, n=5):
    res.sort(key=lambda r: r[0])
    print(
        label,
        " | ".join(f"{r[0] * 1e6:.1f}us {r[1]}" for r in res[:n]),
        "| worst",
        f"{res[-1][0] * 1e6:.1f}",
        flush=True,
    )


for fmt in ["bf16", "q8_0"]:
    w = b.make_experts(E, F, H, fmt, dev)
    for T in [1, 4, 16] if what == "sparse" else [16, 64, 256]:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        routes = [b.routing(T, E, K, i, dev) for i in range(8)]
        ids, tw = routes[0][0].clone(), routes[0][1].clone()
        timer = b.Timer(dev, routes, ids, tw)
        _, _, _, rb, _, _ = _prep(x, w, fmt, ids, tw, "silu")
        P = T * K
        if what == "sparse":
            from kernels.moe_sparse import moe_sparse_fused, moe_sparse
            from kernels.moe_dense import moe_dense_decode
            g = moe_gate(x, w, fmt, ids)
            mags = act_ref(g, "silu").abs().flatten().sort().values
            thr = mags[int(0.85 * (mags.numel() - 1))].reshape(1).clone()
            res = []
            for bn, bh, nw in [(8, 512, 2), (16, 512, 2), (32, 512, 4), (16, 256, 2)]:
                res.append((timer(functools.partial(moe_dense_decode, x, w, fmt, ids, tw, block_n=bn, block_h=bh), 20)[0], f"dense bn{bn} bh{bh}"))
            top(f"{fmt} T{T} dense", res, 4)
            res = []
            for bn, bh, nw, a2 in [(8, 512, 2, False), (16, 512, 2, False), (16, 512, 4, False), (32, 512, 4, False), (16, 1024, 4, False), (8, 1024, 4, False), (16, 512, 2, True), (8, 512, 2, True), (4, 1024, 4, True), (4, 512, 2, False), (32, 256, 4, False), (64, 256, 4, False)]:
                fn = functools.partial(moe_sparse_fused, x, w, fmt, ids, tw, thr, blocks=(bn, bh, nw, a2))
                res.append((timer(fn, 20)[0], f"fused bn{bn} bh{bh} w{nw} a{int(a2)}"))
            top(f"{fmt} T{T} sparse fused", res, 6)
            fn = functools.partial(moe_sparse, x, w, fmt, ids, tw, thr, path="gate_mask"); print("  gate_mask path", f"{timer(fn, 20)[0]*1e6:.1f}us")
            fn = functools.partial(moe_sparse, x, w, fmt, ids, tw, thr, path="decode"); print("  decode path", f"{timer(fn, 20)[0]*1e6:.1f}us", flush=True)
        else:
            res = []
            for bn, bh, nw in [(16, 512, 2), (8, 512, 2), (32, 256, 4)]:
                y = torch.zeros(T, H, device=dev)
                fn = functools.partial(
                    _moe_gemv_kernel[(P, triton.cdiv(F, bn))],
                    x,
                    w,
                    ids,
                    tw,
                    y,
                    H,
                    F,
                    rb,
                    K,
                    x.stride(0),
                    FMT=FMT_CODES[fmt],
                    ACT=0,
                    GATE_ONLY=False,
                    BLOCK_N=bn,
                    BLOCK_H=bh,
                    num_warps=nw,
                )
                res.append((timer(fn, 20)[0], f"gemv bn{bn} bh{bh} w{nw}"))
            for bm in [16, 32, 64]:
                sp, be, tot = moe_align(ids, E, bm)
                inter = torch.empty(P, F, device=dev)
                y = torch.zeros(T, H, device=dev)
                r1, r2 = [], []
                for bn, bk, nw, ns in [
                    (64, 64, 4, 3),
                    (64, 128, 4, 3),
                    (128, 64, 4, 3),
                    (128, 128, 8, 3),
                    (64, 64, 4, 2),
                    (64, 128, 8, 4),
                    (32, 128, 4, 3),
                ]:
                    f1 = functools.partial(
                        _moe_gemm_gate_up_kernel[(be.numel(), triton.cdiv(F, bn))],
                        x,
                        w,
                        sp,
                        be,
                        tot,
                        inter,
                        H,
                        F,
                        rb,
                        K,
                        P,
                        x.stride(0),
                        FMT=FMT_CODES[fmt],
                        ACT=0,
                        GATE_ONLY=False,
                        DOT_BF16=True,
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                        num_warps=nw,
                        num_stages=ns,
                    )
                    f2 = functools.partial(
                        _moe_gemm_down_kernel[(be.numel(), triton.cdiv(H, bk))],
                        inter,
                        w,
                        sp,
                        be,
                        tot,
                        tw.reshape(-1),
                        y,
                        H,
                        F,
                        rb,
                        K,
                        P,
                        FMT=FMT_CODES[fmt],
                        DOT_BF16=True,
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        BLOCK_H=bk,
                        num_warps=nw,
                        num_stages=ns,
                    )
                    try:
                        r1.append((timer(f1, 10)[0], f"bm{bm} bn{bn} bk{bk} w{nw} s{ns}"))
                        r2.append((timer(f2, 10)[0], f"bm{bm} bn{bn} bk{bk} w{nw} s{ns}"))
                    except Exception as ex:
                        print("fail", bm, bn, bk, type(ex).__name__, str(ex)[:200])
                top(f"{fmt} T{T} gemm gate_up", r1, 3)
                top(f"{fmt} T{T} gemm down", r2, 3)
            top(f"{fmt} T{T} gemv fused", res, 3)
