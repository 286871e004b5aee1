#!/usr/bin/env bash
# Device session 2 of helper cpu16: the final code (NEW) against main's library (OLD, built from
# BASE_SRC = main's runtime/ and CMakeLists.txt) in one process per shape, interleaved rounds
# (bench/cpu_experts.py --sweep LIB=OLD,NEW, with the kernel's profile per cell); the Python
# wrapper's cost (bench/cpu_wrapper_overhead.py); the tests against NEW (AVX-512 paths); if the budget
# allows, granite-1b-a400m decode OLD, NEW, OLD, NEW (each its own process). Ran at commit 9bcc102,
# where the knob PYRT_ITEM_MIN existed (dropped after the run: no gain); later it is ignored.
#   bash bench/cpu16_session2.sh BASE_SRC OUT [BUDGET_S]
set -u
BASE_SRC=$1
OUT=$2
BUDGET_S=${3:-200}
. "$(dirname "$0")/cpu_session_common.sh"
session_begin "$OUT" "$BASE_SRC" c16 || exit 1

for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== sweep $shape at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$NEW timeout 100 python bench/cpu_experts.py --shapes $shape --iters 30 \
        --footprint-gib 4 --batches 1 8 --sparsity 0 0.5 0.9 --rounds "${ROUNDS:-7}" \
        --sweep LIB=$OLD,$NEW PYRT_ITEM_MIN=16,32 PYRT_PROFILE=33
done >"$OUT/sweep.txt" 2>&1
echo "sweeps done at $(elapsed) s" | tee -a "$OUT/machine.txt"

PYRT_PROFILE=100 PYRUNTIME_CORE_LIB=$NEW timeout 60 python bench/cpu_wrapper_overhead.py \
    --shape olmoe-1b-7b --rounds 7 --calls 100 >"$OUT/overhead.txt" 2>&1
echo "overhead done at $(elapsed) s" | tee -a "$OUT/machine.txt"

PYRUNTIME_CORE_LIB=$NEW timeout 150 python -m pytest -q -x -rs tests/test_cpu_core.py \
    tests/test_cpu_decode.py >"$OUT/tests.txt" 2>&1
echo "tests: exit $? at $(elapsed) s" | tee -a "$OUT/tests.txt" "$OUT/machine.txt"

if [ "$(elapsed)" -lt "$BUDGET_S" ]; then
    session_decode_granite "$OUT" "$((BUDGET_S + 40))"
fi
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
