"""Rewrite: turn the traced single-device graph into one rank's program, reading only the plan.

:func:`apply_plan` runs the passes in this fixed order (each module's docstring carries
its number):

0. annotate (:func:`~autopar.rewrite.pipeline.annotate_chunks`, metadata only): every
   node learns its model chunk and layer, before any pass inserts nodes, so that what a
   pass inserts can inherit them from the node it serves.
1. tensor parallelism (:mod:`autopar.rewrite.tensor_parallel`): local shards and explicit
   TP operators. First, because the plan's placements name the nodes of the graph *as
   traced*, and every later pass must see the collectives it inserts (recompute
   checkpoints them with their layer, the cut assigns them to a chunk).
   1b. context parallelism (:mod:`autopar.rewrite.context_parallel`): causal attention over
   the CP group, this rank's token positions. After TP, whose placements name the
   attention nodes as traced (the pass keeps their names); the graph was traced at s/c.
2. dropout RNG (:mod:`autopar.rewrite.dropout`): dropouts on TP-sharded tensors fork the
   tracker's tensor-parallel stream. After TP, whose placements decide which dropouts
   are sharded; before recompute, which must checkpoint the forked modules (and the
   attention core module made here) so that recomputation redraws the same masks.
3. recompute (:mod:`autopar.rewrite.recompute`): checkpoint whole layers or the
   attention core. After 1 and 2, so a checkpointed layer holds its collectives and
   forked dropouts; before the cut, because it moves nodes within one layer, and a layer
   never spans two chunks.
4. pipeline cut (:mod:`autopar.rewrite.pipeline`): split the finished graph into the
   plan's pp·v chunks and keep this rank's (its schedule record's ``rank_chunks``). Last,
   because it turns one graph into several.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from autopar.contract.plan import Plan
from autopar.rewrite.context_parallel import apply_context_parallel
from autopar.rewrite.dropout import apply_dropout_rng
from autopar.rewrite.pipeline import LAYER, annotate_chunks, split_chunks
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.rewrite.recompute import apply_recompute
from autopar.rewrite.tensor_parallel import ShardSpec, apply_tensor_parallel
from autopar.runtime.rng import RNGStatesTracker
from autopar.runtime.tp_ops import Group

__all__ = ["RankProgram", "apply_plan"]


@dataclass
class RankProgram:
    """One rank's rewritten program.

    chunks: this rank's model chunks in local order (chunk j is global chunk
        pp_rank + j·pp); one GraphModule unless the plan is interleaved.
    shards: ``id`` of each local Parameter -> where it comes from (:class:`ShardSpec`).
    partial_grad_params: ``id`` of the replicated Parameters whose gradients are partial
        over TP (used on sequence shards): the runtime sums them over TP after backward.
    """

    chunks: list[fx.GraphModule]
    shards: dict[int, ShardSpec] = field(default_factory=dict)
    partial_grad_params: set[int] = field(default_factory=set)


def apply_plan(traced, plan: Plan, *, tp_rank: int, pp_rank: int, tp_group: Group,
               rng: RNGStatesTracker, cp_rank: int = 0, cp_group: Group = None) -> RankProgram:
    """Rewrite ``traced.gm`` in place into the program of the rank at (``tp_rank``,
    ``pp_rank``) of ``plan``, running the passes in the order of the module docstring.

    traced: :class:`~autopar.graph.annotate.TracedModel` of the local copy of the model
        (its parameters are sharded into new Parameters; the model is not modified).
    tp_group: this rank's TP process group; rng: the program's RNG tracker, seeded.
    cp_rank, cp_group: this rank's place in its CP group and the group (plan.cp > 1; the
        graph then traced at s/c tokens).
    Raises the passes' errors: ValueError (placements not of this graph or tp),
    NotImplementedError (a layout the rewrite cannot express, e.g. a chunk boundary
    crossed by more than one tensor).
    """
    annotate_chunks(traced, plan.stage_layers)                            # 0
    tp = apply_tensor_parallel(traced, plan.placements, tp=plan.tp,      # 1
                               tp_rank=tp_rank, group=tp_group,
                               sequence_parallel=plan.sequence_parallel, ep=plan.ep)
    gm = tp.gm
    apply_context_parallel(gm, cp=plan.cp, cp_rank=cp_rank, group=cp_group,     # 1b
                           local_seq_len=plan.seq_len // plan.cp)
    apply_dropout_rng(gm, plan.placements, rng)                           # 2
    layer_nodes = [[n.name for n in gm.graph.nodes if n.meta.get(LAYER) == layer]
                   for layer in range(traced.num_layers)]
    apply_recompute(gm, layer_nodes, plan.recompute, tracker=rng)         # 3
    chunks = split_chunks(gm, len(plan.stage_layers))                     # 4
    mine = pipeline_schedule(plan.schedule).rank_chunks(plan.pp, len(chunks), pp_rank)
    return RankProgram([chunks[c] for c in mine], tp.shards, tp.partial_grad_params)
