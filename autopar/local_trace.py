"""The trace of this rank's copy of a model for a plan (step 2 of :mod:`autopar.recipe`):
the graph the rewrite cuts, with the model's state-dict names and its buffers by identity,
so that the rewritten program's buffers keep the model's keys."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.contract.plan import Plan
from autopar.graph.annotate import TracedModel
from autopar.graph.capture import COMPUTE_DTYPES, cast_floating, meta_buffers, trace_model
from autopar.runtime.materialize import on_meta
from autopar.techniques.zero_stages import zero_stage

__all__ = ["ModelKeys", "LocalTrace", "local_trace"]

PARAM_DTYPES = COMPUTE_DTYPES


@dataclass(frozen=True, kw_only=True)
class ModelKeys:
    """The whole model's state-dict names, every rank alike (tied aliases included).

    Attributes:
        parameters: every parameter name (``named_parameters(remove_duplicate=False)``).
        buffers: every buffer name, persistent or not (rotary ``inv_freq``, masks).
    """

    parameters: frozenset[str]
    buffers: frozenset[str]


@dataclass(frozen=True)
class LocalTrace:
    """The trace of this rank's model copy, and the copy's buffers by ``id`` (name, tensor:
    held so that the ids stay theirs) for naming the rewritten program's buffers."""

    traced: TracedModel
    buffers: dict[int, tuple[str, torch.Tensor]]
    keys: ModelKeys

    def buffer_keys(self, module: nn.Module) -> dict[str, str]:
        """``module``'s buffer names -> the model's buffer keys."""
        return {n: self.buffers[id(b)][0] for n, b in module.named_buffers() if id(b) in self.buffers}


def local_trace(model: nn.Module, plan: Plan) -> LocalTrace:
    """The trace of this rank's copy of ``model`` in the plan's dtype (the graph the plan
    was made on: :func:`~autopar.graph.capture.trace_model`'s ``dtype``). ZeRO-3: the
    (sharded) parameters then go back to fp32 master weights; FSDP2 casts them to the
    plan's dtype when it gathers them (runtime.fsdp), so the graph computes as traced."""
    local_model = cast_floating(copy.deepcopy(model), PARAM_DTYPES[plan.dtype])
    if on_meta(local_model):  # real buffers beside meta parameters: their values are the
        meta_buffers(local_model)  # Initializer's, the trace needs shapes on one device
    traced = trace_model(local_model, plan.seq_len // plan.cp)  # CP: this rank's s/c tokens
    buffers: dict[int, tuple[str, torch.Tensor]] = {}
    for name, b in local_model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), (name, b))
    if zero_stage(plan.zero_stage).shards_parameters:  # FSDP2 keeps fp32 shards
        cast_floating(local_model, torch.float32)
    keys = ModelKeys(
        parameters=frozenset(n for n, _ in local_model.named_parameters(remove_duplicate=False)),
        buffers=frozenset(n for n, _ in local_model.named_buffers(remove_duplicate=False)))
    return LocalTrace(traced, buffers, keys)
