"""The private or version-sensitive torch APIs autopar uses, in one place.

Everything else in autopar imports these names from here, so a torch upgrade that moves
or renames one of them is fixed in this file alone. Checked against torch 2.13.

* ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the hook
  :class:`autopar.runtime.stats.CommMeter` uses to see every ``c10d`` op.
* :func:`op_schema`: an ``OpOverload``'s qualified name and argument names
  (``func._schema``).
* :func:`unbox_process_group`: the ``ProcessGroup`` behind the script object a ``c10d``
  op receives (``ProcessGroup.unbox``).
* :func:`resolve_group_name`: the ``ProcessGroup`` of a functional collective's
  ``group_name`` argument (``distributed_c10d._resolve_process_group``).
* :func:`group_timeout`: the timeout a process group was created with
  (``ProcessGroup._get_backend(device).options._timeout``).
* :func:`group_options`: backend options carrying a timeout, for the process groups a
  ``DeviceMesh`` creates (``torch._C._distributed_c10d.Backend.Options``,
  ``ProcessGroupNCCL.Options._timeout``).
* ``DropoutBase`` (``torch.nn.modules.dropout._DropoutNd``): the base class of
  ``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout`` and ``FeatureAlphaDropout``.
* :func:`cpu_memory_events`: the CPU allocator's allocations and frees a
  ``torch.profiler.profile(profile_memory=True)`` recorded, in order
  (``prof.profiler.kineto_results``: the public ``events()`` folds them into ops).
* ``PipelineStage``: torch's, or on a torch whose stages warm their neighbours up with a
  send and a receive to each adjacent stage's rank (2.11, ``_get_init_p2p_neighbors_ops``)
  a subclass that leaves out the ones to itself: a V placement's middle cut joins two
  chunks on one rank, and gloo cannot send to its own rank ("Pair is not connected");
  2.13's warm-up skips them itself.
* ``all_gather_single`` / ``reduce_scatter_single``: torch 2.13's names of
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (the old names warn as deprecated
  there; 2.11 has only the old ones).
* ``all_to_all_single_autograd`` (``torch.distributed._functional_collectives``): the
  all-to-all with uneven splits whose backward is the all-to-all with the splits swapped,
  which expert parallelism's dispatch and combine use
  (:mod:`autopar.runtime.expert_parallel`).
* The fake process group and fake tensors of a dry run (:mod:`autopar.verify.dry_run`):
  :func:`init_fake_process_group` (the "fake" backend, registered by importing
  ``torch.testing._internal.distributed.fake_pg``), ``FakeTensorMode``
  (``torch._subclasses.fake_tensor``), :func:`is_fake`, and :func:`storage_key` (a key of a
  tensor's storage while it lives: ``StorageImpl``'s address, ``storage._cdata``, since a
  fake tensor's ``data_ptr`` is 0), :func:`values` (a tensor's values as floats, zeros
  for a fake tensor, which has none) and :func:`real_tensors` (real tensors inside a fake
  mode: ``unset_fake_temporarily``, for the RNG tracker's generator states).
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (public since 2.10), else the private
  ``torch._grouped_mm`` of older builds, else None (callers then loop over the groups).

Tested on torch 2.13 and 2.11 (the supported range, ``pyproject.toml``).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.nn.modules.dropout import _DropoutNd as DropoutBase
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode", "DropoutBase", "op_schema", "unbox_process_group", "group_timeout",
           "group_options", "cpu_memory_events", "resolve_group_name", "all_gather_single", "reduce_scatter_single",
           "PipelineStage", "all_to_all_single_autograd", "grouped_mm", "FakeTensorMode",
           "init_fake_process_group", "is_fake", "storage_key", "values", "real_tensors"]

# (out, in, group=...): the whole tensor gathered / this rank's reduced slice, one call
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# (rows (S, in), weights (G, in, out), offs=int32 cumulative rows per group) -> (S, out)
grouped_mm = (getattr(torch.nn.functional, "grouped_mm", None)
              or getattr(torch, "_grouped_mm", None))



class _NoSelfWarmupStage(_TorchPipelineStage):
    """torch 2.11's ``PipelineStage`` without the warm-up sends and receives to its own rank
    (a local neighbour's activations pass in memory; gloo refuses a pair with itself)."""

    def _get_init_p2p_neighbors_ops(self):
        own = dist.get_rank(self.group)
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != own]


PipelineStage = (_TorchPipelineStage if hasattr(_TorchPipelineStage, "_warmup_forward_vote")
                 else _NoSelfWarmupStage)


def op_schema(func) -> tuple[str, list[str]]:
    """(qualified name such as ``"c10d::allreduce_"``, positional argument names) of the
    ``torch._ops.OpOverload`` ``func`` a dispatch mode receives."""
    schema = func._schema
    return schema.name, [a.name for a in schema.arguments]


def unbox_process_group(value) -> dist.ProcessGroup:
    """The ``dist.ProcessGroup`` of the ``process_group`` argument of a ``c10d`` op."""
    return dist.ProcessGroup.unbox(value)


def resolve_group_name(name: str) -> dist.ProcessGroup:
    """The ``dist.ProcessGroup`` registered under ``name`` (the ``group_name`` argument of a
    ``_c10d_functional`` op such as ``all_to_all_single``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta | None:
    """The timeout ``group`` was created with, read from its backend for ``device``
    (None when that backend does not expose one)."""
    try:
        return group._get_backend(torch.device(device)).options._timeout
    except (RuntimeError, AttributeError):
        return None


def group_options(backend: str, timeout: timedelta) -> C10dBackend.Options | None:
    """Options that give the groups of ``backend`` ("gloo" or "nccl") the timeout
    ``timeout``; None for a mixed backend such as "cpu:gloo,cuda:nccl" (its groups keep
    torch's default)."""
    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    if backend == "gloo":
        return C10dBackend.Options(backend, timeout)
    return None


def cpu_memory_events(prof) -> list[tuple[int, int]]:
    """(start ns, bytes: positive allocated, negative freed) of every CPU allocator event of
    the finished ``torch.profiler.profile`` ``prof`` (run with ``profile_memory=True``), by
    time. Frees of blocks allocated before the profile started are not recorded."""
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    return sorted(events)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of a world of ``world_size`` on torch's "fake"
    backend: every collective returns at once without moving data (its outputs keep what
    they held), so one process builds and steps any rank's program."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers "fake"

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes and dtypes, no values: a dry run's)."""
    return isinstance(t, FakeTensor)


def storage_key(t: torch.Tensor) -> int:
    """A key of ``t``'s storage, unique among the storages alive (views share it)."""
    return t.untyped_storage()._cdata


def values(t: torch.Tensor) -> list[float]:
    """``t.tolist()``, or zeros of its length for a fake tensor (which holds no values)."""
    return [0.0] * t.numel() if is_fake(t) else t.tolist()


def real_tensors():
    """A context in which tensors are real even inside a ``FakeTensorMode`` (a no-op
    outside one): generator states must stay real to be set again."""
    return unset_fake_temporarily()
