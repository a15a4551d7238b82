"""Pipeline schedules (GPipe, 1F1B) for one stage, on ``torch.distributed.pipelining``.

Why the library and not a hand-written schedule: its ``ScheduleGPipe`` and
``Schedule1F1B`` ran on gloo with ``group=pp_group`` a sub-group (pp=2 with dp=2)
and matched single-process training in tests/test_runtime.py; its 1F1B fuses the
sends and receives of the steady state with ``batch_isend_irecv``, which has been
reported to hang on gloo but did not in those runs. If it ever does, the fix is a
schedule of plain ``dist.send``/``dist.recv`` on ``pp_group`` here, behind the same
:class:`PipelineRunner` interface.

How it is used:

* The stage is described statically (``input_args``/``output_args`` on the meta
  device), so the library runs no shape inference through the module: the module
  holds TP collectives, which must not run on meta tensors nor run an extra real
  forward/backward. Stage inputs/outputs: first stage idx (b, s) int64, activations
  (b, s, h) of the activation dtype, requiring grad so that gradients flow back.
  The last stage's outputs (logits (b, s, V), V unknown here) go to the loss, never
  to a peer, and the library neither sends nor validates them; they are described
  with the (b, s, h) activation as a stand-in.
* Micro-batching: ``step`` splits this replica's (m*b, s) batch into m chunks of b
  rows along dim 0. The loss is a per-micro-batch mean and ``scale_grads=True``
  divides the accumulated gradients by m once at the end of the step, so the
  gradient is that of the mean loss over the m micro-batches.
* Stage i is pipeline rank i of ``pp_group`` (ranks ordered by pp_rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.runtime.mesh import ParallelGroups


@dataclass(frozen=True)
class StageShapes:
    """Shapes of what crosses a stage boundary.

    Attributes:
        micro_batch_size: b.
        seq_len: s.
        hidden_size: h.
        activation_dtype: dtype of the (b, s, h) activation and its gradient.
        input_shard_dim / output_shard_dim: the dim of (b, s, h) along which the activation
            this stage receives / sends is split over the TP group (None: whole), e.g. 1
            under sequence parallelism: each TP rank sends its (b, s/t, h) shard.
        tp: the TP degree t.
    """

    micro_batch_size: int
    seq_len: int
    hidden_size: int
    activation_dtype: torch.dtype
    input_shard_dim: int | None = None
    output_shard_dim: int | None = None
    tp: int = 1

    def activation_shape(self, shard_dim: int | None = None) -> tuple[int, int, int]:
        """(b, s, h), with ``shard_dim`` divided by t."""
        shape = [self.micro_batch_size, self.seq_len, self.hidden_size]
        if shard_dim is not None:
            shape[shard_dim] //= self.tp
        return tuple(shape)

    def activation_bytes(self, shard_dim: int | None = None) -> int:
        """Bytes of one activation (or its gradient) of :meth:`activation_shape`."""
        elem = torch.empty((), dtype=self.activation_dtype).element_size()
        return math.prod(self.activation_shape(shard_dim)) * elem


def _stage_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class PipelineRunner:
    """Runs this rank's stage under a GPipe or 1F1B schedule over ``groups.pp_group``.

    Args:
        stage_module: the stage (see ParallelModule for its inputs and outputs).
        groups: this rank's process groups (pp > 1).
        shapes: the boundary shapes.
        num_micro_batches: m.
        schedule: "gpipe" or "1f1b" (validated by the caller).
        loss_fn: per-micro-batch mean loss (logits, targets) -> scalar, used on the last stage.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        groups: ParallelGroups,
        shapes: StageShapes,
        num_micro_batches: int,
        schedule: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        b, s = shapes.micro_batch_size, shapes.seq_len
        dtype = shapes.activation_dtype
        act_in = torch.empty(shapes.activation_shape(shapes.input_shard_dim), dtype=dtype,
                             device="meta", requires_grad=True)
        act_out = torch.empty(shapes.activation_shape(shapes.output_shard_dim), dtype=dtype,
                              device="meta", requires_grad=True)
        first_input = torch.empty(b, s, dtype=torch.long, device="meta")
        stage = PipelineStage(
            stage_module, groups.pp_rank, groups.pp, _stage_device(stage_module),
            input_args=first_input if groups.is_first_stage else act_in,
            output_args=act_out,  # on the last stage a stand-in, see the module docstring
            group=groups.pp_group,
        )
        schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.groups, self.shapes = groups, shapes
        self.num_micro_batches = num_micro_batches
        self._schedule = schedule_cls(stage, num_micro_batches, loss_fn=loss_fn, scale_grads=True)

    def run(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of m micro-batches; gradients accumulate in the stage's parameters.

        idx, targets: this replica's (m*b, s) rows (idx is used on the first stage,
        targets on the last). Returns the mean of the m micro-batch losses (float64
        scalar) on the last stage, None elsewhere.
        """
        g = self.groups
        if g.is_first_stage:
            self._schedule.step(idx)
            result = None
        elif g.is_last_stage:
            losses: list[torch.Tensor] = []
            self._schedule.step(target=targets, losses=losses, return_outputs=False)
            result = torch.stack([loss.detach().double() for loss in losses]).mean()
        else:
            self._schedule.step()
            result = None
        return result
