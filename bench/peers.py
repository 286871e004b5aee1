"""How does pyruntime compare with llama.cpp on the same model shape? llama-bench and
`pyruntime bench` side by side, each in its own process, alternating, on random weights.

The model is made twice by bench/make_random_gguf.py (once per shape and type, reused after):
in pyruntime's layout and in llama.cpp's (the same tensors and types, the routed experts split
as llama.cpp stores them). Setups, each a llama-bench flag set and pyruntime's counterpart:

    gpu       llama-bench -ngl 99 -fa 1                  pyruntime bench --device cuda
    cpu       llama-bench -ngl 0 -dev none -t T           pyruntime bench --device cpu -t T
    cpu-moe   llama-bench -ngl 99 -fa 1 -ncmoe L -t T     (none yet: every layer's experts on
                                                          the CPU, the rest on the GPU)
    gpu-mem   llama-bench -ngl 99 -fa 1 -ncmoe N -t T     pyruntime bench --gpu-mem M -t T
              (--gpu-mem M, default 8G: N is the fewest layers whose experts, left on the CPU,
              bring llama.cpp's GPU weights under M less a 0.5 GiB reserve for its KV cache and
              compute buffers; pyruntime's budget M holds everything it puts on the GPU)

Both run pp P (one or more -p sizes) and tg N (-n) with -r R repetitions after their own
warm-up; per round and setup llama.cpp runs first, then pyruntime (one `pyruntime bench` per
prompt size, tg with the first). The table gives each side's mean tokens/s (median over rounds
when --rounds > 1) and pyruntime / llama.cpp, and for the GPU's pp rows the compute floor:
FLOPs per prompt token (bench/cpu_prefill.py's count, of the pyruntime GGUF) at the peak of a
plain bf16 torch GEMM measured in the same run (bench/gpu_prefill.py --peak-only, in its own
process after each round's GPU setup; median over rounds).

    bash bench/peers_build.sh /tmp/peers          # last line: the llama-bench binary
    python bench/peers.py olmoe-1b-7b --llama-bench /tmp/peers/llama.cpp/build-cuda/bin/llama-bench
    python bench/peers.py olmoe-1b-7b --setups gpu -p 128 512 2048 -n 0 --llama-bench LLAMA_BENCH
    python bench/peers.py tiny-olmoe --setups cpu -p 64 -n 32 --llama-bench LLAMA_BENCH
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pyruntime
sys.path.insert(0, str(ROOT / "bench"))
from compare_trees import LAUNCHER  # noqa: E402
from make_random_gguf import CONFIGS, make_random_gguf  # noqa: E402

# setup: (llama-bench flags, pyruntime bench flags or None); {t} threads, {layers} n_layer
SETUPS = {
    "gpu": (["-ngl", "99", "-fa", "1"], ["--device", "cuda"]),
    "cpu": (["-ngl", "0", "-dev", "none", "-t", "{t}"], ["--device", "cpu", "-t", "{t}"]),
    "cpu-moe": (["-ngl", "99", "-fa", "1", "-ncmoe", "{layers}", "-t", "{t}"], None),
    "gpu-mem": (
        ["-ngl", "99", "-fa", "1", "-ncmoe", "{ncmoe}", "-t", "{t}"],
        ["--device", "auto", "--gpu-mem", "{gpu_mem}", "-t", "{t}"],
    ),
}
RESERVE = 1 << 29  # llama.cpp's KV cache and compute buffers beside its weights (gpu-mem setup)


def llama_rows(stdout: str) -> dict[str, dict]:
    """llama-bench -o json: {test name (pp512, tg128): its row}."""
    out = {}
    for row in json.loads(stdout[stdout.index("[") :]):
        name = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        out[name] = row
    return out


def pyruntime_rows(stdout: str) -> dict[str, dict]:
    """pyruntime bench -o json: {test name: its row}."""
    return {row["test"]: row for row in json.loads(stdout[stdout.index("[") :])}


def run(cmd: list[str], what: str, timeout: float) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"{what} failed (exit {r.returncode}):\n{tail}")
    return r.stdout


def fill(flags: list[str], **values) -> list[str]:
    return [f.format(**values) for f in flags]


def n_cpu_moe(gguf: Path, budget: int) -> tuple[int, int]:
    """(N, GPU weight bytes): the fewest first layers whose routed experts (ffn_*_exps), left
    on the CPU by llama.cpp's -ncmoe N, leave its other weights within budget - RESERVE.
    token_embd is not on the GPU: llama.cpp keeps its input layer on the CPU (a tied one is
    also the output, which it puts on the GPU: counted then)."""
    from pyruntime.gguf.file import open_gguf

    f = open_gguf(gguf)
    total, per_layer = 0, {}
    for name, t in f.tensors.items():
        if name == "token_embd.weight" and "output.weight" in f.tensors:
            continue
        total += t.n_bytes
        if "_exps" in name and name.startswith("blk."):
            layer = int(name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes
    on_gpu = total
    for n in range(len(per_layer) + 1):
        if on_gpu <= budget - RESERVE:
            return n, on_gpu
        on_gpu -= per_layer.get(n, 0)
    raise SystemExit(f"{gguf}: its weights without any expert take {on_gpu / 2**30:.2f} GiB, "
                     f"over --gpu-mem less {RESERVE / 2**30:.1f} GiB")  # fmt: skip


def models(shape: str, outtype: str, folder: Path) -> tuple[Path, Path]:
    """(pyruntime GGUF, llama.cpp GGUF) of the shape, made when missing."""
    folder.mkdir(parents=True, exist_ok=True)
    ours = folder / f"{shape}-{outtype}.gguf"
    theirs = folder / f"{shape}-{outtype}-llama.cpp.gguf"
    for path, layout in ((ours, "pyruntime"), (theirs, "llama.cpp")):
        if not path.exists():
            make_random_gguf(shape, path, outtype, progress=False, layout=layout)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
    return ours, theirs


def gpu_floors(gguf: Path, prompts: list[int], peak_tflops: float) -> dict[str, float]:
    """{ppN: tokens/s} at the compute floor: FLOPs per prompt token of N tokens at the peak."""
    from types import SimpleNamespace

    from cpu_prefill import flops_per_token

    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.config import ModelConfig
    from pyruntime.model.weights import HostWeights

    f = open_gguf(gguf)
    cfg = ModelConfig.from_gguf(f)
    model = SimpleNamespace(config=cfg, weights=HostWeights.from_gguf(f, cfg))
    return {f"pp{n}": peak_tflops * 1e12 / flops_per_token(model, n) for n in prompts}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("shape", choices=sorted(CONFIGS), help="bench/make_random_gguf.py shape")
    p.add_argument("--llama-bench", type=Path, required=True, help="the llama-bench binary")
    p.add_argument("--outtype", default="q8_0", help="weight type of both GGUFs (q8_0)")
    p.add_argument(
        "--setups",
        nargs="+",
        choices=list(SETUPS),
        default=None,
        help="default: gpu and cpu-moe where torch sees a GPU, and cpu",
    )
    p.add_argument("-p", "--n-prompt", type=int, nargs="+", default=[512])
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the two sides")
    p.add_argument("--gguf-dir", type=Path, default=Path("/tmp/pyruntime-peers"))
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    p.add_argument("--gpu-mem", default="8G", help="the gpu-mem setup's budget (8G)")
    args = p.parse_args()
    if not args.llama_bench.is_file():
        raise SystemExit(f"{args.llama_bench}: no such file (bash bench/peers_build.sh builds it)")
    from pyruntime.cpu.core import physical_cores

    threads = args.threads or physical_cores()
    setups = args.setups
    if setups is None:
        import torch

        setups = ["gpu", "cpu-moe", "cpu"] if torch.cuda.is_available() else ["cpu"]
    ours, theirs = models(args.shape, args.outtype, args.gguf_dir)
    layers = CONFIGS[args.shape]["num_hidden_layers"]
    ncmoe = 0
    if "gpu-mem" in setups:
        from pyruntime.options import parse_size

        ncmoe, on_gpu = n_cpu_moe(theirs, parse_size(args.gpu_mem))
        print(f"gpu-mem {args.gpu_mem}: llama.cpp -ncmoe {ncmoe} ({on_gpu / 2**30:.2f} GiB of "
              f"weights on the GPU)", flush=True)  # fmt: skip
    values = dict(t=threads, layers=layers, ncmoe=ncmoe, gpu_mem=args.gpu_mem)
    prompts = ",".join(str(n) for n in args.n_prompt)
    reps = ["-r", str(args.repetitions)]
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    peaks: list[float] = []
    info = None
    for rnd in range(args.rounds):
        for setup in setups:
            lflags, pflags = SETUPS[setup]
            tests = ["-p", prompts, "-n", str(args.n_gen), *reps]
            cmd = [str(args.llama_bench), "-m", str(theirs), *tests, "-o", "json"]
            rows = llama_rows(run(cmd + fill(lflags, **values), "llama-bench", args.timeout))
            info = info or next(iter(rows.values()))
            for test, row in rows.items():
                results.setdefault((setup, test), {}).setdefault("llama.cpp", []).append(
                    row["avg_ts"]
                )
            for i, n_prompt in enumerate(args.n_prompt if pflags is not None else []):
                tests = ["-p", str(n_prompt), "-n", str(args.n_gen if i == 0 else 0), *reps]
                cmd = [sys.executable, "-c", LAUNCHER, str(ROOT), "-m", "pyruntime", "bench",
                       str(ours), *tests, "-o", "json", *fill(pflags, **values)]  # fmt: skip
                out = run(cmd, "pyruntime bench", args.timeout)
                for test, row in pyruntime_rows(out).items():
                    results.setdefault((setup, test), {}).setdefault("pyruntime", []).append(
                        row["avg_ts"]
                    )
            if setup == "gpu":
                peak = run([sys.executable, str(ROOT / "bench" / "gpu_prefill.py"), "--peak-only"],
                           "bf16 GEMM peak", args.timeout)  # fmt: skip
                peaks.append(float(peak.split()[-1]))
            print(f"round {rnd + 1}/{args.rounds} {setup} done", file=sys.stderr, flush=True)
    floors = gpu_floors(ours, args.n_prompt, statistics.median(peaks)) if peaks else {}
    print(f"{args.shape} {args.outtype}, {threads} threads; llama.cpp {info['build_commit']} "
          f"({info['backends']}) on {info['cpu_info']}"
          + (f", {info['gpu_info']}" if info.get("gpu_info") else ""))  # fmt: skip
    if peaks:
        print(f"bf16 GEMM peak {statistics.median(peaks):.0f} TFLOP/s (torch.mm 8192^3, median "
              f"of {len(peaks)})")  # fmt: skip
    print("\n| setup | test | llama.cpp t/s | pyruntime t/s | pyruntime / llama.cpp | floor t/s |")
    print("|---|---|---:|---:|---:|---:|")
    for (setup, test), sides in results.items():
        lc = statistics.median(sides["llama.cpp"])
        ours_ts = statistics.median(sides["pyruntime"]) if "pyruntime" in sides else None
        cell = f"{ours_ts:.2f}" if ours_ts else "-"
        ratio = f"{ours_ts / lc:.2f}x" if ours_ts else "-"
        floor = floors.get(test) if setup == "gpu" else None
        print(f"| {setup} | {test} | {lc:.2f} | {cell} | {ratio} | "
              f"{f'{floor:.0f}' if floor else '-'} |")  # fmt: skip


if __name__ == "__main__":
    main()
