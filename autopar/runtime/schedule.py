"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) on ``torch.distributed.pipelining``.

Why the library and not a hand-written schedule: its ``ScheduleGPipe`` and
``Schedule1F1B`` ran on gloo with ``group=pp_group`` a sub-group (pp=2 with dp=2)
and matched single-process training in tests/multiprocess/test_runtime.py; its 1F1B fuses the
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
  The last stage's outputs, logits (b, s, V) (or (b, s, V/t) kept split over TP), go to
  the loss, never to a peer; they are described as they are (``logits_width``), since
  torch 2.11's library checks every stage's outputs against their description (2.13's
  does not check the last one's).
* Micro-batching: ``step`` splits this replica's (m*b, s) batch into m chunks of b
  rows along dim 0. Each micro-batch's mean loss is divided by m before its backward
  (``scale_grads=False``: the library's division of the accumulated gradients at the end
  of the step would race with the data-parallel all-reduce that backward has already
  started on them, :mod:`autopar.runtime.buckets`), so the gradient is that of the mean
  loss over the m micro-batches.
* Stage i is pipeline rank i of ``pp_group`` (ranks ordered by pp_rank).
* Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): this rank runs v model chunks
  of the p·v-chunk model, chunk c on pipeline rank c % p (ZB-V: the V, chunks r and
  2p - 1 - r on rank r, the first rank computing the loss too); each chunk is a
  ``PipelineStage`` with ``stage_index`` c and ``num_stages`` p·v, and the library's
  ``ScheduleInterleaved1F1B`` orders them (depth first; it needs m a multiple of
  max(1, m // p), autopar asks m % p == 0 as Megatron-LM does, see
  :func:`autopar.techniques.pipeline_schedules.interleaving_problem`). Every chunk boundary is a
  point-to-point send, also between two chunks of neighbouring ranks.
* The runner is the class the schedule's record names; a ``PipelineScheduleMulti`` (interleaved
  1F1B, and ZB-H1's ``ScheduleInterleavedZeroBubble`` with one stage per rank) is given the
  list of this rank's stages, a ``PipelineScheduleSingle`` its one stage. ZB-H1 runs each
  backward as the input gradient, then (later, in the bubble) the weight gradient:
  ``torch.autograd.grad`` twice, so a checkpointed region would be recomputed in each,
  which is why the record refuses full recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
import torch.distributed.pipelining as pipelining

from autopar.runtime.compat import PipelineStage
from autopar.runtime.mesh import ParallelGroups
from autopar.techniques.pipeline_schedules import pipeline_schedule


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
        logits_width: the last dim of the last stage's output (V or V/t; None: h).
    """

    micro_batch_size: int
    seq_len: int
    hidden_size: int
    activation_dtype: torch.dtype
    input_shard_dim: int | None = None
    output_shard_dim: int | None = None
    tp: int = 1
    logits_width: int | None = None

    def activation_shape(self, shard_dim: int | None = None) -> tuple[int, int, int]:
        """(b, s, h), with ``shard_dim`` divided by t."""
        shape = [self.micro_batch_size, self.seq_len, self.hidden_size]
        if shard_dim is not None:
            shape[shard_dim] //= self.tp
        return tuple(shape)


def _scaled_loss(loss_fn: Callable, m: int, logits: torch.Tensor, targets: torch.Tensor):
    """One micro-batch's loss divided by the m micro-batches of the step."""
    return loss_fn(logits, targets) / m


def _stage_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class PipelineRunner:
    """Runs this rank's chunks under a pipeline schedule (GPipe, 1F1B, interleaved 1F1B,
    ZB-H1, ZB-V) over ``groups.pp_group``.

    Args:
        chunks: this rank's model chunks, local order (chunk j is global chunk
            ``stage_indices[j]``, the schedule record's ``rank_chunks``: pp_rank + j·pp
            round-robin, pp_rank and 2pp - 1 - pp_rank for a V); one for GPipe/1F1B, v for
            interleaved 1F1B (see ParallelModule for their inputs and outputs).
        groups: this rank's process groups (pp > 1).
        shapes: the boundary shapes, one per chunk.
        num_micro_batches: m.
        schedule: a pipeline schedule's name (validated by the caller); its record names
            the ``torch.distributed.pipelining`` class that runs it.
        loss_fn: per-micro-batch mean loss (logits, targets) -> scalar, used on the last stage.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        groups: ParallelGroups,
        shapes: Sequence[StageShapes],
        num_micro_batches: int,
        schedule: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        if len(shapes) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(shapes)} boundary shapes")
        b, s = shapes[0].micro_batch_size, shapes[0].seq_len
        first_input = torch.empty(b, s, dtype=torch.long, device="meta")
        num_stages = groups.pp * len(chunks)
        record = pipeline_schedule(schedule)
        self.stage_indices = record.rank_chunks(groups.pp, num_stages, groups.pp_rank)
        stages = []
        for index, chunk, shape in zip(self.stage_indices, chunks, shapes):
            act_in = torch.empty(shape.activation_shape(shape.input_shard_dim),
                                 dtype=shape.activation_dtype, device="meta", requires_grad=True)
            out_shape = shape.activation_shape(shape.output_shard_dim)
            if index == num_stages - 1 and shape.logits_width is not None:
                out_shape = (*out_shape[:2], shape.logits_width)  # the logits
            act_out = torch.empty(out_shape, dtype=shape.activation_dtype, device="meta",
                                  requires_grad=True)
            stages.append(PipelineStage(
                chunk, index, num_stages, _stage_device(chunk),
                input_args=first_input if index == 0 else act_in,
                output_args=act_out,
                group=groups.pp_group,
            ))
        self.groups, self.shapes = groups, shapes
        self.num_micro_batches = num_micro_batches
        scaled = functools.partial(_scaled_loss, loss_fn, num_micro_batches)
        runner = getattr(pipelining, record.runner)  # the record names torch's class
        multi = issubclass(runner, pipelining.schedules.PipelineScheduleMulti)  # takes a list
        self._schedule = runner(stages if multi else stages[0], num_micro_batches,
                                loss_fn=scaled, scale_grads=False)

    def run(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of m micro-batches; gradients accumulate in the stage's parameters.

        idx, targets: this replica's (m*b, s) rows (idx is used on the first stage,
        targets on the last). Returns the mean of the m micro-batch losses (float64
        scalar) on the last stage, None elsewhere.
        """
        first = 0 in self.stage_indices
        last = self.groups.pp * len(self.stage_indices) - 1 in self.stage_indices
        if not last:
            self._schedule.step(*((idx,) if first else ()))
            return None
        losses: list[torch.Tensor] = []  # a V placement's first rank holds both ends
        self._schedule.step(*((idx,) if first else ()), target=targets, losses=losses,
                            return_outputs=False)
        return torch.stack([loss.detach().double() for loss in losses]).sum()  # each / m
