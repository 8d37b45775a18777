"""Bytes held by live tensors, and their peak, measured op by op.

torch has no CPU counterpart of `torch.cuda.max_memory_allocated`, and the memory plan needs one
twice: on real CPU training steps (to test the plan against) and on fake tensors (to measure what a
model at its real size holds, without the memory). `LiveTensorMemory` is a TorchDispatchMode: every
tensor an op returns has its storage counted once (views and in-place results share a storage), and
a weak reference on that storage subtracts it again when the last tensor using it is freed. Ops that
autograd runs during backward pass through the same mode, so gradients and recomputed activations
are counted too. Tensors that existed before are counted with `hold(...)`.

What it does not see: memory that is not a tensor storage (allocator caches, fragmentation, the CUDA
context, cuBLAS/attention workspaces), and storages created outside the dispatcher (e.g. tensors that
`torch.frombuffer` wraps) unless they are passed to `hold`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMemory(TorchDispatchMode):
    """`with LiveTensorMemory() as memory: ...`, then `memory.peak` (bytes), `memory.live` (bytes now)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # id(storage) -> weak reference whose callback takes the storage's bytes off `live`.
        self._storages: dict[int, weakref.ref] = {}

    # -- counting ------------------------------------------------------------------------------
    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        if known is not None and known() is storage:
            return
        size = storage.nbytes()

        def freed(_ref: weakref.ref, key: int = key, size: int = size) -> None:
            self.live -= size
            self._storages.pop(key, None)

        self._storages[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the mode was entered (weights, optimizer states, data)."""
        for tensor in tensors:
            if tensor.layout == torch.strided and tensor.device.type != "meta":
                self._count(tensor)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    # -- the mode ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares a storage of its inputs: nothing new was allocated (and
        # a weight seen through `.t()` is not the op's to count).
        inputs = {
            id(value.untyped_storage())
            for value in tree_flatten((args, kwargs))[0]
            if isinstance(value, torch.Tensor) and value.layout == torch.strided
        }
        for value in tree_flatten(out)[0]:
            if (
                isinstance(value, torch.Tensor)
                and value.layout == torch.strided
                and id(value.untyped_storage()) not in inputs
            ):
                self._count(value)
        return out
