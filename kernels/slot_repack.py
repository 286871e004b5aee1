"""GGUF expert blocks staged on the device -> repacked rows in expert slots, in one launch.

    src   [n, rows * in_rb] uint8      n staged experts, each `rows` GGUF rows of in_rb bytes
    out   [n_slots, rows, ..., out_rb]  the slot tensor (uint8 rows of out_rb bytes)
    slots n ints                        staged expert j goes to out[slots[j]]

What `kernels.expert_formats.repack_rows` followed by an index_copy_ into the slots does (the
same bytes per row: [quants of the row][scales of the row][zero padding to ROW_ALIGN]), as one
gather of bytes: output byte o of a row comes from GGUF block o // QB's quants, or, past the
row's quants, from block s // SB's scale bytes (s = o - quants), or is padding (0). The slot
numbers are the launch's scalar arguments (up to MAX_BATCH a launch), so a staged round needs
no index tensor on the device and no host-to-device copy for it. Pure byte moves: 2 x the
staged bytes of device bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .expert_formats import BLOCKS, REPACKED, SCALE_BYTES, row_bytes
from .launch import interpreting

MAX_BATCH = 8  # staged experts (slot numbers) per launch
_SLOT_ARGS = [f"S{j}" for j in range(MAX_BATCH)]


@triton.jit(do_not_specialize=_SLOT_ARGS)
def _repack_slots_kernel(src_ptr, out_ptr, S0, S1, S2, S3, S4, S5, S6, S7, ROWS, IN_RB, OUT_RB,
                         NQ, NS, QB: tl.constexpr, SB: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_O: tl.constexpr):  # fmt: skip
    j = tl.program_id(0)
    slot = tl.where(j == 0, S0, tl.where(j == 1, S1, tl.where(j == 2, S2, S3)))
    slot = tl.where(
        j < 4, slot, tl.where(j == 4, S4, tl.where(j == 5, S5, tl.where(j == 6, S6, S7)))
    )
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    is_q = o < NQ  # the row's quants, block o // QB
    s = o - NQ
    is_s = (s >= 0) & (s < NS)  # the row's scales, block s // SB
    col = tl.where(is_q, (o // QB) * (QB + SB) + SB + o % QB, (s // SB) * (QB + SB) + s % SB)
    rm = rows < ROWS
    src = src_ptr + (j.to(tl.int64) * ROWS + rows[:, None]) * IN_RB + col[None, :]
    v = tl.load(src, mask=rm[:, None] & (is_q | is_s)[None, :], other=0)
    dst = out_ptr + (slot.to(tl.int64) * ROWS + rows[:, None]) * OUT_RB + o[None, :]
    tl.store(dst, v, mask=rm[:, None] & (o < OUT_RB)[None, :])


def repack_into_slots(src: torch.Tensor, slots: Sequence[int], out: torch.Tensor, fmt: str,
                      n_embd: int) -> None:  # fmt: skip
    """out[slots[j]] = repack_rows(src[j] as out's rows, fmt) for each j (module doc); src:
    uint8 [n, expert bytes] of GGUF `fmt` (q8_0, q4_0, mxfp4) blocks of rows of n_embd
    elements, out: the uint8 slot tensor in REPACKED[fmt]'s layout, contiguous. Queued on the
    current stream."""
    if fmt not in REPACKED:
        raise ValueError(f"only {sorted(REPACKED)} are repacked, got {fmt!r}")
    n = len(slots)
    if n == 0:
        return
    elems, size = BLOCKS[fmt]
    out_rb = row_bytes(REPACKED[fmt], n_embd)
    if out.shape[-1] != out_rb:
        raise ValueError(f"{REPACKED[fmt]} rows of {n_embd} elements have {out_rb} bytes, "
                         f"out's have {out.shape[-1]}")  # fmt: skip
    in_rb = row_bytes(fmt, n_embd)
    rows = out[0].numel() // out_rb
    if src.dtype != torch.uint8 or src.shape[0] < n or src[0].numel() != rows * in_rb:
        raise ValueError(f"src must be uint8 [>= {n}, {rows * in_rb}] {fmt} experts, got "
                         f"{src.dtype} {list(src.shape)}")  # fmt: skip
    if not (src.is_contiguous() and out.is_contiguous() and out.dtype == torch.uint8):
        raise ValueError("src and out must be contiguous, out uint8")
    sb = SCALE_BYTES[fmt]
    nb = n_embd // elems
    block_r, block_o = (64, 1024) if interpreting() else (8, 512)
    block_o = min(block_o, triton.next_power_of_2(out_rb))
    for j in range(0, n, MAX_BATCH):
        chunk = list(slots[j : j + MAX_BATCH])
        args = chunk + [chunk[0]] * (MAX_BATCH - len(chunk))
        grid = (len(chunk), triton.cdiv(rows, block_r), triton.cdiv(out_rb, block_o))
        _repack_slots_kernel[grid](src[j:], out, *args, rows, in_rb, out_rb, nb * (size - sb),
                                   nb * sb, QB=size - sb, SB=sb, BLOCK_R=block_r,
                                   BLOCK_O=block_o)  # fmt: skip
