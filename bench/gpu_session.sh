#!/usr/bin/env bash
# One GPU session for the whole-model GPU path (docs/benchmarks.md, "Whole-model GPU decode"):
# the GPU tests, the decode kernels' microbenchmark (bench/gpu_kernels.py), a random-weight
# olmoe-1b-7b Q8_0 GGUF, `pyruntime bench` on it, and the per-part decode profile. Logs go to
# $OUT (or ./gpu-session-out). Run from the repo root:
#   bash bench/gpu_session.sh [tests|kernels|bench|all]
# OLD_KERNELS=DIR: time the kernel modules in DIR (an older commit's) beside the new ones.
# PARTS=a,b: only these parts of the microbenchmark (router, attention, gemv, small).
# TUNE=1: use the launch configs the microbenchmark picked ($OUT/tuned.json, kernels.tuning).
set -uo pipefail
OUT=${OUT:-gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=${PYTHONPATH:-}:.
what=${1:-all}
M=/tmp/olmoe.gguf
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"

if [[ ($what == bench || $what == all) && ! -f $M ]]; then  # in the background meanwhile
  ( /usr/bin/time -f "make_random_gguf: %e s wall" python bench/make_random_gguf.py olmoe-1b-7b \
      --outtype q8_0 -o $M.part --tokenizer-dir tests/data/tiny-tokenizer >"$OUT/make_gguf.log" \
      2>&1 && mv $M.part $M ) &
fi

if [[ $what == tests || $what == all ]]; then
  python -m pytest -q -x tests/test_kernels_attention.py tests/test_kernels_decoder_ops.py \
    tests/test_kernels_router.py tests/test_kernels_q8_linear.py 2>&1 | tail -n 5 \
    | tee "$OUT/tests_kernels.log"
fi

if [[ $what == kernels || $what == all ]]; then
  python bench/gpu_kernels.py ${OLD_KERNELS:+--old $OLD_KERNELS} ${PARTS:+--parts $PARTS} \
    --write "$OUT/tuned.json" \
    2>&1 | tee "$OUT/kernels.log" | grep -v "^| " | tail -n 12
fi
[[ ${TUNE:-0} == 1 && -f $OUT/tuned.json ]] && export PYRUNTIME_DECODE_TUNING=$OUT/tuned.json

if [[ $what == bench || $what == all ]]; then
  wait
  cat "$OUT/make_gguf.log" 2>/dev/null | tail -n 2
  python -m pyruntime bench $M -p 512 -n 128 -r 3 --device cuda 2>&1 | tee "$OUT/bench.md"
  # the same decode with the separate launches (no fused norm/router), for comparison
  PYRUNTIME_FUSED_DECODE=0 python -m pyruntime bench $M -p 0 -n 128 -r 3 --device cuda 2>&1 \
    | tail -n 1 | tee "$OUT/bench_unfused.md"
  python bench/gpu_decode.py $M --prompt 512 -o "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" \
    | tail -n 45
fi

if [[ $what == tests || $what == all ]]; then
  python -m pytest -q tests/test_gpu_model.py 2>&1 | tail -n 5 | tee "$OUT/tests_model.log"
fi
