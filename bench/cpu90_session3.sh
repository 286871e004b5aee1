#!/usr/bin/env bash
# Device session 3 of helper cpu90 (final). The tests first (they also let a fresh machine settle),
# then one process per shape: main's library (OLD) and this branch's (NEW: the same kernel, a
# longer PYRT_PROFILE report) interleaved, batch 1 and 8, dense / 0.5 / 0.9, through the Python
# wrapper and as bare C calls, the kernel's profile per cell; the DRAM read test before and after
# the sweep; the Python wrapper's cost with and without out=.
#   bash bench/cpu90_session3.sh BASE_SRC OUT
set -u
BASE_SRC=$1
OUT=$2
. "$(dirname "$0")/cpu_session_common.sh"
session_begin "$OUT" "$BASE_SRC" c90 || exit 1

PYRT_PROFILE=5 PYRUNTIME_CORE_LIB=$NEW timeout 110 python -m pytest -q -x -rs \
    tests/test_cpu_core.py tests/test_cpu_decode.py >"$OUT/tests.txt" 2>&1
echo "tests: exit $? at $(elapsed) s" | tee -a "$OUT/tests.txt" "$OUT/machine.txt"
uptime >>"$OUT/machine.txt"

for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== sweep $shape at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$NEW timeout 80 python bench/cpu_experts.py --shapes $shape --iters 20 \
        --footprint-gib 4 --batches 1 8 --sparsity 0 0.5 0.9 --rounds 9 \
        --sweep LIB=$OLD,$NEW PYRT_PROFILE=43
done >"$OUT/sweep.txt" 2>&1
echo "sweeps done at $(elapsed) s" | tee -a "$OUT/machine.txt"

PYRT_PROFILE=100 PYRUNTIME_CORE_LIB=$NEW timeout 40 python bench/cpu_wrapper_overhead.py \
    --shape olmoe-1b-7b --rounds 9 --calls 100 >"$OUT/overhead.txt" 2>&1
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
