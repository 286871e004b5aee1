/* pyrt: the pyruntime C core -- CPU expert kernels for Mixture-of-Experts layers.
 *
 * Called from Python through cffi in ABI mode (pyruntime/cpu/core.py), so this header is plain C:
 * every function returns an int status (PYRT_OK or a PYRT_E_* code) and, on failure, leaves a
 * one-line message in pyrt_last_error() (thread-local). Nothing here calls exit() or prints.
 * Resources come in build/free pairs: pyrt_pool_create / pyrt_pool_free.
 *
 * Weights are read in place (a pointer into the GGUF mmap), in the neuron-contiguous layout of
 * docs/gguf-layout.md: tensor blk.N.ffn_gud_exps.weight, shape [n_expert, n_ff, 3, n_embd], where
 * neuron j of expert e owns rows 3j (gate), 3j+1 (up), 3j+2 (down column, transposed).
 *
 * The declarations between PYRT_CDEF_BEGIN and PYRT_CDEF_END are the binding's: cffi's cdef reads
 * them from this file (installed beside the library), so that section holds only what cffi's
 * parser takes: plain declarations, enums with values, comments; no macros or attributes.
 */
#ifndef PYRT_H
#define PYRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* PYRT_CDEF_BEGIN */
/* This header's version of the API: raised whenever a declaration below changes, so that a
 * caller declared from one header refuses a library built from another (pyrt_api_version). */
enum { PYRT_API_VERSION = 10 };

/* Status codes. */
enum {
    PYRT_OK = 0,
    PYRT_E_INVALID = 1,     /* an argument is invalid: message says which */
    PYRT_E_NOMEM = 2,       /* allocation failed */
    PYRT_E_UNSUPPORTED = 3, /* valid request this build or CPU cannot do */
    PYRT_E_SYSTEM = 4,      /* the OS refused (thread creation, ...) */
    PYRT_E_TIMEOUT = 5      /* a wait for another device's signal ran out */
};

/* Weight formats: ggml's type numbers (GGMLQuantizationType in the gguf package). */
enum {
    PYRT_FMT_F32 = 0,
    PYRT_FMT_F16 = 1,
    PYRT_FMT_Q4_0 = 2,
    PYRT_FMT_Q5_0 = 6, /* llama.cpp's fallback for Q4_K rows not a multiple of 256 */
    PYRT_FMT_Q5_1 = 7, /* ... and for Q5_K */
    PYRT_FMT_Q8_0 = 8,
    PYRT_FMT_Q4_K = 12, /* K-quants: 256-element super-blocks (rows a multiple of 256) */
    PYRT_FMT_Q5_K = 13,
    PYRT_FMT_Q6_K = 14,
    PYRT_FMT_BF16 = 30,
    PYRT_FMT_MXFP4 = 39  /* gpt-oss's experts: 32-element blocks of e2m1 with an E8M0 scale */
};

/* Expert activations: act(gate . x), times (up . x) except where said. */
enum {
    PYRT_ACT_SILU = 0,      /* x * sigmoid(x) */
    PYRT_ACT_GELU_TANH = 1, /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    PYRT_ACT_GELU_ERF = 2,  /* 0.5 x (1 + erf(x / sqrt(2))) */
    PYRT_ACT_SWIGLU_OAI = 3 /* gpt-oss: g = min(x, limit), g * sigmoid(alpha g); times
                               (clamp(up . x, -limit, limit) + 1) instead of (up . x) */
};

/* SIMD levels, chosen at run time from cpuid; a lower level can be forced (tests, benchmarks). */
enum {
    PYRT_SIMD_SCALAR = 0,
    PYRT_SIMD_AVX2 = 1,   /* AVX2 + FMA + F16C */
    PYRT_SIMD_AVX512 = 2  /* AVX-512 F + BW (+ the AVX2 set) */
};

typedef struct pyrt_pool pyrt_pool;

/* How a pool's kernels and the decode steps run on it: given at pool creation, read by every
 * call on that pool. Every setting gives the same results bit for bit (tests/c compares them);
 * they trade speed only. Fill the defaults with pyrt_params_default, then change fields. */
typedef struct {
    int spin_us;                 /* microseconds a thread waiting inside the pool (an idle worker,
                                    the caller waiting for the workers, a task's thread waiting
                                    for another's result) spins before it sleeps; default 300.
                                    Longer: cheaper hand-offs after longer gaps, more CPU burnt
                                    that another process may need. 0..1000000 */
    int adapt_to_load;           /* 1 (default): when a task had to wait for a worker that the OS
                                    preempted (another process holds its core), the caller runs
                                    the tasks alone for a while (2 ms, doubling while it lasts, up
                                    to 128 ms), then tries the workers again; 0: never */
    int idle_prefetch;           /* 1 (default): threads waiting for a task, or for the others at
                                    its end, prefetch the next task's weight rows into their L2
                                    (the decode step names them); 0: they only spin */
    int vnni;                    /* 1 (default): Q8_0 and K-quant dots on AVX512_VNNI where the
                                    CPU has it; 0: the AVX-512 BW dots (same bits) */
    int matvec_prefetch_rows;    /* dense matvec: rows ahead of the current row pair that are
                                    software-prefetched; 0: none; -1 (default): 4 where the
                                    prefetches go to L2, else 2. -1..64 */
    int expert_prefetch_neurons; /* routed experts: neurons ahead whose rows are
                                    software-prefetched; 0: none; -1 (default): 4 where the
                                    prefetches go to L2, else 2. -1..64 */
    int prefetch_l2;             /* weight rows are software-prefetched into L2 (prefetcht1, 1)
                                    or L1 (prefetcht0, 0); -1 (default): L2, where more lines
                                    can be in flight than the L1 miss buffers allow (measured
                                    faster at 1 to 16 threads: params.c). -1..1 */
    int reduce_prefetch_items;   /* routed experts: while summing the work items' partial ys,
                                    done items ahead whose part is prefetched; default 2. 0..64 */
    int fuse_attention;          /* decode step: q/k/v, attention heads and o projection in one
                                    pool task where the q/k norms are per head or absent (1,
                                    default), or in three with the norms and RoPE between (0) */
    int fuse_router;             /* decode step: router, routing and routed experts in one pool
                                    task (1, default), or the router's own task first (0) */
    int fuse_layer;              /* decode step: where both fusions apply, a whole MoE block in
                                    one pool task (1, default), or attention and FFN in two (0) */
    int prefill_union_pct;       /* prefill with a sparsity threshold: once the union of the
                                    neurons a pass's tokens keep has been at least this % of the
                                    neurons (over the call's passes so far), gate and up rows are
                                    read together as dense does, the drops applied after; below,
                                    the gates first and the up rows of that union only. Default
                                    90; 0: always together; 101: never. 0..101 */
} pyrt_params;

/* The defaults of every field. */
void pyrt_params_default(pyrt_params *params);

/* PYRT_API_VERSION of the header this library was built from. */
int pyrt_api_version(void);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char *pyrt_last_error(void);

/* Physical cores usable by this process (affinity mask, SMT siblings counted once); >= 1. */
int pyrt_physical_cores(void);
/* Logical CPUs usable by this process (its affinity mask); >= 1. More threads than these
 * can never all run at once. */
int pyrt_logical_cpus(void);

/* Best SIMD level this CPU supports, and the level in use (process-wide). */
int pyrt_simd_best(void);
int pyrt_simd_active(void);
/* Use `level` (<= pyrt_simd_best()) from now on. Not thread-safe against running kernels. */
int pyrt_simd_force(int level);

/* Thread pool of n_threads workers in all (the calling thread is one of them, so n_threads - 1
 * threads are started). Create once and reuse: kernels split their work across it. Calls on one
 * pool are serialized (a mutex), so one pool may be shared by several Python threads. Its threads
 * spin for a bounded time (params.spin_us), then sleep; a worker another process holds off its
 * core is not waited for unless it holds a share of the work, and under such load the calling
 * thread runs alone for a while (params.adapt_to_load). Results never depend on either.
 * params: copied; NULL = pyrt_params_default's. */
int pyrt_pool_create(int n_threads, const pyrt_params *params, pyrt_pool **out);
void pyrt_pool_free(pyrt_pool *pool);
int pyrt_pool_threads(const pyrt_pool *pool);

/* Bytes of one row of n elements in format fmt (0 if fmt is unknown or n does not fit it). */
size_t pyrt_row_bytes(int fmt, int64_t n);

/* One MoE layer's routed experts as the kernel reads them: n_slots experts in the layout of
 * blk.N.ffn_gud_exps (read in place), and which global expert id each slot holds. */
typedef struct {
    const void *data;           /* [n_slots, n_ff, 3, n_embd] in fmt: neuron j of the expert in a
                                   slot owns rows 3j (gate), 3j+1 (up), 3j+2 (down, transposed) */
    size_t bytes;               /* == n_slots * n_ff * 3 * pyrt_row_bytes(fmt, n_embd) */
    int fmt;                    /* PYRT_FMT_* */
    int n_expert;               /* expert ids (topk_ids) are in [0, n_expert) */
    int n_slots;                /* experts data holds */
    int n_ff, n_embd;
    const int32_t *expert_map;  /* [n_expert]: expert id -> its slot in data, or -1: not held
                                   here (its (token, expert) pairs are skipped and add nothing to
                                   y); NULL: the identity, n_slots == n_expert. As vLLM's fused_moe
                                   expert_map: a cache of slots, or one device's share */
    const float *bias_gu;       /* NULL, or [n_slots, n_ff, 2]: the gate and up biases of neuron j
                                   of the expert in each slot (added to g_j . x and u_j . x) */
    int64_t bias_gu_len;        /* floats bias_gu holds: >= n_slots * n_ff * 2 (0 without it) */
    const float *bias_down;     /* NULL, or [n_slots, n_embd]: added to each expert's output;
                                   given with bias_gu (gpt-oss) */
    int64_t bias_down_len;      /* floats bias_down holds: >= n_slots * n_embd (0 without) */
    float swiglu_alpha;         /* PYRT_ACT_SWIGLU_OAI's alpha and limit (limit > 0); */
    float swiglu_limit;         /* unused by the other activations */
    const void *gates;          /* NULL, or [n_slots, n_ff, n_embd] in fmt: a copy of every
                                   neuron's gate row (row 3j of its slot in data), each expert's
                                   rows contiguous ("gates apart"). The sparse pass (threshold >
                                   0) reads its gates there, a stream rather than every third
                                   row, and gathers the kept neurons' up and down rows from data;
                                   the same values, so the same bits as without it */
    size_t gates_bytes;         /* == n_slots * n_ff * pyrt_row_bytes(fmt, n_embd) with gates */
} pyrt_experts;

/* One MoE layer's routed experts, for n_tokens tokens:
 *   y[t, :] = sum_k topk_w[t, k] * expert_{topk_ids[t, k]}(x[t, :])   (k over the pairs held here)
 *   expert_e(x) = sum_j act(g_j . x) * (u_j . x) * d_j     (j over the n_ff neurons of e)
 *   (with biases: act(g_j . x + bg_j) * (u_j . x + bu_j) * d_j summed, plus bd_e; PYRT_ACT_SWIGLU_OAI
 *   clamps and shifts the up term as its comment says)
 *
 * x         [n_tokens, n_embd] f32;  y [n_tokens, n_embd] f32 (written, not accumulated into;
 *           0 where no pair is held here)
 * topk_ids  [n_tokens, k] int32 in [0, n_expert);  topk_w [n_tokens, k] f32
 * threshold >= 0: a neuron whose |act(g_j . x)| < threshold is skipped for that token (its up and
 *           down rows are not read). 0 is the dense FFN (nothing is skipped).
 * n_active  out (may be NULL): neurons computed, summed over the (token, expert) pairs computed
 *           (those held here); their number * n_ff when dense.
 * For Q8_0/Q4_0 weights, x is quantized to Q8_0 blocks (one f32 scale per 32 values) once per
 * token and the dot products are integer, as llama.cpp does; accumulation is f32 throughout. */
int pyrt_moe_ffn(pyrt_pool *pool, const pyrt_experts *experts, const float *x, int n_tokens,
                 const int32_t *topk_ids, const float *topk_w, int k, int activation,
                 float threshold, float *y, int64_t *n_active);

/* The host's side of a hybrid decode step (pyruntime/offload/step_graph.py): a GPU graph and
 * this call take turns at each of n_layers MoE layers, through flags in page-locked host memory
 * the graph reads and writes over PCIe. For layer m in order: wait until flags[m] == seq (the
 * graph has written layer m's routing, one token's, into x / ids / w / codes); compute its pairs
 * whose code is `code` with experts layers[m] (whose expert_map is ignored: the pairs so coded
 * choose the experts, so each layer holds all n_expert, n_slots == n_expert) at threshold
 * thresholds[m] into y (0 where no pair is so coded); then flags[n_layers + m] = seq, the
 * graph's signal to read y. The routing buffers are overwritten at the next layer, so what a
 * caller needs after the step is logged as read. */
typedef struct {
    int n_layers;
    int k;                              /* pairs per token */
    int code;                           /* the pairs' code computed here */
    int activation;                     /* PYRT_ACT_* */
    const pyrt_experts *const *layers;  /* [n_layers] */
    const float *thresholds;            /* [n_layers]: >= 0, 0 dense (pyrt_moe_ffn's) */
    const float *x;                     /* [n_embd] f32: the layer's input */
    const int32_t *ids;                 /* [k]: expert ids */
    const float *w;                     /* [k]: the pairs' weights */
    const int32_t *codes;               /* [k]: each pair's code */
    float *y;                           /* [n_embd] f32, written */
    int32_t *flags;                     /* [2, n_layers]: (routing written, y written) */
    int32_t *ids_log;                   /* NULL, or [n_layers, k]: ids as read */
    int32_t *codes_log;                 /* NULL, or [n_layers, k]: codes as read */
    const float *logits;                /* NULL, or [n_logits]: the router's logits, */
    int n_logits;
    float *logits_log;                  /* copied to [n_layers, n_logits] (with logits) */
    int64_t *n_active;                  /* [n_layers] out: neurons computed (pyrt_moe_ffn's) */
    int64_t timeout_ns;                 /* > 0: longest wait for one flag */
} pyrt_host_step;

/* Runs the step's n_layers turns (pyrt_host_step) for step number seq. ns [2] out (may be
 * NULL): nanoseconds spent waiting for the graph's flags, and computing. A wait longer than
 * timeout_ns returns PYRT_E_TIMEOUT (message: the layer); on any error the layers from the
 * failing one on are left unsignalled: the caller sets flags[n_layers + m] itself so that the
 * graph can finish. */
int pyrt_moe_host_step(pyrt_pool *pool, const pyrt_host_step *step, int32_t seq, int64_t *ns);

/* Read `bytes` of buf once, split across the pool's threads (a stream-like DRAM read test for
 * benchmarks); checksum (may be NULL) gets the sum of the 64-bit words read. */
int pyrt_mem_read(pyrt_pool *pool, const void *buf, size_t bytes, uint64_t *checksum);

/* Quantize n_rows rows of n_per_row floats (a multiple of 256) to fmt PYRT_FMT_Q4_K, Q5_K or
 * Q6_K: out (n_rows * pyrt_row_bytes(fmt, n_per_row) bytes, out_bytes) gets the bytes ggml's
 * reference quantizers write (llama-quantize without an importance matrix), bit for bit. pool:
 * the super-blocks are split across its threads (the same bytes), or NULL: the calling thread. */
int pyrt_quantize_rows(pyrt_pool *pool, int fmt, const float *x, int64_t n_rows,
                       int64_t n_per_row, void *out, size_t out_bytes);
/* The inverse: n_rows rows of n_per_row elements in fmt (Q4_K, Q5_K or Q6_K; data holds `bytes`
 * == n_rows * pyrt_row_bytes(fmt, n_per_row)) -> float32 out [n_rows, n_per_row], the values of
 * ggml's dequantizers bit for bit. pool: as pyrt_quantize_rows'. */
int pyrt_dequantize_rows(pyrt_pool *pool, int fmt, const void *data, size_t bytes, int64_t n_rows,
                         int64_t n_per_row, float *out);
/* ---- dense weights and the whole-model decode step (linear.c, decode.c) ---- */

/* A weight matrix [n_out, n_in] read in place (a pointer into the GGUF mmap): row o holds n_in
 * elements in format fmt (pyrt_row_bytes(fmt, n_in) bytes), rows contiguous, so
 * bytes == n_out * pyrt_row_bytes(fmt, n_in). data == NULL means "absent" where that is allowed. */
typedef struct {
    const void *data;
    size_t bytes;
    int fmt;
    int n_out;
    int n_in;
} pyrt_matrix;

/* y[t, o] = w[o, :] . x[t, :] (+ bias[o]) for t < n_tokens, o < n_out.
 * x [n_tokens, n_in] f32; bias [n_out] f32 or NULL; y [n_tokens, n_out] f32 (written).
 * For Q8_0/Q4_0 weights x is quantized to Q8_0 blocks once per token (as pyrt_moe_ffn does);
 * rows are split across the pool's threads. */
int pyrt_linear(pyrt_pool *pool, const pyrt_matrix *w, const float *x, int n_tokens,
                const float *bias, float *y);

/* One matvec per head (mla.c): y[h, :] = w_h x[h, :] for h < n_heads, where w_h is rows
 * [h r, (h + 1) r) of w (r = n_out / n_heads; a per-head stack [n_heads, r, n_in] such as
 * deepseek2's attn_k_b / attn_v_b). x [n_heads, n_in] f32 (x_len floats), y [n_heads, r] f32
 * (y_len floats, written). Q8_0/Q4_0 as pyrt_linear (x quantized per head). */
int pyrt_linear_heads(pyrt_pool *pool, const pyrt_matrix *w, int n_heads, const float *x,
                      int64_t x_len, float *y, int64_t y_len);

/* A float32 vector read in place, with its length: the decoder checks every length against the
 * model's shape at creation and never reads past n. data == NULL (n 0) means "absent" where that
 * is allowed. */
typedef struct {
    const float *data;
    int64_t n;                      /* elements data holds */
} pyrt_vector;

/* One transformer block's weights (docs/gguf-layout.md names in brackets). Optional tensors are
 * vectors / matrices with data == NULL when the model has no such tensor. */
typedef struct {
    pyrt_vector attn_norm;          /* [n_embd] attn_norm */
    pyrt_matrix wq, wk, wv;         /* [n_head*head_dim | n_head_kv*head_dim, n_embd] attn_q/k/v */
    pyrt_matrix wo;                 /* [n_embd, n_head*head_dim] attn_output */
    pyrt_vector bq, bk, bv;         /* q/k/v biases [n_out of wq/wk/wv] (qwen2moe), or absent */
    pyrt_vector q_norm, k_norm;     /* absent; [n_head*head_dim] / [n_head_kv*head_dim] (olmoe,
                                       over all heads); or [head_dim] each (qwen3moe, per head) */
    pyrt_vector ffn_norm;           /* [n_embd] ffn_norm */
    pyrt_matrix router;             /* [n_expert, n_embd] ffn_gate_inp; data NULL: dense layer */
    const void *gud;                /* [n_expert, n_ff_exp, 3, n_embd] ffn_gud_exps */
    size_t gud_bytes;
    int gud_fmt;
    const void *gud_gates;          /* NULL, or [n_expert, n_ff_exp, n_embd] in gud_fmt: the gate
                                       rows of gud apart (pyrt_experts.gates), which sparse decode
                                       steps read; dense steps and prefill read gud */
    size_t gud_gates_bytes;
    pyrt_matrix sh_gate, sh_up;     /* [n_ff_shexp, n_embd] shared expert, or data NULL */
    pyrt_matrix sh_down;            /* [n_embd, n_ff_shexp] */
    pyrt_vector sh_gate_inp;        /* [n_embd]: shared output *= sigmoid(x . it), or absent */
    pyrt_matrix ffn_gate, ffn_up;   /* dense FFN layer (router.data == NULL): [n_ff, n_embd] */
    pyrt_matrix ffn_down;           /* [n_embd, n_ff] */
    /* gpt-oss (absent / 0 for the other families) */
    pyrt_vector bo;                 /* [n_embd] attn_output bias, or absent */
    pyrt_vector sinks;              /* [n_head] attn_sinks: a logit per head that joins the
                                       softmax's denominator (attends to nothing), or absent */
    int window;                     /* > 0: a query attends to its last `window` positions, itself
                                       included (sliding-window attention); 0: to all */
    pyrt_vector router_bias;        /* [n_expert] ffn_gate_inp bias, or absent */
    pyrt_vector exp_bias_gu;        /* [n_expert * n_ff_exp * 2] ffn_gu_exps, or absent */
    pyrt_vector exp_bias_down;      /* [n_expert * n_embd] ffn_down_exps (with exp_bias_gu) */
    /* multi-head latent attention (deepseek2; the model's mla_kv_rank > 0): wq, wk, wv absent,
       wo [n_embd, n_head * mla_v_dim]; with R = mla_kv_rank, D = mla_nope_dim, r = rope_dim */
    pyrt_matrix wq_a;               /* [mla_q_rank, n_embd] attn_q_a (query LoRA), or absent: */
    pyrt_matrix wq_b;               /* [n_head (D + r), mla_q_rank] attn_q_b; or, without the
                                       LoRA, [n_head (D + r), n_embd] attn_q */
    pyrt_vector q_a_norm;           /* [mla_q_rank] attn_q_a_norm (with wq_a) */
    pyrt_matrix wkv_a;              /* [R + r, n_embd] attn_kv_a_mqa */
    pyrt_vector kv_a_norm;          /* [R] attn_kv_a_norm */
    pyrt_matrix wk_b;               /* [n_head R, D] attn_k_b: head h's rows [h R, (h + 1) R) */
    pyrt_matrix wv_b;               /* [n_head mla_v_dim, R] attn_v_b */
    /* llama4 (0 for the other families) */
    int chunk;                      /* > 0: a query at position p attends to the positions of its
                                       own chunk up to itself, [p - p % chunk, p]; 0: to all */
    int nope;                       /* 1: a NoPE layer: no RoPE, no q/k L2 norm, q times the
                                       model's temperature of its position */
} pyrt_block_weights;

/* The whole model. Borrowed: every pointer must stay valid for the decoder's life. */
typedef struct {
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, rope_dim;
    int n_expert, n_expert_used, n_ff_exp;
    int expert_weights_norm;        /* renormalize the top-k routing weights to sum to 1 */
    int activation;                 /* PYRT_ACT_* of every FFN (routed, shared, dense) */
    float rms_eps;
    float embedding_scale, residual_scale, attention_scale, logit_scale;
    float clamp_kqv;                /* > 0: q, k, v clamped to [-clamp_kqv, clamp_kqv]; 0: none */
    pyrt_vector rope_inv_freq;      /* [rope_dim / 2]: theta^(-2i/rope_dim), HF rotate_half (or
                                       YaRN's blend of it) */
    float rope_scale;               /* cos and sin are multiplied by it (YaRN's attention factor);
                                       0: 1 */
    float swiglu_alpha, swiglu_limit; /* PYRT_ACT_SWIGLU_OAI's (limit > 0 with it) */
    /* multi-head latent attention (deepseek2; docs/gguf-layout.md): mla_kv_rank R > 0 makes
       every block MLA; the cache then holds per position [c_kv (R); k_pe (rope_dim)]: n_head_kv
       1, head_dim R + rope_dim, k and v the same storage. 0: none */
    int mla_kv_rank, mla_q_rank, mla_nope_dim, mla_v_dim;
    /* routing: the top-k weights times expert_weights_scale (0: 1); expert_groups > 1: the top-k
       taken within the expert_groups_used groups (of n_expert / expert_groups consecutive
       experts) whose best probability is highest; 0: no groups */
    float expert_weights_scale;
    int expert_groups, expert_groups_used;
    /* llama4 (0 for the other families) */
    int qk_l2_norm;                 /* 1: the rope layers' q and k, per head after RoPE, times
                                       1 / sqrt(mean(x^2) + rms_eps) */
    int temperature_length;         /* > 0: a NoPE layer's q at position p times
                                       1 + temperature_scale log(1 + floor((p + 1) / length)) */
    float temperature_scale;
    int expert_input_weight;        /* 1: routing = the top k of the router's logits, weights
                                       sigmoid(logit), each multiplying its expert's INPUT (the
                                       outputs summed as they are); 0: softmax top-k weights
                                       multiplying the outputs */
    pyrt_matrix token_embd;         /* [n_vocab, n_embd] */
    pyrt_matrix output;             /* [n_vocab, n_embd] (token_embd when tied) */
    pyrt_vector output_norm;        /* [n_embd] */
    const pyrt_block_weights *blocks; /* [n_blocks] */
    int n_blocks;                   /* entries of blocks: n_layer */
} pyrt_model_weights;

typedef struct pyrt_decoder pyrt_decoder;

/* Checks every shape, length and format once and allocates the step's scratch (for up to
 * n_expert experts per token); the weights are borrowed. */
int pyrt_decoder_create(const pyrt_model_weights *w, pyrt_decoder **out);
void pyrt_decoder_free(pyrt_decoder *dec);

/* The KV cache a step or a prefill reads and writes: per layer, the keys and the values of every
 * position, [n_head_kv, cap, head_dim] f32 each. Positions < the call's pos hold earlier tokens;
 * the call writes its own. */
typedef struct {
    float *const *k;             /* [n_layer]: layer i's keys */
    float *const *v;             /* [n_layer]: layer i's values */
    int n_layer;                 /* entries of k and v: the model's n_layer */
    int cap;                     /* positions each layer is laid out for */
    int64_t layer_floats;        /* floats each k[i] and v[i] holds (>= n_head_kv * cap *
                                    head_dim) */
} pyrt_kv_cache;

/* How a call's routed experts run. Zero-initialized: dense, the model's k, every expert here. */
typedef struct {
    const float *thresholds;     /* [n_thresholds] per-layer sparsity thresholds (0 = dense): a
                                    neuron whose |act(gate . x)| is under it is skipped; or NULL:
                                    all dense */
    int n_thresholds;            /* the model's n_layer when thresholds is set */
    int k;                       /* experts per token, [1, n_expert]; 0: the model's n_expert_used.
                                    The k chosen are renormalized as the model says
                                    (expert_weights_norm), whatever k is */
    const int32_t *const *maps;  /* NULL, or [n_maps] maps of map_len entries as in pyrt_experts
                                    over the layer's own experts (slots = ids): -1 = computed
                                    elsewhere, skipped here; a NULL entry: all computed here */
    int n_maps;                  /* the model's n_layer when maps is set */
    int map_len;                 /* entries of every map: the model's n_expert */
} pyrt_expert_args;

/* What one decode step takes and gives. Zero-initialize, then set the inputs; NULL pointers and
 * 0 are the defaults. Every pointer comes with the length of what it points at. */
typedef struct {
    /* in */
    int token;                   /* [0, n_vocab) */
    int pos;                     /* its position, [0, cache.cap) */
    pyrt_kv_cache cache;
    pyrt_expert_args experts;
    /* out (pointers NULL: not wanted, no work done for them) */
    float *logits;               /* [n_vocab] the next token's logits (required) */
    int64_t logits_len;          /* floats logits holds: >= n_vocab */
    int32_t *route_ids;          /* [n_layer, k] (k as resolved: n_expert_used when 0): each MoE
                                    layer's chosen experts in order of routing weight, every one
                                    chosen (computed here or not); -1 rows for dense-FFN layers */
    int64_t route_ids_len;       /* >= n_layer * k */
    float *route_logits;         /* [n_layer, n_expert]: the router's logits before the softmax;
                                    NaN rows for dense-FFN layers (no router) */
    int64_t route_logits_len;    /* >= n_layer * n_expert */
    int64_t n_active;            /* routed neurons computed, summed over layers and pairs */
    int64_t n_pairs;             /* (token, expert) pairs computed: k per MoE layer, less those a
                                    map sends elsewhere */
} pyrt_step_args;

/* One decode step of one token, all layers, on the pool: the logits of the token after
 * args->token, with args->n_active / n_pairs and the routing asked for. */
int pyrt_decoder_step(pyrt_decoder *dec, pyrt_pool *pool, pyrt_step_args *args);

/* The same step in pieces, so that a layer's attention or experts can run elsewhere in between
 * (the caller reads and writes the residual stream x with pyrt_decoder_read_x / _write_x):
 *   pyrt_decoder_begin(dec, pool, args)             x = embedding of args->token; n_active and
 *                                                   n_pairs = 0
 *   for each layer i, in order:
 *     pyrt_decoder_attention(dec, pool, i, args)    x += the attention half of block i (writes
 *                                                   position pos of layer i's cache)
 *     pyrt_decoder_ffn(dec, pool, i, args)          x += the FFN half of block i (its route_ids /
 *                                                   route_logits rows; n_active, n_pairs add up)
 *   pyrt_decoder_end(dec, pool, args)               args->logits from x
 * Called in that order they give pyrt_decoder_step's bits (which runs them fused where it can). */
int pyrt_decoder_begin(pyrt_decoder *dec, pyrt_pool *pool, pyrt_step_args *args);
int pyrt_decoder_attention(pyrt_decoder *dec, pyrt_pool *pool, int layer, pyrt_step_args *args);
int pyrt_decoder_ffn(pyrt_decoder *dec, pyrt_pool *pool, int layer, pyrt_step_args *args);
int pyrt_decoder_end(pyrt_decoder *dec, pyrt_pool *pool, pyrt_step_args *args);
/* The residual stream x [n_embd] f32 between those calls: copied out of / into the decoder. */
int pyrt_decoder_read_x(pyrt_decoder *dec, float *x);
int pyrt_decoder_write_x(pyrt_decoder *dec, const float *x);

/* ---- prefill: many tokens per call (prefill.c) ---- */

/* Tokens per chunk of a prefill when its args leave ubatch 0. Measured on granite-1b-a400m Q8_0
 * (bench/cpu_prefill.py, 1 thread, CPU time): 64 is 10-15% slower than 128-512, which are level
 * within the noise; the largest of the level ones serves each routed expert's rows to the most
 * tokens per read, which counts where DRAM, not arithmetic, is the limit (many threads). */
enum { PYRT_UBATCH_DEFAULT = 512 };

/* What one prefill takes and gives. Zero-initialize, then set the inputs. */
typedef struct {
    /* in */
    const int32_t *tokens;       /* [n_tokens] in [0, n_vocab) */
    int n_tokens;                /* >= 1 */
    int pos;                     /* position of tokens[0]: the cache holds positions < pos, the
                                    call writes [pos, pos + n_tokens) (<= cache.cap) */
    int ubatch;                  /* tokens per chunk, >= 1 (0: PYRT_UBATCH_DEFAULT): the prompt is
                                    processed chunk by chunk, each chunk's tokens through every
                                    layer together; the scratch grows with it, not with n_tokens */
    pyrt_kv_cache cache;
    pyrt_expert_args experts;    /* as a step's, for every token */
    int all_logits;              /* 0: the last token's logits [n_vocab]; 1: every token's
                                    [n_tokens, n_vocab], row i the logits of the token after
                                    tokens[i] */
    /* out */
    float *logits;               /* required */
    int64_t logits_len;          /* >= n_vocab, or n_tokens * n_vocab with all_logits */
    int32_t *route_ids;          /* [n_layer, k] of the last token, as a step's; or NULL */
    int64_t route_ids_len;
    float *route_logits;         /* [n_layer, n_expert] of the last token, as a step's; or NULL */
    int64_t route_logits_len;
    int64_t n_active;            /* routed neurons computed, over every token */
    int64_t n_pairs;             /* (token, expert) pairs computed, over every token */
} pyrt_prefill_args;

/* Runs args->n_tokens tokens through the model, writing their keys and values into the cache at
 * [pos, pos + n_tokens) and the logits asked for; the same math as that many steps (dense
 * matrices on all of a chunk's tokens at once, each routed expert once per chunk for the tokens
 * routed to it, the chunk's attention over the cache; multi-head latent attention's absorbed
 * form over the latent cache). */
int pyrt_decoder_prefill(pyrt_decoder *dec, pyrt_pool *pool, pyrt_prefill_args *args);

/* Time spent by the decoder's steps since the last reset, in ns: [0] embedding + attention
 * (norm, q/k/v, RoPE, attention, output projection), [1] FFN (norm, router, routed experts, shared
 * expert or dense FFN), [2] output (final norm, output matrix); [3] steps. reset != 0 zeroes it. */
int pyrt_decoder_times(pyrt_decoder *dec, int64_t *ns, int reset);

/* ---- a Gated DeltaNet layer's decode step (deltanet.c; qwen35moe's linear attention) ---- */

/* One Gated DeltaNet layer (pyruntime/model/deltanet.py): C = 2 Hk dk + Hv dv conv channels
 * (queries, keys, values), Hv value heads of dv, each key head (of dk) read by Hv / Hk
 * consecutive value heads; a conv kernel of K taps over time. Borrowed pointers. */
typedef struct {
    int n_embd, n_k_heads, n_v_heads, head_k_dim, head_v_dim, conv_kernel;
    float rms_eps;                  /* of the gated RMSNorm of each head's output */
    pyrt_matrix qkv;                /* [C, n_embd] attn_qkv */
    pyrt_matrix gate;               /* [Hv dv, n_embd] attn_gate: z, the output gate */
    pyrt_matrix beta;               /* [Hv, n_embd] ssm_beta */
    pyrt_matrix alpha;              /* [Hv, n_embd] ssm_alpha */
    pyrt_matrix out;                /* [n_embd, Hv dv] ssm_out */
    pyrt_vector conv;               /* [C, K] ssm_conv1d: tap K - 1 multiplies the newest input */
    pyrt_vector dt_bias;            /* [Hv] */
    pyrt_vector a;                  /* [Hv] A = -exp(A_log): the decay rates, < 0 */
    pyrt_vector norm;               /* [dv] ssm_norm */
} pyrt_deltanet;

/* One token through the layer: y [n_embd] (written) from x [n_embd] (the normed input), the
 * state advanced in place: conv_state [C, K - 1] f32 (each channel's last K - 1 inputs, oldest
 * first) and ssm_state [Hv, dk, dv] f32 (the delta rule's state per value head), their lengths
 * in floats given (checked against the shape). Per value head h:
 *   q, k = l2norm of the conv'd key head (q times dk^-1/2), v its value slice,
 *   beta = sigmoid(x . beta_h), g = a_h softplus(x . alpha_h + dt_bias_h),
 *   S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q,
 * then y = out . (RMSNorm(o) * norm * silu(z)). The in-projections are one pool task, the heads
 * another, the out-projection a third. */
int pyrt_deltanet_step(pyrt_pool *pool, const pyrt_deltanet *w, const float *x,
                       float *conv_state, int64_t conv_n, float *ssm_state, int64_t ssm_n,
                       float *y);
/* PYRT_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* PYRT_H */
