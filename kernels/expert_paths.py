"""Which kernel computes a layer's routed experts: one table, read by one function.

`expert_path(fmt, n_embd, n_tok, switch)` is the whole decision of kernels.dispatch.moe_experts
(and of moe_dense / moe_sparse with path="auto"): dense or sparse from the layer's SparseSwitch
(profiled per GPU, kernels.switch), then the kernel from PATHS by format family and batch size.

Paths, dense:
  q8r_pipe     kernels.moe_q8r_pipe: persistent, the next neuron tile's rows requested before
               the current tile's arithmetic; dp4a dots on Q8-quantized x (as the C core)
  q4r_pipe     kernels.moe_q4r_pipe: q8r_pipe's schedule on 4-bit rows (q4_0r, mxfp4r): dp4a
               dots with the nibbles expanded to int8 lanes in registers; takes biases and
               swiglu_oai (gpt-oss)
  q8r_stream   kernels.moe_q8r_stream: one pair's neuron range per program, tiles through shared
               memory (cp.async); dp4a dots
  gemv         kernels.moe_dense._moe_gemv_kernel: one program per (pair, neuron tile)
  gemm         pairs grouped by expert (moe_align), two grouped GEMMs on tl.dot tiles
Paths, sparse (up/down rows of neurons with |act(gate)| under the threshold skipped):
  q8r_sparse2  two phases per persistent program: gate tiles, then the kept neurons' rows
  q8r_sparse   kernels.moe_q8r._moe_q8r_kernel: kept neurons compacted in registers
  fused        _moe_gemv_kernel in its sparse mode: gate, mask and kept rows in one kernel
  gemv_mask    gate GEMV + kernels.sparse_mask + compacted up-down kernel
  gemm_mask    gate GEMM + kernels.sparse_mask + compacted up-down kernel
  split        gate-up kernel + down kernel (not in the table: it lost to "fused" everywhere it
               was timed, 30 vs 23 us bf16, 69 vs 26 us q8_0r at batch 1; kept for comparisons)

Format families: "q8r" (q8_0r with n_embd % 64 == 0: rows 4-byte aligned for the dp4a kernels),
"q4r" (q4_0r, mxfp4r: kernels.expert_formats.q4r_supported), "packed" (other q8_0r), "block"
(GGUF q8_0 / q4_0 read unrepacked), "float".
"""

from __future__ import annotations

from dataclasses import dataclass

from .expert_formats import format_family, q4r_supported, q8r_supported

ANY = 1 << 62  # "any number of tokens" in PATHS

# (family, sparse) -> ((max tokens, path), ...): the first entry with n_tok <= max tokens.
# H100, three real expert shapes (bench/sweep_q8r.py, bench/sweep_moe.py, bench/moe_layer.py):
# - q8r dense: q8r_pipe 1.18-1.24x the one-wave kernel at batch 1; q8r_stream 1.23-1.33x
#   q8r_pipe at batch 16, 0.98-1.09x at 4, 0.80-0.84x at 1 (all programs of the token add
#   into one y row at the end); q8r 0.94-1.12x gemv at batch 1, 1.28-1.34x at 4, and
#   1.10-2.0x gemm at 16.
# - q8r sparse (sparsity 0.85): q8r_sparse 1.16-1.20x fused at batch 1, 1.56-1.83x at 4,
#   1.66-1.75x gemv_mask at 16; q8r_sparse2 0.90-0.94x the time of q8r_sparse at batch 1,
#   within 1-2% at 4 and 16.
# - q4r dense (H200, gpt-oss-20b mxfp4r with biases and swiglu_oai / qwen3.5 q4_0r, one layer,
#   CUDA graph, L2 flushed): q4r_pipe 1.60x / 1.38x gemv at batch 1, 1.26x / 1.64x at 2,
#   1.20x / 2.14x at 8 (x quantized by one launch first above 1 token); not timed against gemm.
#   Since, q4r_pipe with row pieces and the down rows through the gate/up lanes (H100, same
#   layer; former time / new time): 1.28x / 1.18x at batch 1, 1.63-1.75x / 1.15-1.25x at 2-8.
# - packed / float: the sweep's fastest at batch 1, 4, 16; block: a hand sweep's choice.
# - gemv vs gemm (dense): gemv up to 8 tokens (bench/moe_layer.py).
PATHS: dict[tuple[str, bool], tuple[tuple[int, str], ...]] = {
    ("q8r", False): ((7, "q8r_pipe"), (16, "q8r_stream"), (ANY, "gemm")),
    ("q8r", True): ((1, "q8r_sparse2"), (16, "q8r_sparse"), (ANY, "gemm_mask")),
    ("q4r", False): ((8, "q4r_pipe"), (ANY, "gemm")),
    ("q4r", True): ((4, "fused"), (16, "gemv_mask"), (ANY, "gemm_mask")),
    ("packed", False): ((8, "gemv"), (ANY, "gemm")),
    ("packed", True): ((4, "fused"), (16, "gemv_mask"), (ANY, "gemm_mask")),
    ("block", False): ((8, "gemv"), (ANY, "gemm")),
    ("block", True): ((1, "fused"), (8, "gemv_mask"), (ANY, "gemm_mask")),
    ("float", False): ((8, "gemv"), (ANY, "gemm")),
    ("float", True): ((16, "fused"), (ANY, "gemm_mask")),
}
DENSE_PATHS = ("q8r_pipe", "q4r_pipe", "q8r_stream", "gemv", "gemm")
SPARSE_PATHS = ("q8r_sparse2", "q8r_sparse", "fused", "split", "gemv_mask", "gemm_mask")
Q8R_PATHS = ("q8r_pipe", "q8r_stream", "q8r_sparse2", "q8r_sparse")  # need q8r_supported
Q4R_PATHS = ("q4r_pipe",)  # need q4r_supported
# Paths that take expert biases and the GENERIC_ONLY activations (kernels.moe_args).
BIAS_PATHS = ("q4r_pipe", "gemv", "gemm", "fused")


@dataclass(frozen=True)
class SparseSwitch:
    """At which batch sizes a layer's sparse path beats its dense one (kernels.switch profiles
    it per GPU and layer): the profiled batch sizes (ascending) and those where sparse won."""

    profiled: tuple[int, ...] = ()
    won: tuple[int, ...] = ()

    @classmethod
    def up_to(cls, n: int) -> SparseSwitch:
        """Sparse for every batch of at most n tokens (0: never), dense above."""
        return cls((n,), (n,)) if n >= 1 else cls()

    def use_sparse(self, n_tok: int) -> bool:
        """The decision of the smallest profiled batch >= n_tok; dense past the last one."""
        return next((b in self.won for b in self.profiled if b >= n_tok), False)


def path_family(fmt: str, n_embd: int) -> str:
    """The PATHS family of a layer's expert format and row length."""
    if q8r_supported(fmt, n_embd):
        return "q8r"
    return "q4r" if q4r_supported(fmt, n_embd) else format_family(fmt)


# Layers with expert biases or a GENERIC_ONLY activation (gpt-oss): the generic kernels, or a
# family's own table where every path of it takes them (BIAS_PATHS: q4r dense).
GENERIC_PATHS = {False: ((8, "gemv"), (ANY, "gemm")), True: ((ANY, "fused"),)}


def table_path(fmt: str, n_embd: int, n_tok: int, sparse: bool, generic: bool = False) -> str:
    """PATHS' kernel for n_tok tokens of experts in `fmt` (rows of n_embd), dense or sparse;
    generic: biases or swiglu_oai (kernels.moe_args): the family's rows if all of them take
    those (BIAS_PATHS), else GENERIC_PATHS'."""
    rows = PATHS[(path_family(fmt, n_embd), sparse)]
    if generic and any(path not in BIAS_PATHS for _, path in rows):
        rows = GENERIC_PATHS[sparse]
    return next(path for max_tok, path in rows if n_tok <= max_tok)


def expert_path(fmt: str, n_embd: int, n_tok: int, switch: SparseSwitch | None = None,
                generic: bool = False) -> str:  # fmt: skip
    """The kernel moe_experts runs for n_tok tokens: sparse where the layer's switch (None: no
    threshold, dense) says so at n_tok, then the table's choice (generic: GENERIC_PATHS')."""
    sparse = switch is not None and switch.use_sparse(n_tok)
    return table_path(fmt, n_embd, n_tok, sparse, generic)


def quantizes_x(path: str) -> bool:
    """Whether `path` takes the gate/up dots on Q8-quantized x (as the C core does): then the
    torch reference of its result is moe_dense_ref / moe_sparse_ref with q8_x=True."""
    return path in Q8R_PATHS or path in Q4R_PATHS
