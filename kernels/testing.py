"""Random MoE layer inputs at odd shapes and result checks, shared by the kernel tests."""

import torch

from .expert_formats import BLOCKS, act_ref, quantize_rows
from .launch import interpreting

N_EXPERT, N_FF, TOP_K = 6, 45, 3  # odd n_ff: partial neuron tiles
# The tests' device: the GPU when kernels compile for it (TRITON_INTERPRET=0), else the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def n_embd_for(fmt: str) -> int:
    """A multiple of the block but not a power of two for block formats (3 blocks of 32; for
    the K-quants 2 super-blocks of 256, 16 blocks of 32: the interpreter's time); not even a
    multiple of 32 for float formats (partial H tiles)."""
    if fmt in BLOCKS:
        return 96 if BLOCKS[fmt][0] == 32 else 512
    return 100


# n_embd of the q8r kernel tests: a multiple of 64 (the kernel's alignment need) whose 6
# Q8 blocks are not a power of two (padded, masked blocks).
Q8R_N_EMBD = 192


def make_case(fmt: str, n_tok: int, x_dtype=torch.float32, seed: int = 0, n_embd=None):
    """(x [T, H], w expert tensor, topk_ids [T, K] int32, topk_w [T, K] f32), fresh and random;
    H = n_embd or n_embd_for(fmt)."""
    g = torch.Generator().manual_seed(seed)
    H = n_embd or n_embd_for(fmt)
    wf = torch.randn(N_EXPERT, N_FF, 3, H, generator=g) * H**-0.5
    w = quantize_rows(wf, fmt)
    x = torch.randn(n_tok, H, generator=g).to(x_dtype)
    ids = torch.stack([torch.randperm(N_EXPERT, generator=g)[:TOP_K] for _ in range(n_tok)])
    tw = torch.rand(n_tok, TOP_K, generator=g) + 0.1
    return x.to(DEVICE), w.to(DEVICE), ids.to(torch.int32).to(DEVICE), tw.to(DEVICE)


def make_bias(H: int, seed: int = 0, n_expert: int = N_EXPERT):
    """gpt-oss-style expert biases (gate_up [n_expert, N_FF, 2], down [n_expert, H]) on DEVICE,
    large enough that the swiglu_oai clamps bind for a share of the neurons."""
    g = torch.Generator().manual_seed(seed + 1000)
    gate_up = torch.randn(n_expert, N_FF, 2, generator=g) * 2
    down = torch.randn(n_expert, H, generator=g) * 0.1
    return gate_up.to(DEVICE), down.to(DEVICE)


def rtol_for(x_dtype) -> float:
    """Relative tolerance (to max |ref|) of a kernel result vs the fp32 torch reference.

    Every path accumulates in fp32 and the reference dequantizes exactly, so fp32 math leaves
    only summation-order rounding (~1e-6). On a GPU the prefill dots of bf16 x run on bf16
    tensor cores (weights and the act*up intermediate rounded to bf16: ~2^-9 each) -> 1e-2.
    """
    if x_dtype == torch.bfloat16 and not interpreting():
        return 1e-2
    return 1e-5


def assert_close_rel(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    scale = ref.abs().max().item()
    assert scale > 0
    err = (y - ref).abs().max().item()
    assert err <= rtol * scale, f"max abs err {err:.3e} > {rtol:.0e} * max|ref| {scale:.3e}"


def gap_threshold(gate: torch.Tensor, activation: str, quantile: float) -> float:
    """A threshold near `quantile` of |act(gate)| in the widest gap between neighbouring values
    there, so kernel rounding (~1e-6 relative) cannot move any neuron across it."""
    mags = act_ref(gate.double(), activation).abs().flatten().sort().values
    n = mags.numel()
    lo, hi = int(n * (quantile - 0.1)), int(n * (quantile + 0.1))
    gaps = mags[lo + 1 : hi] - mags[lo : hi - 1]
    i = int(gaps.argmax())
    assert gaps[i] > 1e-4 * mags[-1], "no usable gap; change the seed"
    return float((mags[lo + i] + mags[lo + i + 1]) / 2)


def spy_tokens(monkeypatch, launchers: dict, path: str) -> list[int]:
    """Wrap launchers[path] (a launcher whose first argument is x [T, ...]; launchers is
    moe_dense.DENSE_LAUNCHERS or moe_sparse.SPARSE_LAUNCHERS) so that every call appends T to
    the returned list and then runs the real function (dispatch tests)."""
    calls: list[int] = []
    real = launchers[path]

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setitem(launchers, path, spy)
    return calls
