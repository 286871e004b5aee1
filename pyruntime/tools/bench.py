"""`pyruntime bench`: prompt-processing and generation speed, in the spirit of llama-bench.

Two tests per run, each repeated `reps` times after warm-up runs (not counted): one, and on a
GPU two, as its kernels compile and its CUDA graphs are captured (the decode step's on the
first, a prompt shape's when it comes the second time: pyruntime.gpu.executor):
- pp N: one forward pass over N prompt tokens from an empty cache (prefill); N / seconds;
- tg N: N single-token forward passes from an empty cache (decode, batch 1); N / seconds.
Tokens are random ids (fixed seed), fed without sampling, as llama-bench does. Each timed
forward pass ends with its logits on the CPU, so the time includes the device's work. With
--experts-per-token both tests use that many experts. With big/little decoding, pp is the big
model's prefill and tg N generates N tokens greedily through the big/little strategy from a
one-token prompt (its fallbacks, or drafts and verifications, are what is timed).
Results: tokens/s mean ± sample standard deviation over the repetitions.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pyruntime.decoding.big_little import BigLittleStats
from pyruntime.decoding.mode import DecodingMode
from pyruntime.decoding.plain import DecodingStrategy, PromptStats
from pyruntime.decoding.sampling import Sampler, SamplingParams
from pyruntime.decoding.session import Session
from pyruntime.errors import UsageError


@dataclass
class BenchResult:
    test: str  # "pp512", "tg128"
    n_tokens: int
    seconds: list[float]  # one per repetition

    @property
    def tokens_per_second(self) -> list[float]:
        return [self.n_tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.tokens_per_second)

    @property
    def std(self) -> float:
        tps = self.tokens_per_second
        return statistics.stdev(tps) if len(tps) > 1 else 0.0


def _time_prefill(net: Any, cache: Any, ids: list[int], k: int | None) -> float:
    cache.truncate(0)
    t0 = time.perf_counter()
    net.forward(ids, cache, last_only=True, k=k)
    return time.perf_counter() - t0


def _time_decode(net: Any, cache: Any, ids: list[int], k: int | None) -> float:
    cache.truncate(0)
    t0 = time.perf_counter()
    for tok in ids:
        net.forward([tok], cache, last_only=True, k=k)
    return time.perf_counter() - t0


def _timer_generate(session: Session, strategy: DecodingStrategy):
    """tg through a decoding strategy: len(ids) tokens generated greedily after ids[0]."""

    def timer(net: Any, cache: Any, ids: list[int], k: int | None) -> float:
        session.reset()
        prompt = PromptStats()
        steps = strategy(session, ids[:1], Sampler(SamplingParams(temp=0.0)), prompt)
        t0 = time.perf_counter()
        for _ in itertools.islice(steps, len(ids)):
            pass
        elapsed = time.perf_counter() - t0 - prompt.seconds
        steps.close()
        return elapsed

    return timer


def run_bench(
    net: Any,
    n_prompt: int,
    n_gen: int,
    reps: int,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    mode: DecodingMode | None = None,
    stats: BigLittleStats | None = None,
) -> list[BenchResult]:
    """Time pp{n_prompt} and tg{n_gen} (a test is skipped when its N is 0) on `net`
    (CpuExecutor or GpuExecutor) in a decoding mode (None: plain, the model's top-k)."""
    if n_prompt < 0 or n_gen < 0 or n_prompt + n_gen == 0:
        raise UsageError("bench needs -p N and/or -n N >= 1 (0 skips that test)")
    if reps < 1:
        raise UsageError(f"-r/--repetitions must be >= 1, got {reps}")
    g = torch.Generator().manual_seed(seed)
    cfg = net.config
    mode = mode or DecodingMode(k_big=cfg.n_expert_used)
    k = None if mode.k_big == cfg.n_expert_used else mode.k_big
    n_ctx = max(n_prompt, n_gen + 1 if mode.big_little else n_gen)
    cache = net.new_cache(n_ctx)
    decode = _time_decode
    if mode.big_little:
        session = Session(net, n_ctx)
        decode = _timer_generate(
            session, mode.strategy(stats or BigLittleStats(), cfg.n_expert_used)
        )
    results = []
    for name, n, timer in (("pp", n_prompt, _time_prefill), ("tg", n_gen, decode)):
        if n == 0:
            continue
        ids = torch.randint(0, cfg.n_vocab, (n,), generator=g).tolist()
        for _ in range(2 if getattr(net, "cuda_graphs", False) else 1):  # warm-up (module doc)
            timer(net, cache, ids, k)
        seconds = []
        for r in range(reps):
            seconds.append(timer(net, cache, ids, k))
            if progress:
                progress(f"{name}{n} [{r + 1}/{reps}] {n / seconds[-1]:.2f} tokens/s")
        results.append(BenchResult(f"{name}{n}", n, seconds))
    return results


# ---------------------------------------------------------------------------------------------
# Report


def describe_model(model: Any) -> dict[str, Any]:
    """Model name, size and parameter count for the table (from the GGUF)."""
    f = model.file
    n_params = sum(t.n_elements for t in f.tensors.values())
    # the type holding most weights (llama-bench's label); a layer's attn_q is not in every
    # architecture (Gated DeltaNet layers have none)
    elements: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) >= 2:
            elements[t.qtype.name] = elements.get(t.qtype.name, 0) + t.n_elements
    qtype = max(elements, key=elements.get)
    return {
        "model": f"{f.arch} {n_params / 1e9:.2f}B {qtype}",
        "model_size": f.file_size,
        "model_params": n_params,
    }


def device_label(device: str) -> str:
    if device == "cpu":
        return "CPU"
    return f"CUDA ({torch.cuda.get_device_name(torch.device(device))})"


def result_rows(model: Any, results: list[BenchResult], threads: int) -> list[dict[str, Any]]:
    base = describe_model(model)
    base.update(
        device=model.device,
        backend=device_label(model.device),
        threads=threads,
        sparsity_target=model.sparsity,
        sparsity_achieved=model.achieved_sparsity,
        decoding=model.decoding.describe(),
    )
    by_phase = model.sparsity_by_phase()
    return [
        {
            **base,
            # the fraction skipped in this test's phase: pp is prefill, tg decode
            "sparsity_test": by_phase.get("prefill" if r.test.startswith("pp") else "decode"),
            "test": r.test,
            "n_tokens": r.n_tokens,
            "reps": len(r.seconds),
            "samples_s": r.seconds,
            "avg_ts": r.mean,
            "stddev_ts": r.std,
        }
        for r in results
    ]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = "| model | size | params | backend | threads | sparsity | test | t/s |"
    sep = "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"
    lines = [head, sep]
    for r in rows:
        achieved = r["sparsity_test"]
        if achieved is None:
            achieved = r["sparsity_achieved"]
        sparsity = f"{r['sparsity_target']:.2f} ({achieved:.3f})" if r["sparsity_target"] else "0"
        lines.append(
            f"| {r['model']} | {r['model_size'] / 2**30:.2f} GiB | "
            f"{r['model_params'] / 1e9:.2f} B | {r['backend']} | {r['threads']} | {sparsity} | "
            f"{r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |"
        )
    return "\n".join(lines)
