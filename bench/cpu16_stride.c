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
    int mode, ahead, lines, ith, nth;
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

/* The gate row's 34 lines in a fixed shuffled order (no run of 3 ascending or descending lines):
 * prefetched in this order, they may not train the L2 streamer, which otherwise runs past the
 * row's end into the up row that the gate phase does not need (modes 3 and 4). */
static const int SHUFFLE[ROW / 64] = {17, 3, 29, 8, 22, 0, 31, 12, 25, 5, 19, 33, 10, 27, 1, 15, 30,
                                      6, 23, 13, 32, 2, 20, 9, 26, 16, 4, 28, 11, 21, 7, 24, 14, 18};

static void prefetch_row(const uint8_t *f, int mode) {
    for (int l = 0; l < ROW / 64; l++) {
        const char *line = (const char *)f + 64 * (mode == 2 || mode == 5 ? l : SHUFFLE[l]);
        if (mode == 4 || mode == 5)
            _mm_prefetch(line, _MM_HINT_T2);
        else
            _mm_prefetch(line, _MM_HINT_T0);
    }
}

/* Whether neuron n is kept at `percent` (a fixed hash: the same neurons in every round). */
static int kept(size_t n, int percent) {
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return (int)(h % 100) < percent;
}

/* modes: 0 contiguous slice; 1 gate rows only, plain loads; 2 gate rows, software prefetch
 * (prefetcht0) of the gate row `ahead` neurons on, in line order; 3 the same in SHUFFLE order;
 * 4 SHUFFLE order with prefetcht2; 5 line order with prefetcht2; 6 only the row's first `lines` lines
 * `ahead` on (prefetcht0: the L2 streamer fetches the rest); 7 four neurons at once, from four
 * quarters of the thread's range, summed line by line in turn (4 streams in flight per core),
 * plain loads; 8 the sparse kernel's whole pattern at keep = `lines` percent: per chunk of 32
 * neurons the gate rows (software prefetch `ahead` neurons on, as mode 2), then the up and down
 * rows (2 x ROW, contiguous) of the chunk's kept neurons (a fixed hash picks them), the next kept
 * neuron's rows prefetched while one is summed. Its speedup over reading everything (contiguous)
 * is what a plain read allows the sparse kernel at that sparsity against a perfect dense one. */
static void *run(void *arg) {
    job *j = arg;
    const size_t n_neurons = j->bytes / NEURON;
    const size_t lo = n_neurons * j->ith / j->nth, hi = n_neurons * (j->ith + 1) / j->nth;
    __m256i a = _mm256_setzero_si256();
    pthread_barrier_wait(j->bar);
    if (j->mode == 0) {
        a = sum_bytes(j->p + lo * NEURON, (hi - lo) * NEURON, a);
    } else if (j->mode == 7) {
        const size_t q = (hi - lo) / 4;
        for (size_t n = lo; n < lo + q; n++)
            for (int l = 0; l < ROW; l += 64)
                for (int k = 0; k < 4; k++) {
                    const uint8_t *g = j->p + (n + k * q) * NEURON + l;
                    a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)g));
                    a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(g + 32)));
                }
    } else if (j->mode == 8) {
        for (size_t c0 = lo; c0 < hi; c0 += 32) {
            const size_t c1 = c0 + 32 < hi ? c0 + 32 : hi;
            for (size_t n = c0; n < c1; n++) {
                const uint8_t *g = j->p + n * NEURON;
                if (n + j->ahead < hi)
                    prefetch_row(g + (size_t)j->ahead * NEURON, 2);
                a = sum_bytes(g, ROW / 128 * 128, a);
                a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(g + ROW - 32)));
            }
            for (size_t n = c0; n < c1; n++) {
                if (!kept(n, j->lines))
                    continue;
                for (size_t m = n + 1; m < c1; m++)
                    if (kept(m, j->lines)) {
                        for (int l = 0; l < 2 * ROW; l += 64)
                            _mm_prefetch((const char *)j->p + m * NEURON + ROW + l, _MM_HINT_T0);
                        break;
                    }
                const uint8_t *ud = j->p + n * NEURON + ROW;
                a = sum_bytes(ud, 2 * ROW, a);
            }
        }
    } else if (j->mode == 6) {
        for (size_t n = lo; n < hi; n++) {
            const uint8_t *g = j->p + n * NEURON;
            if (n + j->ahead < hi)
                for (int l = 0; l < j->lines; l++)
                    _mm_prefetch((const char *)g + (size_t)j->ahead * NEURON + 64 * l,
                                 _MM_HINT_T0);
            a = sum_bytes(g, ROW / 128 * 128, a);
            a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(g + ROW - 32)));
        }
    } else {
        for (size_t n = lo; n < hi; n++) {
            const uint8_t *g = j->p + n * NEURON;
            if (j->mode >= 2 && n + j->ahead < hi)
                prefetch_row(g + (size_t)j->ahead * NEURON, j->mode);
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
    const struct { int mode, ahead, lines; const char *name; } cases[] = {
        {0, 0, 0, "contiguous"},          {1, 0, 0, "gate rows, plain"}, {2, 1, 0, "gate rows, sw pf 1"},
        {2, 2, 0, "gate rows, sw pf 2"}, {2, 4, 0, "gate rows, sw pf 4"}, {2, 8, 0, "gate rows, sw pf 8"},
        {3, 1, 0, "shuffled pf 1"},      {3, 2, 0, "shuffled pf 2"},    {3, 4, 0, "shuffled pf 4"},
        {4, 2, 0, "shuffled pf t2 2"},   {4, 4, 0, "shuffled pf t2 4"}, {5, 2, 0, "pf t2 2"},
        {5, 4, 0, "pf t2 4"},            {6, 1, 2, "first 2 lines pf 1"}, {6, 2, 2, "first 2 lines pf 2"},
        {6, 3, 2, "first 2 lines pf 3"}, {6, 4, 2, "first 2 lines pf 4"}, {6, 2, 1, "first line pf 2"},
        {6, 3, 1, "first line pf 3"}, {6, 2, 4, "first 4 lines pf 2"}, {6, 3, 4, "first 4 lines pf 3"},
        {7, 0, 0, "4 rows at once"},   {8, 2, 10, "sparse 0.9 pattern"},
        {8, 2, 50, "sparse 0.5 pattern"}, {8, 2, 30, "sparse 0.7 pattern"}};
    enum { REPS = 7, N_CASES = sizeof cases / sizeof cases[0] };
    double useful[N_CASES]; /* bytes each case reads: all, the gate rows, + kept up/down rows */
    for (int c = 0; c < N_CASES; c++) {
        useful[c] = cases[c].mode == 0 ? (double)bytes : (double)bytes / 3;
        for (size_t n = 0; cases[c].mode == 8 && n < bytes / NEURON; n++)
            useful[c] += kept(n, cases[c].lines) ? 2.0 * ROW : 0.0;
    }
    double secs[N_CASES][REPS];
    for (int r = 0; r < REPS; r++) /* cases interleaved per round */
        for (int c = 0; c < N_CASES; c++) {
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
            pthread_t th[256];
            job jobs[256];
            for (int t = 0; t < nth; t++) {
                jobs[t] = (job){p,  bytes, cases[c].mode, cases[c].ahead, cases[c].lines,
                                t, nth, 0,     &bar};
                pthread_create(&th[t], NULL, run, &jobs[t]);
            }
            pthread_barrier_wait(&bar);
            const double t0 = now();
            for (int t = 0; t < nth; t++)
                pthread_join(th[t], NULL);
            secs[c][r] = now() - t0;
            pthread_barrier_destroy(&bar);
        }
    printf("strided read test: %d threads, %.2f GiB buffer, %d rounds (median / best GB/s of the "
           "bytes read)\n", nth, gib, REPS);
    for (int c = 0; c < N_CASES; c++) {
        double rate[REPS], ratio[REPS]; /* GB/s of the useful bytes; time of case 0 / this case */
        for (int r = 0; r < REPS; r++) {
            rate[r] = useful[c] / secs[c][r] / 1e9;
            ratio[r] = secs[0][r] / secs[c][r]; /* case 0 reads everything in the same round */
        }
        qsort(rate, REPS, sizeof(double), cmp);
        qsort(ratio, REPS, sizeof(double), cmp);
        printf("  %-22s %6.1f / %6.1f GB/s", cases[c].name, rate[REPS / 2], rate[REPS - 1]);
        if (cases[c].mode == 8)
            printf("  speedup over reading everything (same round) %.2fx median, %.2f-%.2f",
                   ratio[REPS / 2], ratio[0], ratio[REPS - 1]);
        printf("\n");
    }
    free(p);
    return 0;
}
