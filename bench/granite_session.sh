#!/usr/bin/env bash
# Device session for the granite branch (issue 3, whole-model CPU decode): builds the C core of
# this tree (NEW) and of a base (OLD), makes a random granite-1b-a400m Q8_0 GGUF, then runs
# bench/cpu_decode.py --threads $THREADS --tokens 64, each run its own process, round-robin over
#   OLD | NEW | NEW PYRT_FUSE_LAYER=0 | NEW PYRT_FUSE_ROUTER=0
# (the last two: the granite2 branch's fusions off, one or both, see docs/benchmarks.md, "granite2";
# the granite branch's knobs, PYRT_FUSE_ATTN=0, PYRT_PLAN_LINES=8, PYRT_VNNI=0,
# PYRT_MV_PREFETCH=4, through GRANITE_VARIANTS), 3 rounds, starting a run only while less
# than BUDGET_S (default 180) seconds have passed; then the C unit tests (the AVX512_VNNI
# bit-equality test runs only where the CPU has it) and a summary (median ms/token and % of
# floor per variant) in $OUT/summary.txt. At most ~4 minutes on 16 cores.
#
#   bash bench/granite_session.sh OUT BASE_SRC [BUDGET_S]
#
# BASE_SRC: a folder with the base's runtime/ and CMakeLists.txt, e.g.
#   mkdir -p .wt/base && git archive REV runtime CMakeLists.txt | tar -x -C .wt/base
# Local try: THREADS=2 bash bench/granite_session.sh /tmp/granite-out .wt/base
# DECODE_ARGS adds arguments of bench/cpu_decode.py, e.g. DECODE_ARGS="--dram-gib 8".
# Other variants: GRANITE_VARIANTS=$'OLD|OLD|\nNEW|NEW|\nNEW_PLAN8|NEW|PYRT_PLAN_LINES=8' ROUNDS=4 bash ...
set -u
OUT=$(realpath -m "${1:?usage: bash bench/granite_session.sh OUT BASE_SRC [BUDGET_S]}")
BASE_SRC=$(realpath -m "${2:?usage: bash bench/granite_session.sh OUT BASE_SRC [BUDGET_S]}")
cd "$(dirname "$0")/.."
BUDGET_S=${3:-180}
THREADS=${THREADS:-16}
ROUNDS=${ROUNDS:-3}
DECODE_ARGS=${DECODE_ARGS:-} # more bench/cpu_decode.py arguments, e.g. --dram-gib 8
export PYTHONPATH=${PYTHONPATH:-.}
. bench/cpu_session_common.sh
session_begin "$OUT" "$BASE_SRC" granite || {
    echo "build failed" | tee -a "$OUT/machine.txt"
    exit 1
}

G=/tmp/granite-q8_0.gguf
python bench/make_random_gguf.py granite-1b-a400m --outtype q8_0 -o $G \
    --tokenizer-dir tests/data/tiny-tokenizer >/dev/null || exit 1
echo "gguf at $(elapsed) s" | tee -a "$OUT/machine.txt"

# name|library (OLD or NEW)|environment; GRANITE_VARIANTS replaces the list
VARIANTS=${GRANITE_VARIANTS:-"OLD|OLD|
NEW|NEW|
NEW_FL0|NEW|PYRT_FUSE_LAYER=0
NEW_FR0|NEW|PYRT_FUSE_ROUTER=0"}
for round in $(seq "$ROUNDS"); do
    while IFS='|' read -r name which envs; do
        if [ "$which" = OLD ]; then lib=$OLD; else lib=$NEW; fi
        [ "$(elapsed)" -lt "$BUDGET_S" ] || break 2
        echo "== $name round $round ($lib) $envs at $(elapsed) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
        env $envs PYRUNTIME_CORE_LIB="$lib" timeout 40 python bench/cpu_decode.py \
            granite-1b-a400m --gguf $G --threads "$THREADS" --tokens 64 $DECODE_ARGS
    done <<<"$VARIANTS"
done >"$OUT/decode-granite.txt" 2>&1
rm -f $G
echo "decode done at $(elapsed) s" | tee -a "$OUT/machine.txt"

if [ "$(elapsed)" -lt $((BUDGET_S + 20)) ]; then
    PYRUNTIME_CORE_LIB=$NEW timeout 60 python -m pytest -q tests/test_cpu_core.py \
        -k c_unit_tests 2>&1 | tail -5 >"$OUT/tests.txt"
fi
python bench/granite_summary.py "$OUT/decode-granite.txt" | tee "$OUT/summary.txt"
echo "session done at $(elapsed) s" | tee -a "$OUT/machine.txt"
