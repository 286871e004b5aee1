/* Strided DRAM read test: what 16 threads can read of only the gate rows of Q8_0 experts in the
 * neuron-contiguous layout (one 2176-byte row of every 6528 bytes: gate, then up and down) against
 * a contiguous read of the same buffer, with plain loads (hardware prefetch only) and with
 * software prefetch of the gate row `ahead` neurons on. The ceiling of the sparse kernel's gate
 * phase, independent of the kernel. Not part of the library.
 *
 *   gcc -O2 -mavx2 -pthread bench/cpu16_stride.c -o /tmp/stride && /tmp/stride 16 2
 * (threads, GiB). Prints GB/s of the bytes read (the useful bytes), median and best of 7. */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ROW = 2176, NEURON = 3 * ROW };

typedef struct {
    const uint8_t *p;
    size_t bytes;
    int mode, ahead, ith, nth;
    uint64_t sum;
    pthread_barrier_t *bar;
} job;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static __m256i sum_bytes(const uint8_t *p, size_t n, __m256i a) {
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    return a;
}

/* modes: 0 contiguous slice; 1 gate rows only, plain loads; 2 gate rows, software prefetch
 * (prefetcht0) of the gate row `ahead` neurons on, one line per 64 bytes summed (spread) */
static void *run(void *arg) {
    job *j = arg;
    const size_t n_neurons = j->bytes / NEURON;
    const size_t lo = n_neurons * j->ith / j->nth, hi = n_neurons * (j->ith + 1) / j->nth;
    __m256i a = _mm256_setzero_si256();
    pthread_barrier_wait(j->bar);
    if (j->mode == 0) {
        a = sum_bytes(j->p + lo * NEURON, (hi - lo) * NEURON, a);
    } else {
        for (size_t n = lo; n < hi; n++) {
            const uint8_t *g = j->p + n * NEURON;
            if (j->mode == 2 && n + j->ahead < hi) {
                const uint8_t *f = g + (size_t)j->ahead * NEURON;
                for (int l = 0; l < ROW; l += 64)
                    _mm_prefetch((const char *)f + l, _MM_HINT_T0);
            }
            a = sum_bytes(g, ROW / 128 * 128, a);
            a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(g + ROW - 32)));
        }
    }
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, a);
    j->sum = l[0] + l[1] + l[2] + l[3];
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 16;
    const double gib = argc > 2 ? atof(argv[2]) : 2.0;
    const size_t bytes = (size_t)(gib * (1 << 30)) / NEURON * NEURON;
    uint8_t *p = aligned_alloc(4096, bytes);
    memset(p, 1, bytes);
    const struct { int mode, ahead; const char *name; } cases[] = {
        {0, 0, "contiguous"},          {1, 0, "gate rows, plain"}, {2, 1, "gate rows, sw pf 1"},
        {2, 2, "gate rows, sw pf 2"}, {2, 4, "gate rows, sw pf 4"}, {2, 8, "gate rows, sw pf 8"}};
    enum { REPS = 7, N_CASES = sizeof cases / sizeof cases[0] };
    double rate[N_CASES][REPS];
    for (int r = 0; r < REPS; r++) /* cases interleaved per round */
        for (int c = 0; c < N_CASES; c++) {
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
            pthread_t th[256];
            job jobs[256];
            for (int t = 0; t < nth; t++) {
                jobs[t] = (job){p, bytes, cases[c].mode, cases[c].ahead, t, nth, 0, &bar};
                pthread_create(&th[t], NULL, run, &jobs[t]);
            }
            pthread_barrier_wait(&bar);
            const double t0 = now();
            for (int t = 0; t < nth; t++)
                pthread_join(th[t], NULL);
            const double dt = now() - t0;
            pthread_barrier_destroy(&bar);
            const double useful = cases[c].mode == 0 ? (double)bytes : (double)bytes / 3;
            rate[c][r] = useful / dt / 1e9;
        }
    printf("strided read test: %d threads, %.2f GiB buffer, %d rounds (median / best GB/s of the "
           "bytes read)\n", nth, gib, REPS);
    for (int c = 0; c < N_CASES; c++) {
        qsort(rate[c], REPS, sizeof(double), cmp);
        printf("  %-22s %6.1f / %6.1f GB/s\n", cases[c].name, rate[c][REPS / 2], rate[c][REPS - 1]);
    }
    free(p);
    return 0;
}
