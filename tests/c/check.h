/* What the C test programs share: a failure counter with CHECK, and a deterministic xorshift
 * generator. Define TEST_RNG_SEED (a nonzero 64-bit constant) before including, so each program
 * keeps its own random stream. */
#ifndef PYRT_TEST_CHECK_H
#define PYRT_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>

static int failures = 0;

/* Number of elements of a true array (not a pointer). */
#define COUNT_OF(a) ((int)(sizeof(a) / sizeof *(a)))

#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            failures++;                                                                           \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                           \
            printf(__VA_ARGS__);                                                                  \
            printf("\n");                                                                         \
        }                                                                                         \
    } while (0)

static uint64_t rng_state = TEST_RNG_SEED;

static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

#endif
