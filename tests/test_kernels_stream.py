"""kernels.moe_q8r_stream (via kernels.moe_q8r.moe_q8r_stream): the dense q8_0r decode MoE with
one pair's neuron range per program, against the reference on Q8-quantized x."""

import pytest
import torch

from pyruntime.kernels.expert_paths import PATHS
from pyruntime.kernels.moe_dense import DENSE_LAUNCHERS, moe_dense, moe_dense_ref
from pyruntime.kernels.moe_q8r import moe_q8r_stream
from pyruntime.kernels.moe_q8r_stream import stream_grid
from pyruntime.kernels.testing import Q8R_N_EMBD, assert_close_rel, make_case, spy_tokens

# the first batch size the table gives to the streaming kernel
STREAM_FROM = 1 + next(t for t, path in PATHS[("q8r", False)] if path == "q8r_pipe")

# (BLOCK_N, num_warps, programs per SM, STAGES); the interpreter's grid is P * SPP with
# "programs per SM" programs in all: one program per pair, several (ranges that do not divide
# n_ff evenly), one per tile
CONFIGS = [(16, 4, 1, 1), (4, 4, 7, 2), (2, 4, 1000, 3)]


@pytest.mark.parametrize("blocks", CONFIGS)
@pytest.mark.parametrize("n_tok", [1, 3])
def test_moe_q8r_stream_dense_matches_reference(n_tok, blocks):
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=80 + n_tok, n_embd=Q8R_N_EMBD)
    y = moe_q8r_stream(x, w, "q8_0r", ids, tw, blocks=blocks)
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)


@pytest.mark.parametrize("n_tok", [STREAM_FROM - 1, STREAM_FROM])
def test_moe_dense_takes_the_stream_kernel_from_its_batch(n_tok, monkeypatch):
    """The dispatch: moe_dense's auto path on aligned q8_0r calls moe_q8r_stream from the
    table's batch size on (not below), and matches the reference either way."""
    calls = spy_tokens(monkeypatch, DENSE_LAUNCHERS, "q8r_stream")
    x, w, ids, tw = make_case("q8_0r", n_tok, torch.bfloat16, seed=85, n_embd=Q8R_N_EMBD)
    y = moe_dense(x, w, "q8_0r", ids, tw)
    assert calls == ([n_tok] if n_tok >= STREAM_FROM else [])
    assert_close_rel(y, moe_dense_ref(x, w, "q8_0r", ids, tw, q8_x=True), 1e-5)


@pytest.mark.parametrize(
    ("n_ff", "n_pairs", "block_n", "n_programs"),
    [(768, 8, 2, 264), (37, 3, 4, 10), (5, 40, 2, 264), (512, 1, 8, 1)],
)
def test_stream_grid_covers_every_neuron_once(n_ff, n_pairs, block_n, n_programs):
    spp, nps = stream_grid(n_ff, n_pairs, block_n, n_programs)
    assert nps % block_n == 0 and spp * nps >= n_ff > (spp - 1) * nps
