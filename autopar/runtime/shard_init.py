"""Materialise one rank's rewritten program of a meta model: its parameters are the
shards of the layout-independent initialisation of :mod:`autopar.runtime.materialize`
(rule 3 there), its buffers the rule's whole buffers, its graphs' device constants the
rank's device. ``autopar.parallelize`` calls :func:`materialize_shards` after the rewrite
and before the optimizer copies the parameters into its flat buffer (ZeRO-0/1/2), and
:func:`materialize_fsdp_shards` after FSDP2 has sharded the meta stage (ZeRO-3), so that
a rank allocates its DP shard only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.graph.capture import place_meta_devices
from autopar.runtime.materialize import Initializer, replace_tensors

if TYPE_CHECKING:
    from autopar.contract.placement import ShardSpec

__all__ = ["materialize_shards", "materialize_fsdp_shards", "place_program_devices"]


def _local_values(params: dict[str, nn.Parameter], shards: dict[str, ShardSpec],
                  init: Initializer, tp_rank: int, tp: int
                  ) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """(name, parameter, its TP-local value) for each parameter of ``params`` (the meta
    ones of a stage, by name), one owning module's whole parameters alive at a time."""
    by_owner: dict[str, list[str]] = {}
    for name in params:
        if name not in shards:
            raise RuntimeError(f"parameter {name!r} of this rank's program comes from no "
                               "parameter of the model; this is a bug in the rewrite")
        by_owner.setdefault(init.owner(shards[name].key), []).append(name)
    for owner in sorted(by_owner):
        whole = init.module_params(owner)
        for name in by_owner[owner]:
            p, spec = params[name], shards[name]
            value = spec.local(whole[spec.key], tp_rank, tp).to(p.dtype)
            if tuple(value.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: the shard of {spec.key} has shape "
                                   f"{tuple(value.shape)}, the program's parameter "
                                   f"{tuple(p.shape)}; this is a bug in the rewrite")
            yield name, p, value.contiguous()
        del whole


def _meta_params(stage: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in stage.named_parameters() if p.is_meta}


def _buffer_values(stage: nn.Module, init: Initializer, keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """The value of each buffer of ``stage`` (by name) not on ``init.device``: a meta one's
    from its model key ``keys``, a real one moved."""
    values = {}
    for name, b in stage.named_buffers():
        if not b.is_meta and b.device != init.device:
            values[name] = b.to(init.device)
        elif b.is_meta:
            if name not in keys:
                raise ValueError(f"buffer {name!r} of this rank's program is on the meta device "
                                 "and comes from no buffer of the model; build the model with "
                                 "real buffers")
            values[name] = init.buffers[keys[name]].to(b.dtype)
    return values


def place_program_devices(stage: nn.Module, device: torch.device) -> None:
    """Make ``stage``'s graphs create their tensors on ``device``: a model captured on meta
    has meta device constants baked in (:func:`~autopar.graph.capture.place_meta_devices`).
    Call it before FSDP2 wraps the stage: recompiling a GraphModule whose class FSDP2 has
    subclassed makes ``torch.fx``'s call wrapper recurse forever."""
    for module in stage.modules():
        if isinstance(module, fx.GraphModule):
            place_meta_devices(module, device)


def _check_real(stage: nn.Module) -> None:
    left = [n for n, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors of this rank's program left on the meta device: {left[:5]}; "
                           "this is a bug in autopar.runtime.shard_init")


def materialize_shards(stage: nn.Module, shards: dict[str, ShardSpec], init: Initializer, *,
                       tp_rank: int, tp: int, buffer_keys: dict[str, str]) -> None:
    """Replace this rank's meta parameters and buffers in ``stage`` (its chunk module) by
    their values on ``init.device``: shard ``shards[name]`` of the owning module's whole
    initialisation (rule 3), cast to the parameter's dtype; its graphs' meta device
    constants by ``init.device`` (:func:`place_program_devices`). Local: no collective.

    shards: local parameter name -> :class:`~autopar.contract.placement.ShardSpec`;
    buffer_keys: local buffer name -> the model's buffer key. Raises ValueError (a
    parameter or buffer the rule leaves unset), RuntimeError (a shape that does not match).
    """
    params = {id(p): nn.Parameter(v, requires_grad=p.requires_grad)
              for _, p, v in _local_values(_meta_params(stage), shards, init, tp_rank, tp)}
    values = _buffer_values(stage, init, buffer_keys)
    buffers = {id(b): values[n] for n, b in stage.named_buffers() if n in values}
    replace_tensors(stage, params, buffers)
    place_program_devices(stage, init.device)
    _check_real(stage)


def _dim0_chunk(t: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """FSDP2's shard of ``t`` on DP rank ``rank``: ``torch.chunk`` along dim 0, empty for a
    rank past the last chunk."""
    chunks = t.chunk(parts, 0)
    return chunks[rank] if rank < len(chunks) else t.new_empty((0, *t.shape[1:]))


def materialize_fsdp_shards(stage: nn.Module, shards: dict[str, ShardSpec], init: Initializer, *,
                            tp_rank: int, tp: int, dp_rank: int, dp: int,
                            buffer_keys: dict[str, str]) -> None:
    """ZeRO-3: ``stage`` was wrapped by FSDP2 (``fully_shard``) while on meta, its
    parameters DTensors sharded along dim 0 over the DP mesh. Allocate them on
    ``init.device`` (``to_empty``, FSDP2's meta-device recipe) and write this DP rank's
    chunk of each TP-local value; buffers as :func:`materialize_shards`. Local; errors
    as :func:`materialize_shards`. Call :func:`place_program_devices` before FSDP2 wraps
    the stage."""
    buffers = _buffer_values(stage, init, buffer_keys)
    buffers.update({n: b for n, b in stage.named_buffers() if not b.is_meta})
    values = _local_values(_meta_params(stage), shards, init, tp_rank, tp)  # lazy: after to_empty
    stage.to_empty(device=init.device)  # DTensor parameters keep their identity (swap)
    with torch.no_grad():
        for name, p, value in values:
            local = p.to_local()
            chunk = _dim0_chunk(value, dp, dp_rank)
            if local.shape != chunk.shape:
                raise RuntimeError(f"{name}: FSDP2's local shard has shape {tuple(local.shape)}, "
                                   f"the DP chunk {tuple(chunk.shape)}; this is a bug")
            local.copy_(chunk)
    for name, value in buffers.items():
        prefix, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(prefix), leaf, value.to(init.device))
    _check_real(stage)
