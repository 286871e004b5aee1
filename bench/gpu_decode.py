"""How fast is one whole-model decode step on the GPU, against the bytes it must read at the
measured HBM bandwidth, and where does its time go?

    python bench/gpu_decode.py /tmp/olmoe-q8_0.gguf --prompt 512 -o /tmp/decode.json

1. HBM read bandwidth: torch sum over a 4 GiB buffer (CUDA events, median of 10).
2. The model on the GPU (pyruntime.Model, device cuda), a prefill of --prompt random tokens.
3. Decode step time: CUDA-graph replays of the step at position --prompt, timed with CUDA events
   (GPU time only), and forward() per token (with the logits copy to the host and Python).
4. Bytes one decode step must read at that position: routed experts (top-k of n_expert per MoE
   layer, GGUF format), dense weights as stored on the GPU (bf16 or f32), routers, the lm_head,
   and the KV cache up to the position. Roofline = bytes / bandwidth.
5. torch.profiler over one eager decode step with each part of a layer labelled: kernel time
   per part (summed over layers), and the top kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pyruntime

from pyruntime.api import Model  # noqa: E402
from pyruntime.gpu.executor import GpuExecutor  # noqa: E402
from pyruntime.kernels.timing import event_seconds, hbm_read_bandwidth  # noqa: E402


def _nbytes(t) -> int:
    """Bytes of a tensor or a Linear (pyruntime.gpu.executor), 0 for None."""
    if t is None:
        return 0
    return t.nbytes if hasattr(t, "stack") else t.numel() * t.element_size()


def decode_bytes(net: GpuExecutor, position: int) -> dict[str, int]:
    """Bytes read by one decode step at `position`, by part."""
    cfg = net.config
    parts = dict(experts=0, attention_weights=0, deltanet_weights=0, deltanet_state=0, router=0,
                 shared=0, dense_ffn=0, norms=0)  # fmt: skip
    for blk in net.blocks:
        if blk.experts is not None:
            parts["experts"] += _nbytes(blk.experts) * cfg.n_expert_used // cfg.n_expert
            parts["router"] += _nbytes(blk.router)
        parts["attention_weights"] += sum(map(_nbytes, (blk.wqkv, blk.wo, blk.attn_gate)))
        if blk.deltanet is not None:  # qwen35moe: projections, conv, and the state read + written
            d = blk.deltanet
            parts["deltanet_weights"] += sum(map(_nbytes, (d.in_proj, d.out, d.conv)))
            parts["deltanet_state"] += (
                2 * cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim * 4
            )
        for ffn, key in ((blk.shared, "shared"), (blk.dense_ffn, "dense_ffn")):
            if ffn is not None:
                parts[key] += _nbytes(ffn.gate_up) + _nbytes(ffn.down)
        parts["norms"] += sum(
            map(_nbytes, (blk.attn_norm, blk.ffn_norm, blk.q_norm, blk.k_norm, blk.shared_gate))
        )
    parts["lm_head"] = _nbytes(net.output)
    elt = net.dtype.itemsize  # KV cache dtype
    n_kv = cfg.n_layer - sum(blk.deltanet is not None for blk in net.blocks)  # DeltaNet: no K/V
    parts["kv_cache"] = n_kv * 2 * cfg.n_head_kv * (position + 1) * cfg.head_dim * elt
    parts["total"] = sum(parts.values())
    return parts


PARTS = ("norm", "qkv", "rope+kv store", "attention", "attention gate", "o_proj",
         "deltanet in_proj", "deltanet", "deltanet out_proj", "router", "routed experts",
         "shared expert", "dense ffn", "lm_head")  # fmt: skip


def profile_step(net: GpuExecutor, cache, log) -> dict[str, float]:
    """Kernel microseconds per labelled part of one eager decode step."""
    from torch.profiler import ProfilerActivity, profile

    net.profile_parts = True
    try:
        for _ in range(2):  # warm (eager kernels compiled)
            net.decode_step_eager(cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            net.decode_step_eager(cache)
            torch.cuda.synchronize()
    finally:
        net.profile_parts = False
    out: dict[str, float] = {}
    # A label's device time is its GPU-side span (the CPU-side event sees only the kernels of
    # aten ops, not Triton's launches). In this eager step the span also holds the GPU's idle
    # wait for the next launch inside the label, so a label of several launches (routed
    # experts: zero-fill, then the Triton kernel) reads high; the kernel lines are exact.
    for evt in prof.key_averages():
        if evt.key in PARTS:
            us = getattr(evt, "device_time_total", None)
            if us is None:
                us = evt.cuda_time_total
            out[evt.key] = max(out.get(evt.key, 0.0), float(us))
    kernels = sorted(
        (
            e
            for e in prof.key_averages()
            if getattr(e, "self_device_time_total", 0) > 0 and e.key not in PARTS
        ),
        key=lambda e: -e.self_device_time_total,
    )
    n_kernels = sum(e.count for e in kernels)
    total = sum(e.self_device_time_total for e in kernels)
    out["all kernels"] = total
    out["kernel launches"] = n_kernels
    print(f"eager step: {n_kernels} kernels, {total:.0f} us of kernel time", file=log)
    for e in kernels[:25]:
        print(
            f"  {e.self_device_time_total:9.1f} us  x{e.count:<4d} {e.key[:110]}",
            file=log,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", type=Path)
    p.add_argument("--prompt", type=int, default=512, help="prefill tokens before decoding")
    p.add_argument("--reps", type=int, default=200, help="graph replays timed")
    p.add_argument("-o", "--output", type=Path, default=None, help="JSON results")
    args = p.parse_args()
    log = sys.stdout
    bw = hbm_read_bandwidth("cuda", 4 << 30)  # bytes/s
    torch.cuda.empty_cache()
    print(f"HBM read bandwidth (4 GiB sum): {bw / 1e12:.3f} TB/s", file=log)

    t0 = time.perf_counter()
    model = Model(args.model, n_ctx=args.prompt + 8, device="cuda")
    load_s = time.perf_counter() - t0
    net: GpuExecutor = model.net
    print(f"load: {load_s:.1f} s, dense dtype {net.dtype}", file=log)
    cache = net.new_cache(args.prompt + 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, net.config.n_vocab, (args.prompt + 2,), generator=g).tolist()
    net.forward(ids[: args.prompt], cache)
    net.forward(ids[args.prompt : args.prompt + 1], cache)  # captures the graph
    cache.truncate(args.prompt)
    # The graph's inputs now say position = prompt; replays recompute that step.
    replay = statistics.median(event_seconds(net.decode_graph(cache).replay, args.reps))
    fwd = []
    for _ in range(20):
        cache.truncate(args.prompt)
        t = time.perf_counter()
        net.forward([ids[-1]], cache)
        fwd.append(time.perf_counter() - t)
    forward_s = statistics.median(fwd)
    nbytes = decode_bytes(net, args.prompt)
    roof = nbytes["total"] / bw
    print(
        f"decode step at position {args.prompt}: graph replay {replay * 1e6:.1f} us "
        f"({1 / replay:.0f} tok/s), forward() {forward_s * 1e6:.1f} us ({1 / forward_s:.0f} tok/s)",
        file=log,
    )
    print(
        f"bytes per token {nbytes['total'] / 1e9:.3f} GB -> roofline {roof * 1e6:.1f} us "
        f"({1 / roof:.0f} tok/s); replay at {roof / replay:.0%} of it; parts: "
        + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items() if k != "total"),
        file=log,
    )
    cache.truncate(args.prompt)
    parts = profile_step(net, cache, log)
    print("per-part kernel time of one eager decode step (us, summed over layers):", file=log)
    for k, v in parts.items():
        print(f"  {k:16s} {v:9.1f}", file=log)
    if args.output:
        args.output.write_text(
            json.dumps(
                dict(
                    model=str(args.model),
                    gpu=torch.cuda.get_device_name(),
                    hbm_read_bytes_per_s=bw,
                    load_s=load_s,
                    position=args.prompt,
                    graph_replay_s=replay,
                    forward_s=forward_s,
                    bytes_per_token=nbytes,
                    roofline_s=roof,
                    profile_us=parts,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
