"""How fast does the whole model decode on the CPU, against the bytes-per-token / DRAM-read
floor, and where does a step's time go?

A random-weight GGUF of a real model's shape (bench/make_random_gguf.py, streamed to disk once)
is loaded with the C core (dense weights and experts read in place from the mmap); after a short
prefill, tokens are decoded one at a time (greedy), each a single C call (pyrt_decoder_step).

Bytes per token are counted from the model's tensors, as stored: every dense matrix of every
block (attention q/k/v/o, router, shared expert, dense FFN), top-k routed experts per MoE layer
(all three rows of each neuron: the dense kernel), the output matrix (token_embd when tied), one
embedding row, the norms and biases, and the KV cache read at the mean position of the run.
The floor is that many bytes at this machine's DRAM read bandwidth, measured with pyrt_mem_read
on the same thread pool. The per-part breakdown (attention / FFN / output) comes from the step's
own timers (pyrt_decoder_times), each part next to its bytes.

The timed steps come in --segments segments, each after 3 reads of the read test and one untimed
step: `paired:` is the median over segments of each segment's % of the floor at the read rate
measured right before it, which cancels most of the machine's drift.

--narrow answers: how much of a step does not scale with the weights' bytes (norms, routing,
attention over the cache, the pool's hand-offs, Python)? It runs the shape's structure (layers,
heads, experts, top-k) at hidden 256, expert and dense FFN width 32 and a vocabulary of 4096
(NARROW): a step whose weights are a few MB, read from cache, so its time is that part plus
little (an upper bound on it).

--param NAME=VALUE sets one of the C core's execution parameters (pyrt_params in
runtime/include/pyrt.h: fusions, prefetch distances, VNNI, spin) for the run.

--sparsity S [S ...] (with --sparsity-table FILE from `pyruntime calibrate`, default the sidecar
beside the GGUF) answers instead: how much faster than dense is a decode step at sparsity S, with
every layer sparse and as the CPU switch chooses (pyruntime.cpu.sparse_switch, measured afresh in
this process)? Steps at one position (each reads the same cache), dense and sparse alternated
--rounds times; per round the dense time over the sparse time, median and min-max over rounds,
and each side's median ms a step (so the sparse step's expert time can be set beside the read
rate of its bytes, bench/cpu_sparse_read.c).
--gate-copy on / both: the sparse steps also (both) or only (on) with the experts' gate rows
apart (pyruntime.experts.gates: the sparse gate pass streams a copy instead of every third row
of the file); the switch is measured for each layout; the copy's load time and extra RSS are
printed.

--weights-copy: the file read into RAM on 2 MiB pages (option `weights_copy`,
pyruntime.gguf.file.read_in_huge_pages), not mapped: does the weight stream overlap the kernels
better on huge pages? (Its load time is printed; compare with a run without it.)

    python bench/cpu_decode.py granite-1b-a400m --outtype q8_0 --threads 2
    python bench/cpu_decode.py olmoe-1b-7b --gguf /tmp/olmoe-q8_0.gguf --threads 16 --tokens 64
    python bench/cpu_decode.py granite-1b-a400m --param fuse_layer=0 --param vnni=0
    python bench/cpu_decode.py granite-1b-a400m --outtype q4_k_m --threads 1 --narrow
    python bench/cpu_decode.py granite-1b-a400m --threads 1 --sparsity 0.5 0.9 \
        --sparsity-table /tmp/granite.sparsity.json --rounds 9 --gate-copy both
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_experts import ReadTest  # noqa: E402
from make_random_gguf import CONFIGS, make_random_gguf  # noqa: E402

from pyruntime.cpu import core as cpu_core  # noqa: E402
from pyruntime.cpu import sparse_switch  # noqa: E402
from pyruntime.cpu.executor import CpuExecutor  # noqa: E402
from pyruntime.cpu.experts import CpuCoreBackend  # noqa: E402
from pyruntime.experts.sparsity import SparsityTable  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402

# --narrow: the sizes that set the weights' bytes, made small (rows of 256: K-quants stay real)
NARROW = {"hidden_size": 256, "intermediate_size": 32, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "vocab_size": 4096}  # fmt: skip
# shapes whose attention or mixer has its own widths (MLA ranks, DeltaNet heads, head_dim): not
# made narrow by NARROW alone
NARROW_NOT = ("kv_lora_rank", "q_lora_rank", "linear_num_key_heads", "head_dim")


def narrow_shape(shape: str) -> str:
    """Registers `shape`'s structure at NARROW's sizes as CONFIGS[shape + "-narrow"] (shapes
    with none of NARROW_NOT's keys)."""
    config = CONFIGS[shape]
    CONFIGS[f"{shape}-narrow"] = {**config, **{k: v for k, v in NARROW.items() if k in config}}
    return f"{shape}-narrow"


def bytes_per_token(model: CpuExecutor, mean_pos: float) -> dict[str, float]:
    """Bytes one decode step must read, by part (see the module docstring)."""
    cfg = model.config
    attn = ffn = 0.0
    for blk in model.blocks:
        mla = blk.mla  # deepseek2: the latent attention's matrices; one latent per position
        mats = (blk.wq, blk.wk, blk.wv, blk.wo) if mla is None else (
            blk.wo, mla.q, mla.q_a, mla.q_b, mla.kv_a, mla.k_b, mla.v_b)  # fmt: skip
        attn += sum(m.nbytes for m in mats if m is not None)
        attn += sum(t.numel() * 4 for t in (blk.attn_norm, blk.bq, blk.bk, blk.bv) if t is not None)
        attn += sum(t.numel() * 4 for t in (blk.q_norm, blk.k_norm) if t is not None)
        planes = 1 if mla is not None else 2  # K and V, f32 (MLA: [c_kv; k_pe] serves both)
        attn += planes * cfg.n_head_kv * cfg.head_dim * 4 * (mean_pos + 1)
        ffn += blk.ffn_norm.numel() * 4
        if blk.experts is not None:
            ffn += blk.router.nbytes + cfg.n_expert_used * blk.experts.expert_bytes
            if blk.shared is not None:
                ffn += blk.shared.gate.nbytes + blk.shared.up.nbytes + blk.shared.down.nbytes
                ffn += 0 if blk.shared_gate is None else blk.shared_gate.numel() * 4
        else:
            f = blk.dense_ffn
            ffn += f.gate.nbytes + f.up.nbytes + f.down.nbytes
    w = model.weights
    emb_row = w.token_embd.nbytes / cfg.n_vocab
    output = w.output.nbytes + w.output_norm.numel() * 4
    return {"attention": attn + emb_row, "ffn": ffn, "output": output}


def decode(
    model: CpuExecutor,
    n_prompt: int,
    n_tokens: int,
    warmup: int,
    seed: int,
    segments: int = 1,
    between=None,
):
    """Per-step seconds of n_tokens greedy steps after a prompt of n_prompt random tokens, as
    `segments` lists of consecutive steps; before each segment `between()` runs (the read test)
    and one untimed step follows it, so no timed step pays for the caches it left behind."""
    cache = model.new_cache(n_prompt + warmup + n_tokens + segments + 1)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.n_vocab, (n_prompt,), generator=gen)
    logits = model.forward(prompt, cache, last_only=True)
    tok = int(logits[-1].argmax())
    for _ in range(warmup):
        tok = int(model.forward([tok], cache)[-1].argmax())
    model.decode_times(reset=True)
    seg_steps = []
    for s in range(segments):
        if between is not None:
            between()
            tok = int(model.forward([tok], cache)[-1].argmax())
        steps = []
        for _ in range(n_tokens * (s + 1) // segments - n_tokens * s // segments):
            t = time.perf_counter()
            logits = model.forward([tok], cache)
            steps.append(time.perf_counter() - t)
            tok = int(logits[-1].argmax())
        seg_steps.append(steps)
    return seg_steps, model.decode_times()


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def layouts(model: CpuExecutor, gate_copy: str) -> dict:
    """{layout name: (its decoder, its gate copies)}: the file's layout (off, both) and the gate
    rows apart in every MoE layer (on, both; the copy's time and extra RSS printed)."""
    out = {}
    if gate_copy in ("off", "both"):
        out["file"] = (model._decoder, {})
    if gate_copy in ("on", "both"):
        rss, t = rss_bytes(), time.perf_counter()
        model.use_gate_copy("on", 0)
        dt, extra = time.perf_counter() - t, rss_bytes() - rss
        print(f"gate copy: {model.gate_copy_bytes / 2**20:.1f} MiB made in {dt:.2f} s, "
              f"RSS +{extra / 2**20:.1f} MiB")  # fmt: skip
        out["gates apart"] = (model._decoder, model._gate_copies)
    return out


def sparse_speedups(model: CpuExecutor, table, sparsities, rounds: int,
                    gate_copy: str = "off") -> None:  # fmt: skip
    """Prints, per sparsity and layout, dense step time / sparse step time (all layers sparse,
    and the switch's per-layer mix), paired per round (see the module docstring)."""
    decoders = layouts(model, gate_copy)
    steps = sparse_switch.DecodeSteps(model)
    dense_dec = next(iter(decoders.values()))[0]  # dense steps never read the copy
    with tempfile.TemporaryDirectory() as tmp:
        for s in sparsities:
            thr = table.for_sparsity(s)
            model.expert_threshold = thr
            cases = {}
            for layout, (dec, copies) in decoders.items():
                # the switch measures on this layout (it may then free the copies of the layers
                # it leaves dense: the cases below run on the decoder with all of them)
                model._decoder, model._gate_copies = dec, copies
                model.gate_copy_bytes = sum(c.nbytes for c in copies.values())
                model.choose_decode_sparsity(f"bench-{s}", Path(tmp))
                layers = model.sparse_layers
                tag = "" if len(decoders) == 1 else f", {layout}"
                print(f"sparsity {s}{tag}: switch: {sum(layers)}/{len(layers)} layers sparse")
                cases[f"every layer sparse{tag}"] = (dec, thr)
                cases[f"as the switch chose{tag}"] = (dec, model.decode_thresholds())
            ratios: dict[str, list[float]] = {name: [] for name in cases}
            secs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
            for dec, case in cases.values():
                steps.dec = dec
                steps.whole(case)  # warm-up
            for _ in range(rounds):
                for name, (dec, case) in cases.items():
                    if case is None:
                        ratios[name].append(1.0)
                        continue
                    steps.dec = dense_dec
                    t0 = time.perf_counter()
                    steps.whole(None)
                    t1 = time.perf_counter()
                    steps.dec = dec
                    steps.whole(case)
                    t2 = time.perf_counter()
                    ratios[name].append((t1 - t0) / (t2 - t1))
                    secs[name].append((t1 - t0, t2 - t1))
            for name, r in ratios.items():
                # ms a step, dense / sparse, medians over the rounds (to set beside read rates)
                pairs = secs[name] or [(float("nan"), float("nan"))]
                dense_ms, sparse_ms = (
                    statistics.median(p[k] for p in pairs) / sparse_switch.STEPS * 1e3
                    for k in (0, 1)
                )
                print(
                    f"  {name:32s} {statistics.median(r):.2f}x dense (min {min(r):.2f}, "
                    f"max {max(r):.2f}, {rounds} rounds of {sparse_switch.STEPS} steps each; "
                    f"{dense_ms:.2f} / {sparse_ms:.2f} ms a step)"
                )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("shape", choices=sorted(CONFIGS), help="real model shape")
    ap.add_argument("--outtype", default="q8_0", help="weight type of the random GGUF")
    ap.add_argument("--gguf", type=Path, help="the GGUF (made when missing; default in /tmp)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dram-gib", type=float, default=1.0)
    ap.add_argument(
        "--narrow",
        action="store_true",
        help="the shape's structure with few weight bytes: the step's part that does not scale "
        "with them (see the docstring)",
    )
    ap.add_argument(
        "--segments",
        type=int,
        default=4,
        help="the steps in this many segments, each after 3 reads of the read test: every "
        "segment's %% of the floor is against the read rate measured right before it",
    )
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a C core execution parameter (pyrt_params), e.g. fuse_layer=0; repeatable",
    )
    ap.add_argument(
        "--sparsity",
        type=float,
        nargs="+",
        default=None,
        help="time dense vs sparse steps at these sparsities instead (see the docstring)",
    )
    ap.add_argument("--sparsity-table", type=Path, default=None, help="from pyruntime calibrate")
    ap.add_argument("--rounds", type=int, default=9, help="--sparsity: dense/sparse alternations")
    ap.add_argument(
        "--gate-copy",
        choices=["off", "on", "both"],
        default="off",
        help="--sparsity: sparse steps with the file's layout (off), the gate rows apart (on), "
        "or both, interleaved",
    )
    ap.add_argument(
        "--weights-copy", action="store_true", help="the file in RAM on 2 MiB pages, not mapped"
    )
    args = ap.parse_args()
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            ap.error(f"--param takes NAME=INTEGER, got {item!r}")
        params[name] = int(value)

    own = [key for key in NARROW_NOT if key in CONFIGS[args.shape]] if args.narrow else []
    if own:
        ap.error(f"--narrow: {args.shape} has widths of its own ({', '.join(own)})")
    shape = narrow_shape(args.shape) if args.narrow else args.shape
    path = args.gguf or Path(f"/tmp/{shape}-{args.outtype}.gguf")
    if not path.exists():
        t = time.perf_counter()
        make_random_gguf(shape, path, args.outtype, progress=False)
        size = path.stat().st_size / 1e9
        print(f"wrote {path} ({size:.2f} GB) in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    f = open_gguf(path, in_ram=args.weights_copy)
    if args.weights_copy:
        dt = time.perf_counter() - t
        print(f"weights copy: {f.file_size / 2**20:.0f} MiB read in {dt:.2f} s")
    model = CpuExecutor.from_gguf(f, threads=args.threads, expert_backend="torch")
    model.expert_backend = CpuCoreBackend(args.threads, params)
    model.use_core(model.expert_backend.core)
    core = model.core
    # Map every page of the file into this process once (and into the page cache): the run then
    # measures steady-state decode, not first-touch page faults of experts not yet used.
    core.mem_read(f._map)
    print(
        f"{shape} {args.outtype}: {platform.processor() or platform.machine()}, "
        f"{core.threads} threads, simd {cpu_core.simd_level()}, torch threads "
        f"{torch.get_num_threads()}, params {params or 'default'}"
    )
    if args.sparsity:
        table = SparsityTable.load(path, args.sparsity_table)
        sparse_speedups(model, table, args.sparsity, args.rounds, args.gate_copy)
        return
    read = ReadTest(core, args.dram_gib)
    rates = read.rates(10)
    print(
        f"DRAM read (pyrt_mem_read, {args.dram_gib} GiB): median {statistics.median(rates):.1f} "
        f"GB/s, best {max(rates):.1f}"
    )
    seg_bw = []

    def read_between():
        seg_bw.append(statistics.median(read.rates(3)))

    seg_steps, times = decode(
        model, args.prompt, args.tokens, args.warmup, 0, args.segments, read_between
    )
    steps = [t for seg in seg_steps for t in seg]
    mean_pos = args.prompt + args.warmup + (args.tokens + args.segments - 1) / 2
    parts = bytes_per_token(model, mean_pos)
    total_bytes = sum(parts.values())
    step_med = statistics.median(steps)
    bw_med = statistics.median(rates + seg_bw)
    floor_s = total_bytes / (bw_med * 1e9)
    print(
        f"bytes/token {total_bytes / 1e6:.1f} MB -> floor {floor_s * 1e3:.2f} ms/token "
        f"({1 / floor_s:.1f} tokens/s at {bw_med:.1f} GB/s, the median of all read tests)"
    )
    print(
        f"decode: median {step_med * 1e3:.2f} ms/token = {1 / step_med:.1f} tokens/s "
        f"(mean {statistics.fmean(steps) * 1e3:.2f} ms, best {min(steps) * 1e3:.2f} ms, "
        f"{args.tokens} steps) = {floor_s / step_med * 100:.1f}% of the floor"
    )
    pcts = [
        total_bytes / (bw * 1e9) / statistics.median(seg) * 100
        for bw, seg in zip(seg_bw, seg_steps, strict=True)
    ]
    for i, (bw, seg, pct) in enumerate(zip(seg_bw, seg_steps, pcts, strict=True)):
        print(
            f"  segment {i}: read {bw:.1f} GB/s, median {statistics.median(seg) * 1e3:.2f} "
            f"ms/token over {len(seg)} steps = {pct:.1f}% of its floor"
        )
    print(
        f"paired: median {statistics.median(pcts):.1f}% of the floor over {len(pcts)} segments "
        f"(each against the read test right before it; min {min(pcts):.1f}, max {max(pcts):.1f})"
    )
    n = times["steps"]
    c_total = 0.0
    for part in ("attention", "ffn", "output"):
        s = times[part] / n
        c_total += s
        rate = parts[part] / s / 1e9 if s > 0 else float("nan")
        print(
            f"  {part:9s} {s * 1e3:6.2f} ms  {parts[part] / 1e6:7.1f} MB  "
            f"{rate:5.1f} GB/s ({rate / bw_med * 100:.0f}% of DRAM)"
        )
    mean_step = statistics.fmean(steps)
    overhead = (mean_step - c_total) * 1e3
    print(f"  python + call overhead {overhead:.2f} ms/token (mean step - C parts)")


if __name__ == "__main__":
    main()
