"""An untied token embedding in host memory, for the hybrid executor.

An untied token_embd (the output has a tensor of its own) is read only by the lookup, one row a
token. The hybrid leaves it in the mapped GGUF, where llama.cpp keeps it too, and spends its
device bytes on expert slots (gpt-oss-20b: 201,088 x 2,880 Q8_0, 0.57 GiB, ~75 slots). The rows
of a pass's tokens are dequantized on the host into float32, bit for bit the values the GPU's
lookup makes of a device copy (pyruntime.gpu.layers.DecoderLayers.embed):

- Q8_0, and Q4_0 (which the GPU keeps as the same weights in Q8_0): d * q, exact in f32, times
  the embedding scale (one rounding, as kernels.q8_embed);
- any other type: the dequantized value rounded to the activation dtype (the GPU's float copy,
  pyruntime.gpu.weights.upload_dense), back to f32, times the scale.

A decode step writes its row into the page-locked `x0` of its step buffers, which segment 0's
graph copies to the device (pyruntime.offload.segments); a prefill uploads its rows through one
pinned buffer, at most CHUNK_ELEMENTS floats at a time. A tied token_embd is the lm_head: it
stays on the GPU, and the lookup reads it there.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pyruntime.gguf.quant import QuantMatrix, dequantize

Q = GGMLQuantizationType
# Floats of the pinned buffer a prefill's rows go up through (8 MiB: 728 rows of 2,880).
CHUNK_ELEMENTS = 1 << 21
QK = 32  # weights of a Q8_0 / Q4_0 block
BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18}  # f16 d, then 32 int8 (Q8_0) or 16 bytes of nibbles


class HostEmbedding:
    """token_embd [n_vocab, n_embd] read in place from the GGUF mapping (module doc)."""

    def __init__(self, m: QuantMatrix, scale: float, dtype: torch.dtype) -> None:
        """scale: the model's embedding scale; dtype: the GPU's activation dtype (the float copy
        a non-Q8_0 embedding would have had there)."""
        self.n_vocab, self.n_embd = m.shape
        self.qtype = m.qtype
        self.by_row = np.asarray(m.raw).reshape(-1).view(np.uint8).reshape(self.n_vocab, -1)
        self.scale = np.float32(scale)
        self.dtype = dtype
        self.nbytes = self.by_row.nbytes
        self._pinned: torch.Tensor | None = None  # [chunk rows, n_embd] f32, made on first use

    def rows(self, ids: int | np.ndarray, out: np.ndarray) -> None:
        """out f32 [n, n_embd] (contiguous) = the rows of ids (one id, or int64 [n])."""
        picked = self.by_row[ids]  # [row_bytes] (a view) or [n, row_bytes] (a copy)
        if self.qtype in BLOCK_BYTES:
            blocks = picked.reshape(-1, BLOCK_BYTES[self.qtype])
            d = blocks[:, :2].view(np.float16)  # [nb, 1]
            x = out.reshape(-1, QK)
            if self.qtype == Q.Q8_0:
                np.multiply(blocks[:, 2:].view(np.int8), d, out=x, dtype=np.float32)
            else:  # element j of a block: the low nibble of byte j, element 16 + j: its high one
                qs = blocks[:, 2:]
                np.multiply((qs & 0x0F).view(np.int8) - np.int8(8), d, out=x[:, : QK // 2],
                            dtype=np.float32)  # fmt: skip
                np.multiply((qs >> 4).view(np.int8) - np.int8(8), d, out=x[:, QK // 2 :],
                            dtype=np.float32)  # fmt: skip
        else:
            n = out.shape[0]
            t = dequantize(picked.reshape(n, -1), self.qtype, (n, self.n_embd))
            out[:] = t.to(self.dtype).float().numpy()
        if self.scale != 1.0:
            np.multiply(out, self.scale, out=out)

    def upload(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x [n, n_embd] f32 on `device` (a new tensor) of token ids [n] (int64, on the host):
        the rows written on the host and copied up in chunks through the pinned buffer (each
        copy waited for, so the buffer can take the next chunk)."""
        ids_np = ids.numpy()
        x = torch.empty(len(ids_np), self.n_embd, dtype=torch.float32, device=device)
        step = max(1, CHUNK_ELEMENTS // self.n_embd)
        if self._pinned is None:
            self._pinned = torch.empty(step, self.n_embd, dtype=torch.float32,
                                       pin_memory=device.type == "cuda")  # fmt: skip
        buf = self._pinned.numpy()
        for a in range(0, len(ids_np), step):
            b = min(a + step, len(ids_np))
            self.rows(ids_np[a:b], buf[: b - a])
            x[a:b].copy_(self._pinned[: b - a])  # synchronous: the buffer is free after it
        return x
