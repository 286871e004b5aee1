"""How fast are the GPU prefill's pieces, against the tensor cores' measured peak?

At olmoe-1b-7b shapes (n_embd 2048, 16 heads of 128, 64 experts of n_ff 1024, top-8, vocab
50304, Q8_0) and prompts of 128, 512 and 2048 tokens, each piece is checked against its plain
torch reference, then timed (CUDA events, median of --reps after a warm-up call):
- peak: torch.mm of two bf16 [8192, 8192] matrices (cuBLAS): TFLOP/s, the floor's divisor;
- q8_gemm (kernels.q8_linear: W tiles dequantized in registers, tensor-core dots) against the
  path it replaced, dequantize_q8 to bf16 + torch's matmul (cuBLAS), for q/k/v [6144 x 2048],
  o [2048 x 2048] and lm_head [50304 x 2048]; `--write FILE` stores in a kernels.tuning file
  (merged into FILE if it exists) "q8_gemm": {"max_tokens": M}, the largest prompt length
  below which q8_gemm was never slower (the executor then takes cuBLAS above it: pass the file
  with --kernel-tuning);
- the routed experts' grouped GEMMs (kernels.moe_dense "gemm" path, q8_0r experts) with each
  GEMM_CONFIGS regime's tiles ("some": 32-pair tiles, "many": 64), the regime the rule picks
  marked;
- prefill attention (SDPA, causal, from position 0): the executor's call (4-D, is_causal:
  flash) against the explicit-mask call (memory-efficient kernel);
- a Gated DeltaNet layer's prompt at qwen3.5-35b-a3b's shape (16 key and 32 value heads of 128,
  conv of 4; gpu/deltanet.py: the conv and chunked Triton kernels) against the chunked form in
  torch ops that it replaced (pyruntime.model.deltanet on the device), from the projection to
  the gated output.
Each row gives µs, TFLOP/s and % of the peak.

    python bench/gpu_prefill.py
    python bench/gpu_prefill.py --tokens 512 --write tuned.json
    python bench/gpu_prefill.py --peak-only          # one line: the bf16 GEMM peak, TFLOP/s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyruntime.gpu.deltanet import deltanet_prefill  # noqa: E402
from pyruntime.kernels.expert_formats import quantize_rows, repack_rows  # noqa: E402
from pyruntime.kernels.moe_dense import (  # noqa: E402
    GEMM_CONFIGS,
    gemm_regime,
    moe_dense_gemm,
    moe_dense_ref,
)
from pyruntime.kernels.q8_linear import (  # noqa: E402
    dequantize_q8,
    gemm_config,
    q8_gemm,
    q8_linear_ref,
)
from pyruntime.model import deltanet as dn_ref  # noqa: E402
from pyruntime.model.reference import attention_mask  # noqa: E402

H, N_HEAD, D, E, N_FF, TOPK, VOCAB = 2048, 16, 128, 64, 1024, 8, 50304


def time_us(fn, reps: int) -> float:
    """Median µs of fn() by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def gemm_peak(reps: int = 20, n: int = 8192) -> float:
    """TFLOP/s of torch.mm on bf16 [n, n] x [n, n] (cuBLAS; the floor's divisor)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_us(lambda: torch.mm(a, b), reps) / 1e6


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def row(rows: list, name: str, us: float, flops: float, peak: float, note: str = "") -> None:
    tf = flops / us / 1e6
    rows.append(f"| {name} | {us:.1f} | {tf:.0f} | {tf / peak * 100:.0f}% | {note} |")


def bench_q8_linear(tokens: list[int], peak: float, reps: int, rows: list) -> int | None:
    """Rows for q8_gemm vs dequantize + cuBLAS. Returns the largest of `tokens` (sorted) below
    the first one where q8_gemm lost on some shape (4, the GEMV's limit, when it lost at the
    first), or None when it never lost."""
    lost = set()
    for name, N in (("qkv", 3 * H), ("o_proj", H), ("lm_head", VOCAB)):
        q = torch.randint(-127, 128, (N, H), dtype=torch.int8, device="cuda")
        d = (torch.rand(N, H // 32, device="cuda") * 2e-3 + 1e-4).half()
        for M in tokens:
            x = torch.randn(M, H, device="cuda").bfloat16()
            err = rel_err(q8_gemm(x, q, d), q8_linear_ref(x, q, d))
            ours = time_us(lambda x=x, q=q, d=d: q8_gemm(x, q, d), reps)
            theirs = time_us(lambda x=x, q=q, d=d: F.linear(x, dequantize_q8(q, d, x.dtype)), reps)
            flops = 2 * M * N * H
            row(rows, f"{name} M={M} q8_gemm {gemm_config(M)}", ours, flops, peak,
                f"rel err {err:.1e}; {theirs / ours:.2f}x the cuBLAS path")  # fmt: skip
            row(rows, f"{name} M={M} dequantize + cuBLAS", theirs, flops, peak)
            if ours > theirs:
                lost.add(M)
    if not lost:
        return None
    first = tokens.index(min(lost))
    return tokens[first - 1] if first else 4


def q8_experts() -> torch.Tensor:
    w = torch.randn(E, N_FF, 3, H, device="cuda") * H**-0.5
    return repack_rows(quantize_rows(w, "q8_0"), "q8_0")


def bench_experts(tokens: list[int], peak: float, reps: int, rows: list) -> None:
    w = q8_experts()
    for T in tokens:
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(T)]).int()
        tw = torch.rand(T, TOPK, device="cuda")
        ref = moe_dense_ref(x[:4], w, "q8_0r", ids[:4], tw[:4])  # a few tokens: the loop's
        flops = 2 * T * TOPK * 3 * N_FF * H
        rule = gemm_regime(T * TOPK, E)
        for regime, blocks in GEMM_CONFIGS.items():
            if regime == "few":
                continue
            y = moe_dense_gemm(x, w, "q8_0r", ids, tw, blocks=blocks)
            err = rel_err(y[:4], ref)
            us = time_us(lambda b=blocks, x=x, ids=ids, tw=tw: moe_dense_gemm(
                x, w, "q8_0r", ids, tw, blocks=b), reps)  # fmt: skip
            mark = " (the rule's)" if regime == rule else ""
            row(rows, f"experts T={T} gemm {regime}{mark}", us, flops, peak, f"rel err {err:.1e}")


def bench_attention(tokens: list[int], peak: float, reps: int, rows: list) -> None:
    for T in tokens:
        q, k, v = (torch.randn(1, N_HEAD, T, D, device="cuda").bfloat16() for _ in range(3))
        mask = attention_mask(0, T, 0, q.device)
        flops = 4 * N_HEAD * D * T * T / 2  # causal: half the scores
        causal = time_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), reps)  # fmt: skip
        masked = time_us(lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m), reps)  # fmt: skip
        row(rows, f"attention T={T} SDPA is_causal (the executor's)", causal, flops, peak)
        row(rows, f"attention T={T} SDPA explicit mask", masked, flops, peak)


def torch_deltanet_prefill(cfg, proj, conv_w, conv_state, ssm_state, a, dt_bias, norm):
    """The prompt path before the Triton kernels: model.deltanet's conv and chunked form in
    torch ops on the device (~15 launches per chunk of 64 and a triangular solve)."""
    hk, hv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    C, T = cfg.ssm_conv_channels, proj.shape[0]
    proj = proj.float()
    z, b, alpha = torch.split(proj[:, C:], [hv * dv, hv, hv], dim=-1)
    mixed, new_conv = dn_ref.causal_conv(proj[:, :C], conv_state, conv_w)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = (dn_ref.l2norm(q.reshape(T, hk, dk)) * dk**-0.5).repeat_interleave(hv // hk, dim=1)
    k = dn_ref.l2norm(k.reshape(T, hk, dk)).repeat_interleave(hv // hk, dim=1)
    g = a * F.softplus(alpha + dt_bias)
    o, new_ssm = dn_ref.chunked(q, k, v.reshape(T, hv, dv), g, torch.sigmoid(b), ssm_state)
    conv_state.copy_(new_conv)
    ssm_state.copy_(new_ssm)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * norm
    return (o * F.silu(z.reshape(T, hv, dv))).reshape(T, hv * dv).bfloat16()


def bench_deltanet(tokens: list[int], peak: float, reps: int, rows: list) -> None:
    from types import SimpleNamespace

    hk, hv, dk, dv, K, L = 16, 32, 128, 128, 4, 64
    C = 2 * hk * dk + hv * dv
    cfg = SimpleNamespace(ssm_n_k_heads=hk, ssm_n_v_heads=hv, ssm_head_k_dim=dk,
                          ssm_head_v_dim=dv, ssm_conv_channels=C, rms_eps=1e-6)  # fmt: skip
    conv_w = torch.randn(C, K, device="cuda") * 0.5
    a = -torch.rand(hv, device="cuda") * 3
    dt_bias, norm = torch.randn(hv, device="cuda"), torch.ones(dv, device="cuda")
    conv0, ssm0 = torch.zeros(C, K - 1, device="cuda"), torch.zeros(hv, dk, dv, device="cuda")
    for T in tokens:
        proj = torch.randn(T, C + hv * dv + 2 * hv, device="cuda").bfloat16()
        ours = deltanet_prefill(cfg, proj, conv_w, conv0.clone(), ssm0.clone(), a, dt_bias,
                                norm, torch.bfloat16)  # fmt: skip
        ref = torch_deltanet_prefill(cfg, proj, conv_w, conv0.clone(), ssm0.clone(), a,
                                     dt_bias, norm)  # fmt: skip
        # per token and value head: the state products (q S, W S, K^T U), the chunk's
        # k k^T and q k^T, (I + A)^-1 times K and V, (q k^T) U
        flops = 2 * T * hv * (3 * dk * dv + 2 * L * dk + L * (dk + 2 * dv))
        new = time_us(lambda p=proj: deltanet_prefill(cfg, p, conv_w, conv0.clone(),
                      ssm0.clone(), a, dt_bias, norm, torch.bfloat16), reps)  # fmt: skip
        old = time_us(lambda p=proj: torch_deltanet_prefill(cfg, p, conv_w, conv0.clone(),
                      ssm0.clone(), a, dt_bias, norm), reps)  # fmt: skip
        row(rows, f"deltanet T={T} Triton chunked (the executor's)", new, flops, peak,
            f"rel err {rel_err(ours, ref):.1e}; {old / new:.2f}x the torch form")  # fmt: skip
        row(rows, f"deltanet T={T} torch chunked form", old, flops, peak)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--write", type=Path, default=None, help="kernels.tuning JSON to write")
    p.add_argument("--peak-only", action="store_true", help="print the bf16 GEMM peak and stop")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_prefill.py needs a CUDA GPU")
    if args.peak_only:
        print(f"{gemm_peak(args.reps):.1f}")
        return
    tokens = sorted(args.tokens)
    torch.manual_seed(0)
    peak = gemm_peak(args.reps)
    print(f"GPU: {torch.cuda.get_device_name()}; bf16 torch.mm 8192^3 peak {peak:.0f} TFLOP/s")
    rows = ["| piece | µs | TFLOP/s | % of peak | |", "|---|---:|---:|---:|---|"]
    best = bench_q8_linear(tokens, peak, args.reps, rows)
    bench_experts(tokens, peak, args.reps, rows)
    bench_attention(tokens, peak, args.reps, rows)
    bench_deltanet(tokens, peak, args.reps, rows)
    print("\n".join(rows))
    print(f"q8_gemm up to: {'any number of' if best is None else best} tokens (above: cuBLAS)")
    if args.write:
        tuned = json.loads(args.write.read_text()) if args.write.exists() else {}
        if best is None:
            tuned.pop("q8_gemm", None)
        else:
            tuned["q8_gemm"] = {"max_tokens": best}
        args.write.write_text(json.dumps(tuned, indent=1))


if __name__ == "__main__":
    main()
