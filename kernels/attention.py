"""Decode attention (one query token) over a static KV cache, split along the sequence.

    out[h] = softmax(scale * K[kv(h), :n] @ q[h]) @ V[kv(h), :n]      kv(h) = h // (n_head / n_kv)

The cached length n is read from a device tensor, not passed from the host, so one launch is
valid at every position: a CUDA graph captured once replays for every decoded token. Only the
first n positions of the cache are read (the static cache is allocated for the whole context).

Split-K ("flash-decoding") in one launch: program (h, s) takes split s of the n positions
(cdiv(n, N_SPLIT) of them, computed in the kernel from n, so the work stays spread over all
splits at any length), in BLOCK_S-position tiles, and writes its running max m, sum l and
unnormalized output acc [D]. The last split of head h to finish (kernels.grid_sync) merges the
N_SPLIT partials: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s. Splits past n write
m = -inf, l = 0. Math in fp32 whatever the cache dtype; exponentials as exp2 with log2(e) folded
into the scale. (A second launch for the combine costs ~1.8 µs per layer on an H100.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .grid_sync import counters, last_arrival, reset_counter
from .launch import interpreting
from .tuning import lookup

LOG2E = 1.4426950408889634
# Launch defaults: H100, olmoe shape (16 heads of 128), graph-timed by bench/gpu_kernels.py
# (16 layers' caches): 32 splits of 16-position tiles, one warp per program (its reductions
# stay in the warp: no CTA barriers) took 4.6 µs a layer at 128 positions and 7.7 µs at 513
# (split and combine kernels in two launches: 5.4 and 10.3 µs).
DECODE_BLOCK_S, DECODE_PROGRAMS, DECODE_WARPS = 16, 512, 1


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, out_ptr,
                        sink_ptr, stride_kvh, GROUP, scale_log2, window, chunk, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, N_SPLIT: tl.constexpr,
                        HAS_SINKS: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    sp = tl.program_id(1)
    kvh = h // GROUP
    n = tl.load(len_ptr).to(tl.int32)
    # a sliding window (window > 0) attends to the last `window` positions only
    first = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    # chunked attention (chunk > 0, llama4): the keys of the query's own chunk (query at n - 1)
    first = tl.where(chunk > 0, (n - 1) // tl.maximum(chunk, 1) * chunk, first)
    chunk = tl.cdiv(n - first, N_SPLIT)
    start = first + sp * chunk
    end = tl.minimum(start + chunk, n)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + h * D + d, mask=dm, other=0.0).to(tl.float32) * scale_log2
    m_i = tl.full([1], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    base = kvh.to(tl.int64) * stride_kvh
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        sm = s < end
        off = base + s[:, None].to(tl.int64) * D + d[None, :]
        kv_mask = sm[:, None] & dm[None, :]
        # K and V tiles issued together: one memory round trip per tile, not two
        k = tl.load(k_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        v = tl.load(v_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)
        sc = tl.sum(k * q[None, :], axis=1)
        sc = tl.where(sm, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new)  # [BLOCK_S]; 0 off the mask
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    row = h * N_SPLIT + sp
    one = tl.arange(0, 1)
    tl.store(m_ptr + row + one, m_i)
    tl.store(l_ptr + row + one, l_i)
    tl.store(acc_ptr + row * D + d, acc, mask=dm)
    if last_arrival(cnt_ptr + h, N_SPLIT):
        sps = tl.arange(0, N_SPLIT)
        m = tl.load(m_ptr + h * N_SPLIT + sps, cache_modifier=".cg")  # [N_SPLIT]
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:  # the sink's logit joins the denominator (log2 units, as the scores)
            sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        w = tl.exp2(m - m_max)  # 0 for empty splits (m = -inf)
        l_sum = tl.sum(tl.load(l_ptr + h * N_SPLIT + sps, cache_modifier=".cg") * w, axis=0)
        if HAS_SINKS:
            l_sum += tl.exp2(sink - m_max)
        part = tl.load(acc_ptr + (h * N_SPLIT + sps)[:, None] * D + d[None, :],
                       mask=dm[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        out = tl.sum(part * w[:, None], axis=0) / l_sum
        tl.store(out_ptr + h * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)
        reset_counter(cnt_ptr + h)


def decode_splits(n_head: int, max_tokens: int, block_s: int, programs: int = 512) -> int:
    """Splits per head: ~`programs` programs in all (an H100 has 132 SMs; a split is one or a few
    BLOCK_S-position tiles, so many small programs keep many loads in flight), never more than
    the cache's BLOCK_S-position blocks. A power of two (tl.arange in the merge)."""
    want = max(1, min(64, programs // max(n_head, 1), triton.cdiv(max_tokens, block_s)))
    return 1 << (want.bit_length() - 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float,
    n_split: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """q [n_head, D]; k_cache, v_cache [n_kv, max_tokens, D] (contiguous rows); seq_len [1]
    int32/int64 device tensor (1 <= n <= max_tokens positions to attend). Returns [n_head, D]
    in q's dtype. window > 0: only the last `window` of the n positions (sliding-window
    attention); sinks: None or [n_head] f32 logits that join each head's softmax denominator
    (gpt-oss); chunk > 0: only the positions of the query's chunk of `chunk` positions (the query
    is position n - 1: positions (n - 1) // chunk * chunk .. n - 1; llama4). No host
    synchronization (graph-capturable). n_split, block_s, num_warps:
    default from decode_splits, DECODE_BLOCK_S, DECODE_PROGRAMS, DECODE_WARPS (or the
    kernels.tuning overrides)."""
    n_head, D = q.shape
    n_kv, max_tokens, d_k = k_cache.shape
    if d_k != D or v_cache.shape != k_cache.shape or n_head % n_kv:
        raise ValueError(
            f"q {list(q.shape)}, k {list(k_cache.shape)}, v {list(v_cache.shape)}: need "
            "q [n_head, D], k = v [n_kv, max_tokens, D] with n_head % n_kv == 0"
        )
    if k_cache.stride(2) != 1 or k_cache.stride(1) != D or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have contiguous [max_tokens, D] rows per head")
    if seq_len.numel() != 1 or seq_len.dtype not in (torch.int32, torch.int64):
        raise ValueError("seq_len must be a [1] int32 or int64 tensor")
    q = q.contiguous()
    tuned = lookup("attention") or {}
    block_s = block_s or tuned.get("block_s", DECODE_BLOCK_S)
    programs = tuned.get("programs", DECODE_PROGRAMS)
    n_split = n_split or decode_splits(n_head, max_tokens, block_s, programs)
    num_warps = num_warps or tuned.get("num_warps", DECODE_WARPS)
    if n_split & (n_split - 1):
        raise ValueError(f"n_split must be a power of two, got {n_split}")
    f32 = dict(device=q.device, dtype=torch.float32)
    m = torch.empty(n_head * n_split, **f32)
    l_sum = torch.empty(n_head * n_split, **f32)
    acc = torch.empty(n_head * n_split, D, **f32)
    out = torch.empty_like(q)
    if sinks is not None and (sinks.shape != (n_head,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [{n_head}], got {sinks.dtype} {list(sinks.shape)}")
    _decode_attn_kernel[(n_head, n_split)](
        q, k_cache, v_cache, seq_len, m, l_sum, acc, counters(q.device, n_head), out,
        m if sinks is None else sinks, k_cache.stride(0), n_head // n_kv, scale * LOG2E,
        int(window), int(chunk), D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=block_s,
        N_SPLIT=n_split,
        HAS_SINKS=sinks is not None, num_warps=1 if interpreting() else num_warps,
    )  # fmt: skip
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Plain torch: softmax attention of each head over the first n cached positions (the last
    `window` of them when window > 0, those of the last position's chunk when chunk > 0), with
    sinks[h] in the denominator when given, fp32."""
    group = q.shape[0] // k_cache.shape[0]
    first = max(0, n - window) if window > 0 else 0
    if chunk > 0:
        first = (n - 1) // chunk * chunk
    k = k_cache[:, first:n].float().repeat_interleave(group, dim=0)  # [n_head, n', D]
    v = v_cache[:, first:n].float().repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hnd->hn", q.float(), k) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
    p = torch.softmax(scores, dim=-1)[:, : k.shape[1]]
    return torch.einsum("hn,hnd->hd", p, v)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
