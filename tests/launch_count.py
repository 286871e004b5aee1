"""What a piece of GPU code queues, counted on torch's CPU device under the Triton interpreter:
each aten op that does work on a tensor (views and metadata ops are not launches on a GPU) and
each Triton kernel launch (the interpreter's own torch ops inside it are not counted)."""

from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only make views or read metadata: no kernel on a GPU
_NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "slice", "select", "as_strided", "alias", "detach",
    "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "flatten", "unflatten", "view_as", "lift_fresh",
    "empty", "empty_strided", "is_pinned", "_local_scalar_dense", "set_", "_to_copy_meta",
    "item", "numpy_T", "_pin_memory", "new_empty", "new_empty_strided", "resolve_conj",
    "resolve_neg", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim",
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts (name -> launches) of what runs inside `with LaunchCounter() as c:`;
    c.total: all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        out = func(*args, **(kwargs or {}))
        # a conversion to what the tensor already is (Tensor.numpy's) returns it: no launch
        no_op = name == "to" and args and out is args[0]
        if not self._paused and name not in _NO_LAUNCH and not no_op:
            self.counts[f"aten.{name}"] += 1
        return out

    @contextlib.contextmanager
    def paused(self):
        """Count nothing inside (what a GPU runs as one graph replay, say)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def triton(self):
        """Count each interpreted Triton launch once, not the torch ops it runs."""
        from triton.runtime.interpreter import GridExecutor

        real = GridExecutor.__call__
        counter = self

        def call(executor, *args, **kwargs):
            if not counter._paused:
                counter.counts[f"triton.{executor.fn.__name__}"] += 1
            with counter.paused():
                return real(executor, *args, **kwargs)

        GridExecutor.__call__ = call
        try:
            yield self
        finally:
            GridExecutor.__call__ = real

    @property
    def total(self) -> int:
        return sum(self.counts.values())
