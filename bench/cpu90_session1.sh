#!/usr/bin/env bash
# Device session 1 of helper cpu90 (issue 3: dense batch 1 >= 90% of DRAM read). One process per
# shape: the new library's knobs against each other (bench/cpu_experts.py --sweep, wrapper and bare
# C call per cell, the kernel's profile per cell): guided item plan (PYRT_ITEM_PLAN=div:min),
# cldemote of finished partial ys (PYRT_DEMOTE), reduce prefetch distance (PYRT_REDUCE_PF); the
# old library (main) beside the new one's defaults (LIB=OLD,NEW, which must tie); the Python
# wrapper's cost with and without out=; the DRAM read test at 8-16 threads.
# Ran at commit 77c48bc, where those knobs existed (dropped after run 2, no gain: see
# docs/benchmarks.md, "the bare kernel vs the Python wrapper"); at later commits the kernel ignores them.
#   bash bench/cpu90_session1.sh BASE_SRC OUT
set -u
BASE_SRC=$1
OUT=$2
. "$(dirname "$0")/cpu_session_common.sh"
session_begin "$OUT" "$BASE_SRC" c90 || exit 1
grep -o -w -E "cldemote|movdiri" /proc/cpuinfo | sort | uniq -c >>"$OUT/machine.txt"

for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== knob sweep $shape at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$NEW timeout 80 python bench/cpu_experts.py --shapes $shape --iters 20 \
        --footprint-gib 4 --batches 1 --sparsity 0 0.9 --rounds 7 \
        --sweep PYRT_ITEM_PLAN=2:16,2:32,1.5:32,1:32,1:64 PYRT_DEMOTE=0,1 PYRT_REDUCE_PF=2,6 \
        PYRT_PROFILE=43
done >"$OUT/sweep.txt" 2>&1
echo "knob sweeps done at $(elapsed) s" | tee -a "$OUT/machine.txt"

echo "== old vs new (defaults) olmoe at $(elapsed) s" >"$OUT/oldnew.txt"
PYRUNTIME_CORE_LIB=$NEW timeout 50 python bench/cpu_experts.py --shapes olmoe-1b-7b --iters 20 \
    --footprint-gib 4 --batches 1 --sparsity 0 0.9 --rounds 9 --sweep LIB=$OLD,$NEW \
    >>"$OUT/oldnew.txt" 2>&1
echo "old/new done at $(elapsed) s" | tee -a "$OUT/machine.txt"

PYRT_PROFILE=100 PYRUNTIME_CORE_LIB=$NEW timeout 40 python bench/cpu_wrapper_overhead.py \
    --shape olmoe-1b-7b --rounds 7 --calls 100 >"$OUT/overhead.txt" 2>&1
echo "overhead done at $(elapsed) s" | tee -a "$OUT/machine.txt"

PYRUNTIME_CORE_LIB=$NEW timeout 40 python - >"$OUT/readscale.txt" 2>&1 <<'PY'
import statistics, time
import numpy as np
from pyruntime import cpu_core
buf = np.random.default_rng(2).integers(0, 256, size=2**30, dtype=np.uint8)
for n in (8, 12, 14, 15, 16, 8, 12, 14, 15, 16):
    with cpu_core.CpuCore(n) as core:
        core.mem_read(buf)
        r = []
        for _ in range(9):
            t = time.perf_counter(); core.mem_read(buf); r.append(buf.nbytes / (time.perf_counter() - t) / 1e9)
        print(f"{n} threads: median {statistics.median(r):.1f} GB/s, best {max(r):.1f}")
PY
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
