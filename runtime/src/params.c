/* The execution parameters of a pool (pyrt_params, pyrt.h): their defaults and ranges. Every
 * value gives the same results; the defaults are the fastest measured (the spin: a bound on the
 * CPU idle workers burn between calls, which torch's threads may need). */
#include <stddef.h>

#include "error.h"
#include "pool.h"

void pyrt_params_default(pyrt_params *p) {
    *p = (pyrt_params){
        .spin_us = 300,
        .adapt_to_load = 1,
        .idle_prefetch = 1,
        .vnni = 1,
        .matvec_prefetch_rows = -1,    /* pyrt_params_resolve */
        .expert_prefetch_neurons = -1, /* pyrt_params_resolve */
        .prefetch_l2 = -1,             /* pyrt_params_resolve */
        .reduce_prefetch_items = 2,   /* 6 measured no faster on 16 cores */
        .fuse_attention = 1,
        .fuse_router = 1,
        .fuse_layer = 1,
        .prefill_union_pct = 90, /* granite-1b-a400m Q8_0, 1 thread, pp512 (cpu_prefill.py
                                    --param): 50% skipped 1.03x dense with 90, 0.97x with 101
                                    (gates apart); 87% skipped 1.10x / 1.11x */
    };
}

int pyrt_params_check(const pyrt_params *p, const char *fn) {
    const struct {
        const char *name;
        int value, lo, hi;
    } fields[] = {
        {"spin_us", p->spin_us, 0, 1000000},
        {"adapt_to_load", p->adapt_to_load, 0, 1},
        {"idle_prefetch", p->idle_prefetch, 0, 1},
        {"vnni", p->vnni, 0, 1},
        {"matvec_prefetch_rows", p->matvec_prefetch_rows, -1, 64},
        {"expert_prefetch_neurons", p->expert_prefetch_neurons, -1, 64},
        {"prefetch_l2", p->prefetch_l2, -1, 1},
        {"reduce_prefetch_items", p->reduce_prefetch_items, 0, 64},
        {"fuse_attention", p->fuse_attention, 0, 1},
        {"fuse_router", p->fuse_router, 0, 1},
        {"fuse_layer", p->fuse_layer, 0, 1},
        {"prefill_union_pct", p->prefill_union_pct, 0, 101},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value < fields[i].lo || fields[i].value > fields[i].hi)
            return pyrt_fail(PYRT_E_INVALID, "%s: params.%s = %d is outside [%d, %d]", fn,
                             fields[i].name, fields[i].value, fields[i].lo, fields[i].hi);
    return PYRT_OK;
}

void pyrt_params_resolve(pyrt_params *p) {
    /* L2, 4 neurons / rows ahead, on every pool. 1-2 threads, where one thread streams a large
     * share of the weights: on the 2-core Zen 4 box, 1 thread, Q8_0, the routed experts of
     * granite-1b-a400m's shape (n_embd 1024, n_ff 512, top-8 of 64) read at 16-21 GB/s with
     * prefetcht1 4 neurons ahead against 11-12.5 with prefetcht0 2 ahead (prefetcht1 2 ahead: 11;
     * burst instead of spread: 15); 2 threads 17-28 against 11.5. 4-16 threads (olmoe-1b-7b
     * Q8_0, H200 host, 16 Sapphire Rapids cores, bench/cpu_decode.py --param prefetch_l2=0/1
     * alternated twice, in two runs): the whole decode step at 4 / 8 / 16 threads 78-88% /
     * 80-94% / 76-86% of its floor (paired) against 72-77% / 72-78% / 72-83% with prefetcht0 2
     * ahead, the settings earlier tuned there among L1 distances only. */
    if (p->prefetch_l2 < 0)
        p->prefetch_l2 = 1;
    const int ahead = p->prefetch_l2 ? 4 : 2;
    if (p->matvec_prefetch_rows < 0)
        p->matvec_prefetch_rows = ahead;
    if (p->expert_prefetch_neurons < 0)
        p->expert_prefetch_neurons = ahead;
}
