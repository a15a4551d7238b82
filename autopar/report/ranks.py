"""The rank map of a plan: which global ranks (and nodes) form each tensor-, context-,
pipeline- and data-parallel group, as a Markdown section of the report (no picture).

Ranks are numbered in Megatron-LM's order (``megatron/core/parallel_state.py``):
``rank = tp_rank + t · (cp_rank + c · (dp_rank + d · pp_rank))``, so tensor-parallel peers
are adjacent and share a node when t divides the GPUs per node.
"""

from __future__ import annotations

from autopar.contract.plan import Plan

__all__ = ["rank_groups", "rank_layout_section"]


def rank_groups(tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Global ranks of every TP, CP (cp > 1), PP and DP group in Megatron-LM's order.

    ``rank = tp_rank + t · (cp_rank + c · (dp_rank + d · pp_rank))``: tensor-parallel peers
    are adjacent ranks (so they share a node when t divides the GPUs per node), then the
    context-parallel ranks of a sequence, then data-parallel replicas, then pipeline
    stages. A DP group holds the d replicas of one CP rank (gradients are averaged over the
    c·d ranks of its CP and DP groups).
    """
    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    groups = {
        "TP": [[rank(t, c, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)
               for c in range(cp)],
        "CP": [[rank(t, c, d, p) for c in range(cp)] for p in range(pp) for d in range(dp)
               for t in range(tp)],
        "PP": [[rank(t, c, d, p) for p in range(pp)] for d in range(dp) for c in range(cp)
               for t in range(tp)],
        "DP": [[rank(t, c, d, p) for d in range(dp)] for p in range(pp) for c in range(cp)
               for t in range(tp)],
    }
    if cp == 1:
        del groups["CP"]
    return groups


def _short_list(values: list[int], limit: int = 16) -> str:
    """``0, 1, 2, 3`` or ``0, 8, ..., 504 (64 in all)`` for long lists."""
    if len(values) <= limit:
        return ", ".join(map(str, values))
    head = ", ".join(map(str, values[:limit // 2]))
    return f"{head}, …, {values[-1]} ({len(values)} in all)"


def rank_layout_section(plan: Plan, max_ranks: int = 64, shown: int = 4) -> list[str]:
    """Markdown: which global ranks (and nodes) form each TP, PP and DP group.

    Plans of more than ``max_ranks`` GPUs list the first ``shown`` groups of each kind and
    the number of groups.
    """
    per_node = int(plan.cluster.get("gpus_per_node") or plan.num_gpus)
    rows = []
    cp = plan.cp
    for kind, groups in rank_groups(plan.tp, plan.pp, plan.dp, cp).items():
        limit = len(groups) if plan.num_gpus <= max_ranks else shown
        for g, ranks in enumerate(groups[:limit]):
            nodes = sorted({r // per_node for r in ranks})
            rows.append([kind, f"{g}", _short_list(ranks), _short_list(nodes, 8)])
        if limit < len(groups):
            rows.append([kind, "…", f"{len(groups) - limit} more groups "
                         f"({len(groups)} {kind} groups in all)", ""])
    order = "tp_rank + t·(cp_rank + c·(dp_rank + d·pp_rank))" if cp > 1 else \
        "tp_rank + t·(dp_rank + d·pp_rank)"
    cps = f"{plan.tp * plan.pp * plan.dp} CP groups of {cp}, " if cp > 1 else ""
    lines = ["## Rank layout", "",
             f"Global rank = {order} (Megatron-LM order); node = rank // {per_node} GPUs per "
             f"node. {plan.pp * plan.dp * cp} TP groups of {plan.tp}, {cps}"
             f"{plan.tp * plan.dp * cp} PP groups of {plan.pp}, {plan.tp * plan.pp * cp} DP "
             f"groups of {plan.dp}.", ""]
    header = ["group", "index", "global ranks", "nodes"]
    return lines + ["| " + " | ".join(header) + " |", "| :--- | ---: | :--- | :--- |"] + \
        ["| " + " | ".join(row) + " |" for row in rows] + [""]
