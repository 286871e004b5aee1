#!/usr/bin/env bash
# Device session of helper cpu16 (issue 3, CPU expert kernel at 16 threads). Run 1: diagnose and
# compare candidate changes behind knobs in one process per shape (bench/cpu_experts.py --sweep),
# the kernel's per-phase profile per cell, the strided read test (bench/cpu16_stride.c) and the
# C unit tests under ASan/UBSan (the AVX-512 quantize). Ran at commit 4e0db34, where the knobs
# PYRT_QUANT_SCALAR, PYRT_REDUCE, PYRT_ITEM_MIN and PYRT_GATE_AHEAD existed (dropped after the run,
# see docs/benchmarks.md, CPU sections); at later commits they are ignored.
#   bash bench/cpu16_session.sh OUT
set -u
OUT=$1
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
. "$(dirname "$0")/cpu_session_common.sh"
session_machine "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/c16 && cmake -S . -B /tmp/c16 -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build /tmp/c16 >/dev/null || exit 1
export PYRUNTIME_CORE_LIB=/tmp/c16/libpyrt.so
gcc -O2 -mavx2 -pthread bench/cpu16_stride.c -o /tmp/stride || exit 1
echo "built at $(elapsed) s" | tee -a "$OUT/machine.txt"

# C unit tests (AVX-512 quantize vs scalar, MoE kernel) under ASan/UBSan, default and new knobs
gcc -std=c11 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra \
    -Werror -Iruntime/include -Iruntime/src runtime/src/*.c tests/c/test_core.c -o /tmp/tc \
    -pthread -lm && { /tmp/tc | tail -3; PYRT_REDUCE=1 PYRT_ITEM_MIN=64 /tmp/tc | tail -1; } \
    >"$OUT/ctests.txt" 2>&1
echo "ctests done at $(elapsed) s" | tee -a "$OUT/machine.txt"

timeout 60 /tmp/stride 16 2 >"$OUT/stride.txt" 2>&1
echo "stride done at $(elapsed) s" | tee -a "$OUT/machine.txt"

for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== sweep $shape at $(elapsed) s"
    timeout 100 python bench/cpu_experts.py --shapes $shape --iters 30 --footprint-gib 4 \
        --batches 1 --sparsity 0 0.5 0.9 0.99 --rounds "${ROUNDS:-5}" \
        --sweep PYRT_QUANT_SCALAR=1,0 PYRT_REDUCE=0,1 PYRT_ITEM_MIN=16,64 \
        PYRT_GATE_AHEAD=2,6 PYRT_PROFILE=33
done >"$OUT/sweep.txt" 2>&1
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
