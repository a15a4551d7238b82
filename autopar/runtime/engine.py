"""Train one pipeline stage of a (tp, pp, dp) plan: micro-batches, schedule, gradient sync, step.

``ParallelModule`` wraps the stage this rank runs (already tensor-parallel-rewritten,
its TP collectives inside) and implements one training step:

1. Every rank receives the same global batch (B, s), B = d * b * m, and keeps its DP
   slice of B/d rows, cut into m micro-batches of b rows; under context parallelism (c
   ranks per replica) its s/c tokens of each row (two of 2c chunks,
   :func:`~autopar.runtime.context_parallel.shard_sequence`), its loss the mean over them
   (equal shares: the mean over the c·d ranks of the gradient axis is the global mean).
2. Forward/backward of the stage over the m micro-batches. pp == 1: plain gradient
   accumulation, each micro-batch loss scaled by 1/m. pp > 1: the pipeline schedule
   (GPipe, 1F1B or interleaved 1F1B over v chunks) of :mod:`autopar.runtime.schedule`;
   the last stage computes a per-micro-batch mean loss, also scaled by 1/m before its
   backward, so either way the gradient is that of the mean loss over the DP-local batch.
3. Tied embedding: the first and last stage each hold a copy of the (shard of the)
   word embedding and get a partial gradient; they are summed over
   ``groups.embedding_group`` (pp > 1).
4. DP and the optimizer (:class:`autopar.runtime.zero.DistributedOptimizer`): gradients
   averaged over ``groups.dp_group`` in buckets started during backward
   (:mod:`autopar.runtime.buckets`): all-reduce (ZeRO-0, then the sums of step 3 and of the
   SP partial gradients over TP) or reduce-scatter (ZeRO-1/2; the buckets of the
   parameters step 3 and SP sum wait for those sums; ZeRO-2 after every micro-batch), the
   optimizer steps (the owned slice, fp32 master weights under bf16), parameters
   all-gathered back (ZeRO-1/2). ZeRO-3
   (:class:`autopar.runtime.fsdp.FullyShardedOptimizer`, pp == 1): FSDP2 shards the
   stage over the DP mesh, gathers each layer's parameters around its forward and
   backward and reduce-scatters its gradient per micro-batch.
5. The returned loss is the mean over all micro-batches and replicas, the same float on
   every rank. One all-reduce over the world carries it with the squared gradient norm
   (:mod:`autopar.runtime.health`): before the optimizer runs, a non-finite loss or norm
   stops (or skips) the step on every rank, and ``max_norm`` clips the gradient by its
   global norm.

Every collective a measured step issues is counted by :class:`autopar.runtime.stats.CommMeter`
(payload bytes by kind) and its saved activations by ``SavedActivationTracker``, readable
with ``last_step_stats()``. Both hook every op the step runs (a dispatch mode and
saved-tensor hooks: about 3x the step time of a small model on CPU), so only step 2 (the
first steady step: in step 1 the pipeline library also exchanges shapes) and every
``measure_every``-th step after it are measured.

A failure raises on the rank that saw it; the others then fail in their next
collective (a dead peer's closed connection, or the process groups' timeout), re-raised as
:class:`~autopar.runtime.health.CollectiveError` naming the step and the collective.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.runtime.health import (NonFiniteError, as_collective_error, check_step_options,
                                   clip_coefficient, nonfinite_message)
from autopar.runtime.buckets import chunk_parameters
from autopar.runtime.compat import values
from autopar.runtime.context_parallel import shard_sequence
from autopar.runtime.mesh import ParallelGroups
from autopar.runtime.schedule import PipelineRunner, StageShapes
from autopar.runtime.stats import CommMeter, SavedActivationTracker
from autopar.runtime.fsdp import FullyShardedOptimizer
from autopar.runtime.zero import DistributedOptimizer
from autopar.contract.support import check_positive_ints, pipeline_problem
from autopar.techniques.pipeline_schedules import DEFAULT_SCHEDULE, PIPELINE_SCHEDULES, SCHEDULES
from autopar.techniques.zero_stages import zero_stage as zero_stage_record


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over tokens. logits: (b, s, V), targets: (b, s) int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _check_schedule(schedule: str, pp: int, num_micro_batches: int, num_chunks: int = 1) -> None:
    """The module structure the schedule needs, then the one pipeline rule of
    :func:`autopar.contract.support.pipeline_problem` (the layer-count rule is the planner's: this
    rank's chunks are already cut). Raises NotImplementedError for an unknown schedule and
    ValueError for a rule the layout breaks."""
    if schedule not in PIPELINE_SCHEDULES:
        raise NotImplementedError(f"pipeline schedule {schedule!r} is not supported; use one of {SCHEDULES}")
    if (num_chunks > 1) != PIPELINE_SCHEDULES[schedule].interleaved:
        raise ValueError(f"schedule {schedule!r} with {num_chunks} model chunks on this rank: "
                         "pass an nn.ModuleList of v >= 2 chunks exactly for an interleaved "
                         "schedule")
    problem = pipeline_problem(schedule, pp, num_micro_batches, num_layers=None,
                               virtual_stages=num_chunks)
    if problem:
        raise ValueError(problem)


class ParallelModule(nn.Module):
    """One rank's share of a (tp, pp, dp) training job; see the module docstring.

    Args:
        stage_module: this rank's pipeline stage. Input: first stage idx (b, s) int64,
            other stages (b, s, hidden_size) of activation_dtype. Output: (b, s,
            hidden_size) of activation_dtype, the last stage logits (b, s, V). For
            interleaved 1F1B an ``nn.ModuleList`` of this rank's v chunks, local order
            (chunk j is global chunk pp_rank + j·pp, see ``Plan.stage_layers``), each
            such a stage; ``chunks`` lists them (``[stage_module]`` otherwise).
        groups: this rank's process groups.
        micro_batch_size: b, rows per micro-batch.
        num_micro_batches: m, micro-batches per step and DP replica.
        seq_len: s (each of the c CP ranks runs s/c of every sequence's tokens).
        hidden_size: h, the width of the activation between stages.
        schedule: a pipeline schedule's name (:data:`SCHEDULES`; ignored when pp == 1).
        optimizer_factory: builds an element-wise optimizer (SGD, Adam, AdamW, ...) from a
            list of tensors; it is given this rank's flat (slice of the) master weights
            (ZeRO-3: the stage's FSDP2-sharded DTensor parameters).
        tied_parameter_names: names (in stage_module.named_parameters()) of the tied
            embedding shard on the first and last stage; summed over the embedding group.
        activation_dtype: dtype of the activations sent between stages (the parameters').
        loss_fn: per-micro-batch mean loss (logits (b, s, V), targets (b, s)) -> scalar.
        zero_stage: 0, 1, 2 or 3 over the DP group (2 and 3 only with pp == 1). ZeRO-3
            needs fp32 parameters (the sharded master weights); with activation_dtype
            bf16 FSDP2 computes in bf16 (mixed precision).
        master_dtype: the optimizer's weights; float32 with bf16 parameters is mixed
            precision (None: the parameters' dtype). Unused by ZeRO-3.
        partial_grad_parameter_names: replicated parameters used on sequence shards
            (LayerNorm under sequence parallelism): their gradients are summed over the TP
            group after backward (per micro-batch under ZeRO-2).
        boundary_shard_dims: per chunk, the dims along which the activation it receives /
            sends is split over TP (None: whole), see StageShapes.
        logits_width: the last dim of the last stage's logits (b, s, V, or V/t when they
            stay split over TP); None: hidden_size (the pipeline library then must not
            check the last stage's outputs, as torch 2.11's does).
        tp_sharded_parameter_names: parameters split over the TP group (each TP rank holds
            another part); the others are replicated over TP and counted once in the
            gradient norm.
        expert_parameter_names: this rank's experts under expert parallelism (ZeRO-0):
            summed over ``groups.edp_group`` and divided by d instead of the DP average,
            counted in the norm once per EP rank (:class:`DistributedOptimizer`).
        max_norm: clip the gradient to this global L2 norm (None: no clipping).
        on_nonfinite: "raise" (NonFiniteError on every rank, before the update) or "skip"
            (no update on any rank) when the loss or the gradient norm is not finite.
        measure_every: measure communication bytes and saved activations on step 2 and
            every measure_every-th step after it (1: every step).

    Raises:
        ValueError: a size is not a positive int, 1F1B with m < p, interleaved 1F1B with
            pp == 1 or m % p != 0 or without a ModuleList of >= 2 chunks, a tied name is
            missing on the first/last stage, ZeRO-2/3 with pp > 1, or a bad max_norm /
            on_nonfinite.
        NotImplementedError: an unknown schedule.
    """

    def __init__(
        self,
        stage_module: nn.Module,
        groups: ParallelGroups,
        *,
        micro_batch_size: int,
        num_micro_batches: int,
        seq_len: int,
        hidden_size: int,
        schedule: str = DEFAULT_SCHEDULE,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        tied_parameter_names: Sequence[str] = (),
        activation_dtype: torch.dtype = torch.float32,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_cross_entropy,
        zero_stage: int = 0,
        master_dtype: torch.dtype | None = None,
        partial_grad_parameter_names: Sequence[str] = (),
        boundary_shard_dims: Sequence[tuple[int | None, int | None]] = ((None, None),),
        logits_width: int | None = None,
        tp_sharded_parameter_names: Sequence[str] = (),
        expert_parameter_names: Sequence[str] = (),
        max_norm: float | None = None,
        on_nonfinite: str = "raise",
        measure_every: int = 100,
    ) -> None:
        super().__init__()
        check_step_options(max_norm, on_nonfinite)
        check_positive_ints(measure_every=measure_every)
        self.measure_every = measure_every
        self.max_norm, self.on_nonfinite = max_norm, on_nonfinite
        self.device = groups.device
        check_positive_ints(micro_batch_size=micro_batch_size,
                            num_micro_batches=num_micro_batches, seq_len=seq_len,
                            hidden_size=hidden_size)
        chunks = list(stage_module) if isinstance(stage_module, nn.ModuleList) else [stage_module]
        _check_schedule(schedule, groups.pp, num_micro_batches, len(chunks))
        zero = zero_stage_record(zero_stage)
        if zero.problem(groups.pp):
            raise ValueError(zero.problem(groups.pp))
        # ZeRO-2's gradients leave each micro-batch, their sums over TP first; FSDP2's once
        self._partial_sums_each_micro_batch = (zero.reduces_each_micro_batch
                                               and not zero.shards_parameters)
        self._dp_all_reduce = zero.gradient_collective == "all_reduce"
        self._swaps_parameters = zero.shards_parameters  # FSDP2 registers gathered ones
        self.stage_module = stage_module
        self.chunks = chunks
        self.groups = groups
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.seq_len, self.hidden_size, self.schedule = seq_len, hidden_size, schedule
        self.loss_fn = loss_fn
        self._stats: dict = {}
        self.steps_done = 0  # optimizer steps taken (restored by a checkpoint)
        self.tied_parameters = self._find_tied(tied_parameter_names)
        if zero.shards_parameters:
            self.dp_optimizer = FullyShardedOptimizer(
                stage_module, optimizer_factory,
                dp_mesh=groups.device_mesh["dp"] if groups.device_mesh is not None else None,
                param_dtype=activation_dtype)
        else:  # ZeRO-1/2 reduce these after their sums over TP and the tied pair
            named = dict(stage_module.named_parameters())
            deferred = self.tied_parameters + [named[n] for n in partial_grad_parameter_names]
            self.dp_optimizer = DistributedOptimizer(
                chunk_parameters(stage_module), optimizer_factory, dp_group=groups.dp_group,
                zero_stage=zero_stage, master_dtype=master_dtype,
                accumulations=num_micro_batches, deferred=deferred,
                experts=[named[n] for n in expert_parameter_names], expert_group=groups.edp_group)
        params = dict(stage_module.named_parameters())  # after FSDP2 swapped them in
        self.partial_grad_parameters = [params[n] for n in partial_grad_parameter_names]
        self._norm_counted = self._counted_in_norm(params, set(tp_sharded_parameter_names))
        self.optimizer = self.dp_optimizer.optimizer
        self.runner: PipelineRunner | None = None
        if groups.pp > 1:
            shapes = [StageShapes(micro_batch_size, seq_len // groups.cp, hidden_size,
                                  activation_dtype,
                                  *dims, tp=groups.tp, logits_width=logits_width)
                      for dims in boundary_shard_dims]
            self.runner = PipelineRunner(chunks, groups, shapes, num_micro_batches,
                                         schedule, loss_fn)

    def _find_tied(self, names: Sequence[str]) -> list[nn.Parameter]:
        """The tied parameters present on this stage; all must exist on the first/last stage."""
        params = dict(self.stage_module.named_parameters())
        on_end_stage = self.groups.is_first_stage or self.groups.is_last_stage
        missing = [n for n in names if n not in params]
        if missing and on_end_stage:
            raise ValueError(
                f"tied parameter(s) {missing} not found in stage {self.groups.pp_rank}; "
                f"its parameters are {sorted(params)}"
            )
        return [params[n] for n in names if n in params]

    def _counted_in_norm(self, params: dict[str, nn.Parameter], tp_sharded: set[str]) -> set[int]:
        """ids of the parameters whose gradient this rank counts in the global norm: TP
        shards on every TP rank, TP-replicated ones on TP rank 0, the tied embedding on the
        first stage only (the last stage's copy holds the same summed gradient)."""
        g = self.groups
        tied = {id(p) for p in self.tied_parameters} if g.pp > 1 and not g.is_first_stage else set()
        return {id(p) for name, p in params.items()
                if (g.tp == 1 or name in tp_sharded or g.tp_rank == 0) and id(p) not in tied}

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        """Run the stage module alone (no pipeline, no gradient sync; v = 1 only)."""
        if len(self.chunks) > 1:
            raise NotImplementedError("this rank holds several interleaved chunks that do not "
                                      "run back to back; call pm.chunks[j](x) for one of them")
        return self.stage_module(*args)

    def _local_batch(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP replica's rows, and under context parallelism this CP rank's tokens of
        them: (B, s) -> (B/d, s/c). Raises ValueError on a wrong shape."""
        g, b, m, s = self.groups, self.micro_batch_size, self.num_micro_batches, self.seq_len
        replicas = g.dp // g.cp
        expected = (replicas * b * m, s)
        for name, t in (("idx", idx), ("targets", targets)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)} but the plan needs the global batch "
                    f"(B, s) = ({replicas}*{b}*{m}, {s}) = {expected} (dp * micro_batch_size * "
                    f"num_micro_batches rows of seq_len tokens)"
                )
        rows = b * m
        start = g.data_rank * rows
        return tuple(shard_sequence(t[start:start + rows], g.cp, g.cp_rank)
                     for t in (idx, targets))

    def _accumulate(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """pp == 1: forward/backward each micro-batch, loss / m. Returns the mean loss (detached)."""
        m = self.num_micro_batches
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb_idx, mb_targets in zip(idx.split(self.micro_batch_size), targets.split(self.micro_batch_size)):
            loss = self.loss_fn(self.stage_module(mb_idx), mb_targets)  # (b, s, V) -> scalar
            (loss / m).backward()
            if self._partial_sums_each_micro_batch:
                self._sync_partial_grads()
            self.dp_optimizer.micro_batch_done()
            total += loss.detach().double()
        return total / m

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch idx, targets: (B, s) int64, the same on every rank.

        Returns the mean loss over all micro-batches and DP replicas (same on every rank).
        After it returns, each parameter's ``.grad`` holds this step's synchronised (and
        clipped) gradient, the one the optimizer used, until the next call.

        Raises:
            ValueError: B != dp * micro_batch_size * num_micro_batches or s != seq_len.
            NonFiniteError: on_nonfinite="raise" and the loss or gradient norm is NaN/inf
                (on every rank, before the update).
            CollectiveError: a collective failed (a peer died or timed out).
        """
        local_idx, local_targets = (t.to(self.device) for t in self._local_batch(idx, targets))
        self.dp_optimizer.zero_grad()  # grads stay readable until the next step
        start = time.perf_counter()
        step = self.steps_done + 1
        measured = self.steps_done % self.measure_every == 1 % self.measure_every
        meter = CommMeter(self.groups.axis_names()) if measured else contextlib.nullcontext()
        # the module (its parameters read at every save) only where FSDP2 swaps them in;
        # else the parameters once (a walk of the module per save: 2 ms on a 4-layer GPT)
        excluded = (self.stage_module if self._swaps_parameters
                    else list(self.stage_module.parameters()))
        saved = SavedActivationTracker(excluded) if measured else contextlib.nullcontext()
        try:
            with meter:
                with saved:
                    if self.runner is None:
                        loss = self._accumulate(local_idx, local_targets)
                    else:
                        loss = self.runner.run(local_idx, local_targets)  # last stage, else None
                # ZeRO-0 started its DP all-reduce in backward: the sums over TP and the tied
                # pair follow it (they commute with it on the whole gradient). ZeRO-1/2 own
                # shards of buffers laid out per stage: the sums come first, on whole tensors
                # of the deferred buckets, which reduce_gradients then reduce-scatters.
                dp_first = self._dp_all_reduce
                if dp_first:
                    self.dp_optimizer.reduce_gradients()
                if not self._partial_sums_each_micro_batch:
                    self._sync_partial_grads()
                self._sync_tied_grads()
                if not dp_first:
                    self.dp_optimizer.reduce_gradients()
                result, norm = self._global_loss_and_norm(loss)
                skipped = not (math.isfinite(result) and math.isfinite(norm))
                if skipped and self.on_nonfinite == "raise":
                    raise NonFiniteError(nonfinite_message(step, result, norm))
                if not skipped:
                    self.dp_optimizer.scale_gradients(clip_coefficient(norm, self.max_norm))
                    self.dp_optimizer.step()
        except RuntimeError as exc:
            error = as_collective_error(exc, getattr(meter, "last", None), step,
                                        self.groups.timeout, self.groups.axis_names())
            if error is None:
                raise
            raise error from exc
        if measured:
            self._stats = {"comm_bytes": dict(meter.bytes), "saved_activation_bytes":
                           saved.peak_bytes, "measured_step": step}
        self._stats.update(model_state_bytes=self.dp_optimizer.state_bytes(),
                           step_time_s=time.perf_counter() - start, grad_norm=norm,
                           skipped=skipped)
        self.steps_done += 1
        return result

    def _sync_partial_grads(self) -> None:
        """Sum over TP the gradients of replicated parameters used on sequence shards (each
        TP rank saw only its part of the sequence; Korthikanti et al. 2022, section 4.2.2)."""
        if self.groups.tp == 1:
            return
        for p in self.partial_grad_parameters:
            if p.grad is not None:  # ZeRO-3: this rank's DP shard (sums commute)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.groups.tp_group)

    def _sync_tied_grads(self) -> None:
        """Sum the tied embedding's partial gradients over the first and last stage."""
        group = self.groups.embedding_group
        if group is None:
            return
        for p in self.tied_parameters:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            p.grad = grad

    def _global_loss_and_norm(self, local_loss: torch.Tensor | None) -> tuple[float, float]:
        """(mean loss over DP replicas, global gradient L2 norm), the same floats on every
        rank: one float64 all-reduce over the world of (this rank's share of the loss: the
        last stage's TP rank 0, divided by d; its squared norm share, see
        :meth:`_counted_in_norm`). No collective when the world is one rank."""
        g = self.groups
        share = torch.zeros(2, dtype=torch.float64, device=self.device)
        if local_loss is not None and g.tp_rank == 0:
            share[0] = local_loss.double() / g.dp
        share[1] = self.dp_optimizer.grad_square_sum(self._norm_counted)
        if g.world_size > 1:
            dist.all_reduce(share, op=dist.ReduceOp.SUM, group=g.world_group)
        loss, square = values(share)  # a dry run's fake tensors: zeros
        return loss, math.sqrt(square)  # NaN and inf stay what they are

    def last_step_stats(self) -> dict:
        """Measured statistics of the last ``train_step`` on this rank (the keys of
        ``Plan.predicted.stage_stats``): ``comm_bytes`` (payload bytes handed to
        collectives and p2p sends, by kind), ``model_state_bytes`` (parameters, gradients
        and optimizer states held), ``saved_activation_bytes`` (peak bytes saved for
        backward) and ``step_time_s`` (wall seconds); and ``grad_norm`` (the global
        gradient L2 norm before clipping) and ``skipped`` (True when a non-finite loss or
        norm dropped the update, on_nonfinite="skip"). ``comm_bytes`` and
        ``saved_activation_bytes`` are those of the last measured step, ``measured_step``
        (see ``measure_every``). Empty before the first step."""
        return dict(self._stats)
