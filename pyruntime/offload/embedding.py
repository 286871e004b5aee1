"""An untied token embedding in host memory, for the hybrid executor.

An untied token_embd (the output has a tensor of its own) is read only by the lookup, one row a
token. The hybrid leaves it in the mapped GGUF, where llama.cpp keeps it too, and spends its
device bytes on expert slots (gpt-oss-20b: 201,088 x 2,880 Q8_0, 0.57 GiB, ~75 slots). A
pass's rows reach the GPU as float32, bit for bit the values the GPU's lookup makes of a device
copy (pyruntime.gpu.layers.embedding_rows):

- decode: the host dequantizes the step's row into the page-locked `x0` of the step buffers,
  which segment 0's graph copies up (pyruntime.offload.segments). Q8_0, and Q4_0 (which the GPU
  keeps as the same weights in Q8_0): d * q, exact in f32, times the embedding scale (one
  rounding, as kernels.q8_embed); any other type: the dequantized value rounded to the
  activation dtype (the GPU's float copy: pyruntime.gpu.weights.upload_dense), back to f32,
  times the scale.
- prefill: the tokens' stored rows (1.06 bytes a weight at Q8_0) go up as they are, at most
  CHUNK_ELEMENTS weights at a time, and the device converts them with the upload's and the
  lookup's own code (upload_linear, embedding_rows).

A tied token_embd is the lm_head: it stays on the GPU, and the lookup reads it there.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pyruntime.gguf.quant import QuantMatrix, dequantize
from pyruntime.gpu.layers import embedding_rows
from pyruntime.gpu.weights import upload_linear

Q = GGMLQuantizationType
# Weights of the rows a prefill converts on the device at once (2 Mi: 728 rows of 2,880; a
# Q8_0 chunk is 2.1 MiB up, 8 MiB of f32 rows).
CHUNK_ELEMENTS = 1 << 21
QK = 32  # weights of a Q8_0 / Q4_0 block
BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18}  # f16 d, then 32 int8 (Q8_0) or 16 bytes of nibbles


class HostEmbedding:
    """token_embd [n_vocab, n_embd] read in place from the GGUF mapping (module doc)."""

    def __init__(self, m: QuantMatrix, scale: float, dtype: torch.dtype) -> None:
        """scale: the model's embedding scale; dtype: the GPU's activation dtype (the float copy
        a non-Q8_0 embedding would have had there)."""
        self.n_vocab, self.n_embd = m.shape
        self.qtype, self.name = m.qtype, m.name
        self.by_row = np.asarray(m.raw).reshape(-1).view(np.uint8).reshape(self.n_vocab, -1)
        self.nbytes = self.by_row.nbytes
        self.scale = float(scale)
        self.dtype = dtype
        if self.qtype in BLOCK_BYTES:  # the blocks' scales and quants as views of the mapping
            blocks = self.by_row.reshape(self.n_vocab, -1, BLOCK_BYTES[self.qtype])
            self._d = blocks[:, :, :2].view(np.float16)  # [n_vocab, nb, 1]
            self._q = blocks[:, :, 2:]  # [n_vocab, nb, 32 int8 (Q8_0) or 16 uint8 (Q4_0)]
            if self.qtype == Q.Q8_0:
                self._q = self._q.view(np.int8)
            self._d32 = np.empty((blocks.shape[1], 1), dtype=np.float32)  # a row's scales

    def row(self, token: int, out: np.ndarray) -> None:
        """out f32 [1, n_embd] (contiguous) = the embedding of `token` (a decode step's). The
        block formats through casts into f32 buffers and one product, each exact (numpy's mixed
        int8 x f16 product took twice as long: ~7 of ~9 us a row)."""
        if self.qtype in BLOCK_BYTES:
            x, q = out.reshape(-1, QK), self._q[token]
            if self.qtype == Q.Q8_0:
                np.copyto(x, q)
            else:  # element j of a block: byte j's low nibble - 8; 16 + j: its high one - 8
                np.copyto(x[:, : QK // 2], q & 0x0F)
                np.copyto(x[:, QK // 2 :], q >> 4)
                np.subtract(x, np.float32(8), out=x)
            np.copyto(self._d32, self._d[token])
            np.multiply(x, self._d32, out=x)
        else:
            t = dequantize(self.by_row[token], self.qtype, (1, self.n_embd))
            out[:] = t.to(self.dtype).float().numpy()
        if self.scale != 1.0:
            np.multiply(out, np.float32(self.scale), out=out)

    def upload(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x [n, n_embd] f32 on `device` (a new tensor) of token ids [n] (int64, on the host):
        each chunk's stored rows copied up and converted there (module doc)."""
        ids_np = ids.numpy()
        x = torch.empty(len(ids_np), self.n_embd, dtype=torch.float32, device=device)
        step = max(1, CHUNK_ELEMENTS // self.n_embd)
        for a in range(0, len(ids_np), step):
            picked = self.by_row[ids_np[a : a + step]]  # [rows, row_bytes], a copy
            rows = QuantMatrix(self.name, self.qtype, (len(picked), self.n_embd), picked)
            e = upload_linear(rows, device, self.dtype)
            at = torch.arange(len(picked), device=device)
            x[a : a + len(picked)] = embedding_rows(e, at, self.scale)
        return x
