"""kernels.host_flags: the step number, the placement of a token's pairs and the routing a
graph publishes for the host, and the wait for the host's share that gives up. On a GPU the
host buffers are page-locked memory mapped for the device (as a step graph's); under the Triton
interpreter plain tensors stand in."""

import numpy as np
import torch

from kernels import host_flags
from kernels.testing import DEVICE
from pyruntime.offload.host_register import mapped_tensor, page_locked


def host_array(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, torch.Tensor]:
    """(the host's view, the kernels' tensor) of zeros."""
    if DEVICE.type != "cuda":
        t = torch.zeros(shape, dtype=dtype)
        return t.numpy(), t
    nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    host = page_locked(nbytes).view(torch.tensor([], dtype=dtype).numpy().dtype).reshape(shape)
    host[...] = 0
    return host, mapped_tensor(host, DEVICE)


def done() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def reference_place(ids, table, n_direct):
    """(codes, rows, map_slots, map_direct) of kernels.host_flags.place, in plain torch."""
    slot = table[ids.long()]
    hit = slot >= 0
    rank = torch.cumsum((~hit).to(torch.int32), 0) - 1
    direct = ~hit & (rank < n_direct)
    codes = torch.where(hit, 0, torch.where(direct, 1, 2)).to(torch.int32)
    map_slots = torch.full_like(table, -1)
    map_slots[ids.long()[hit]] = slot[hit]
    map_direct = torch.full_like(table, -1)
    map_direct[ids.long()[direct]] = rank[direct].to(torch.int32)
    return codes, rank.to(torch.int32), map_slots, map_direct


def place_outputs(k: int, n_expert: int):
    return tuple(torch.full((n,), 9, dtype=torch.int32, device=DEVICE)
                 for n in (k, k, n_expert, n_expert))  # fmt: skip


def test_place_codes_the_pairs_and_builds_the_maps():
    n_expert, k = 37, 6
    table = torch.full((n_expert,), -1, dtype=torch.int32)
    table[[3, 9, 20]] = torch.tensor([0, 4, 2], dtype=torch.int32)
    ids = torch.tensor([9, 1, 30, 20, 5, 36])  # int64, as the router's
    for nd in (0, 1, 2, 10):
        out = place_outputs(k, n_expert)
        host_flags.place(ids.to(DEVICE), table.to(DEVICE),
                         torch.tensor([nd], dtype=torch.int32, device=DEVICE), out)  # fmt: skip
        want = reference_place(ids, table, nd)
        rows_of_direct = [r for r, c in zip(out[1].tolist(), out[0].tolist(), strict=True)
                          if c == 1]  # fmt: skip
        assert out[0].tolist() == want[0].tolist()
        assert rows_of_direct == list(range(min(nd, 4)))  # 4 misses: ranks 0..3
        assert torch.equal(out[2].cpu(), want[2]) and torch.equal(out[3].cpu(), want[3])


def test_place_publishes_the_routing_then_the_flag():
    seq = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    host_flags.advance(seq)
    host_flags.advance(seq)
    assert seq.item() == 2
    g = torch.Generator().manual_seed(0)
    k, n, e = 3, 1500, 37  # odd sizes: masked tails
    ids = torch.tensor([5, 0, 36], device=DEVICE)
    table = torch.full((e,), -1, dtype=torch.int32, device=DEVICE)
    table[0] = 3
    w = torch.rand(k, generator=g).to(DEVICE)
    h = torch.randn(n, generator=g).to(DEVICE)
    logits = torch.randn(e, generator=g).to(DEVICE, torch.bfloat16)
    outs = [host_array((k,), torch.int32), host_array((k,), torch.float32),
            host_array((k,), torch.int32), host_array((n,), torch.float32),
            host_array((e,), torch.float32)]  # fmt: skip
    flags_host, flags = host_array((2, 4), torch.int32)
    nd = torch.ones(1, dtype=torch.int32, device=DEVICE)
    publish = (w, h, logits, tuple(t for _, t in outs), flags[0], seq, 1)
    host_flags.place(ids, table, nd, place_outputs(k, e), publish)
    done()
    assert flags_host.tolist() == [[0, 2, 0, 0], [0, 0, 0, 0]]
    assert outs[0][0].tolist() == [5, 0, 36]
    assert np.array_equal(outs[1][0], w.cpu().numpy())
    assert outs[2][0].tolist() == [1, 0, 2]  # a miss on the GPU, a hit, a miss on the CPU
    assert np.array_equal(outs[3][0], h.cpu().numpy())
    assert np.array_equal(outs[4][0], logits.float().cpu().numpy())


def test_absorb_adds_the_hosts_share_and_gives_up_saying_so():
    seq = torch.ones(1, dtype=torch.int32, device=DEVICE)
    flags_host, flags = host_array((2, 2), torch.int32)
    failed = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    n = 1100
    y_gpu = torch.arange(n, dtype=torch.float32, device=DEVICE)
    y_cpu_host, y_cpu = host_array((n,), torch.float32)
    y_cpu_host[:] = 0.5
    out = torch.zeros(n, device=DEVICE)
    flags_host[1, 1] = 1  # the host's answer is there: no wait
    host_flags.absorb(flags[1], seq, failed, 1, y_gpu, y_cpu, out, limit=1)
    assert failed.item() == 0
    assert torch.equal(out.cpu(), torch.arange(n, dtype=torch.float32) + 0.5)
    host_flags.absorb(flags[1], seq, failed, 0, y_gpu, y_cpu, out, limit=5)  # never written
    assert failed.item() == 1
