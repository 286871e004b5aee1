#!/usr/bin/env bash
# One device session for the AVX512_VNNI / block-scale work on the C core's quantized dots. The
# runs of docs/benchmarks.md used it at commits 9fabf51 and 5ab3492, where the SIMD level
# avx512vnni and the knobs PYRT_QSCALES (0: the kernels before the work) and PYRT_SPARSE_PAIRS
# existed, with SWEEP="SIMD=avx512,avx512vnni PYRT_QSCALES=0,1 [PYRT_SPARSE_PAIRS=0,1]"; all three
# were dropped after those runs (docs/benchmarks.md says why).
# Builds the library of this tree (NEW) and of a base tree (OLD: main's runtime/ and
# CMakeLists.txt copied to a folder), then, each in its own process:
#   1. tests/test_cpu_core.py (with the C unit tests under ASan/UBSan) and tests/test_cpu_decode.py
#      against NEW: the AVX-512 paths only run on a CPU that has them;
#   2. bench/cpu_experts.py --sweep $SWEEP on NEW, olmoe-1b-7b and qwen3-30b-a3b, batch 1 and 8,
#      sparsity 0 / 0.5 / 0.9, interleaved rounds in one process;
#   3. the same sweep on one thread, olmoe batch 1 dense (does less arithmetic per byte let one
#      thread stream faster?);
#   4. bench/cpu_experts.py (dense, 0.5, 0.9; batch 1 and 8; both shapes), OLD then NEW;
#   5. if less than BUDGET_S (default 230) seconds have passed: granite-1b-a400m Q8_0 random GGUF,
#      bench/cpu_decode.py --threads 16 --tokens 64, OLD, NEW, OLD, NEW (the matvecs use the
#      same dot2 kernels).
# Logs go to $OUT (one file per step).
#
#   bash bench/cpu_vnni_session.sh BASE_SRC OUT
# STEPS (default "tests sweep thread1 experts decode") picks the steps; SWEEP the knobs of 2 and 3
# (default "SIMD=avx2,avx512"); FOOT=GiB overrides --footprint-gib 4,
# ROUNDS=n the sweeps' --rounds 3.
set -u
. "$(dirname "$0")/cpu_session_common.sh"
FOOT=${FOOT:-4}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-tests sweep thread1 experts decode}
SWEEP=${SWEEP:-SIMD=avx2,avx512}
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac }
BASE_SRC=$1
OUT=$2
BUDGET_S=${BUDGET_S:-230}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
session_machine "$OUT"

session_build "$BASE_SRC" vnni >>"$OUT/machine.txt" || exit 1
echo "built at $(elapsed) s" | tee -a "$OUT/machine.txt"

# 1. tests
if step tests; then
    PYRUNTIME_CORE_LIB=$NEW timeout 170 python -m pytest -q -x -rs --durations=5 \
        tests/test_cpu_core.py tests/test_cpu_decode.py >"$OUT/tests.txt" 2>&1
    echo "tests: exit $? at $(elapsed) s" | tee -a "$OUT/tests.txt"
fi

# 2. in-process sweeps, 16 threads
step sweep && for shape in olmoe-1b-7b qwen3-30b-a3b; do
    echo "== sweep $shape at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$NEW timeout 90 python bench/cpu_experts.py --shapes $shape --iters 20 \
        --footprint-gib "$FOOT" --batches 1 8 --sparsity 0 0.5 0.9 --rounds "$ROUNDS" \
        --sweep $SWEEP
done >"$OUT/sweep.txt" 2>&1

# 3. one thread
if step thread1; then
    echo "== sweep olmoe-1b-7b, 1 thread, at $(elapsed) s" >"$OUT/sweep-1thread.txt"
    PYRUNTIME_CORE_LIB=$NEW timeout 60 python bench/cpu_experts.py --shapes olmoe-1b-7b \
        --threads 1 --iters 8 --footprint-gib "$FOOT" --batches 1 --sparsity 0 0.9 \
        --rounds "$ROUNDS" --sweep $SWEEP >>"$OUT/sweep-1thread.txt" 2>&1
fi

# 4. old vs new, separate processes
step experts && for v in OLD NEW; do
    lib=$OLD
    [ $v = NEW ] && lib=$NEW
    echo "== $v ($lib) at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$lib timeout 90 python bench/cpu_experts.py --iters 20 \
        --footprint-gib "$FOOT" --sparsity 0 0.5 0.9
done >"$OUT/experts.txt" 2>&1
# 5. whole-model decode
if step decode && [ "$(elapsed)" -lt "$BUDGET_S" ]; then
    session_decode_granite "$OUT"
fi
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
