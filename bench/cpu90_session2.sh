#!/usr/bin/env bash
# Device session 2 of helper cpu90. The tests first (tests/test_cpu_core.py, test_cpu_decode.py
# against the new library at AVX-512; they also let a fresh machine settle: session 1's first
# ~90 s were noisy), then one process per shape: main's library (OLD) and this branch's (NEW)
# interleaved, NEW under its knobs (OLD ignores them, so its rows repeat: their spread is the
# noise): item plan (PYRT_ITEM_PLAN div:min), cldemote of finished partial ys (PYRT_DEMOTE),
# reducers (PYRT_REDUCERS, 0 = nth - 1); wrapper and bare C call, the kernel's profile per cell.
# Ran at commit 2fabc86, where those knobs existed (dropped after run 2, no gain: see
# docs/benchmarks.md, "the bare kernel vs the Python wrapper"); at later commits the kernel ignores them.
#   bash bench/cpu90_session2.sh BASE_SRC OUT
set -u
BASE_SRC=$1
OUT=$2
. "$(dirname "$0")/cpu_session_common.sh"
session_begin "$OUT" "$BASE_SRC" c90 || exit 1

PYRUNTIME_CORE_LIB=$NEW timeout 110 python -m pytest -q -x -rs tests/test_cpu_core.py \
    tests/test_cpu_decode.py >"$OUT/tests.txt" 2>&1
echo "tests: exit $? at $(elapsed) s" | tee -a "$OUT/tests.txt" "$OUT/machine.txt"
uptime >>"$OUT/machine.txt"

for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== sweep $shape at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$NEW timeout 75 python bench/cpu_experts.py --shapes $shape --iters 20 \
        --footprint-gib 4 --batches 1 --sparsity 0 0.9 --rounds 9 \
        --sweep LIB=$OLD,$NEW PYRT_ITEM_PLAN=2:16,1:64,1.5:32 PYRT_DEMOTE=0,1 \
        PYRT_REDUCERS=0,8 PYRT_PROFILE=43
done >"$OUT/sweep.txt" 2>&1
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
