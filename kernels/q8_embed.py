"""The token-embedding lookup from Q8_0 rows kept quantized on the GPU: x = scale * W[ids].

W [n_vocab, K] is a Q8_0 matrix split as kernels.q8_linear keeps dense weights (q int8 [n_vocab,
K], d f16 [n_vocab, K / 32]); the same (q, d) serve a tied lm_head, so the embedding has one
device copy (1.0625 bytes a weight) and no float copy for the lookup. `q8_embed` gathers and
dequantizes the rows of `ids` into float32: x[t, k] = scale * d[id, k // 32] * q[id, k], the
exact products (the f16 scale and the int8 quant are exact in fp32), rounded once by `scale`.

No host sync and one output allocation of a fixed size per call: it runs inside a captured
CUDA graph (pyruntime.offload.segments' segment 0) with the ids in a static buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting
from .q8_linear import dequantize_q8


@triton.jit
def _q8_embed_kernel(ids_ptr, q_ptr, d_ptr, x_ptr, K, KB, scale, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < K
    row = tl.load(ids_ptr + t).to(tl.int64)
    q = tl.load(q_ptr + row * K + k, mask=km, other=0).to(tl.float32)
    d = tl.load(d_ptr + row * KB + k // 32, mask=km, other=0.0).to(tl.float32)
    tl.store(x_ptr + t * K + k, q * d * scale, mask=km)


def embed_config(K: int) -> tuple[int, int]:
    """(BLOCK_K columns per program, num_warps): a row in one or a few programs (an embedding
    row is K bytes + K / 16 bytes of scales; the lookup is a few KiB a token)."""
    if interpreting():
        return triton.next_power_of_2(K), 1  # one program a row: the interpreter runs each
    return min(1024, triton.next_power_of_2(K)), 4


def q8_embed(
    ids: torch.Tensor, q: torch.Tensor, d: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """ids [n] (int32 / int64, on q's device, each in [0, n_vocab)) -> x [n, K] float32."""
    N, K = q.shape
    if ids.dim() != 1 or d.shape != (N, K // 32) or K % 32 or q.dtype != torch.int8:
        raise ValueError(f"ids [n], q int8 [N, K], d [N, K/32]: got ids {list(ids.shape)}, "
                         f"q {q.dtype} {list(q.shape)}, d {list(d.shape)}")  # fmt: skip
    n = ids.shape[0]
    x = torch.empty(n, K, device=q.device, dtype=torch.float32)
    if n == 0:
        return x
    block_k, warps = embed_config(K)
    _q8_embed_kernel[(n, triton.cdiv(K, block_k))](
        ids, q, d, x, K, K // 32, float(scale), BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return x


def q8_embed_ref(ids: torch.Tensor, q: torch.Tensor, d: torch.Tensor, scale: float = 1.0):
    """Plain torch: dequantize the whole matrix in float32, then index its rows, then scale."""
    return dequantize_q8(q, d, torch.float32)[ids.long()] * scale
