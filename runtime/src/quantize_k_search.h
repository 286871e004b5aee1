/* The scale searches of quantize_k.c on LANES sub-blocks at once, one per lane of a GCC vector:
 * a lane does the reference's scalar operations in the reference's order (no FMA contraction:
 * quantize_k.c), so the lane count changes speed, never bits.
 *
 * Included once per lane count: the includer defines QK_LANES (4: SSE2 on every x86-64, NEON
 * on arm64; 8: AVX2, inside a target pragma) and QK_NAME(name), which gives each instance's
 * types and functions their own names; the instance defines QK_NAME(fit_scale_min) and
 * QK_NAME(fit_scale_q6). Needs SUB, SUB6 and GROUP_EPS (quantize_k.c). */

#define vf QK_NAME(vf)
#define vi QK_NAME(vi)
#define vsplat QK_NAME(vsplat)
#define vsplat_i QK_NAME(vsplat_i)
#define vsel QK_NAME(vsel)
#define vsel_i QK_NAME(vsel_i)
#define vgather QK_NAME(vgather)
#define vround QK_NAME(vround)
#define vclamp QK_NAME(vclamp)
#define vfloat QK_NAME(vfloat)
#define vabs QK_NAME(vabs)
#define fit_scale_min QK_NAME(fit_scale_min)
#define fit_scale_q6 QK_NAME(fit_scale_q6)
#define LANES QK_LANES

typedef float vf __attribute__((vector_size(4 * QK_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * QK_LANES)));

static inline vf vsplat(float f) {
    vf v = {0};
    for (int j = 0; j < LANES; j++)
        v[j] = f;
    return v;
}

static inline vi vsplat_i(int i) {
    vi v = {0};
    for (int j = 0; j < LANES; j++)
        v[j] = i;
    return v;
}

/* mask ? a : b, lane by lane (mask lanes all ones or zero; a vector ?: is C++ only) */
static inline vf vsel(vi mask, vf a, vf b) {
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

static inline vi vsel_i(vi mask, vi a, vi b) {
    return (a & mask) | (b & ~mask);
}

/* x[0], x[stride], ..., x[(LANES - 1) stride]: element i of LANES sub-blocks */
static inline vf vgather(const float *x, int stride) {
    vf v = {0};
    for (int j = 0; j < LANES; j++)
        v[j] = x[j * stride];
    return v;
}

static inline vi vround(vf f) { /* round_int, lane by lane */
    const vi bits = (vi)(f + vsplat(12582912.f));
    return (bits & 0x007fffff) - 0x00400000;
}

static inline vi vclamp(vi l, int lo, int hi) {
    l = vsel_i(l < lo, vsplat_i(lo), l);
    return vsel_i(l > hi, vsplat_i(hi), l);
}

static inline vf vfloat(vi l) {
    return __builtin_convertvector(l, vf);
}

static inline vf vabs(vf f) {
    return (vf)((vi)f & 0x7fffffff);
}

/* ---- Q4_K / Q5_K ----------------------------------------------------------------------------- */

/* LANES sub-blocks x[32 LANES] at once (lane j: sub-block j): codes L (0..nmax), scales[LANES],
 * neg_mins[LANES] (-m >= 0). Weights sqrt(mean x^2) + |x|; the min/max grid, then nstep + 1
 * grids of (nmax + rmin + rdelta is) / (max - min) steps, each refitted by weighted least
 * squares (min clamped to <= 0), the lowest weighted squared error kept; each grid starts from
 * the min of the best fit so far (the reference's order, which decides the bytes). */
static void fit_scale_min(int nmax, const float *x, uint8_t *L, float *scales, float *neg_mins,
                          float rmin, float rdelta, int nstep) {
    vf xt[SUB], w[SUB];
    for (int i = 0; i < SUB; i++)
        xt[i] = vgather(x + i, SUB);
    vf sum_x2 = xt[0] * xt[0];
    for (int i = 1; i < SUB; i++)
        sum_x2 += xt[i] * xt[i];
    vf av_x;
    for (int j = 0; j < LANES; j++)
        av_x[j] = sqrtf(sum_x2[j] / SUB);
    for (int i = 0; i < SUB; i++)
        w[i] = av_x + vabs(xt[i]);

    vf min = xt[0], max = xt[0], sum_w = w[0], sum_x = w[0] * xt[0];
    for (int i = 1; i < SUB; i++) {
        min = vsel(xt[i] < min, xt[i], min);
        max = vsel(xt[i] > max, xt[i], max);
        sum_w += w[i];
        sum_x += w[i] * xt[i];
    }
    min = vsel(min > 0, vsplat(0.f), min);
    const vi flat = max == min; /* such a lane: codes 0, scale 0 (its other values unused) */
    const vf iscale = vsplat((float)nmax) / (max - min);
    vf scale = vsplat(1.f) / iscale, best_err = vsplat(0.f);
    vi best[SUB], trial[SUB];
    for (int i = 0; i < SUB; i++) {
        best[i] = vclamp(vround(iscale * (xt[i] - min)), 0, nmax);
        const vf diff = scale * vfloat(best[i]) + min - xt[i];
        best_err += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; is++) {
        /* (max - min) and (x - min) with the min of the best fit so far, as the reference */
        const vf step_iscale = vsplat(rmin + rdelta * is + nmax) / (max - min);
        vf sum_l = vsplat(0.f), sum_l2 = sum_l, sum_xl = sum_l;
        for (int i = 0; i < SUB; i++) {
            trial[i] = vclamp(vround(step_iscale * (xt[i] - min)), 0, nmax);
            const vf l = vfloat(trial[i]);
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * xt[i];
        }
        const vf det = sum_w * sum_l2 - sum_l * sum_l;
        const vi fit = det > 0;
        vf s = (sum_w * sum_xl - sum_x * sum_l) / det;
        vf m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        const vi pos = m > 0;
        m = vsel(pos, vsplat(0.f), m);
        s = vsel(pos, sum_xl / sum_l2, s);
        vf err = vsplat(0.f);
        for (int i = 0; i < SUB; i++) {
            const vf diff = s * vfloat(trial[i]) + m - xt[i];
            err += w[i] * (diff * diff);
        }
        const vi better = fit & (err < best_err);
        for (int i = 0; i < SUB; i++)
            best[i] = vsel_i(better, trial[i], best[i]);
        best_err = vsel(better, err, best_err);
        scale = vsel(better, s, scale);
        min = vsel(better, m, min);
    }
    scale = vsel(flat, vsplat(0.f), scale);
    for (int j = 0; j < LANES; j++) {
        scales[j] = scale[j];
        neg_mins[j] = -min[j];
        for (int i = 0; i < SUB; i++)
            L[SUB * j + i] = flat[j] ? 0 : (uint8_t)best[i][j];
    }
}

/* ---- Q6_K ------------------------------------------------------------------------------------ */

/* LANES sub-blocks x[16 LANES] at once (lane j: sub-block j): codes L (0..63, q + 32) and
 * scales[LANES]: -32 / (the largest-|x| value) as the grid, refitted by least squares with
 * weights x^2, then 18 grids around it, a refit kept where it beats the best so far. */
static void fit_scale_q6(const float *x, uint8_t *L, float *scales) {
    enum { NMAX = 32 };
    vf xt[SUB6], w[SUB6];
    for (int i = 0; i < SUB6; i++)
        xt[i] = vgather(x + i, SUB6);
    vf max = vsplat(0.f), amax = max;
    for (int i = 0; i < SUB6; i++) {
        const vf ax = vabs(xt[i]);
        const vi gt = ax > amax;
        amax = vsel(gt, ax, amax);
        max = vsel(gt, xt[i], max);
        w[i] = xt[i] * xt[i];
    }
    const vi zero = amax < GROUP_EPS; /* such a lane: codes 0, scale 0 */
    vf iscale = vsplat((float)-NMAX) / max;
    vf sumlx = vsplat(0.f), suml2 = sumlx;
    vi best[SUB6];
    for (int i = 0; i < SUB6; i++) {
        best[i] = vclamp(vround(iscale * xt[i]), -NMAX, NMAX - 1);
        const vf l = vfloat(best[i]);
        sumlx += w[i] * xt[i] * l;
        suml2 += w[i] * l * l;
    }
    vf scale = vsel(suml2 != 0, sumlx / suml2, vsplat(0.f));
    vf best_fit = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        iscale = vsplat(-(NMAX + 0.1f * is)) / max;
        vi trial[SUB6];
        sumlx = suml2 = vsplat(0.f);
        for (int i = 0; i < SUB6; i++) {
            trial[i] = vclamp(vround(iscale * xt[i]), -NMAX, NMAX - 1);
            const vf l = vfloat(trial[i]);
            sumlx += w[i] * xt[i] * l;
            suml2 += w[i] * l * l;
        }
        const vi better = (suml2 > 0) & (sumlx * sumlx > best_fit * suml2);
        for (int i = 0; i < SUB6; i++)
            best[i] = vsel_i(better, trial[i], best[i]);
        const vf s = sumlx / suml2;
        scale = vsel(better, s, scale);
        best_fit = vsel(better, s * sumlx, best_fit);
    }
    for (int j = 0; j < LANES; j++) {
        scales[j] = zero[j] ? 0.f : scale[j];
        for (int i = 0; i < SUB6; i++)
            L[SUB6 * j + i] = zero[j] ? 0 : (uint8_t)(best[i][j] + NMAX);
    }
}

#undef vf
#undef vi
#undef vsplat
#undef vsplat_i
#undef vsel
#undef vsel_i
#undef vgather
#undef vround
#undef vclamp
#undef vfloat
#undef vabs
#undef fit_scale_min
#undef fit_scale_q6
#undef LANES
