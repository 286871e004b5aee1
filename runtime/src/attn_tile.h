/* Attention of a tile of query rows over one kv head's cached keys and values, flash-style: the
 * keys in blocks of PYRT_ATTN_KB positions, each block read once for all the tile's rows, an
 * online softmax per row (running max m, denominator l, output o rescaled by exp(m_old - m_new)
 * when m grows), so a tile's scratch is fixed (no row of scores as long as the cache; only a
 * one-row tile given `stream` keeps one, to read its keys in one pass).
 *
 * Row r of the tile: o_r = softmax(q_r k^T * scale) v over positions [lo_r, pos_r] (lo_r =
 * pos_r + 1 - window on a sliding-window layer, pos_r - pos_r % chunk on a chunked one, else
 * 0); with a sink s, exp(s) joins the
 * softmax's denominator (the online state starts at m = s, l = 1). Blocks start at multiples of
 * KB and every row's sums run in one order, so a row's output has the same bits in any tile:
 * the decode step (attention.c) runs its heads as one-row tiles, and a step and a prefill give
 * a query the same output. Against the softmax in f64: ~1e-7 relative. */
#ifndef PYRT_ATTN_TILE_H
#define PYRT_ATTN_TILE_H

#include <stddef.h>

#define PYRT_ATTN_ROWS 16 /* query rows a tile holds at most */
#define PYRT_ATTN_KB 64   /* key positions per block */

typedef struct {
    const float *q[PYRT_ATTN_ROWS]; /* row r's query [hd] */
    float *out[PYRT_ATTN_ROWS];     /* row r's output [hd] */
    int pos[PYRT_ATTN_ROWS];        /* row r's position (its last key) */
    int n_rows;
    const float *k, *v; /* the kv head's cache: position p's key at k + p * hd */
    int hd, window;     /* window 0: every earlier position */
    int chunk;          /* > 0: row r's keys are [pos_r - pos_r % chunk, pos_r] (llama4) */
    float scale;
    int has_sink;
    float sink[PYRT_ATTN_ROWS]; /* row r's query head's sink logit, when has_sink */
    float *scratch;    /* pyrt_attn_scratch_floats(hd) floats, the calling thread's own */
    float *stream;     /* NULL, or for a tile of one row pyrt_attn_stream_floats(pos + 1) floats:
                          its keys are then read in one pass before the values (same bits) */
} pyrt_attn_tile;

/* Floats of scratch one thread needs for head_dim hd. */
size_t pyrt_attn_scratch_floats(int hd);

/* Floats of a one-row tile's stream scores over n_pos positions (block-aligned, with a block of
 * slack for the mask). */
size_t pyrt_attn_stream_floats(int n_pos);

/* The tile's rows, with the active SIMD level's kernel (attn_tile.c). */
void pyrt_attn_tile_run(const pyrt_attn_tile *t);

#endif /* PYRT_ATTN_TILE_H */
