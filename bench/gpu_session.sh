#!/usr/bin/env bash
# One GPU session for the whole-model GPU path (docs/benchmarks.md, "Whole-model GPU decode"):
# the GPU tests, a random-weight olmoe-1b-7b Q8_0 GGUF, `pyruntime bench` on it, and the
# per-part decode profile. Logs go to $OUT (or ./gpu-session-out). Run from the repo root:
#   bash bench/gpu_session.sh [tests|bench|all]
set -uo pipefail
OUT=${OUT:-gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=${PYTHONPATH:-}:.
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"

if [[ $what == tests || $what == all ]]; then
  python -m pytest -q -x tests/test_kernels_attention.py tests/test_kernels_decoder_ops.py \
    tests/test_kernels_router.py tests/test_kernels_q8_linear.py tests/test_gpu_model.py \
    tests/test_bench_cmd.py 2>&1 | tail -n 30 | tee "$OUT/tests.log"
fi

if [[ $what == bench || $what == all ]]; then
  M=/tmp/olmoe.gguf
  if [[ ! -f $M ]]; then
    /usr/bin/time -f "make_random_gguf: %e s wall, %M KB max RSS" \
      python bench/make_random_gguf.py olmoe-1b-7b --outtype q8_0 -o $M \
      --tokenizer-dir tests/data/tiny-tokenizer 2>&1 | tail -n 3 | tee "$OUT/make_gguf.log"
    ls -l $M | tee -a "$OUT/make_gguf.log"
  fi
  python -m pyruntime bench $M -p 512 -n 128 -r 5 --device cuda 2>&1 | tee "$OUT/bench.md"
  python -m pyruntime bench $M -p 512 -n 128 -r 5 --device cuda -o json \
    >"$OUT/bench.json" 2>/dev/null
  PYRUNTIME_DENSE_Q8=0 python -m pyruntime bench $M -p 0 -n 128 -r 3 --device cuda 2>&1 \
    | tail -n 3 | tee "$OUT/bench_bf16_dense.md"
  PYRUNTIME_CUDA_GRAPH=0 python -m pyruntime bench $M -p 0 -n 128 -r 3 --device cuda 2>&1 \
    | tail -n 3 | tee "$OUT/bench_eager.md"
  python bench/gpu_decode.py $M --prompt 512 -o "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
fi
