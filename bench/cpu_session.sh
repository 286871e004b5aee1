#!/usr/bin/env bash
# One device session of the C core's CPU benchmarks: builds the library of this tree (NEW) and of
# a base tree (OLD, e.g. main's runtime/ and CMakeLists.txt copied to a folder), then, each in its
# own process, in this order (most important first; later steps are skipped past BUDGET_S):
#   1. knob sweep of the new expert kernel (bench/cpu_experts.py --sweep $SWEEP, default
#      PYRT_PREFETCH_AHEAD=2,1; the first value of each knob should be its default), interleaved
#      rounds; the best dense batch-1 setting (if >= 5% faster than the defaults) is exported for
#      the steps after it and reported;
#   2. bench/cpu_experts.py --iters 20 --footprint-gib 4, OLD then NEW;
#   3. granite-1b-a400m Q8_0 random GGUF, bench/cpu_decode.py --threads 16 --tokens 64: OLD, NEW,
#      NEW with PYRT_IDLE_PREFETCH=0;
#   4. tests/test_cpu_core.py and tests/test_cpu_decode.py against NEW (AVX-512 paths run here),
#      whatever the budget;
#   5. the same as 3 for olmoe-1b-7b.
# Logs go to $OUT (one file per step).
#
#   bash bench/cpu_session.sh BASE_SRC OUT [BUDGET_S]
# (FOOT=GiB and TOKENS=n override --footprint-gib 4 and --tokens 64, for a quick local try.)
set -u
. "$(dirname "$0")/cpu_session_common.sh"
SWEEP=${SWEEP:-PYRT_PREFETCH_AHEAD=2,1}
FOOT=${FOOT:-4}
TOKENS=${TOKENS:-64}
BASE_SRC=$1
OUT=$2
BUDGET_S=${3:-170}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { [ "$(elapsed)" -lt "$BUDGET_S" ]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
session_machine "$OUT"

session_build "$BASE_SRC" cpu || exit 1
echo "built at $(elapsed) s"

# 1. sweep
PYRUNTIME_CORE_LIB=$NEW python bench/cpu_experts.py --shapes olmoe-1b-7b --iters 20 \
    --footprint-gib "$FOOT" --batches 1 --sparsity 0 0.5 0.9 --rounds 3 \
    --sweep $SWEEP 2>&1 | tee "$OUT/sweep.txt"
# the best batch-1 dense setting, if >= 5% faster than the defaults (first row); else the defaults
BEST=$(python bench/cpu_session_pick.py "$OUT/sweep.txt")
export $BEST
echo "chosen from the sweep: $BEST (at $(elapsed) s)" | tee -a "$OUT/sweep.txt"

# 2. expert kernel, old vs new
for v in OLD NEW; do
    lib=$OLD
    [ $v = NEW ] && lib=$NEW
    echo "== $v ($lib) at $(elapsed) s"
    PYRUNTIME_CORE_LIB=$lib python bench/cpu_experts.py --iters 20 --footprint-gib "$FOOT"
done 2>&1 | tee "$OUT/experts.txt"

decode_model() { # shape
    local shape=$1 g=/tmp/$1-q8_0.gguf
    python bench/make_random_gguf.py "$shape" --outtype q8_0 -o "$g" \
        --tokenizer-dir tests/data/tiny-tokenizer >/dev/null || return
    for v in OLD NEW NEW_IDLE_OFF; do
        lib=$NEW idle=1
        [ $v = OLD ] && lib=$OLD
        [ $v = NEW_IDLE_OFF ] && idle=0
        left || break
        echo "== $v ($lib) $BEST at $(elapsed) s"
        PYRT_IDLE_PREFETCH=$idle PYRUNTIME_CORE_LIB=$lib python bench/cpu_decode.py "$shape" \
            --gguf "$g" --threads 16 --tokens "$TOKENS"
    done
    rm -f "$g"
}

if left; then decode_model granite-1b-a400m 2>&1 | tee "$OUT/decode-granite.txt"; fi
# 3. tests, whatever the budget (the AVX-512 paths only run here)
PYRUNTIME_CORE_LIB=$NEW timeout 120 python -m pytest -q -x tests/test_cpu_core.py \
    tests/test_cpu_decode.py 2>&1 | tail -15 >"$OUT/tests.txt"
echo "tests done at $(elapsed) s" >>"$OUT/tests.txt"

if left; then decode_model olmoe-1b-7b 2>&1 | tee "$OUT/decode-olmoe.txt"; fi
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
