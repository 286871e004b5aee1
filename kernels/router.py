"""MoE routing in one launch: softmax over all experts, top-k, optional renormalization.

    p = softmax(logits[t]);  ids[t] = the k largest p, descending;  w[t] = p[ids]
    (renormalize: w /= sum(w), which equals softmax over the k selected logits)

Same numbers as pyruntime.experts.compute.route (torch softmax + topk), which took three to four
kernel launches and ~10 µs per layer on an H100 at batch 1 (torch's topk sorts). One program per
token; the k picks are k masked arg-max passes over the n_expert probabilities in registers
(ties: the smaller expert id first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _router_topk_kernel(logit_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_E: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    logits = tl.load(logit_ptr + t * E + e, mask=em, other=float("-inf"))
    z = tl.exp(logits - tl.max(logits, axis=0))
    p = z / tl.sum(z, axis=0)  # [BLOCK_E]; 0 off the mask
    p = tl.where(em, p, -1.0)  # never picked
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        tl.store(ids_ptr + t * K + j, idx.to(tl.int64))
        tl.store(w_ptr + t * K + j, best)
        total += best
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        for j in tl.static_range(K):
            tl.store(w_ptr + t * K + j, tl.load(w_ptr + t * K + j) / total)


def router_topk(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, n_expert] float32 -> (ids [T, k] int64, weights [T, k] float32)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous float32 [T, n_expert], got {logits.dtype}")
    if not 0 < k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k}")
    ids = torch.empty(T, k, device=logits.device, dtype=torch.int64)
    w = torch.empty(T, k, device=logits.device, dtype=torch.float32)
    _router_topk_kernel[(T,)](
        logits, ids, w, E, K=k, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(E),
        num_warps=1,
    )  # fmt: skip
    return ids, w
