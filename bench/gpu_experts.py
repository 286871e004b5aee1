"""How fast are one MoE layer's routed experts on the GPU, dense vs activation-sparse, against
the HBM bytes they must read?

Shapes are real models' MoE layers; weights and inputs are random (the kernels' speed does not
depend on the values, only on the sparsity). Q8_0 experts are repacked to q8_0r (MXFP4 to
mxfp4r) by kernels.dispatch.prepare_experts, as the GPU model does. Per (shape, format, target
sparsity) the threshold is calibrated once (quantile of |act(gate)| over 64 other random
tokens) and the dense/sparse switch is profiled once by kernels.switch.sparse_switch; "auto" times
moe_experts with that switch, i.e. what the GPU model runs. Each case is captured in a CUDA
graph (the decode step's real setting) and replayed with the L2 cache flushed before every
timed replay, with a fresh routing each time, so weights come from HBM. Times are medians of
CUDA-event intervals. Dense and sparse(threshold 0) are checked against the torch reference
first (a wrong result stops the run).

Reported bandwidth is on the bytes each path must read (weights only; x and y are < 0.1%):
dense = the routed experts' full blocks (gate+up+down rows of every distinct routed expert),
sparse = those experts' gate rows + the up/down rows of each distinct active (expert, neuron).
Peak = a measured HBM read bandwidth (torch sum over a 2 GiB tensor).

  python bench/gpu_experts.py                      # full table (a few minutes)
  python bench/gpu_experts.py --quick              # one shape, batch 1 and 16, sparsity 0.85
  python bench/gpu_experts.py --json out.json      # also write every row as JSON
  TRITON_INTERPRET=1 python bench/gpu_experts.py --smoke   # tiny shape on CPU (interpreter)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime

import triton  # noqa: E402

from pyruntime import options  # noqa: E402
from pyruntime.kernels import switch, timing  # noqa: E402
from pyruntime.kernels.dispatch import moe_experts, prepare_experts  # noqa: E402
from pyruntime.kernels.expert_formats import act_ref, quantize_rows, row_bytes  # noqa: E402
from pyruntime.kernels.expert_paths import quantizes_x, table_path  # noqa: E402
from pyruntime.kernels.moe_dense import moe_dense, moe_dense_ref  # noqa: E402
from pyruntime.kernels.moe_sparse import moe_gate, moe_sparse  # noqa: E402

# name: (hidden n_embd, n_expert, top-k, expert n_ff)
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "olmoe-1b-7b": (2048, 64, 8, 1024),
    "qwen3.5-35b-a3b-like": (2048, 256, 8, 512),
    "gpt-oss-20b": (2880, 32, 4, 2880),  # its MXFP4 experts: --formats mxfp4 (-> mxfp4r)
}
SMOKE_SHAPE = {"smoke": (64, 6, 2, 40)}


def make_experts(n_expert: int, n_ff: int, n_embd: int, fmt: str, device) -> torch.Tensor:
    """Random expert tensor in `fmt`, built one expert at a time (bounded temporary memory)."""
    gen = torch.Generator(device=device).manual_seed(0)
    last = n_embd if fmt in ("bf16", "f16", "f32") else row_bytes(fmt, n_embd)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}.get(
        fmt, torch.uint8
    )
    w = torch.empty(n_expert, n_ff, 3, last, dtype=dtype, device=device)
    for e in range(n_expert):
        rows = torch.randn(n_ff, 3, n_embd, generator=gen, device=device) * n_embd**-0.5
        w[e] = quantize_rows(rows, fmt)
    return w


def routing(n_tok: int, n_expert: int, k: int, seed: int, device):
    """Uniformly random distinct top-k experts per token and softmax-like weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(n_tok, n_expert, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(n_tok, k, generator=gen)
    return ids.to(device), (w / w.sum(dim=1, keepdim=True)).to(device)


def hbm_read_bandwidth(device) -> float | None:
    """Measured HBM read bandwidth in GB/s (kernels.timing: torch.sum over 2 GiB); None off CUDA."""
    if device.type != "cuda":
        return None
    return timing.hbm_read_bandwidth(device) / 1e9


class Timer:
    """Times fn() (which reads the static routing buffers) with fresh routings, L2 flushed.

    On CUDA the call is captured once in a CUDA graph (falls back to eager if capture fails);
    on CPU (interpreter smoke run) it is timed with perf_counter.
    """

    def __init__(self, device, routings, ids_buf, w_buf):
        self.device, self.routings, self.ids_buf, self.w_buf = device, routings, ids_buf, w_buf
        if device.type == "cuda":
            self.evict_l2 = timing.l2_evictor(device)

    def set_routing(self, i):
        ids, w = self.routings[i % len(self.routings)]
        self.ids_buf.copy_(ids)
        self.w_buf.copy_(w)

    def __call__(self, fn, reps: int) -> tuple[float, bool]:
        if self.device.type != "cuda":
            times = []
            for i in range(reps):
                self.set_routing(i)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), False
        graph = None
        timing.warm_up(fn)  # compile + warm up outside the capture
        torch.cuda.synchronize()
        try:
            graph = timing.capture(fn)
            run = graph.replay
        except Exception as exc:  # noqa: BLE001 - report, time eagerly instead
            print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
            graph, run = None, fn
        for i in range(3):
            self.set_routing(i)
            run()

        def before(i):
            self.set_routing(i)
            self.evict_l2()  # the weights come from HBM

        times = timing.event_seconds(run, reps, before)
        return statistics.median(times), graph is not None


def gbps(value: float, peak: float | None) -> str:
    """'1234 (41%)': GB/s and its share of the measured peak (no peak on CPU)."""
    return f"{value:.0f} ({100 * value / peak:.0f}%)" if peak else f"{value:.3g}"


def bytes_read(w, fmt, n_embd, ids, gate, threshold, activation):
    """(dense bytes, sparse bytes, achieved sparsity) for one routing, from the gate values."""
    n_expert, n_ff = w.shape[0], w.shape[1]
    rb = row_bytes(fmt, n_embd)
    flat = ids.reshape(-1).long()
    used = torch.zeros(n_expert, dtype=torch.bool, device=w.device)
    used[flat] = True
    n_used = int(used.sum())
    keep = act_ref(gate, activation).abs() >= threshold  # [P, F]
    active = torch.zeros(n_expert, n_ff, dtype=torch.bool, device=w.device)
    active.index_put_((flat,), keep, accumulate=True)
    dense = n_used * n_ff * 3 * rb
    sparse = n_used * n_ff * rb + int(active.sum()) * 2 * rb
    return dense, sparse, 1.0 - float(keep.float().mean())


def check_correct(x, w, fmt, ids, tw, activation):
    """Dense and sparse(threshold 0) vs the torch reference on the routed experts (for the
    sparse path on Q8-quantized x, the reference on that x)."""
    uniq, remap = torch.unique(ids.long(), return_inverse=True)
    sub = w[uniq].contiguous()
    ref = moe_dense_ref(x, sub, fmt, remap, tw, activation)
    T, H = x.shape
    ref_q = moe_dense_ref(x, sub, fmt, remap, tw, activation, q8_x=True) if fmt == "q8_0r" else ref
    y = moe_dense(x, w, fmt, ids, tw, activation)
    ys, _ = moe_sparse(x, w, fmt, ids, tw, 0.0, activation)
    scale = ref.abs().max().item()
    q8_d, q8_s = (quantizes_x(table_path(fmt, H, T, sparse)) for sparse in (False, True))
    err_d = (y - (ref_q if q8_d else ref)).abs().max().item()
    err_s = (ys - (ref_q if q8_s else ref)).abs().max().item()
    err_d, err_s = err_d / scale, err_s / scale
    tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
    if err_d > tol or err_s > tol:
        raise SystemExit(f"WRONG RESULT {fmt}: dense err {err_d:.2e}, sparse(0) err {err_s:.2e}")
    return max(err_d, err_s)


def calibrated_threshold(w, fmt, shape, sparsity, device, n_tok: int = 64) -> torch.Tensor:
    """[1] threshold = the `sparsity` quantile of |act(gate)| over n_tok random tokens (seed
    apart from the timed ones): a calibrated threshold, fixed for every batch size."""
    n_embd, n_expert, k, _ = shape
    gen = torch.Generator(device="cpu").manual_seed(999)
    x = torch.randn(n_tok, n_embd, generator=gen).to(device=device, dtype=bench_dtype(device))
    ids, _ = routing(n_tok, n_expert, k, 999, device)
    mags = act_ref(moe_gate(x, w, fmt, ids), "silu").abs().flatten().sort().values
    return mags[int(sparsity * (mags.numel() - 1))].reshape(1).clone()


def bench_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # interpreter: f32 fastest


def case_inputs(T: int, shape, device, dtype, n_routings: int):
    """(x [T, n_embd], ids [T, k], weights [T, k], Timer) of one batch: x seeded by T, the
    routings the timer cycles through seeded by T too; ids / weights are the static buffers
    the captured graphs read (the timer writes each routing into them)."""
    n_embd, n_expert, k, _ = shape
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, n_embd, generator=gen).to(device=device, dtype=dtype)
    routes = [routing(T, n_expert, k, 100 * T + i, device) for i in range(n_routings)]
    ids, tw = routes[0][0].clone(), routes[0][1].clone()
    return x, ids, tw, Timer(device, routes, ids, tw)


def _batches(won: tuple[int, ...]) -> str:
    """'1+2+4' text of the profiled batches where sparse won ('none')."""
    return "+".join(str(b) for b in won) if won else "none"


def bench_batch(model, shape, fmt, w, T, args, device, peak, thresholds, switch_at) -> list[dict]:
    """Dense once; sparse and auto (moe_experts with the profiled switch) at every target
    sparsity, for one (shape, format, batch). w, fmt: prepared (q8_0 -> q8_0r)."""
    n_embd, n_expert, k, n_ff = shape
    reps = 3 if args.smoke else args.reps
    x, ids_buf, w_buf, timer = case_inputs(T, shape, device, bench_dtype(device), args.routings)
    if T == args.batches[0]:
        check_correct(x, w, fmt, ids_buf, w_buf, "silu")
    t_dense, graphed = timer(functools.partial(moe_dense, x, w, fmt, ids_buf, w_buf), reps)
    timer.set_routing(0)
    gate = moe_gate(x, w, fmt, ids_buf)
    rows = []
    for s in args.sparsities:
        thr, sw = thresholds[s], switch_at[s]
        fn = functools.partial(moe_sparse, x, w, fmt, ids_buf, w_buf, thr)
        t_sparse, _ = timer(fn, reps)
        auto = functools.partial(moe_experts, x, w, fmt, ids_buf, w_buf, "silu", thr, sw)
        t_auto, _ = timer(auto, reps)
        timer.set_routing(0)  # bytes and achieved sparsity of routing 0 (all are alike)
        b_dense, b_sparse, achieved = bytes_read(w, fmt, n_embd, ids_buf, gate, float(thr), "silu")
        row = dict(
            model=model, fmt=fmt, batch=T, n_embd=n_embd, n_expert=n_expert, top_k=k,
            n_ff=n_ff, target_sparsity=s, threshold=float(thr), achieved_sparsity=achieved,
            dense_s=t_dense, sparse_s=t_sparse, auto_s=t_auto, speedup=t_dense / t_sparse,
            auto_speedup=t_dense / t_auto, sparse_batches=list(sw.won),
            switch_profiled=list(sw.profiled), sparse_path=table_path(fmt, n_embd, T, True),
            auto_path="sparse" if sw.use_sparse(T) else "dense",
            dense_bytes=b_dense, sparse_bytes=b_sparse,
            dense_gbps=b_dense / t_dense / 1e9, sparse_gbps=b_sparse / t_sparse / 1e9,
            peak_gbps=peak, cuda_graph=graphed,
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {model} | {fmt} | {T} | {s:.2f} | {achieved:.3f} "
            f"| {t_dense * 1e6:.1f} | {t_sparse * 1e6:.1f} ({row['sparse_path']}) "
            f"| {row['speedup']:.2f}x | {t_auto * 1e6:.1f} ({row['auto_path']}, "
            f"sparse at {_batches(sw.won)}) "
            f"| {row['auto_speedup']:.2f}x "
            f"| {gbps(row['dense_gbps'], peak)} | {gbps(row['sparse_gbps'], peak)} |",
            flush=True,
        )
    return rows


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 and --smoke to test on CPU")
    shapes = SMOKE_SHAPE if args.smoke else {k: SHAPES[k] for k in args.models}
    peak = hbm_read_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"# MoE layer bench on {name}: torch {torch.__version__}, triton {triton.__version__}")
    print(f"# measured HBM read bandwidth: {peak or 0:.0f} GB/s; times in microseconds")
    print("# fmt = the GGUF format; q8_0 is repacked to q8_0r by prepare_experts (same bytes)")
    print("# auto = moe_experts with the switch profiled by kernels.switch (the batches where")
    print("# sparse won; a batch takes the decision of the smallest profiled batch >= it)\n")
    print(
        "| model | fmt | batch | target | achieved | dense us | sparse us (path) | speedup "
        "| auto us (path, switch) | auto speedup | dense GB/s (%peak) | sparse GB/s (%peak) |"
    )
    print("|" + "---|" * 12)
    rows = []
    for model, shape in shapes.items():
        n_embd, n_expert, k, n_ff = shape
        for gguf_fmt in args.formats:
            w, fmt = prepare_experts(make_experts(n_expert, n_ff, n_embd, gguf_fmt, device),
                                     gguf_fmt, n_embd)  # fmt: skip
            thresholds = {
                s: calibrated_threshold(w, fmt, shape, s, device) for s in args.sparsities
            }
            switch_at = {
                s: switch.sparse_switch(
                    w, fmt, n_embd, k, "silu", thresholds[s], f"bench/{model}/s{s}",
                    timer=switch.graph_timer(3 if args.smoke else 20),
                    batches=args.switch_batches, refresh=True,
                    directory=options.cache_dir() / "switch",
                )
                for s in args.sparsities
            }  # fmt: skip
            for T in args.batches:
                rows += bench_batch(model, shape, fmt, w, T, args, device, peak, thresholds,
                                    switch_at)  # fmt: skip
            del w
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        meta = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                    peak_gbps=peak, command=" ".join(sys.argv))  # fmt: skip
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="qwen3-30b-a3b, batch 1/16, s=0.85")
    ap.add_argument("--smoke", action="store_true", help="tiny shape (CPU interpreter)")
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16", "q8_0"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    ap.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.7, 0.85, 0.9])
    ap.add_argument("--switch-batches", nargs="+", type=int, default=list(switch.BATCHES),
                    help="batches the dense/sparse switch is profiled at")  # fmt: skip
    ap.add_argument("--reps", type=int, default=50, help="timed replays per case")
    ap.add_argument("--routings", type=int, default=8, help="distinct routings cycled")
    ap.add_argument("--json", help="write the rows and metadata to this JSON file")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.sparsities = ["qwen3-30b-a3b"], [1, 16], [0.85]
        args.reps = min(args.reps, 30)
    if args.smoke:
        args.batches, args.sparsities, args.routings = [1, 3], [0.5], 2
        args.switch_batches = [1, 2]
    return run(args)


if __name__ == "__main__":
    main()
