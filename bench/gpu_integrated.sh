#!/usr/bin/env bash
# The lead's integrated GPU check (docs/benchmarks.md, "Whole-model GPU decode", current
# numbers): the GPU model/dispatch tests and the q8r sparse kernel tests on CUDA, a random
# olmoe-1b-7b Q8_0 GGUF, `pyruntime bench` dense, calibration, `pyruntime bench --sparsity 0.85`,
# and the per-part decode profile. Run from the repo root on a CUDA machine:
#   OUT=dir bash bench/gpu_integrated.sh CALIBRATION_TEXT
set -uo pipefail
OUT=${OUT:-gpu-integrated-out}
CALIB=${1:?usage: bench/gpu_integrated.sh CALIBRATION_TEXT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=/tmp/olmoe.gguf
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && cmake --build /tmp/b >/dev/null && export PYRUNTIME_CORE_LIB=/tmp/b/libpyrt.so
if [[ ! -f $M ]]; then  # written in the background while the tests run
  ( python bench/make_random_gguf.py olmoe-1b-7b --outtype q8_0 -o $M.part \
      --tokenizer-dir tests/data/tiny-tokenizer >"$OUT/gguf.log" 2>&1 && mv $M.part $M ) &
fi
timeout 120 python -m pytest -q tests/test_gpu_model.py tests/test_kernels_dispatch.py 2>&1 \
  | tail -n 4 | tee "$OUT/tests.log"
timeout 60 python -m pytest -q tests/test_kernels_sparse.py -k q8r 2>&1 | tail -n 2 \
  | tee -a "$OUT/tests.log"
wait
python -m pyruntime bench $M -p 512 -n 128 -r 3 --device cuda 2>&1 | tee "$OUT/bench_dense.md"
timeout 120 python -m pyruntime calibrate $M -f "$CALIB" --ctx 256 --max-tokens 256 -t 16 2>&1 \
  | tail -n 3 | tee "$OUT/calib.log"
python -m pyruntime bench $M -p 0 -n 128 -r 3 --device cuda --sparsity 0.85 2>&1 \
  | tee "$OUT/bench_sparse.md"
timeout 100 python bench/gpu_decode.py $M --prompt 512 -o "$OUT/decode.json" 2>&1 | tail -n 40 \
  | tee "$OUT/decode.log"
date -u | tee -a "$OUT/gpu.txt"
