"""Measure what a training step really used, to check the cost model against it.

``SavedActivationTracker`` wraps a step in ``torch.autograd.graph.saved_tensors_hooks`` and
keeps the running and peak bytes of tensors autograd saved for backward. A storage is
counted once however many ops save it (or views of it), parameters are excluded (they are
model states), and bytes are released when autograd frees the saved tensor. Tensors saved
inside ``torch.utils.checkpoint`` regions are not stored, so they are not counted.

``PeakAllocation`` keeps the peak of the bytes torch's CPU allocator holds for tensors
allocated inside a region (a rank's ``parallelize`` and first step: what building and
training the program adds to the process at its highest).

``CommMeter`` is a ``TorchDispatchMode`` that sees every ``c10d`` collective and p2p send
the step issues (``dist.all_reduce`` and friends go through the dispatcher as
``c10d.allreduce_`` etc., including those issued by libraries such as
``torch.distributed.pipelining``), and sums their payload bytes by kind; and expert
parallelism's all-to-alls (the functional ``_c10d_functional::all_to_all_single`` of the
dispatch and combine, forward and backward, and the ``c10d::alltoall_base_`` of the counts)
as "ep_all_to_all".
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.contract.plan import COMM_KINDS
from autopar.runtime.compat import (TorchDispatchMode, cpu_memory_events, op_schema,
                                    resolve_group_name, storage_key, unbox_process_group)

__all__ = ["SavedActivationTracker", "CommMeter", "PeakAllocation"]


def _storages(params: Iterable[nn.Parameter]) -> set[int]:
    """Data pointers of the parameters' storages (a DTensor's: its local shard's)."""
    return {storage_key(p.to_local() if isinstance(p, DTensor) else p) for p in params}


class _Saved:
    """Handle returned by the pack hook; releases its storage's bytes when autograd drops it."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: "SavedActivationTracker") -> None:
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        self.tracker._release(self.key)


class SavedActivationTracker:
    """Peak bytes of activations saved for backward while the context is active.

    params: the parameters whose storages are not activations; or a module, whose
        parameters are read at every save, because FSDP2 (ZeRO-3) registers the gathered
        parameters on the modules only while they run.
    Attributes after use: ``peak_bytes`` (int), ``current_bytes`` (int).
    """

    def __init__(self, params: Iterable[nn.Parameter] | nn.Module) -> None:
        self.module = params if isinstance(params, nn.Module) else None
        self.exclude = set() if self.module is not None else _storages(params)
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.current_bytes = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage_key(t)  # not data_ptr: a dry run's fake tensors have none
        exclude = self.exclude if self.module is None else _storages(self.module.parameters())
        if key in exclude or t.device.type == "meta":
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        # detached: a saved output's grad_fn is the node holding this handle, and the cycle
        # through C++ would keep the node and its tensors alive whenever the node is not
        # run with retain_graph=False (a split backward's input-gradient pass: torch's
        # own saving of outputs leaves the grad_fn out for the same reason); the detached
        # view shares the storage and the version counter
        return _Saved(t.detach(), key, self)

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


class PeakAllocation:
    """Peak bytes of CPU tensor memory allocated and not yet freed while the context is
    active: the running sum of the CPU allocator's allocations and frees that
    ``torch.profiler`` records with ``profile_memory=True`` (tensors that existed before
    entry, and their frees, are not counted). Attributes after exit: ``peak_bytes``,
    ``end_bytes`` (still held at exit). Counts torch's CPU allocator only: not Python
    objects, not gloo's own buffers, not another device's memory. Slows the region
    (every op is recorded): for tests and benchmarks.
    """

    def __init__(self) -> None:
        self.peak_bytes = self.end_bytes = 0
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True)

    def __enter__(self) -> "PeakAllocation":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        live = 0
        for _, nbytes in cpu_memory_events(self._prof):
            live += nbytes
            self.peak_bytes = max(self.peak_bytes, live)
        self.end_bytes = live


# c10d dispatcher op -> (collective, the argument whose bytes are this rank's payload)
_C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("p2p", "tensors"),
}


# all-to-all ops -> the argument naming their group (a ProcessGroup, or a registered name)
_ALL_TO_ALL_OPS = {"c10d::alltoall_base_": "process_group",
                   "_c10d_functional::all_to_all_single": "group_name"}


def _all_to_all_sent(values: dict, group: dist.ProcessGroup) -> int:
    """Bytes an all-to-all sends from this rank to the other ranks of ``group``: the rows
    of its ``input_split_sizes`` for every peer but itself (even splits when empty: numel
    / group size to each), times the bytes of a row of ``input`` (input (S, ...))."""
    t, n, me = values["input"], group.size(), group.rank()
    splits = list(values.get("input_split_sizes") or [])
    if not splits:
        return (n - 1) * (t.numel() // n) * t.element_size()
    row = (t.numel() // t.size(0) if t.dim() and t.size(0) else 0) * t.element_size()
    return sum(rows for peer, rows in enumerate(splits) if peer != me) * row


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CommMeter(TorchDispatchMode):
    """Payload bytes of every collective issued while active, by kind of :data:`COMM_KINDS`.

    axes: process-group name (``ProcessGroup.group_name``) -> axis ("tp", "pp", "dp"; any
    other name counts as "other"). The kind is ``f"{axis}_{collective}"`` when that is one
    of COMM_KINDS (tp_all_reduce, dp_reduce_scatter, pp_p2p, ...), else "other".
    Payload: all-reduce and broadcast the tensor; all-gather this rank's input shard;
    reduce-scatter the full input; p2p what this rank sends (receives are not counted).
    Every all-to-all (expert parallelism's, whatever its group) is "ep_all_to_all": the
    bytes this rank sends to the other ranks (rows it keeps are not counted). Expert
    gradients all-reduced over the expert-data-parallel group count as "dp_all_reduce"
    when ``axes`` names that group "dp" (:meth:`ParallelGroups.axis_names`).
    Attributes: ``bytes`` (kind -> int); ``last`` (the last ``c10d`` op issued, e.g.
    "c10d::allreduce_ over the dp group", or None), to name the collective a failure
    happened in (a synchronous collective fails in its ``wait``, after it was issued).
    """

    def __init__(self, axes: dict[str, str]) -> None:
        super().__init__()
        self.axes = dict(axes)
        self.bytes = dict.fromkeys(COMM_KINDS, 0)
        self.last: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, arg_names = op_schema(func)
        if name in _ALL_TO_ALL_OPS:
            values = dict(zip(arg_names, args)) | kwargs
            group = values[_ALL_TO_ALL_OPS[name]]
            group = (resolve_group_name(group) if isinstance(group, str)
                     else unbox_process_group(group))
            self.last = f"{name} over the {self.axes.get(group.group_name, 'other')} group"
            self.bytes["ep_all_to_all"] += _all_to_all_sent(values, group)
        elif name.startswith("c10d::"):
            values = dict(zip(arg_names, args)) | kwargs
            axis = None
            if "process_group" in values:
                group = unbox_process_group(values["process_group"])
                axis = self.axes.get(group.group_name, "world" if group.size() ==
                                     dist.get_world_size() else "other")
            self.last = name + (f" over the {axis} group" if axis else "")
            op = _C10D_OPS.get(name[len("c10d::"):])
            if op is not None:
                kind = f"{axis}_{op[0]}"
                self.bytes[kind if kind in COMM_KINDS else "other"] += _nbytes(values[op[1]])
        return func(*args, **kwargs)
