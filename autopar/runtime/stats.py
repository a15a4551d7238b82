"""Measure what a training step really used, to check the cost model against it.

``SavedActivationTracker`` wraps a step in ``torch.autograd.graph.saved_tensors_hooks`` and
keeps the running and peak bytes of tensors autograd saved for backward. A storage is
counted once however many ops save it (or views of it), parameters are excluded (they are
model states), and bytes are released when autograd frees the saved tensor. Tensors saved
inside ``torch.utils.checkpoint`` regions are not stored, so they are not counted.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

__all__ = ["SavedActivationTracker", "model_state_bytes"]


class _Saved:
    """Handle returned by the pack hook; releases its storage's bytes when autograd drops it."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: "SavedActivationTracker") -> None:
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        self.tracker._release(self.key)


class SavedActivationTracker:
    """Peak bytes of activations saved for backward while the context is active.

    params: the parameters whose storages are not activations.
    Attributes after use: ``peak_bytes`` (int), ``current_bytes`` (int).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.current_bytes = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or t.device.type == "meta":
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(handle):
        return handle.tensor if isinstance(handle, _Saved) else handle

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current_bytes -= entry[1]
            del self.live[key]

    def __enter__(self) -> "SavedActivationTracker":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, their gradients and the optimizer's state tensors on this rank."""
    params = list(module.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total
