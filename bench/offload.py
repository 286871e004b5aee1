"""How fast does a model bigger than the GPU run hybrid, and how close is that to its floor?

The matrix of issue 15, in one process: for each budget (a share of all routed experts that fits
in GPU slots), each placement of the misses (stage: copied into slots and computed on the GPU;
auto: split between the CPU and staging by the measured costs; cpu: all on the CPU), dense and
with neuron sparsity, pp N (a prefill) and tg N (one-token decode steps), timed as `pyruntime
bench` times them (pyruntime.tools.bench: a warm-up run, then -r repetitions). A budget of 0
keeps no cache: its slots are 2 x top-k, room to stage two layers' experts (staging needs a slot
to land in; --misses cpu at 0 uses none, as llama.cpp's --cpu-moe).

Each figure stands beside its floor: the bytes that crossed DRAM or PCIe per token (experts read
by the CPU, experts staged, from the executor's counters) over the bandwidth measured in the same
run, before the matrix: the C core's DRAM read (pyrt_mem_read), the pinned host-to-GPU copy, and
both at once (bench/read_ceilings.py's measure). cpu rows divide by the read alone, stage rows by
the copy alone, auto rows by both together. `% floor` = floor time / measured time.

--stats times each row's parts (pyruntime.offload.stats: the decode step's dense graph segments,
the GPU's experts, waits for copies, the host's wait for each layer's routing, the C core's
calls) and prints them per token, beside what the cost model expected of the C core's calls and
of the staged experts (their copies and GPU time); --staging-rates register,bounce,pinned first
measures how fast each expert home fills slots (the copies alone), beside the pinned copy
ceiling;
--host-memory how fast the CPU reads host memory the GPU wrote, by kind (plain, torch's pinned,
page-locked from the driver, registered user memory), and the C core's read of a layer's
experts before and after the mapping is registered (both GPU only).

The costs are measured once (pyruntime.offload.costs, not cached here); --sparsity S takes the
thresholds from the model's calibration (MODEL.sparsity.json), made first from random tokens if
there is none. MODEL is a GGUF or a shape of bench/make_random_gguf.py (written once to
--workdir).

    python bench/offload.py olmoe-1b-7b --outtype q8_0 -t 16
    python bench/offload.py /tmp/olmoe-q8_0.gguf --fractions 0.25 --misses auto -n 64
    TRITON_INTERPRET=1 python bench/offload.py tiny-olmoe --device cpu -p 16 -n 4 -r 1 \
        --fractions 0.5 --ceiling-gib 0.05      (the CPU standing in for the GPU: a check)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_experts import ReadTest  # noqa: E402
from make_random_gguf import CONFIGS, make_random_gguf  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.cpu.executor import CpuExecutor  # noqa: E402
from pyruntime.decoding.big_little import BigLittleStats  # noqa: E402
from pyruntime.decoding.mode import DecodingMode  # noqa: E402
from pyruntime.experts.sparsity import SparsityTable, calibrate, sidecar_path  # noqa: E402
from pyruntime.gc_freeze import freeze_imports  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402
from pyruntime.gguf.quant import FORMAT_NAMES  # noqa: E402
from pyruntime.model.config import ModelConfig  # noqa: E402
from pyruntime.model.weights import HostWeights  # noqa: E402
from pyruntime.offload.costs import measure_costs  # noqa: E402
from pyruntime.offload.executor import HybridExecutor  # noqa: E402
from pyruntime.offload.home import PAGE, open_home, page_aligned, page_span  # noqa: E402
from pyruntime.offload.host_register import cuda_pinning, page_locked  # noqa: E402
from pyruntime.offload.slots import ExpertSlots  # noqa: E402
from pyruntime.offload.stats import OffloadStats  # noqa: E402
from pyruntime.offload.streams import DeviceStreams  # noqa: E402
from pyruntime.tools.bench import run_bench  # noqa: E402

CPU_THREAD = {"auto": None, "always": True, "never": False}  # --cpu-thread -> HybridExecutor's


@dataclasses.dataclass
class Ceilings:
    read: float  # GB/s, the C core reading DRAM alone
    copy: float  # GB/s, pinned host -> device alone
    both: float | None  # GB/s, the two at once in all (None on a CPU device)

    def rate(self, misses: str) -> float:
        if misses == "cpu":
            return self.read
        if misses == "stage":
            return self.copy
        return self.both or self.read + self.copy


def measure_ceilings(core: cpu_core.CpuCore, device: torch.device, gib: float,
                     rounds: int = 3) -> Ceilings:  # fmt: skip
    read_test = ReadTest(core, gib)
    read = statistics.median(read_test.rates(rounds))
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t) / 1e9)
    both = None
    if device.type == "cuda":
        from read_ceilings import copy_while_reading

        pairs = [copy_while_reading(dst, src, read_test) for _ in range(rounds)]
        both = statistics.median(c + r for c, r in pairs)
    return Ceilings(read, statistics.median(rates), both)


def thresholds_for(path: Path, f, sparsity: float, threads: int | None) -> list[float] | None:
    """The model's calibrated thresholds at `sparsity`, calibrating on random tokens first
    (saved beside the model) when it has none."""
    if sparsity == 0:
        return None
    if not sidecar_path(path).exists():
        print(f"calibrating {path.name} on 256 random tokens ...", file=sys.stderr, flush=True)
        net = CpuExecutor.from_gguf(f, threads=threads)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, net.config.n_vocab, (256,), generator=g).tolist()
        calibrate(net, ids, 256, "random tokens", f.file_size).save(sidecar_path(path))
    return SparsityTable.load(path).for_sparsity(sparsity)


def n_direct_list(text: str) -> list[float | None]:
    """--n-direct: comma-separated misses per layer, or auto (None: the executor's default)."""
    try:
        return [None if x == "auto" else float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: numbers or auto, comma-separated") from None


def slots_for(fraction: float, misses: str, n_experts: int, k: int) -> int:
    if fraction == 0:
        return 0 if misses in ("cpu", "direct") else 2 * k
    return max(1, round(fraction * n_experts))


def decoding_modes(k: int, threshold: float, big_little: bool) -> dict[str, DecodingMode]:
    """plain (the model's top-k); with --big-little also little-only (k/2), big/little lossy at
    `threshold`, verify and verify with drafts from the experts in slots (`--draft-experts
    resident`), each timed as tg rows."""
    plain = DecodingMode(k_big=k)
    if not big_little:
        return {"plain": plain}
    return {
        "plain": plain,
        "little": DecodingMode(k_big=k // 2),
        "lossy": DecodingMode(k_big=k, k_little=k // 2, threshold=threshold),
        "verify": DecodingMode(k_big=k, k_little=k // 2, threshold=threshold, fallback="verify"),
        "verify-resident": DecodingMode(
            k_big=k,
            k_little=k // 2,
            threshold=threshold,
            fallback="verify",
            draft_experts="resident",
        ),
    }


def combined_speedup(rows: dict[str, dict], ratios: list[float],
                     t_dense: float | None = None) -> str:  # fmt: skip
    """T / (T_l + r·T_b) from the measured steps: T the plain step, T_l the little step, T_b a
    fallback's big pass (the lossy rows' big seconds per fallback), r each given ratio. With
    t_dense (the plain step without sparsity, same placement) and sparse rows, also
    T_dense / (T_l + r·T_b): big/little and sparsity together against plain dense decoding."""
    t = 1 / rows["plain"]["tok_s"]
    t_l = 1 / rows["little"]["tok_s"]
    bl = rows["lossy"]["stats"]
    t_b = bl.big_seconds / bl.fallbacks if bl.fallbacks else t
    combined = ", ".join(f"{t / (t_l + r * t_b):.2f}x at r = {r:g}" for r in ratios)
    line = (
        f"  big/little: T {1e3 * t:.2f} ms, T_l {1e3 * t_l:.2f} ms, T_b {1e3 * t_b:.2f} ms "
        f"(measured); this model's fallback ratio {bl.fallback_ratio:.2f}, prefetch hit rate "
        f"{bl.prefetch_hit_rate:.2f}; T / (T_l + r·T_b) = {combined} (combined)"
    )
    if t_dense is not None and t_dense != t:
        vs_dense = ", ".join(f"{t_dense / (t_l + r * t_b):.2f}x at r = {r:g}" for r in ratios)
        line += f"; against the dense plain step ({1e3 * t_dense:.2f} ms): {vs_dense}"
    return line


def staging_rates(host: HostWeights, device: torch.device, modes: list[str], n_slots: int,
                  reps: int = 3) -> dict[str, float]:  # fmt: skip
    """GB/s of each home (register, bounce, pinned) filling n_slots slots with experts of every
    MoE layer in turn (the copies alone: no CPU work meanwhile), median of `reps` fills."""
    moe = [i for i, b in enumerate(host.blocks) if b.experts is not None]
    first = host.blocks[moe[0]].experts
    streams = DeviceStreams(device)
    slots = ExpertSlots(n_slots, first.n_ff, first.n_embd, FORMAT_NAMES[first.qtype], device,
                        streams, 8)  # fmt: skip
    keys = [(layer, e) for e in range(first.n_expert) for layer in moe]
    out = {}
    for mode in modes:
        home = open_home(host, device, mode)
        rates = []
        for r in range(reps + 1):  # the first fill warms the buffers up
            batch = [keys[(r * n_slots + j) % len(keys)] for j in range(n_slots)]
            if streams.cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            slots.fill(list(range(n_slots)), home.sources(batch))
            if streams.cuda:
                streams.copy.synchronize()
            rates.append(n_slots * slots.expert_bytes / (time.perf_counter() - t) / 1e9)
        out[home.mode if home.mode == mode else f"{mode} ({home.mode})"] = statistics.median(
            rates[1:]
        )
        home.close()
    return out


def host_memory(core: cpu_core.CpuCore, host: HostWeights, device: torch.device,
                nbytes: int = 1 << 18, reps: int = 20) -> str:  # fmt: skip
    """How fast the CPU reads host memory the GPU wrote (a clone of nbytes, each kind: plain,
    torch's pinned, page-locked from the driver, user memory registered with the driver), and
    how fast the C core reads one layer's experts from the mapped file before and after it is
    registered read-only (as the register home does)."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    block = page_locked(nbytes)
    registered = page_aligned(nbytes)
    pinning = cuda_pinning()
    why = pinning.pin(registered.ctypes.data, page_span(registered), read_only=False)
    kinds = {
        "plain": torch.empty(n),
        "torch pinned": torch.empty(n, pin_memory=True),
        "page-locked": None if block is None else torch.from_numpy(block.view(np.float32)),
        "registered": None if why else torch.from_numpy(registered.view(np.float32)),
    }
    out = []
    for name, t in kinds.items():
        if t is None:
            continue
        times = []
        for _ in range(reps):
            t.copy_(src)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            t.clone()
            times.append(time.perf_counter() - t0)
        out.append(f"{name} {1e6 * statistics.median(times):.0f} us")
    if why is None:
        pinning.unpin(registered.ctypes.data)
    raw = next(b.experts for b in host.blocks if b.experts is not None).raw
    rates = []
    for register in (False, True, False):
        span = (raw.ctypes.data // PAGE * PAGE, -(-(raw.ctypes.data + raw.nbytes) // PAGE) * PAGE)
        if register and pinning.pin(span[0], span[1] - span[0], read_only=True) is not None:
            continue
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            core.mem_read(raw)
            times.append(time.perf_counter() - t0)
        rates.append(f"{'registered' if register else 'plain'} "
                     f"{raw.nbytes / statistics.median(times) / 1e9:.1f} GB/s")  # fmt: skip
        if register:
            pinning.unpin(span[0])
    return (f"host memory the GPU wrote, read by the CPU ({nbytes >> 10} KiB, a clone): "
            f"{', '.join(out)}\nthe C core reading a layer's experts from the mapped file: "
            f"{', '.join(rates)}\n")  # fmt: skip


def part_times(net: HybridExecutor, before: OffloadStats, timer: dict, tokens: int) -> str:
    """Milliseconds per token by part since `before` (--stats; the parts overlap)."""
    after = net.offload
    parts = {p: (net.timer.seconds[p] - timer[p]) for p in net.timer.seconds}
    parts["route_wait"] = after.route_wait_seconds - before.route_wait_seconds
    parts["cpu_experts"] = after.cpu_seconds - before.cpu_seconds
    line = ", ".join(f"{p} {1e3 * v / tokens:.3f}" for p, v in parts.items() if v > 0)
    model = {"cpu_experts": after.cpu_model_seconds - before.cpu_model_seconds,
             "staging": after.stage_model_seconds - before.stage_model_seconds}  # fmt: skip
    if any(model.values()):  # the cost model's view of the same work
        line += "; cost model: " + ", ".join(f"{p} {1e3 * v / tokens:.3f}"
                                             for p, v in model.items())  # fmt: skip
    return line


def run_case(net: HybridExecutor, test: str, n: int, reps: int,
             mode: DecodingMode | None = None) -> dict:  # fmt: skip
    """tok/s and, per token, the bytes the CPU read and staged (warm-up included)."""
    before = dataclasses.replace(net.offload)
    timer = dict(net.timer.seconds)
    hits = net.cache.stats.hits, net.cache.stats.misses
    stats = BigLittleStats()
    [result] = run_bench(net, n if test == "pp" else 0, n if test == "tg" else 0, reps,
                         mode=mode, stats=stats)  # fmt: skip
    after = net.offload
    tokens = max(1, after.tokens - before.tokens)
    lookups = net.cache.stats.hits - hits[0] + net.cache.stats.misses - hits[1]
    return {
        "tok_s": result.mean,
        "std": result.std,
        "hit_rate": (net.cache.stats.hits - hits[0]) / lookups if lookups else 0.0,
        "cpu_mb": (after.cpu_bytes - before.cpu_bytes) / tokens / 1e6,
        "staged_mb": (
            after.staged_bytes - before.staged_bytes + after.direct_bytes - before.direct_bytes
        )
        / tokens
        / 1e6,
        "stats": stats,
        "parts": part_times(net, before, timer, tokens),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="GGUF file, or a shape of bench/make_random_gguf.py")
    p.add_argument("--outtype", default="q8_0", help="a shape's weight type (q8_0)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pyruntime-offload"))
    p.add_argument("--device", default="cuda")
    p.add_argument("-t", "--threads", type=int, default=None, help="C core threads")
    p.add_argument(
        "--fractions",
        default="0,0.1,0.25,0.5",
        help="budgets as shares of all routed experts in slots (0: no cache)",
    )
    p.add_argument("--misses", default="stage,auto",
                   help="placements: cpu, stage, auto, direct")  # fmt: skip
    p.add_argument("--n-direct", default=[None], type=n_direct_list,
                   help="misses a layer's GPU reads in place in a direct step (--misses direct, "
                        "or auto without a cache), a list alternated like --sparsity (auto: the "
                        "executor's default)")  # fmt: skip
    p.add_argument("--sparsity", default="0,0.5", help="neuron sparsity targets")
    p.add_argument("--staging", default="register", choices=["register", "bounce", "pinned"])
    p.add_argument("--policy", default="lfru", choices=["lfru", "lru"])
    p.add_argument(
        "--cpu-thread",
        default="auto",
        choices=["auto", "always", "never"],
        help="the CPU's share on a worker thread while the GPU's is queued: where the cost "
        "model says a layer finishes sooner so (auto, the default), always, or never (inline)",
    )
    p.add_argument(
        "--lookahead",
        action="store_true",
        help="stage the next MoE layer's likely experts during a decode step (its router on "
        "this layer's residual stream)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a C core execution parameter (pyrt_params), e.g. spin_us=2000; repeatable",
    )
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=2)
    p.add_argument("--ceiling-gib", type=float, default=1.0, help="buffer of the ceilings")
    p.add_argument(
        "--stats",
        action="store_true",
        help="time the parts of each row (GPU events per layer) and print them per token",
    )
    p.add_argument(
        "--host-memory",
        action="store_true",
        help="first measure how fast the CPU reads each kind of host memory the GPU writes",
    )
    p.add_argument(
        "--staging-rates",
        default="",
        help="homes whose staging rate to measure first (e.g. register,bounce,pinned)",
    )
    p.add_argument(
        "--big-little",
        action="store_true",
        help="tg rows also for little-only (K/2), big/little lossy, verify (little and resident "
        "drafts), and the combined T / (T_l + r·T_b) for each --fallback-ratio (at a "
        "sparsity > 0 also against the dense plain step when --sparsity includes 0)",
    )
    p.add_argument(
        "--weights-copy",
        action="store_true",
        help="read the file into RAM on 2 MiB pages (option weights_copy) instead of mapping it",
    )
    p.add_argument("--fallback-threshold", type=float, default=0.7, help="big/little's γ")
    p.add_argument(
        "--fallback-ratio", default="0.21", help="r values to combine (0.21: the paper's OLMoE)"
    )
    args = p.parse_args(argv)  # fmt: skip

    path = Path(args.model)
    if args.model in CONFIGS:
        path = args.workdir / f"{args.model}-{args.outtype}.gguf"
        if not path.exists():
            args.workdir.mkdir(parents=True, exist_ok=True)
            make_random_gguf(args.model, path, args.outtype)
    device = torch.device(args.device)
    freeze_imports()  # as a Model does: no full collection walks torch's objects mid-step
    f = open_gguf(path, in_ram=args.weights_copy)
    cfg = ModelConfig.from_gguf(f)
    host = HostWeights.from_gguf(f, cfg)
    n_experts = sum(cfg.n_expert for b in host.blocks if b.experts is not None)
    params = {}
    for item in args.param:
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            p.error(f"--param takes NAME=INTEGER, got {item!r}")
        params[name] = int(value)
    core = cpu_core.CpuCore(args.threads, params or None)
    ceilings = measure_ceilings(core, device, args.ceiling_gib)
    both = "-" if ceilings.both is None else f"{ceilings.both:.1f}"
    share = {"auto": "inline or on a worker thread by the cost model",
             "always": "on a worker thread", "never": "inline"}[args.cpu_thread]  # fmt: skip
    share += ", lookahead" if args.lookahead else ""
    expert_bytes = next(b.experts for b in host.blocks if b.experts is not None).expert_bytes
    print(f"{path.name}: {n_experts} routed experts of {expert_bytes:,} "
          f"bytes; {args.device}, {core.threads} CPU threads, staging {args.staging}, policy "
          f"{args.policy}, CPU share {share}, C core params {params or 'default'}\n"
          f"ceilings (GB/s): DRAM read {ceilings.read:.1f}, "
          f"host->GPU copy {ceilings.copy:.1f}, both at once {both}\n")  # fmt: skip
    if args.host_memory:
        print(host_memory(core, host, device), flush=True)
    if args.staging_rates:
        n_slots = 4 * cfg.n_expert_used
        rates = staging_rates(host, device, args.staging_rates.split(","), n_slots)
        print(f"staging {n_slots} experts into slots (GB/s, copies alone; the copy ceiling "
              f"{ceilings.copy:.1f}): " + ", ".join(f"{m} {r:.1f} ({100 * r / ceilings.copy:.0f}%)"
                                                   for m, r in rates.items()) + "\n",
              flush=True)  # fmt: skip
    fractions = [float(x) for x in args.fractions.split(",")]
    placements = args.misses.split(",")
    sparsities = [float(x) for x in args.sparsity.split(",")]
    tests = [(t, n) for t, n in (("pp", args.n_prompt), ("tg", args.n_gen)) if n]
    thresholds = {s: thresholds_for(path, f, s, args.threads) for s in sparsities}
    modes = decoding_modes(cfg.n_expert_used, args.fallback_threshold, args.big_little)
    ratios = [float(x) for x in args.fallback_ratio.split(",")]
    print(
        "| experts in slots | slots | misses | sparsity | test | mode | tok/s | hit rate "
        "| CPU MB/tok | staged MB/tok | floor tok/s | % floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    costs = None
    dense_step: dict[tuple[int, str], float] = {}  # (slots, misses) -> plain tg step, sparsity 0
    for fraction in fractions:
        for slots in sorted({slots_for(fraction, m, n_experts, cfg.n_expert_used)
                             for m in placements}):  # fmt: skip
            net = HybridExecutor(cfg, host, device, core, slots=slots, misses="cpu",
                                 staging=args.staging, policy=args.policy,
                                 cpu_thread=CPU_THREAD[args.cpu_thread],
                                 lookahead=args.lookahead)  # fmt: skip
            net.timer.enabled = args.stats or not net.streams.cuda
            if costs is None and slots and {"auto", "direct"} & set(placements):
                costs = measure_costs(net)
                print(f"costs: {costs}", flush=True)
            for misses in placements:
                if slots_for(fraction, misses, n_experts, cfg.n_expert_used) != slots:
                    continue
                net.set_misses(misses, costs)
                for nd, s in itertools.product(args.n_direct, sparsities):
                    net.experts.n_direct = nd
                    label = misses if nd is None else f"{misses} {nd:g}"
                    net.set_expert_threshold(thresholds[s])
                    for test, n in tests:
                        rows = {}
                        for name, mode in modes.items() if test == "tg" else [("plain", None)]:
                            row = rows[name] = run_case(net, test, n, args.repetitions, mode)
                            mb = row["cpu_mb"] + row["staged_mb"]
                            floor = ceilings.rate(misses) * 1e3 / mb if mb else None
                            vs = "- | -" if floor is None else \
                                f"{floor:.1f} | {100 * row['tok_s'] / floor:.0f}%"  # fmt: skip
                            print(f"| {100 * slots / n_experts:.1f}% | {slots} | {label} "
                                  f"| {s:g} | {test}{n} | {name} "
                                  f"| {row['tok_s']:.1f} ± {row['std']:.1f} "
                                  f"| {row['hit_rate']:.3f} | {row['cpu_mb']:.2f} "
                                  f"| {row['staged_mb']:.2f} | {vs} |", flush=True)  # fmt: skip
                            if args.stats:
                                print(f"  ms/token: {row['parts']}", flush=True)
                            if name.startswith("verify"):
                                st = row["stats"]
                                print(f"  {name}: {st.acceptance_length:.2f} drafts kept per "
                                      f"round; draft {st.little_seconds:.3f} s, verify "
                                      f"{st.big_seconds:.3f} s", flush=True)  # fmt: skip
                        if test == "tg" and s == 0:
                            dense_step[(slots, misses)] = 1 / rows["plain"]["tok_s"]
                        if "lossy" in rows:
                            t_dense = dense_step.get((slots, misses)) if s else None
                            print(combined_speedup(rows, ratios, t_dense), flush=True)
            net.close()
            del net
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
