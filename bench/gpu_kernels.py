"""Which launch configs of the decode step's non-expert kernels are fastest on this GPU?

At olmoe-1b-7b shapes, each candidate config of the Q8_0 GEMV (q/k/v, o, lm_head), split-K
decode attention, the fused norm + router + top-k and the one-program launches is checked
against its plain torch reference, then timed in a CUDA graph (launch cost included, as in the
model's captured step); the fastest of each goes into a kernels.tuning file, which the GPU
executor installs when --kernel-tuning (or PYRUNTIME_DECODE_TUNING) names it.

    python bench/gpu_kernels.py --write tuned.json
    pyruntime bench model.gguf --device cuda --kernel-tuning tuned.json

Each timed graph runs one op for all 16 layers, each layer with its own weights (16 layers'
weights do not fit in the L2, as in the model), so a time per call is graph time / 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyruntime.kernels.attention import decode_attention, decode_attention_ref, decode_splits  # noqa: E402
from pyruntime.kernels.decoder_ops import add_rms_norm, qk_rope_store  # noqa: E402
from pyruntime.kernels.q8_linear import q8_gemv, q8_linear_ref  # noqa: E402
from pyruntime.kernels.router import add_norm_router, add_norm_router_ref, router_topk  # noqa: E402
from pyruntime.kernels.timing import capture  # noqa: E402

L, H = 16, 2048  # olmoe-1b-7b: 16 layers, n_embd 2048, 16 heads of 128, 64 experts, top-8
N_HEAD, D, E, TOPK = 16, 128, 64, 8
EPS = 1e-5


def graph_us(fn, reps: int = 30) -> float:
    """Median µs of one replay of a CUDA graph of fn() (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def q8_weights(n: int, k: int, layers: int):
    """Random Q8_0 weights (q int8 [n, k], d f16 [n, k / 32]) per layer, on the GPU."""
    out = []
    for _ in range(layers):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        d = (torch.rand(n, k // 32, device="cuda") * 2e-3 + 1e-4).half()
        out.append((q, d))
    return out


def bench_gemv(rows: list, tuned: dict, log) -> None:
    cands = [(bn, 2048, w) for bn in (2, 4, 8, 16, 32) for w in (4, 8)]
    cands += [(8, 1024, 4), (16, 1024, 4)]
    for name, N, K, layers in (("qkv", 3 * H, H, L), ("o_proj", H, H, L), ("lm_head", 50304, H, 1)):
        W = q8_weights(N, K, layers)
        best = _gemv_shape(name, W, cands, rows, log)
        tuned.setdefault("q8_gemv", {})[f"{N}x{K}"] = list(best[1])


def _gemv_shape(name: str, W: list, cands: list, rows: list, log):
    """Times each candidate config on weights W (one per layer)."""
    N, K = W[0][0].shape
    layers = len(W)
    x = torch.randn(1, K, device="cuda").bfloat16()
    nbytes = N * K * 34 / 32
    ref = q8_linear_ref(x, *W[0])
    best = None
    for cfg in cands:
        if N // cfg[0] < 100 and name != "o_proj" or cfg[0] * cfg[1] // (32 * cfg[2]) > 128:
            continue  # too few programs, or > 128 fp32 weights per thread
        err = rel_err(q8_gemv(x, *W[0], config=cfg), ref)
        if err > 1e-2:
            print(f"  {name} {cfg}: WRONG rel err {err:.2e}", file=log)
            continue
        us = graph_us(lambda cfg=cfg: [q8_gemv(x, q, d, config=cfg) for q, d in W]) / layers
        rows.append((f"{name} q8_gemv {cfg}", us, nbytes / us / 1e3))
        best = min(best or (us, cfg), (us, cfg))
    print(f"{name}: best {best[1]} {best[0]:.2f} us", file=log)
    return best


def bench_attention(rows: list, tuned: dict, log) -> None:
    scores: dict = {}
    for n, max_tokens in ((128, 512), (513, 520)):
        _attention_case(n, max_tokens, rows, scores, log)
    (block_s, programs, warps) = min(scores, key=scores.get)
    tuned["attention"] = dict(block_s=block_s, programs=programs, num_warps=warps)
    print(f"attention: best block_s {block_s}, programs {programs}, warps {warps}", file=log)


def _attention_case(n: int, max_tokens: int, rows: list, scores: dict, log) -> None:
    kv = [torch.randn(2, N_HEAD, max_tokens, D, device="cuda").bfloat16() for _ in range(L)]
    q = torch.randn(N_HEAD, D, device="cuda").bfloat16()
    seq = torch.tensor([n], device="cuda")
    nbytes = 2 * N_HEAD * n * D * 2
    ref = decode_attention_ref(q, kv[0][0], kv[0][1], n, D**-0.5)
    cands = [(bs, p, w) for bs in (16, 32, 64) for p in (128, 256, 512) for w in (1, 2, 4)]
    for block_s, programs, warps in cands:
        if block_s * D // (32 * warps) > 64:
            continue  # > 64 fp32 of K (and of V) per thread
        ns = decode_splits(N_HEAD, max_tokens, block_s, programs)
        out = decode_attention(q, kv[0][0], kv[0][1], seq, D**-0.5, ns, block_s, warps)
        if rel_err(out, ref) > 2e-2:
            print(f"  attention {block_s} {programs} {warps}: WRONG", file=log)
            continue
        us = graph_us(
            lambda ns=ns, bs=block_s, w=warps: [
                decode_attention(q, c[0], c[1], seq, D**-0.5, ns, bs, w) for c in kv
            ]
        )
        rows.append((f"attention n={n} block_s={block_s} splits={ns} warps={warps}", us / L,
                     nbytes * L / us / 1e3))  # fmt: skip
        key = (block_s, programs, warps)
        scores[key] = scores.get(key, 0.0) + us / L


def bench_router(rows: list, tuned: dict, log) -> None:
    R = [torch.randn(E, H, device="cuda") * H**-0.5 * 4 for _ in range(L)]
    x = torch.randn(1, H, device="cuda") * 3
    dl = torch.randn(1, H, device="cuda")
    nw = torch.rand(H, device="cuda") + 0.5
    nbytes = E * H * 4

    def unfused():
        for r in R:  # (x drifts by dl per call: harmless for a timing)
            _, h32 = add_rms_norm(x, dl, nw, EPS, torch.bfloat16, 1.0, True)
            router_topk(h32 @ r.T, TOPK, False)

    us = graph_us(unfused) / L
    rows.append(("router unfused (norm + cuBLAS + top-k)", us, nbytes / us / 1e3))
    x = torch.randn(1, H, device="cuda") * 3
    ref = add_norm_router_ref(x, dl, nw, R[0], EPS, TOPK, False, torch.bfloat16)
    best = None
    for be, w in [(be, w) for be in (1, 2, 4) for w in (1, 2, 4)]:
        kw = dict(block_e=be, num_warps=w)
        out = add_norm_router(x, dl, nw, R[0], EPS, TOPK, False, torch.bfloat16, **kw)
        if not torch.equal(out[3], ref[3]) or rel_err(out[4], ref[4]) > 1e-4:
            print(f"  router block_e {be} warps {w}: WRONG", file=log)
            continue
        us = graph_us(
            lambda kw=kw: [
                add_norm_router(x, dl, nw, r, EPS, TOPK, False, torch.bfloat16, **kw) for r in R
            ]
        )
        rows.append((f"router fused block_e={be} warps={w}", us / L, nbytes * L / us / 1e3))
        best = min(best or (us, be, w), (us, be, w))
    tuned["router_block_e"], tuned["router_warps"] = best[1], best[2]


def bench_small(rows: list, tuned: dict, log) -> None:
    """The one-program launches: residual add + RMSNorm, q/k norm + rope + KV store (olmoe:
    q/k norms over all heads), by warps per program."""
    x = torch.randn(1, H, device="cuda")
    dl = torch.randn(1, H, device="cuda")
    nw = torch.rand(H, device="cuda") + 0.5
    best = None
    for w in (1, 2, 4, 8):
        us = graph_us(
            lambda w=w: [
                add_rms_norm(x, dl, nw, EPS, torch.bfloat16, num_warps=w) for _ in range(L)
            ]
        )
        rows.append((f"add_rms_norm warps={w}", us / L, 0))
        best = min(best or (us, w), (us, w))
    tuned["norm_warps"] = best[1]
    S = 520
    kv = [torch.zeros(2, N_HEAD, S, D, device="cuda").bfloat16() for _ in range(L)]
    qkv = torch.randn(1, 3 * N_HEAD * D, device="cuda").bfloat16()
    pos = torch.tensor([513], device="cuda")
    cos, sin = torch.randn(S, D, device="cuda"), torch.randn(S, D, device="cuda")
    qn, kn = torch.rand(N_HEAD * D, device="cuda"), torch.rand(N_HEAD * D, device="cuda")
    best = None
    for w in (1, 2, 4):
        us = graph_us(
            lambda w=w: [
                qk_rope_store(qkv, c, pos, cos, sin, N_HEAD, qn, kn, EPS, num_warps=w) for c in kv
            ]
        )
        rows.append((f"qk_rope_store warps={w}", us / L, 0))
        best = min(best or (us, w), (us, w))
    tuned["rope_warps"] = best[1]


PARTS = dict(router=bench_router, attention=bench_attention, gemv=bench_gemv, small=bench_small)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--write", type=Path, default=None, help="kernels.tuning JSON to write")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    args = p.parse_args()
    log = sys.stdout
    rows: list[tuple[str, float, float]] = []
    tuned: dict = {}
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_kernels.py needs a CUDA GPU")
    print(f"GPU: {torch.cuda.get_device_name()}", file=log)
    for name in args.parts.split(","):
        PARTS[name](rows, tuned, log)
    print("\n| kernel (per layer / call) | µs | GB/s |\n|---|---|---|", file=log)
    for name, us, gbs in rows:
        print(f"| {name} | {us:.2f} | {gbs:.0f} |", file=log)
    print(json.dumps(tuned), file=log)
    if args.write:
        args.write.write_text(json.dumps(tuned, indent=1))


if __name__ == "__main__":
    main()
