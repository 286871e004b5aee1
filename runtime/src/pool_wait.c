/* Waiting inside a pool task for a flag another thread of the task sets (pool.h).
 *
 * A producer is usually microseconds away, less than a sleep and a wake-up cost, so a waiter
 * first spins (prefetching its home of the pool's plan meanwhile); but on a busy machine the
 * producer may have been preempted for a whole scheduler slice, and a waiter that spins through
 * it burns the share of the CPU its own process needs. So the spin is bounded (params.spin_us)
 * and then the waiter sleeps on the flag (a futex on Linux; elsewhere it yields the CPU between
 * looks). A setter wakes sleepers only when there are some: the flag store, then one load of the
 * pool's count of sleepers, both sequentially consistent, against the sleeper's increment of the
 * count and re-read of the flag (a Dekker pair: one of the two sees the other). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>

#include "pool_struct.h"

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Sleep while *flag == seen (returns at once if it differs: the kernel compares atomically). */
static void flag_sleep(const atomic_int *flag, int seen) {
    syscall(SYS_futex, (const int *)flag, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void flag_wake(atomic_int *flag) {
    syscall(SYS_futex, (int *)flag, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static void flag_sleep(const atomic_int *flag, int seen) {
    (void)flag;
    (void)seen;
    sched_yield();
}

static void flag_wake(atomic_int *flag) {
    (void)flag;
}
#endif

void pyrt_pool_wait_slow(pyrt_pool *pool, const atomic_int *flag, int value, int ith) {
    int pf_more = 1;
    pyrt_spinner sp = pyrt_spin_begin();
    for (;;) {
        for (int i = 0; i < SPIN_CHECK; i++) {
            if (atomic_load_explicit(flag, memory_order_acquire) >= value)
                return;
            if (!pf_more || !(pf_more = pyrt_pool_idle_prefetch(pool, ith)))
                pyrt_cpu_relax();
        }
        if (!pyrt_spin_on(pool, &sp))
            break;
    }
    for (;;) {
        atomic_fetch_add(&pool->flag_sleepers, 1); /* then read the flag: see the file comment */
        const int seen = atomic_load(flag);
        if (seen < value)
            flag_sleep(flag, seen);
        atomic_fetch_sub(&pool->flag_sleepers, 1);
        if (seen >= value || atomic_load_explicit(flag, memory_order_acquire) >= value)
            return;
    }
}

void pyrt_pool_flag_store(pyrt_pool *pool, atomic_int *flag, int value) {
    atomic_store(flag, value);
    if (atomic_load(&pool->flag_sleepers) > 0)
        flag_wake(flag);
}

int pyrt_pool_flag_add(pyrt_pool *pool, atomic_int *flag, int n) {
    const int before = atomic_fetch_add(flag, n);
    if (atomic_load(&pool->flag_sleepers) > 0)
        flag_wake(flag);
    return before;
}
