"""What the GPU executor keeps per KV cache (in `cache.executor_state`, dropped with it).

- the decode step's inputs as device tensors (token, position, cached length after the step),
  written by one host-to-device copy from a pinned staging tensor;
- the rope tables of every cache position;
- the decode steps captured in CUDA graphs, one per (experts per token, expert maps): a graph
  reads every input from these fixed addresses, so one capture replays at every position, and
  rewinding the cache only changes n_tokens (the next step's inputs say where it writes); the
  hybrid executor's steps are graph segments (pyruntime.offload.segments), kept the same way;
- prompt passes captured by shape (tokens, first position, ...): the shapes seen once, and the
  last PREFILL_GRAPHS captured ones (GpuExecutor._captured_prefill says when and why).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pyruntime.kernels.timing import graph_capture
from pyruntime.model.config import ModelConfig
from pyruntime.model.reference import model_rope_tables

STATE_KEY = "gpu"  # this executor's entry in KVCache.executor_state


@dataclass
class CapturedStep:
    """A decode step captured in a CUDA graph: replay() reruns it on the current step inputs,
    rewriting `outputs` (logits [1, n_vocab] and the MoE layers' routing tensors) in place."""

    graph: Any  # torch.cuda.CUDAGraph (or a stand-in with replay())
    outputs: Any
    version: int  # the executor's model state it was captured under


@dataclass
class CapturedPrefill(CapturedStep):
    """A prompt pass captured in a CUDA graph: the token ids it reads, [n] int64 on the device
    (rewritten before each replay; its positions are fixed by its shape)."""

    ids: torch.Tensor | None = None


# Prompt passes: the captured shapes a cache keeps (each graph holds the memory of its pass's
# activations in its own pool), least recently used dropped first, and how many shapes seen
# once it remembers.
PREFILL_GRAPHS = 4
PREFILL_SEEN = 256


class GpuCacheState:
    def __init__(self, owner: object, cfg: ModelConfig, max_tokens: int,
                 device: torch.device) -> None:  # fmt: skip
        self.owner_id = id(owner)  # the executor whose graphs these are
        cos, sin = model_rope_tables(cfg, torch.arange(max_tokens))
        self.cos, self.sin = cos.to(device), sin.to(device)  # [max_tokens, rope_dim] f32
        # (token, position, position + 1 = cached length after the step) in one device tensor
        self.step_inputs = torch.zeros(3, dtype=torch.long, device=device)
        self.token, self.position, self.seq_len = self.step_inputs.view(3, 1).unbind(0)
        self._staging = torch.zeros(3, dtype=torch.long, pin_memory=self.step_inputs.is_cuda)
        self.graphs: dict[tuple, CapturedStep] = {}
        # the hybrid executor's decode steps as graph segments (pyruntime.offload.segments)
        self.segments: dict[tuple, Any] = {}
        self.prefills: OrderedDict[tuple, CapturedPrefill] = OrderedDict()
        self._prefills_seen: OrderedDict[tuple, None] = OrderedDict()

    def seen_before(self, key: tuple) -> bool:
        """Whether a prompt pass of this shape came before (and now it has)."""
        seen = key in self._prefills_seen
        self._prefills_seen[key] = None
        self._prefills_seen.move_to_end(key)
        while len(self._prefills_seen) > PREFILL_SEEN:
            self._prefills_seen.popitem(last=False)
        return seen

    def keep_prefill(self, key: tuple, step: CapturedPrefill) -> None:
        """Keep a captured prompt pass, dropping the least recently used beyond PREFILL_GRAPHS."""
        self.prefills[key] = step
        self.prefills.move_to_end(key)
        while len(self.prefills) > PREFILL_GRAPHS:
            self.prefills.popitem(last=False)

    def set_step(self, token: int, position: int) -> None:
        """The next decode step's inputs: `token` at `position`. Asynchronous: the staging
        tensor is rewritten only after the previous step's logits reached the host (forward()
        waits for them), so its copy has run by then."""
        self._staging.numpy()[:] = (token, position, position + 1)
        self.step_inputs.copy_(self._staging, non_blocking=True)


def capture(fn: Callable[[], Any], device: torch.device, pool: Any = None) -> tuple[Any, Any]:
    """(a CUDA graph of fn, fn's outputs in it). fn runs once first on a side stream (Triton
    compiles, allocations and the grid_sync counters happen outside the capture); that run has
    the side effects of a step (KV writes, device counts), which the caller undoes or redoes.
    pool: a memory pool shared with other graphs (torch.cuda.graph_pool_handle()), which must
    then replay in the order they were captured."""
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool):  # the garbage collector off while it captures
        outputs = fn()
    return graph, outputs
