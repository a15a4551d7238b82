"""The ops tensor parallelism leaves whole: what a plan reports as replicated.

An op without a sharding strategy (:func:`~autopar.planner.strategies.nodes.node_strategies`
offers it only "replicate") is still correct: every TP rank runs it on the whole tensor,
and an input that arrives sharded is all-gathered first. It costs t times its share of the
work, so a plan lists these ops with their share of the model's forward FLOPs
(:class:`~autopar.contract.plan.ReplicatedOps`), apart from the ops that had a sharded strategy and
that the solver replicated by choice.

Only compute ops are listed (forward FLOPs > 0): views, slices and other shape ops move no
arithmetic, and creation ops (``arange``, ``ones``) read no tensor. An op autopar has no
rule for counts one FLOP per output element (:mod:`autopar.graph.annotate`), so it shows.
"""

from __future__ import annotations

from autopar.graph.annotate import TracedModel
from autopar.graph.ops import op_name
from autopar.contract.plan import ReplicatedOp, ReplicatedOps
from autopar.contract.placement import parse_strategy_key
from autopar.planner.strategies.nodes import NodeStrategies, node_strategies

__all__ = ["replicated_ops", "REFERENCE_TP"]

REFERENCE_TP = 2
"""The TP size at which a plan with tp = 1 lists the ops TP could not split."""


def replicated_ops(traced: TracedModel, strategies: NodeStrategies, placements: dict[str, str],
                   tp: int, sequence_parallel: bool = False) -> ReplicatedOps:
    """The compute ops of ``traced`` that every TP rank runs whole under a plan with TP size
    ``tp`` and strategy keys ``placements``; ``strategies``: the nodes' strategies at ``tp``
    (:func:`~autopar.planner.strategies.nodes.node_strategies` with ``sequence_parallel``).

    tp = 1: the strategies at :data:`REFERENCE_TP` (without sequence parallelism) say which
    ops TP could not split; nothing was chosen.
    """
    if tp == 1:
        strategies, placements, tp = node_strategies(traced, REFERENCE_TP), {}, REFERENCE_TP
    model_flops = sum(info.flops for info in traced.nodes.values())
    no_strategy, chosen = [], []
    for node in traced.gm.graph.nodes:
        info = traced.nodes[node.name]
        if info.flops <= 0 or node.op in ("placeholder", "output", "get_attr"):
            continue
        record = dict(node=node.name, op=op_name(node, traced.gm), kind=info.kind,
                      section=info.section, layer=info.layer, flops=info.flops,
                      share=info.flops / model_flops, per_sequence=info.per_sequence)
        if all(s.name == "replicate" for s in strategies[node.name]):
            no_strategy.append(ReplicatedOp(**record, reason=_reason(info.kind, tp,
                                                                      sequence_parallel)))
        elif node.name in placements and \
                parse_strategy_key(placements[node.name]).name == "replicate":
            chosen.append(ReplicatedOp(**record, reason="chosen by the solver"))
    return ReplicatedOps(tp=tp, model_flops=model_flops, no_strategy=no_strategy, chosen=chosen)


def _reason(kind: str, tp: int, sequence_parallel: bool) -> str:
    """Why an op of ``kind`` has no strategy but replication (the rules of
    :mod:`autopar.planner.strategies.nodes` and :mod:`autopar.planner.strategies.aten`)."""
    if kind in ("other", "nontensor"):
        return "no sharding rule for this op"
    if kind == "layernorm" and not sequence_parallel:
        return "splits only under sequence parallelism"
    return f"its rule splits none of these shapes at t = {tp}"
