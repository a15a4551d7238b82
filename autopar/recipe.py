"""``autopar.parallelize``: turn a model and a plan into this rank's training program.

The recipe composes the flow's steps (graph -> rewrite -> runtime) beside :mod:`autopar.api`,
so that neither the rewrite nor the runtime imports the other's callers: each step reads
only the plan:

1. agree on the plan (:func:`agreed_plan`): validate it, or solve it on rank 0 and
   broadcast it, then compare a digest on every rank before any other collective;
2. trace the model (the same front end the planner used, so node names match the plan);
3. rewrite (:func:`autopar.rewrite.apply_plan`): tensor parallelism → dropout RNG →
   recompute → pipeline cut, leaving this rank's model chunks;
4. a model on the meta device: give this rank's shards their values
   (:mod:`autopar.runtime.shard_init`: each owning module initialised whole, one at a
   time, by :mod:`autopar.runtime.materialize`'s rule, and sliced), before the optimizer
   copies them into its flat buffer (ZeRO-0/1/2); under ZeRO-3 after FSDP2 has sharded
   the meta stage, so that a rank allocates only its DP shard (FSDP2's meta-device recipe). The buffers and the init rule are checked
   before step 1's first collective; then, under expert parallelism (ep > 1), every
   experts module the rank's graphs call becomes its E/ep-expert shard
   (:func:`~autopar.runtime.expert_parallel.shard_experts`, same parameter names), before
   the optimizer's flat buffer is made (it holds the local experts only);
5. wrap them in the runtime (:class:`ParallelizedModel`, a
   :class:`~autopar.runtime.engine.ParallelModule`): micro-batches, GPipe / 1F1B /
   interleaved 1F1B, DP averaging or ZeRO, tied-embedding gradient sync, optimizer.

The ``verify=True`` option of the public :func:`autopar.parallelize` runs
:func:`autopar.verify.check.verify` between steps 1 and 2; this module never imports
autopar.verify. :func:`autopar.verify.dry_run.dry_run` runs the same steps for any rank
on a fake process group: :func:`checked_trace`, :func:`plan_groups` and
:func:`build_program` (with a local ``agree``) are the pieces ``parallelize`` is made of.
"""

from __future__ import annotations

import copy
import functools
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.graph.annotate import TracedModel
from autopar.graph.experts import is_experts_module
from autopar.contract.plan_check import check_plan
from autopar.planner.plan_fit import check_plan_fits_model, check_seq_len
from autopar.contract.placement import parse_strategy_key
from autopar.contract.plan import Plan
from autopar.local_trace import PARAM_DTYPES, LocalTrace, ModelKeys, local_trace
from autopar.rewrite import RankProgram, apply_plan
from autopar.contract.placement import ShardSpec
from autopar.runtime.engine import ParallelModule, token_cross_entropy
from autopar.runtime.expert_parallel import check_expert_parallel, shard_experts
from autopar.techniques.expert_parallel import experts_token_parallel
from autopar.runtime.health import check_step_options
from autopar.runtime.device import rank_device
from autopar.techniques.zero_stages import zero_stage
from autopar.runtime.full_state import gather_full
from autopar.runtime.materialize import InitFn, Initializer, on_meta
from autopar.runtime.shard_init import (materialize_fsdp_shards, materialize_shards,
                                       place_program_devices)
from autopar.runtime.mesh import ParallelGroups, as_timeout, validate_degrees
from autopar.runtime.rng import RNGStatesTracker, seed_rank
from autopar.runtime.vocab_parallel import vocab_parallel_cross_entropy
from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["check_plan_matches", "parallelize", "agreed_plan", "ParallelizedModel", "PARAM_DTYPES",
           "checked_trace", "plan_groups", "build_program"]


class ParallelizedModel(ParallelModule):
    """This rank's share of the plan: ``train_step(idx, targets) -> global mean loss``,
    ``full_state_dict()``, ``plan`` and ``stage_module`` (print its ``.code``; with
    interleaved 1F1B an nn.ModuleList of this rank's v chunks, parameter names prefixed
    by the local chunk index). Checkpoints: ``save_checkpoint``/``load_checkpoint`` (any
    plan of the same model loads them) and ``load_full_state_dict`` (single-device weights),
    see :mod:`autopar.runtime.checkpoint`."""

    def __init__(self, stage_module, groups, plan: Plan, shards: dict[str, ShardSpec],
                 tied_aliases: dict[str, str], rng_tracker: RNGStatesTracker | None = None,
                 *, model_keys: ModelKeys, **kwargs):
        super().__init__(stage_module, groups, **kwargs)
        self.plan = plan
        self.shards = shards  # local parameter name -> origin
        self.tied_aliases = tied_aliases  # original key -> the key it shares a tensor with
        self.rng_tracker = rng_tracker  # the dropout streams (saved in checkpoints)
        self.model_keys = model_keys  # the whole model's state-dict names (load_full_state_dict)
        self.pending_save = None  # the Future of an asynchronous checkpoint save still writing
        self.expert_slices: dict[str, slice] = {}  # local expert parameter -> its experts (ep > 1)

    def close(self) -> None:
        """Wait for a pending asynchronous save, then destroy this program's process groups
        (:meth:`~autopar.runtime.mesh.ParallelGroups.destroy`; FSDP2's mesh groups stay,
        DTensor's caches hold them); call on every rank when done training in a process
        that goes on (the program cannot run afterwards)."""
        future, self.pending_save = self.pending_save, None
        if future is not None:
            future.result()
        self.groups.destroy(mesh_groups=not self._swaps_parameters)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the original model's keys, on every rank (CPU).

        Collective over the whole world: every rank must call it. Tied parameters appear
        under every original name (e.g. ``lm_head.weight`` and ``transformer.wte.weight``).
        """
        return gather_full(self, lambda p: p)

    def save_checkpoint(self, path, *, extra: dict | None = None, async_save: bool = False):
        """Save the training state to the DCP directory ``path`` (collective; returns the
        write's Future under ``async_save``): :func:`autopar.runtime.checkpoint.save_checkpoint`."""
        from autopar.runtime import checkpoint

        return checkpoint.save_checkpoint(self, path, extra=extra, async_save=async_save)

    def load_checkpoint(self, path) -> dict:
        """Load a checkpoint saved under any plan of this model (collective); returns its
        ``extra``: :func:`autopar.runtime.checkpoint.load_checkpoint`."""
        from autopar.runtime import checkpoint

        return checkpoint.load_checkpoint(self, path)

    def load_latest_checkpoint(self, directory):
        """Load the newest complete checkpoint in ``directory``, skipping (and naming)
        damaged or incomplete newer ones (collective):
        :func:`autopar.runtime.checkpoint.load_latest_checkpoint`."""
        from autopar.runtime import checkpoint

        return checkpoint.load_latest_checkpoint(self, directory)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *,
                             strict: bool = True) -> None:
        """Load whole single-device weights (no collective):
        :func:`autopar.runtime.checkpoint_export.load_full_state_dict`."""
        from autopar.runtime import checkpoint_export

        checkpoint_export.load_full_state_dict(self, state_dict, strict=strict)


def _agree(plan: Plan, world: int) -> None:
    """Every rank must hold the same plan: compare a digest before any other collective."""
    digest = plan.decision_digest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError("ranks hold different plans (digests "
                           f"{sorted(set(digests))}); pass the same plan to every rank or "
                           "plan=None so that rank 0 solves and broadcasts")


def _broadcast_plan(plan: Plan | None) -> Plan:
    box = [plan.to_json() if plan is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])


def _check_process_group() -> None:
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed to be initialised "
                           "(run under torchrun and call dist.init_process_group first)")


def check_plan_matches(model: nn.Module, plan: Plan, traced: TracedModel | None = None) -> None:
    """Raise ValueError (:class:`~autopar.contract.plan_check.PlanError`) unless ``plan`` fits
    ``model``: :func:`autopar.planner.plan_fit.check_plan_fits_model` (config, seq_len
    within the model's positions, layer count, traced node names, every placement a
    strategy of its node at the plan's tp). ``traced``: ``model``'s trace when the caller
    has one. Local (no collective), so :func:`parallelize` calls it before the first
    collective. A model without a config whose graph has the same node names but other
    sizes is not detected here; the TP rewrite then refuses sizes that do not divide, and
    ``autopar verify`` compares against one device."""
    check_plan_fits_model(plan, model, traced)


def agreed_plan(model: nn.Module, cluster=None, plan: Plan | None = None, *,
                global_batch_size: int | None = None, seq_len: int | None = None) -> Plan:
    """The plan every rank will run (step 1 of the module docstring): ``plan`` checked, or
    (plan None) solved for ``cluster`` on rank 0 and broadcast; then digests compared.

    Collective over the world. Raises RuntimeError (no process group, or ranks disagree),
    PlanError (a ValueError: a plan feature the runtime cannot run, or a malformed plan;
    :func:`~autopar.contract.support.check_executable`), ValueError (world size
    != tp·pp·dp, an interleaved plan breaking :func:`~autopar.techniques.pipeline_schedules.interleaving_problem`,
    plan=None without cluster, global_batch_size and seq_len, or a cluster of another size
    than the world).
    """
    _check_process_group()
    world = dist.get_world_size()
    if plan is not None:
        validate_degrees(plan.tp * plan.cp, plan.pp, plan.dp, world)
        check_plan(plan, world_size=world, executable=True)  # the one plan validator
    else:
        if cluster is None or global_batch_size is None or seq_len is None:
            raise ValueError("parallelize(plan=None) needs cluster, global_batch_size and seq_len")
        if cluster.num_gpus != world:
            raise ValueError(f"the cluster has {cluster.num_gpus} GPUs but the world size is "
                             f"{world}; describe the cluster you launched on")
        solved = None
        if dist.get_rank() == 0:
            from autopar.api import plan as solve_plan

            with torch.device("meta"):
                meta_model = copy.deepcopy(model).to("meta")
            solved = solve_plan(meta_model, cluster, global_batch_size=global_batch_size,
                                seq_len=seq_len)
        plan = _broadcast_plan(solved)
    _agree(plan, world)
    return plan


def parallelize(model: nn.Module, cluster=None, plan: Plan | None = None, *,
                optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                global_batch_size: int | None = None, seq_len: int | None = None,
                seed: int = 0, timeout: float | timedelta | None = None,
                max_norm: float | None = None, on_nonfinite: str = "raise",
                measure_every: int = 100, init_fn: InitFn | None = None) -> ParallelizedModel:
    """Build this rank's parallel training program (call inside ``torchrun``/an initialised
    process group, on every rank); the runtime half of :func:`autopar.parallelize`, whose
    docstring lists the arguments and errors (all but ``verify``). A model on the meta
    device is materialised shard by shard on the rank's device
    (:mod:`autopar.runtime.materialize`)."""
    check_step_options(max_norm, on_nonfinite)  # local checks first, before any collective
    timeout = as_timeout(timeout) if timeout is not None else None
    traced = checked_trace(model, plan) if plan is not None else None  # the rewrite's graph
    # an accelerator backend without an accelerator fails here, before any collective
    device = rank_device() if dist.is_initialized() else torch.device("cpu")
    init = None
    if on_meta(model):  # buffers and rule checked before any collective (module docstring)
        init = Initializer.of(copy.deepcopy(model), seed, device=device, init_fn=init_fn)
    _check_process_group()
    plan = agreed_plan(model, cluster, plan, global_batch_size=global_batch_size, seq_len=seq_len)
    if traced is None:  # solved on rank 0: every rank holds it now, all raise alike
        traced = local_trace(model, plan)
        check_expert_parallel(plan, traced.traced)
    groups = plan_groups(plan, device, timeout)
    return build_program(traced, plan, groups, optimizer, seed=seed, init=init,
                         max_norm=max_norm, on_nonfinite=on_nonfinite,
                         measure_every=measure_every)


def checked_trace(model: nn.Module, plan: Plan) -> LocalTrace:
    """This rank's trace of ``model`` for ``plan``, after the local checks of the plan
    against the model (no collective): :func:`~autopar.contract.plan_check.check_plan`,
    the sequence length, :func:`check_plan_matches` and the expert-parallel layout.
    Raises ValueError (PlanError) naming the first problem."""
    check_plan(plan, executable=True)  # the plan's own fields (autopar.contract.plan_check)
    check_seq_len(model, plan.seq_len)
    traced = local_trace(model, plan)
    check_plan_matches(model, plan, traced.traced)
    check_expert_parallel(plan, traced.traced)
    return traced


def plan_groups(plan: Plan, device: torch.device, timeout: timedelta | None) -> ParallelGroups:
    """The plan's process groups on the initialised world (collective: every rank calls it)."""
    head = pipeline_schedule(plan.schedule).head_rank(plan.pp, plan.virtual_stages)
    return ParallelGroups.build(plan.tp, plan.pp, plan.dp, device=device, timeout=timeout,
                                head_pp_rank=head, ep=plan.ep, cp=plan.cp)


def build_program(traced: LocalTrace, plan: Plan, groups: ParallelGroups, optimizer, *,
                  seed: int = 0, init: Initializer | None = None,
                  agree: Callable[[Callable[[], None], ParallelGroups], None] | None = None,
                  **step_options) -> ParallelizedModel:
    """Steps 3 to 5 on built ``groups``: the rewrite, the shards' values (from ``init`` for
    a model on meta) and the runtime. ``agree(build, groups)`` runs a local build step
    that may raise ValueError and agrees on its outcome over the world (default: an
    all-gather of the outcomes; a dry run on a fake process group passes its own, local)."""
    rng = seed_rank(seed, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, device=groups.device)
    program = apply_plan(traced.traced, plan, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank,
                         tp_group=groups.tp_group, rng=rng, cp_rank=groups.cp_rank,
                         cp_group=groups.cp_group)
    if init is None:
        for chunk in program.chunks:  # Module.to keeps each Parameter (program.shards' ids)
            chunk.to(groups.device)
    return _parallel_module(traced, plan, groups, program, optimizer, rng, init,
                            agree=agree or _agreed, **step_options)


def _agreed(build: Callable[[], None], groups: ParallelGroups) -> None:
    """Run ``build`` (a local step that may raise ValueError) and agree on the outcome over
    the world, so that a failure on one rank raises on every rank instead of hanging."""
    error = None
    try:
        build()
    except ValueError as exc:
        error = str(exc)
    errors: list = [None] * groups.world_size
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise ValueError(f"rank {failed[0][0]}: {failed[0][1]}")


def _parallel_module(local: LocalTrace, plan: Plan, groups: ParallelGroups,
                     program: RankProgram, optimizer, rng: RNGStatesTracker | None = None,
                     init: Initializer | None = None, agree=None,
                     **step_options) -> ParallelizedModel:
    """Steps 4 and 5: this rank's chunks, materialised from ``init`` when the model is on
    meta, in a :class:`ParallelizedModel`, parameters named as in the chunk module
    (``program``'s by-id records turned into by-name ones)."""
    traced, chunks = local.traced, program.chunks
    module = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    named = dict(module.named_parameters())
    shards = {name: program.shards[id(p)] for name, p in named.items() if id(p) in program.shards}
    tied_keys = {spec.key for spec in shards.values()} & set(traced.tied_params.values())
    tied_names = [name for name, spec in shards.items() if spec.key in tied_keys]
    partial_names = [name for name, p in named.items() if id(p) in program.partial_grad_params]
    tp_sharded = [name for name, spec in shards.items() if spec.dim is not None]
    zero3 = zero_stage(plan.zero_stage).shards_parameters
    where = dict(tp_rank=groups.tp_rank, tp=plan.tp, buffer_keys=local.buffer_keys(module))
    if init is not None and not zero3:
        (agree or _agreed)(lambda: materialize_shards(module, shards, init, **where), groups)
    elif init is not None:  # the graphs first: FSDP2 subclasses the stage's class
        place_program_devices(module, init.device)
    experts = shard_experts(chunks, groups.ep_group, is_experts_module) if plan.ep > 1 else {}
    if experts_token_parallel(plan.tp, plan.ep):  # the EP group spans TP: each TP rank holds
        tp_sharded += [n for n in experts if n not in tp_sharded]  # other experts (the norm)
    pm = ParallelizedModel(
        module, groups, plan, shards, dict(traced.tied_params), rng, model_keys=local.keys,
        micro_batch_size=plan.micro_batch_size, num_micro_batches=plan.num_micro_batches,
        seq_len=plan.seq_len, hidden_size=traced.nodes[traced.layers[0][-1]].shape[-1],
        schedule=plan.schedule, optimizer_factory=optimizer,
        tied_parameter_names=tied_names if groups.embedding_group is not None else (),
        activation_dtype=PARAM_DTYPES[plan.dtype], zero_stage=plan.zero_stage,
        master_dtype=torch.float32, partial_grad_parameter_names=partial_names,
        tp_sharded_parameter_names=tp_sharded, expert_parameter_names=list(experts),
        **step_options,
        loss_fn=_loss_fn(traced, plan, groups), logits_width=_logits(traced, plan)[1],
        boundary_shard_dims=_boundary_shard_dims(traced, plan, groups.pp_rank))
    pm.expert_slices = experts
    if init is not None and zero3:
        (agree or _agreed)(lambda: materialize_fsdp_shards(module, shards, init, dp_rank=groups.dp_rank,
                                                dp=groups.dp, **where), groups)
    return pm


def _boundary_shard_dims(traced, plan: Plan, rank: int) -> list[tuple[int | None, int | None]]:
    """Per chunk of pipeline rank ``rank`` (its schedule record's ``rank_chunks``), the dims along which the
    activation it receives and sends is split over TP: the placement of the last node of
    the layer before each cut (None: replicated)."""
    def dim(layer: int) -> int | None:
        name = traced.layers[layer][-1]
        placement = parse_strategy_key(plan.placements[name]).output
        if placement.is_partial:
            raise NotImplementedError(f"{name} is a partial sum at a pipeline cut; autopar "
                                      "sends whole or sharded activations between stages")
        return placement.dim
    n = len(plan.stage_layers)
    return [(dim(plan.stage_layers[c][0] - 1) if c > 0 else None,
             dim(plan.stage_layers[c][1] - 1) if c < n - 1 else None)
            for c in pipeline_schedule(plan.schedule).rank_chunks(plan.pp, n, rank)]


def _logits(traced, plan: Plan) -> tuple[bool, int]:
    """(whether the plan keeps the logits split over TP, the logits' last dim on this rank:
    V, or V/t when split)."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    split = parse_strategy_key(plan.placements[out.name]).name == "vocab_parallel"
    logits = out.args[0]
    while logits.name not in traced.nodes:  # a collective the TP rewrite put before the
        logits = logits.args[0]             # output (replicated logits scattered over V)
    vocab = traced.nodes[logits.name].shape[-1]
    return split, vocab // plan.tp if split else vocab


def _loss_fn(traced, plan: Plan, groups: ParallelGroups):
    """The last stage's per-micro-batch loss: token cross-entropy of the whole logits, or
    the vocabulary-parallel one when the plan keeps the logits split (b, s, V/t)."""
    split, local_vocab = _logits(traced, plan)
    if not split:
        return token_cross_entropy
    return functools.partial(vocab_parallel_cross_entropy, group=groups.tp_group,
                             vocab_start=groups.tp_rank * local_vocab)
