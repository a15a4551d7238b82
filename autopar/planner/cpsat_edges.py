r"""The edge rows of the CP-SAT model (:class:`autopar.planner.cpsat.ConfigModel`).

For every edge u → v (input j of v) and strategy pair (k, l) of u and v:

* ``reshard_offered[u->v]``: :math:`x_{u,k} + x_{v,l} \le 1` when the transition is not
  offered (:func:`~autopar.planner.strategies.reshard_kinds`);
* ``reshard[...]``: :math:`e \ge x_{u,k} + x_{v,l} - 1`, e priced by the resharding
  collectives in forward, backward and (when u precedes the layer's last saver) full
  recompute;
* ``megatron_f[u]``: :math:`f_u \ge x_{u,k} + x_{v,l} - 1` when l makes u's gradient
  partial (Megatron's f: one backward all-reduce, or reduce-scatter, of u);
* ``kept_copy[...]``: when v keeps its input for backward and reads u through an
  all-gather, the runtime keeps the gathered tensor whole, so c adds
  :attr:`~autopar.planner.cost_tables.EdgeCost.saved_bytes` to the section's activations
  (one row per edge over all such pairs, :func:`_add_kept_copy`).

A reshard of u into one placement, its kept copy and f are shared by all consumers in a
section (the rewriter inserts one collective), so each has one variable per section.
"""

from __future__ import annotations

from autopar.planner.cost_tables import f_cost
from autopar.planner.step import KIB
from autopar.planner.strategies import gathers_for_partial_grad, partial_grad_input, tensor_inputs

__all__ = ["add_edges"]


def add_edges(cm) -> None:
    """Add the rows of the module docstring for every edge of ``cm`` (a ConfigModel whose
    strategy choices exist) into ``cm.model``, its variables into ``cm.choice``
    (``"f[u,kind]"``), ``cm.reshard`` and ``cm.kept_copy``, and their costs into ``cm.terms``."""
    nodes = cm.traced.nodes
    for node in cm.traced.gm.graph.nodes:
        if node.name not in cm.section_of:
            continue
        for j, src in enumerate(tensor_inputs(node, nodes)):
            src_name = src.name if src.name in cm.choice else cm.traced.layers[0][-1]
            table = cm.tables.edge[(src.name, node.name, j)]
            _add_edge(cm, src_name, node.name, j, table)


def _shared(cm, store: dict, key: tuple, name: str, section: str, costs: dict):
    """The variable of ``key`` in ``store``, created with its ``costs`` ({term key: coef})
    on first use."""
    if key not in store:
        var = cm.model.NewBoolVar(name)
        store[key] = var
        for term, coef in costs.items():
            cm.terms.add(section, term, coef, var)
    return store[key]


def _add_edge(cm, u: str, v: str, j: int, table) -> None:
    section, ups, model = cm.section_of[v], cm.units_per_second, cm.model
    copies: dict[bool, tuple[set, set, float]] = {}  # fused -> (u's k, v's l, bytes)
    for ku, su in enumerate(cm.strategies[u]):
        for kv, sv in enumerate(cm.strategies[v]):
            cost = table.get((ku, kv))
            xu, xv = cm.choice[u][ku], cm.choice[v][kv]
            if cost is None:
                model.AddBoolOr([xu.Not(), xv.Not()]).WithName(f"reshard_offered[{u}->{v}]")
                continue
            if partial_grad_input(sv, j):
                kind, f_s = f_cost(cm.tables, u, su.output)  # all-reduce, or reduce-scatter
                fkey = f"f[{u},{kind}]"
                if fkey not in cm.choice:
                    cm.choice[fkey] = [model.NewBoolVar(fkey)]
                    cm.terms.add(section, "bwd", f_s * ups, cm.choice[fkey][0])
                model.Add(cm.choice[fkey][0] >= xu + xv - 1).WithName(f"megatron_f[{u}]")
            fused = gathers_for_partial_grad(sv, j, su.output)
            rkey = (u, ku, sv.inputs[j], section, fused)
            label = f"{u},{ku}->{sv.inputs[j]}"
            if cost.fwd_s or cost.bwd_s:
                costs = {"fwd": cost.fwd_s * ups, "bwd": cost.bwd_s * ups}
                if section == "layer" and cm.position.get(u, -1) < cm.last_saver:
                    costs["rec"] = cost.fwd_s * ups
                r = _shared(cm, cm.reshard, rkey, f"reshard[{label}]", section, costs)
                model.Add(r >= xu + xv - 1).WithName(f"reshard[{label}]")
            if cost.saved_bytes:
                copies.setdefault(fused, (set(), set(), cost.saved_bytes))
                copies[fused][0].add(ku)
                copies[fused][1].add(kv)
    for fused, (sharded, wants_whole, nbytes) in copies.items():
        _add_kept_copy(cm, u, v, section, fused, sharded, wants_whole, nbytes, table)


def _add_kept_copy(cm, u: str, v: str, section: str, fused: bool, sharded: set, whole: set,
                   nbytes: float, table) -> None:
    r"""``kept_copy[u->R]``: :math:`c \ge \sum_{k \in K_u} x_{u,k} + \sum_{l \in K_v}
    x_{v,l} - 1` over u's sharded outputs :math:`K_u` and v's strategies reading u whole
    :math:`K_v` (every pair of the two sets gathers into a saver: one aggregated row is
    exact for one-hot choices and tighter in CP-SAT's LP relaxation than a row per pair)."""
    if any(not table[(ku, kv)] or not table[(ku, kv)].saved_bytes
           for ku in sharded for kv in whole):
        raise RuntimeError(f"kept copies of {u} -> {v} are not a product of strategy sets; "
                           "autopar's edge table is inconsistent (a bug)")
    c = _shared(cm, cm.kept_copy, (u, section, fused), f"kept_copy[{u}->R,{fused}]", section,
                {"act": nbytes / KIB})
    xu, xv = cm.choice[u], cm.choice[v]
    cm.model.Add(c >= sum(xu[k] for k in sorted(sharded)) + sum(xv[k] for k in sorted(whole)) - 1
                 ).WithName(f"kept_copy[{u}->{v}]")
