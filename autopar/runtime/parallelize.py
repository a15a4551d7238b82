"""``autopar.parallelize``: turn a model and a plan into this rank's training program.

Passes run in a fixed order, each reading only the plan:

1. trace the model (the same front end the planner used, so node names match the plan);
2. annotate each node with its pipeline stage and layer;
3. tensor parallelism (``rewrite.tensor_parallel``): shards + explicit f/g collectives;
3b. dropout RNG (``rewrite.dropout``): dropouts on TP-sharded tensors fork the per-rank
   tensor-parallel stream of the program's ``runtime.rng`` tracker;
4. recompute (``rewrite.recompute``): checkpoint whole layers or the attention core;
5. pipeline split (``rewrite.pipeline``): cut into the plan's pp·v chunks, keep this
   rank's (chunk c on rank c % pp; v > 1: an nn.ModuleList of v chunks);
6. runtime (``runtime.engine.ParallelModule``): micro-batches, 1F1B/GPipe/interleaved, DP averaging,
   tied-embedding gradient sync, optimizer.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.plan import Plan
from autopar.rewrite.dropout import apply_dropout_rng
from autopar.rewrite.pipeline import annotate_stages, rank_chunks, split_stages
from autopar.rewrite.recompute import apply_recompute
from autopar.rewrite.tensor_parallel import ShardSpec, apply_tensor_parallel
from autopar.placement import parse_strategy_key
from autopar.runtime.vocab_parallel import vocab_parallel_cross_entropy
from autopar.runtime.engine import ParallelModule, token_cross_entropy
from autopar.runtime.fsdp import FULLY_SHARDED_STAGE, full_tensor
from autopar.runtime.mesh import ParallelGroups, validate_degrees
from autopar.runtime.rng import seed_rank
from autopar.support import check_executable
from autopar.graph.capture import trace_model

__all__ = ["parallelize", "ParallelizedModel"]


class ParallelizedModel(ParallelModule):
    """This rank's share of the plan: ``train_step(idx, targets) -> global mean loss``,
    ``full_state_dict()``, ``plan`` and ``stage_module`` (print its ``.code``; with
    interleaved 1F1B an nn.ModuleList of this rank's v chunks, parameter names prefixed
    by the local chunk index)."""

    def __init__(self, stage_module, groups, plan: Plan, shards: dict[str, ShardSpec],
                 tied_aliases: dict[str, str], **kwargs):
        super().__init__(stage_module, groups, **kwargs)
        self.plan = plan
        self.shards = shards  # local parameter name -> origin
        self.tied_aliases = tied_aliases  # original key -> the key it shares a tensor with

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the original model's keys, on every rank (CPU).

        Collective over the whole world: every rank must call it. Tied parameters appear
        under every original name (e.g. ``lm_head.weight`` and ``transformer.wte.weight``).
        """
        return gather_full(self, lambda p: p)


def gather_full(pm: ParallelizedModel, pick: Callable[[nn.Parameter], torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """``pick(p)`` of every local parameter (the parameter, its gradient, ...), all-gathered
    over DP (ZeRO-3's DTensor shards) and TP (split dims), collected from every stage, on
    the CPU under the original keys, tied aliases included. Collective over the world."""
    g = pm.groups
    local: dict[str, torch.Tensor] = {}
    params = dict(pm.stage_module.named_parameters())
    for name, spec in sorted(pm.shards.items()):
        t = full_tensor(pick(params[name]).detach())  # ZeRO-3: all-gathered over DP
        if spec.dim is not None and g.tp > 1:
            parts = [torch.empty_like(t) for _ in range(g.tp)]
            dist.all_gather(parts, t.contiguous(), group=g.tp_group)
            t = torch.cat(parts, dim=spec.dim)
        local[spec.key] = t.cpu().clone()
    gathered: list = [None] * g.world_size
    dist.all_gather_object(gathered, local if g.tp_rank == 0 and g.dp_rank == 0 else {})
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    for alias, canonical in pm.tied_aliases.items():
        if canonical in full:
            full[alias] = full[canonical]
    return full


def _agree(plan: Plan, groups_world: int) -> None:
    """Every rank must hold the same plan: compare a digest before any other collective."""
    digest = plan.decision_digest()
    digests: list = [None] * groups_world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError("ranks hold different plans (digests "
                           f"{sorted(set(digests))}); pass the same plan to every rank or "
                           "plan=None so that rank 0 solves and broadcasts")


def _broadcast_plan(plan: Plan | None) -> Plan:
    box = [plan.to_json() if plan is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])


def parallelize(model: nn.Module, cluster=None, plan: Plan | None = None, *,
                optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                global_batch_size: int | None = None, seq_len: int | None = None,
                seed: int = 0, verify: bool = False) -> ParallelizedModel:
    """Build this rank's parallel training program (call inside ``torchrun``/an initialised
    process group on every rank).

    model: the single-device model (materialised; it is copied, not modified).
    cluster: used to solve when ``plan`` is None (rank 0 solves and broadcasts; then
        global_batch_size and seq_len are required).
    optimizer: parameters -> torch.optim.Optimizer, e.g. ``partial(torch.optim.AdamW, lr=3e-4)``.
    seed: dropout seed, the same on every rank; each rank seeds its default generator
        (``torch.manual_seed``) and a tensor-parallel stream from it the Megatron way
        (:func:`autopar.runtime.rng.rank_seeds`), so runs with one seed repeat exactly.
    verify: first run :func:`autopar.verify.check.verify` (3 SGD steps of a copy against one
        device; ``model`` is untouched) and raise its VerificationError on a mismatch.
    Returns a :class:`ParallelizedModel`; ``train_step(idx (B, s), targets (B, s))`` takes the
    same global batch on every rank and returns the global mean loss.

    Raises ValueError (world size != tp·pp·dp, or an interleaved plan breaking
    :func:`~autopar.support.interleaving_problem`, e.g. m % pp != 0: before any
    collective), NotImplementedError
    (a plan feature the runtime cannot run, or a backend other than gloo), RuntimeError (ranks disagree on the plan),
    ``autopar.verify.check.VerificationError`` (verify=True and the program is wrong).
    """
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed to be initialised "
                           "(run under torchrun and call dist.init_process_group first)")
    if dist.get_backend() != "gloo":
        raise NotImplementedError(
            f"the autopar runtime keeps each stage on the CPU, which the {dist.get_backend()!r} "
            "backend cannot carry; initialise the process group with backend='gloo' (placing "
            "stages on cuda:LOCAL_RANK for NCCL is not implemented yet)")
    world = dist.get_world_size()
    if plan is not None:
        validate_degrees(plan.tp, plan.pp, plan.dp, world)
        check_executable(plan)
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
    if verify:
        from autopar.verify.check import verify as verify_plan

        verify_plan(model, plan)  # on copies, before anything trains the real model
    groups = ParallelGroups.build(plan.tp, plan.pp, plan.dp)
    return _build(model, plan, groups, optimizer, seed)


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(model, plan: Plan, groups: ParallelGroups, optimizer, seed: int = 0) -> ParallelizedModel:
    rng = seed_rank(seed, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank)
    # ZeRO-3: the (sharded) parameters stay fp32 master weights; FSDP2 casts them to the
    # plan's dtype when it gathers them (runtime.fsdp), so the activations are bf16 as well
    zero3 = plan.zero_stage == FULLY_SHARDED_STAGE
    local_model = copy.deepcopy(model).to(torch.float32 if zero3 else PARAM_DTYPES[plan.dtype])
    traced = trace_model(local_model, plan.seq_len)
    annotate_stages(traced, plan.stage_layers)
    tp = apply_tensor_parallel(traced, plan.placements, tp=plan.tp, tp_rank=groups.tp_rank,
                               group=groups.tp_group, sequence_parallel=plan.sequence_parallel)
    gm = tp.gm
    apply_dropout_rng(gm, plan.placements, rng)
    layer_nodes = [[n.name for n in gm.graph.nodes if n.meta.get("autopar_layer") == l]
                   for l in range(traced.num_layers)]
    apply_recompute(gm, layer_nodes, plan.recompute, tracker=rng)
    mine = rank_chunks(split_stages(gm, gm, len(plan.stage_layers)), plan.pp, groups.pp_rank)
    stage = mine[0] if len(mine) == 1 else nn.ModuleList(mine)
    shards = {name: tp.shards[id(p)] for name, p in stage.named_parameters() if id(p) in tp.shards}
    tied_keys = {spec.key for spec in shards.values()} & set(traced.tied_params.values())
    tied_names = [name for name, spec in shards.items() if spec.key in tied_keys]
    partial_names = [name for name, p in stage.named_parameters() if id(p) in tp.partial_grad_params]
    module = ParallelizedModel(
        stage, groups, plan, shards, dict(traced.tied_params), micro_batch_size=plan.micro_batch_size,
        num_micro_batches=plan.num_micro_batches, seq_len=plan.seq_len,
        hidden_size=traced.nodes[traced.layers[0][-1]].shape[-1], schedule=plan.schedule,
        optimizer_factory=optimizer, tied_parameter_names=tied_names if plan.pp > 1 else (),
        activation_dtype=PARAM_DTYPES[plan.dtype], zero_stage=plan.zero_stage,
        master_dtype=torch.float32, partial_grad_parameter_names=partial_names,
        loss_fn=_loss_fn(traced, plan, groups),
        boundary_shard_dims=_boundary_shard_dims(traced, plan, groups.pp_rank))
    return module


def _boundary_shard_dims(traced, plan: Plan, rank: int) -> list[tuple[int | None, int | None]]:
    """Per chunk of pipeline rank ``rank`` (chunk c = rank + j·pp), the dims along which the
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
            for c in range(rank, n, plan.pp)]


def _loss_fn(traced, plan: Plan, groups: ParallelGroups):
    """The last stage's per-micro-batch loss: token cross-entropy of the whole logits, or
    the vocabulary-parallel one when the plan keeps the logits split (b, s, V/t)."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    if parse_strategy_key(plan.placements[out.name]).name != "vocab_parallel":
        return token_cross_entropy
    local_vocab = traced.nodes[out.args[0].name].shape[-1] // plan.tp
    return functools.partial(vocab_parallel_cross_entropy, group=groups.tp_group,
                             vocab_start=groups.tp_rank * local_vocab)
