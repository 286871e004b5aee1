# Shared by the device CPU session scripts (bench/cpu_session.sh, cpu_vnni_session.sh, cpu16_session*.sh,
# cpu90_session*.sh, granite_session.sh):
# source it, then call
#   session_machine OUT              the machine's CPU, cache sizes, AVX-512/VNNI flags, load
#                                    -> OUT/machine.txt
#   session_build BASE_SRC PREFIX    builds the C core of BASE_SRC (OLD) and of this tree (NEW)
#                                    afresh in /tmp/PREFIX-old and /tmp/PREFIX-new, both Release;
#                                    sets OLD and NEW to their libpyrt.so (returns 1 if a build
#                                    failed: never times a stale library)
#   session_decode_granite OUT [S]   a random granite-1b-a400m Q8_0 GGUF, then whole-model decode
#                                    with OLD, NEW, OLD, NEW (own processes), each started only
#                                    while elapsed < S seconds (default: always) -> OUT/decode-granite.txt
session_machine() {
    {
        date -u
        nproc
        lscpu | grep -E "Model name|L2|L3"
        grep -o -w -E "avx512f|avx512bw|avx512_vnni|avx_vnni" /proc/cpuinfo | sort | uniq -c
        uptime
    } >"$1/machine.txt" 2>&1
}

session_build() {
    rm -rf "/tmp/$2-old" "/tmp/$2-new"
    (cmake -S "$1" -B "/tmp/$2-old" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        cmake --build "/tmp/$2-old" >/dev/null) &
    local old_pid=$!
    cmake -S . -B "/tmp/$2-new" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        cmake --build "/tmp/$2-new" >/dev/null
    local new_rc=$?
    wait $old_pid || return 1
    [ $new_rc -eq 0 ] || return 1
    OLD=/tmp/$2-old/libpyrt.so
    NEW=/tmp/$2-new/libpyrt.so
    ls -la "$OLD" "$NEW"
}

session_decode_granite() {
    local g=/tmp/granite-q8_0.gguf limit=${2:-999999}
    python bench/make_random_gguf.py granite-1b-a400m --outtype q8_0 -o $g \
        --tokenizer-dir tests/data/tiny-tokenizer >/dev/null &&
        for v in OLD NEW OLD NEW; do
            [ "$(elapsed)" -lt "$limit" ] || break
            local lib=$OLD
            [ $v = NEW ] && lib=$NEW
            echo "== $v ($lib) at $(elapsed) s"
            PYRUNTIME_CORE_LIB=$lib timeout 40 python bench/cpu_decode.py granite-1b-a400m \
                --gguf $g --threads 16 --tokens 64
        done >"$1/decode-granite.txt" 2>&1
}

# session_begin OUT BASE_SRC PREFIX: the start every session script shares: OUT made, the timer
# started (elapsed prints seconds since), the machine report, OLD and NEW built (returns 1 if a
# build failed)
session_begin() {
    mkdir -p "$1"
    T0=$(date +%s)
    export PYTHONUNBUFFERED=1
    session_machine "$1"
    session_build "$2" "$3" >>"$1/machine.txt" || return 1
    echo "built at $(elapsed) s" | tee -a "$1/machine.txt"
}

elapsed() { echo $(($(date +%s) - T0)); }
