#!/usr/bin/env bash
# Build llama.cpp's llama-bench from the source archive in ../shared/peers (the peer that
# bench/peers.py runs beside pyruntime), with CUDA where a GPU answers nvidia-smi, else for the CPU.
#
#   bash bench/peers_build.sh [DIR] [--cpu|--cuda] [--no-amx]
#
# --no-amx: a CPU build for AVX-512 without Intel AMX (build-cpu-noamx/). On an AMX host the native
# build puts Q8_0 weights in ggml's AMX buffer, and deepseek2 then stops with
# GGML_ASSERT(*cur_backend_id != -1): an op on such a weight that the AMX backend refuses.
#
# DIR (default /tmp/peers) receives llama.cpp/ and its build/; the last line printed is the path of
# llama-bench. The archive is $PYRUNTIME_SHARED/peers/llama.cpp-src.tar.xz, PYRUNTIME_SHARED being
# the workplace's shared/ folder (default: ../shared beside the repository). A build takes ~6 minutes with CUDA on 16 cores, ~12 minutes for
# the CPU on 2 cores; an existing build in DIR is reused (ninja rebuilds only what changed).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=/tmp/peers
mode=auto
amx=on
for arg in "$@"; do
    case $arg in
    --cpu) mode=cpu ;;
    --cuda) mode=cuda ;;
    --no-amx) amx=off ;;
    -h | --help)
        sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    -*)
        echo "error: unknown option $arg (--cpu, --cuda, --no-amx)" >&2
        exit 2
        ;;
    *) dir=$arg ;;
    esac
done
archive=${PYRUNTIME_SHARED:-$here/../shared}/peers/llama.cpp-src.tar.xz
if [ ! -f "$archive" ]; then
    echo "error: $archive not found (set PYRUNTIME_SHARED to the shared/ folder that holds peers/)" >&2
    exit 1
fi
if [ $amx = off ]; then
    [ $mode = cuda ] && { echo "error: --no-amx is a CPU build: drop --cuda" >&2; exit 2; }
    mode=cpu
fi
if [ $mode = auto ]; then
    if nvidia-smi -L >/dev/null 2>&1; then mode=cuda; else mode=cpu; fi
fi
mkdir -p "$dir"
[ -f "$dir/llama.cpp/CMakeLists.txt" ] || tar xJf "$archive" -C "$dir"
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_NUMBER=10472 -DLLAMA_BUILD_COMMIT=d32676d7)
if [ $mode = cuda ]; then
    # sm_90: the H100 / H200 of the device host; set CUDAARCHS for another card
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDAARCHS:-90}")
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ $amx = off ]; then
    mode=cpu-noamx
    flags=("${flags[@]/-DGGML_NATIVE=ON/-DGGML_NATIVE=OFF}")
    flags+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
build=$dir/llama.cpp/build-$mode
log=$dir/cmake-$mode.log
if ! { cmake -S "$dir/llama.cpp" -B "$build" "${generator[@]}" "${flags[@]}" >"$log" 2>&1 &&
    cmake --build "$build" --target llama-bench -j "$(nproc)" >>"$log" 2>&1; }; then
    tail -n 20 "$log" >&2
    echo "error: the llama.cpp build failed; log: $log" >&2
    exit 1
fi
echo "$build/bin/llama-bench"
