/* What the CPU offers: physical core count and the SIMD level, chosen at run time.
 *
 * The library is compiled for baseline x86-64 (never -march=native); the AVX2 and AVX-512 row
 * kernels carry per-function target attributes and are only called after cpuid says the CPU (and
 * the OS, via XGETBV, which __builtin_cpu_supports checks) supports them. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "error.h"
#include "rows.h"

/* ---- physical cores ------------------------------------------------------------------------ */

static int read_int_file(const char *path, int *value) {
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    int ok = fscanf(f, "%d", value) == 1;
    fclose(f);
    return ok;
}

int pyrt_physical_cores(void) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int logical = online > 0 ? (int)online : 1;
#ifdef __linux__
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) != 0)
        return logical;
    /* Count distinct (package, core) pairs among the CPUs we may run on. */
    enum { MAX_CORES = 1024 };
    int seen_pkg[MAX_CORES], seen_core[MAX_CORES];
    int n_seen = 0, n_allowed = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &mask))
            continue;
        n_allowed++;
        char path[128];
        int pkg = 0, core = cpu;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id",
                 cpu);
        read_int_file(path, &pkg);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
        if (!read_int_file(path, &core))
            core = cpu; /* no topology: count the logical CPU as a core */
        int dup = 0;
        for (int i = 0; i < n_seen && !dup; i++)
            dup = seen_pkg[i] == pkg && seen_core[i] == core;
        if (!dup && n_seen < MAX_CORES) {
            seen_pkg[n_seen] = pkg;
            seen_core[n_seen] = core;
            n_seen++;
        }
    }
    if (n_seen > 0)
        return n_seen;
    return n_allowed > 0 ? n_allowed : logical;
#else
    return logical;
#endif
}

int pyrt_logical_cpus(void) {
#ifdef __linux__
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) == 0 && CPU_COUNT(&mask) > 0)
        return CPU_COUNT(&mask);
#endif
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

/* ---- SIMD dispatch ------------------------------------------------------------------------- */

int pyrt_simd_best(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (avx512)
        return PYRT_SIMD_AVX512;
    if (avx2)
        return PYRT_SIMD_AVX2;
#endif
    return PYRT_SIMD_SCALAR;
}

/* -1 until first use, then the level in use. */
static atomic_int simd_level = -1;

int pyrt_simd_active(void) {
    int level = atomic_load(&simd_level);
    if (level < 0) {
        level = pyrt_simd_best();
        atomic_store(&simd_level, level);
    }
    return level;
}

int pyrt_simd_force(int level) {
    pyrt_clear_error();
    int best = pyrt_simd_best();
    if (level < PYRT_SIMD_SCALAR || level > PYRT_SIMD_AVX512)
        return pyrt_fail(PYRT_E_INVALID, "pyrt_simd_force: unknown SIMD level %d (0 scalar, "
                                         "1 avx2, 2 avx512)", level);
    if (level > best)
        return pyrt_fail(PYRT_E_UNSUPPORTED,
                         "pyrt_simd_force: this CPU supports SIMD level %d at most, asked for %d",
                         best, level);
    atomic_store(&simd_level, level);
    return PYRT_OK;
}

/* -1 until first use. */
static atomic_int has_vnni = -1;

int pyrt_cpu_has_vnni(void) {
    int v = atomic_load(&has_vnni);
    if (v < 0) {
        v = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512vnni") != 0;
#endif
        atomic_store(&has_vnni, v);
    }
    return v;
}

const pyrt_row_ops *pyrt_row_ops_at(int level, int fmt, int vnni) {
    switch (level) {
    case PYRT_SIMD_AVX512:
        return vnni && pyrt_cpu_has_vnni() ? pyrt_row_ops_avx512_vnni(fmt)
                                           : pyrt_row_ops_avx512(fmt);
    case PYRT_SIMD_AVX2:
        return pyrt_row_ops_avx2(fmt);
    case PYRT_SIMD_SCALAR:
        return pyrt_row_ops_scalar(fmt);
    default:
        return NULL;
    }
}

pyrt_add_fn pyrt_add_f32_active(void) {
    switch (pyrt_simd_active()) {
    case PYRT_SIMD_AVX512:
        return pyrt_add_f32_avx512;
    case PYRT_SIMD_AVX2:
        return pyrt_add_f32_avx2;
    default:
        return pyrt_add_f32_scalar;
    }
}

void pyrt_quantize_x_q8(const float *x, pyrt_xq8 *out, int n) {
    switch (pyrt_simd_active()) {
    case PYRT_SIMD_AVX512:
        pyrt_quantize_x_q8_avx512(x, out, n);
        return;
    case PYRT_SIMD_AVX2:
        pyrt_quantize_x_q8_avx2(x, out, n);
        return;
    default:
        pyrt_quantize_x_q8_scalar(x, out, n);
    }
}

void pyrt_quantize_x_q8k(const float *x, pyrt_xq8 *out, int n) {
    switch (pyrt_simd_active()) {
    case PYRT_SIMD_AVX512:
        pyrt_quantize_x_q8k_avx512(x, out, n);
        return;
    case PYRT_SIMD_AVX2:
        pyrt_quantize_x_q8k_avx2(x, out, n);
        return;
    default:
        pyrt_quantize_x_q8k_scalar(x, out, n);
    }
}

void pyrt_quantize_x_for(int kind, const float *x, pyrt_xq8 *out, int n) {
    if (kind == PYRT_XQ_SHARED)
        pyrt_quantize_x_q8k(x, out, n);
    else if (kind == PYRT_XQ_BLOCKS)
        pyrt_quantize_x_q8(x, out, n);
}
