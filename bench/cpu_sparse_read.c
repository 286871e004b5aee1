/* How fast can a plain read (no arithmetic) go over exactly the bytes the CPU sparse expert kernel
 * reads, in its order, against reading everything? The ceiling of the sparse kernel's speedup at
 * a given sparsity, whatever the kernel does.
 *
 * Q8_0 experts of n_embd 2048 in the neuron-contiguous layout (docs/gguf-layout.md): per neuron a
 * gate, an up and a down row of 2176 bytes (or of the row bytes given). Cases, each on every
 * thread over its share of the neurons, interleaved over 7 rounds:
 *   contiguous            the whole buffer (what the dense kernel reads);
 *   gate rows, plain      only the gate rows (hardware prefetch alone);
 *   gate rows, sw pf 2    the gate rows with the row 2 neurons on prefetched (the kernel's scheme);
 *   sparse P pattern      the sparse kernel's order at sparsity P: per chunk of 32 neurons the gate
 *                         rows (prefetched as above), then the up and down rows of the kept
 *                         neurons (a fixed hash keeps 1 - P of them), the next kept neuron's rows
 *                         prefetched while one is summed; with its speedup over "contiguous" in
 *                         the same round (median, min-max);
 *   gates apart P         the same at sparsity P in a layout with an expert's gate rows apart
 *                         from its neurons' up/down rows (the buffer read as all gate rows, then
 *                         every neuron's up and down rows): per chunk its gate rows in one
 *                         contiguous run, then the kept neurons' up/down rows as above;
 *   apart P pipelined     the same bytes in the kernel's order (moe_sparse.c): a chunk's gate
 *                         rows, with the previous chunk's kept up/down rows prefetched line by
 *                         line, spread over that read, then those up/down rows;
 *   apart P 4 ahead       the same bytes, the kept up/down rows 4 kept neurons ahead prefetched,
 *                         spread over the read of the current one;
 *   apart, all up/down    per chunk its gate rows, then all its neurons' up/down rows (the kept
 *                         ones and the rest: what reading past the gaps would cost);
 *   calls, all rows       per call (as a decode step's layer) 8 random experts of 64 in one layer
 *                         (experts of 1024 neurons: OLMoE-1B-7B's), their neurons split over
 *                         the threads, a spin barrier after each call: the whole rows;
 *   calls, sparse 0.5     the same calls in the "sparse 0.5 pattern" order; its speedup is over
 *                         "calls, all rows" of the same round: the ceiling of the kernel's
 *                         speedup as a decode step calls it (each thread's share of a call is
 *                         ~3 MB at 16 threads, so ramp-up and the barrier count as they do there);
 *   apart 0.9 pipelined, apart 0.9 4 ahead
 *                         the two schemes above at sparsity 0.9, where the gate rows are most of
 *                         the bytes (1 thread, granite's rows: pipelined 1.79x the contiguous
 *                         read, 4 ahead 1.63x, the plain "gates apart 0.9" 1.63x; the bytes
 *                         alone would allow 2.5x).
 * The variants ask whether another prefetch scheme lifts the ceiling (1-2 threads of a 2-core
 * Xeon: no, the three within a few % of each other; reading the up/down rows whole ~0.9x).
 * GB/s count the bytes each case reads for its answer (all for contiguous and all up/down; the
 * gate rows; the gate rows + the kept up/down rows).
 * x86-64 with AVX2; not part of the library.
 *
 *   cc -O2 -mavx2 -pthread bench/cpu_sparse_read.c -o /tmp/sparse_read && /tmp/sparse_read 16 8
 *   /tmp/sparse_read 1 2 1088 1   (1 thread, granite-1b-a400m's rows, prefetches into L2)
 * (threads, GiB of experts: several times the last-level cache, so the bytes come from DRAM) */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { CHUNK = 32, MAX_THREADS = 256, CALL_NFF = 1024, CALL_EXPERTS = 64, CALL_TOPK = 8 };
/* Bytes of a row (2176: Q8_0 of 2048; 1088: of 1024, granite-1b-a400m) and of a neuron's three;
 * where the software prefetches go (_MM_HINT_T0: L1; _MM_HINT_T1: L2, as the kernel does by
 * default). Set once in main. */
static size_t ROW = 2176, NEURON = 3 * 2176;
static int pf_l2 = 0;
enum mode { CONTIGUOUS, GATE_PLAIN, GATE_PREFETCH, CALLS_ALL, SPARSE, CALLS_SPARSE, GATES_APART,
            APART_PIPELINED, APART_AHEAD, APART_ALL };


typedef struct {
    const uint8_t *p;
    size_t bytes;
    enum mode mode;
    int ahead, keep_percent, ith, nth;
    const uint8_t **lines; /* this thread's: room for a chunk's up/down lines (the prefetches of
                              a gates-apart variant over one read) */
    uint64_t sum;
    pthread_barrier_t *bar;
    const int *routes; /* the calls' cases: n_calls x CALL_TOPK experts (of the whole buffer) */
    int n_calls;
} job;

/* The threads' barrier between calls: a count and a generation, spun on (as the C core's pool). */
static atomic_int call_arrived, call_gen;

static void call_barrier(int nth) {
    const int g = atomic_load(&call_gen);
    if (atomic_fetch_add(&call_arrived, 1) == nth - 1) {
        atomic_store(&call_arrived, 0);
        atomic_fetch_add(&call_gen, 1);
    } else {
        while (atomic_load(&call_gen) == g)
            _mm_pause();
    }
}

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

/* One gate row: its 2176 bytes (17 blocks of 128, then the last 32). */
static __m256i sum_row(const uint8_t *g, __m256i a) {
    a = sum_bytes(g, ROW / 128 * 128, a);
    return _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(g + ROW - 32)));
}

static void prefetch_line(const void *p) {
    if (pf_l2)
        _mm_prefetch((const char *)p, _MM_HINT_T1);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

static void prefetch(const uint8_t *p, size_t n) {
    for (size_t l = 0; l < n; l += 64)
        prefetch_line(p + l);
}

/* sum_bytes over n bytes (a multiple of 128) that prefetches lines[0 .. n_lines) on the way, in
 * even steps (the kernel's spread: one burst would stall on full line-fill buffers). */
static __m256i sum_bytes_pf(const uint8_t *p, size_t n, __m256i a, const uint8_t *const *lines,
                            size_t n_lines) {
    const size_t steps = n / 128;
    size_t done = 0;
    for (size_t i = 0; i < steps; i++) {
        for (const size_t due = n_lines * (i + 1) / steps; done < due; done++)
            prefetch_line(lines[done]);
        a = sum_bytes(p + i * 128, 128, a);
    }
    for (; done < n_lines; done++)
        prefetch_line(lines[done]);
    return a;
}

/* Appends the lines of [p, p + n) to lines[*n_lines]. */
static void add_lines(const uint8_t **lines, size_t *n_lines, const uint8_t *p, size_t n) {
    for (size_t l = 0; l < n; l += 64)
        lines[(*n_lines)++] = p + l;
}

/* Whether neuron n is kept at `percent` (a fixed hash: the same neurons in every round). */
static int kept(size_t n, int percent) {
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return (int)(h % 100) < percent;
}

/* Neuron i of a call's concatenated experts: its index in the buffer. */
static size_t call_neuron(const int *route, size_t i) {
    return (size_t)route[i / CALL_NFF] * CALL_NFF + i % CALL_NFF;
}

/* The calls: per call this thread's share of its 8 experts' neurons, all rows or the sparse
 * pattern (chunks of CHUNK inside one expert: gate rows `ahead` on prefetched, then the kept
 * neurons' up/down rows, the next kept one's prefetched), then the barrier. */
static __m256i run_calls(const job *j, __m256i a) {
    const size_t total = (size_t)CALL_TOPK * CALL_NFF;
    const size_t lo = total * j->ith / j->nth, hi = total * (j->ith + 1) / j->nth;
    for (int c = 0; c < j->n_calls; c++) {
        const int *route = j->routes + (size_t)c * CALL_TOPK;
        for (size_t c0 = lo; c0 < hi && j->mode == CALLS_ALL;) {
            const size_t c1 = (c0 / CALL_NFF + 1) * CALL_NFF < hi ? (c0 / CALL_NFF + 1) * CALL_NFF : hi;
            a = sum_bytes(j->p + call_neuron(route, c0) * NEURON, (c1 - c0) * NEURON, a);
            c0 = c1;
        }
        for (size_t c0 = lo; c0 < hi && j->mode == CALLS_SPARSE;) {
            size_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
            if (c1 / CALL_NFF != c0 / CALL_NFF)
                c1 = c1 / CALL_NFF * CALL_NFF; /* a chunk stays in one expert */
            for (size_t i = c0; i < c1; i++) {
                if (i + (size_t)j->ahead < hi)
                    prefetch(j->p + call_neuron(route, i + (size_t)j->ahead) * NEURON, ROW);
                a = sum_row(j->p + call_neuron(route, i) * NEURON, a);
            }
            for (size_t i = c0; i < c1; i++) {
                const size_t n = call_neuron(route, i);
                if (!kept(n, j->keep_percent))
                    continue;
                for (size_t m = i + 1; m < c1; m++)
                    if (kept(call_neuron(route, m), j->keep_percent)) {
                        prefetch(j->p + call_neuron(route, m) * NEURON + ROW, 2 * ROW);
                        break;
                    }
                a = sum_bytes(j->p + n * NEURON + ROW, 2 * ROW, a);
            }
            c0 = c1;
        }
        call_barrier(j->nth);
    }
    return a;
}

static void *run(void *arg) {
    job *j = arg;
    const size_t n_neurons = j->bytes / NEURON;
    const size_t lo = n_neurons * j->ith / j->nth, hi = n_neurons * (j->ith + 1) / j->nth;
    __m256i a = _mm256_setzero_si256();
    pthread_barrier_wait(j->bar);
    if (j->mode == CALLS_ALL || j->mode == CALLS_SPARSE) {
        a = run_calls(j, a);
    } else if (j->mode == CONTIGUOUS) {
        a = sum_bytes(j->p + lo * NEURON, (hi - lo) * NEURON, a);
    } else if (j->mode == GATES_APART) {
        const uint8_t *gates = j->p, *pairs = j->p + n_neurons * ROW;
        for (size_t c0 = lo; c0 < hi; c0 += CHUNK) {
            const size_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
            a = sum_bytes(gates + c0 * ROW, (c1 - c0) * ROW, a);
            for (size_t n = c0; n < c1; n++) {
                if (!kept(n, j->keep_percent))
                    continue;
                for (size_t m = n + 1; m < c1; m++)
                    if (kept(m, j->keep_percent)) {
                        prefetch(pairs + m * 2 * ROW, 2 * ROW);
                        break;
                    }
                a = sum_bytes(pairs + n * 2 * ROW, 2 * ROW, a);
            }
        }
    } else if (j->mode == APART_PIPELINED) {
        const uint8_t *gates = j->p, *pairs = j->p + n_neurons * ROW;
        size_t p0 = lo, p1 = lo; /* the previous chunk: its kept up/down rows still to read */
        for (size_t c0 = lo; p0 < hi; c0 += CHUNK) {
            const size_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi; /* c0 >= hi: no chunk left */
            size_t n_lines = 0;
            for (size_t n = p0; n < p1 && c0 < hi; n++)
                if (kept(n, j->keep_percent))
                    add_lines(j->lines, &n_lines, pairs + n * 2 * ROW, 2 * ROW);
            if (c0 < hi)
                a = sum_bytes_pf(gates + c0 * ROW, (c1 - c0) * ROW, a, j->lines, n_lines);
            for (size_t n = p0; n < p1; n++)
                if (kept(n, j->keep_percent))
                    a = sum_bytes(pairs + n * 2 * ROW, 2 * ROW, a);
            p0 = c0 < hi ? c0 : hi;
            p1 = c1;
        }
    } else if (j->mode == APART_AHEAD || j->mode == APART_ALL) {
        const uint8_t *gates = j->p, *pairs = j->p + n_neurons * ROW;
        for (size_t c0 = lo; c0 < hi; c0 += CHUNK) {
            const size_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
            a = sum_bytes(gates + c0 * ROW, (c1 - c0) * ROW, a);
            if (j->mode == APART_ALL) {
                a = sum_bytes(pairs + c0 * 2 * ROW, (c1 - c0) * 2 * ROW, a);
                continue;
            }
            size_t list[CHUNK], n_kept = 0;
            for (size_t n = c0; n < c1; n++)
                if (kept(n, j->keep_percent))
                    list[n_kept++] = n;
            for (size_t k = 0; k < n_kept && k < (size_t)j->ahead; k++) /* a burst to start */
                prefetch(pairs + list[k] * 2 * ROW, 2 * ROW);
            for (size_t k = 0; k < n_kept; k++) {
                size_t n_lines = 0;
                if (k + (size_t)j->ahead < n_kept)
                    add_lines(j->lines, &n_lines, pairs + list[k + j->ahead] * 2 * ROW, 2 * ROW);
                a = sum_bytes_pf(pairs + list[k] * 2 * ROW, 2 * ROW, a, j->lines, n_lines);
            }
        }
    } else if (j->mode == SPARSE) {
        for (size_t c0 = lo; c0 < hi; c0 += CHUNK) {
            const size_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
            for (size_t n = c0; n < c1; n++) {
                const uint8_t *g = j->p + n * NEURON;
                if (n + (size_t)j->ahead < hi)
                    prefetch(g + (size_t)j->ahead * NEURON, ROW);
                a = sum_row(g, a);
            }
            for (size_t n = c0; n < c1; n++) {
                if (!kept(n, j->keep_percent))
                    continue;
                for (size_t m = n + 1; m < c1; m++)
                    if (kept(m, j->keep_percent)) {
                        prefetch(j->p + m * NEURON + ROW, 2 * ROW);
                        break;
                    }
                a = sum_bytes(j->p + n * NEURON + ROW, 2 * ROW, a);
            }
        }
    } else {
        for (size_t n = lo; n < hi; n++) {
            const uint8_t *g = j->p + n * NEURON;
            if (j->mode == GATE_PREFETCH && n + (size_t)j->ahead < hi)
                prefetch(g + (size_t)j->ahead * NEURON, ROW);
            a = sum_row(g, a);
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
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        printf("usage: %s [threads (16)] [GiB of experts (8)] [row bytes (2176), a multiple of "
               "32 >= 128] [prefetch into L2 (0: L1)]\n", argv[0]);
        return 0;
    }
    const int nth = argc > 1 ? atoi(argv[1]) : 16;
    const double gib = argc > 2 ? atof(argv[2]) : 8.0;
    ROW = argc > 3 ? (size_t)atol(argv[3]) : 2176;
    NEURON = 3 * ROW;
    pf_l2 = argc > 4 ? atoi(argv[4]) : 0;
    if (ROW < 128 || ROW % 32 || ROW > (1 << 20)) {
        fprintf(stderr, "error: row bytes must be a multiple of 32 in [128, 1 MiB]\n");
        return 2;
    }
    if (nth < 1 || nth > MAX_THREADS || gib <= 0) {
        fprintf(stderr, "error: threads must be 1-%d and GiB > 0\n", MAX_THREADS);
        return 2;
    }
    const size_t bytes = (size_t)(gib * (1 << 30)) / NEURON * NEURON;
    uint8_t *p = aligned_alloc(4096, bytes);
    if (p == NULL) {
        fprintf(stderr, "error: cannot allocate %.2f GiB\n", gib);
        return 1;
    }
    memset(p, 1, bytes);
    const size_t chunk_lines = CHUNK * (2 * ROW / 64 + 1);
    const uint8_t **lines = malloc((size_t)nth * chunk_lines * sizeof *lines);
    if (lines == NULL) {
        fprintf(stderr, "error: cannot allocate the prefetch lists\n");
        return 1;
    }
    /* The calls' experts: each call 8 distinct random experts of one layer (64 experts of 1024
     * neurons), the layers in turn; as many calls as read the buffer's bytes once. */
    const size_t n_layers = bytes / NEURON / CALL_NFF / CALL_EXPERTS;
    const int n_calls = n_layers ? (int)(bytes / NEURON / CALL_NFF / CALL_TOPK) : 0;
    int *routes = malloc((size_t)(n_calls ? n_calls : 1) * CALL_TOPK * sizeof *routes);
    if (routes == NULL) {
        fprintf(stderr, "error: cannot allocate the calls' experts\n");
        return 1;
    }
    srand(7);
    for (int c = 0; c < n_calls; c++) {
        int used[CALL_EXPERTS] = {0};
        for (int k = 0; k < CALL_TOPK; k++) {
            int e;
            do
                e = rand() % CALL_EXPERTS;
            while (used[e]);
            used[e] = 1;
            routes[c * CALL_TOPK + k] = (int)((size_t)c % n_layers) * CALL_EXPERTS + e;
        }
    }
    const struct {
        enum mode mode;
        int ahead, keep_percent;
        const char *name;
    } cases[] = {
        {CONTIGUOUS, 0, 0, "contiguous"},          {GATE_PLAIN, 0, 0, "gate rows, plain"},
        {GATE_PREFETCH, 2, 0, "gate rows, sw pf 2"}, {CALLS_ALL, 0, 0, "calls, all rows"},
        {CALLS_SPARSE, 2, 50, "calls, sparse 0.5"},  {SPARSE, 2, 50, "sparse 0.5 pattern"},
        {SPARSE, 2, 30, "sparse 0.7 pattern"},     {SPARSE, 2, 10, "sparse 0.9 pattern"},
        {GATES_APART, 0, 50, "gates apart 0.5"},     {GATES_APART, 0, 10, "gates apart 0.9"},
        {APART_PIPELINED, 0, 50, "apart 0.5 pipelined"}, {APART_AHEAD, 4, 50, "apart 0.5 4 ahead"},
        {APART_ALL, 0, 50, "apart, all up/down"},
        {APART_PIPELINED, 0, 10, "apart 0.9 pipelined"}, {APART_AHEAD, 4, 10, "apart 0.9 4 ahead"}};
    enum { REPS = 7, N_CASES = sizeof cases / sizeof cases[0] };
    double useful[N_CASES]; /* bytes each case needs */
    int base[N_CASES];      /* the case its speedup is over */
    for (int c = 0; c < N_CASES; c++) {
        const enum mode m = cases[c].mode;
        base[c] = m == CALLS_SPARSE ? 3 : 0;
        if (m == CALLS_ALL || m == CALLS_SPARSE) {
            useful[c] = 0.0;
            for (int k = 0; k < n_calls * CALL_TOPK; k++)
                for (size_t i = 0; i < CALL_NFF; i++) {
                    const size_t n = (size_t)routes[k] * CALL_NFF + i;
                    useful[c] += m == CALLS_ALL ? (double)NEURON
                                 : kept(n, cases[c].keep_percent) ? (double)NEURON
                                                                   : (double)ROW;
                }
            continue;
        }
        const int all = m == CONTIGUOUS || m == APART_ALL;
        useful[c] = all ? (double)bytes : (double)bytes / 3;
        const int sparse = m >= SPARSE && !all;
        for (size_t n = 0; sparse && n < bytes / NEURON; n++)
            useful[c] += kept(n, cases[c].keep_percent) ? 2.0 * ROW : 0.0;
    }
    double secs[N_CASES][REPS];
    for (int r = 0; r < REPS; r++) /* cases interleaved per round */
        for (int c = 0; c < N_CASES; c++) {
            if ((cases[c].mode == CALLS_ALL || cases[c].mode == CALLS_SPARSE) && n_calls == 0) {
                secs[c][r] = 0.0; /* less than a layer of experts: no calls */
                continue;
            }
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, NULL, (unsigned)nth + 1);
            pthread_t th[MAX_THREADS];
            job jobs[MAX_THREADS];
            for (int t = 0; t < nth; t++) {
                jobs[t] = (job){p, bytes, cases[c].mode, cases[c].ahead, cases[c].keep_percent,
                                t, nth, lines + (size_t)t * chunk_lines, 0, &bar, routes,
                                n_calls};
                pthread_create(&th[t], NULL, run, &jobs[t]);
            }
            pthread_barrier_wait(&bar);
            const double t0 = now();
            for (int t = 0; t < nth; t++)
                pthread_join(th[t], NULL);
            secs[c][r] = now() - t0;
            pthread_barrier_destroy(&bar);
        }
    printf("plain reads: %d threads, %.2f GiB of experts (rows of %zu bytes, prefetches into %s), "
           "%d rounds; "
           "median / best GB/s of the bytes each case needs\n", nth, gib, ROW, pf_l2 ? "L2" : "L1",
           REPS);
    for (int c = 0; c < N_CASES; c++) {
        if (secs[c][0] == 0.0) {
            printf("  %-20s (needs a layer: %d experts of %d neurons)\n", cases[c].name,
                   CALL_EXPERTS, CALL_NFF);
            continue;
        }
        double rate[REPS], ratio[REPS]; /* GB/s; time of its base case / this case, same round */
        for (int r = 0; r < REPS; r++) {
            rate[r] = useful[c] / secs[c][r] / 1e9;
            ratio[r] = secs[base[c]][r] / secs[c][r];
        }
        qsort(rate, REPS, sizeof(double), cmp);
        qsort(ratio, REPS, sizeof(double), cmp);
        printf("  %-20s %6.1f / %6.1f GB/s", cases[c].name, rate[REPS / 2], rate[REPS - 1]);
        if (cases[c].mode >= SPARSE)
            printf("  speedup over %s (same round) %.2fx median, %.2f-%.2f", cases[base[c]].name,
                   ratio[REPS / 2], ratio[0], ratio[REPS - 1]);
        printf("\n");
    }
    free(routes);
    free(lines);
    free(p);
    return 0;
}
