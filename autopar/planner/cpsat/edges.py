r"""The edge rows of the CP-SAT model (:class:`autopar.planner.cpsat.model.ConfigModel`).

For every edge u → v (input j of v) and strategy pair (k, l) of u and v:

* ``reshard_offered[u->v]``: :math:`x_{u,k} + x_{v,l} \le 1` when the transition is not
  offered (:func:`~autopar.planner.strategies.reshard_kinds`);
* ``reshard[...]``: :math:`e \ge x_{u,k} + x_{v,l} - 1`, e priced by the resharding
  collectives in forward, backward and (when u precedes the layer's last saver) full
  recompute;
* ``megatron_f[u]``: :math:`f_u \ge x_{u,k} + x_{v,l} - 1` when l makes u's gradient
  partial (Megatron's f: one backward all-reduce, or reduce-scatter, of u);
* ``kept[...]`` (:func:`add_saved_versions`): when v keeps its input for backward, the
  version of u it reads (u itself, or the copy a reshard makes) is kept once per section:
  the activations a plan keeps are counted on its edges.

A reshard of u into one placement, its kept copy and f are shared by all consumers in a
section (the rewriter inserts one collective), so each has one variable per section.
"""

from __future__ import annotations

from autopar.graph.annotate import saves_inputs
from autopar.planner.costs.tables import f_cost
from autopar.planner.costs.predict import crosses_section
from autopar.planner.costs.step import KIB
from autopar.planner.strategies import gathers_for_partial_grad, partial_grad_input, tensor_inputs

__all__ = ["add_edges", "add_saved_versions"]


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
    add_saved_versions(cm)


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


def add_saved_versions(cm) -> None:
    r"""``kept[u,D]``: the version D of tensor u that some consumer keeps for backward (u's
    own output, or the copy a reshard makes: :attr:`~autopar.planner.costs.tables.EdgeCost.saved_bytes`),
    one variable per tensor, version and charged section (:func:`~autopar.planner.costs.predict.crosses_section`) with its
    bytes in that section's activations: for each consumer v of u that saves its inputs,
    :math:`c \ge \sum_{k \in K_u} x_{u,k} + \sum_{l \in K_v} x_{v,l} - 1` over the
    strategies of v that read u as D (with one Megatron-f flavour) and those of u that make
    that reshard (every pair of the two sets keeps the same copy: one aggregated row is exact
    for one-hot choices and tighter in CP-SAT's LP relaxation than a row per pair).
    A tensor with a single saving read needs no variable: the version kept follows from the
    reader's strategy, so its bytes go on the reader's choice booleans. Consumers of the
    embedding section, the template layer and the head stand for all."""
    traced, nodes = cm.traced, cm.traced.nodes
    readers: dict[tuple[str, str], list] = {}  # (tensor, charged section) -> its saving reads
    for v in traced.gm.graph.nodes:
        if v.name not in cm.section_of or not saves_inputs(nodes[v.name]):
            continue
        for j, src in enumerate(tensor_inputs(v, nodes)):
            u = src.name if src.name in cm.choice else traced.layers[0][-1]
            section = cm.section_of[v.name if crosses_section(traced, src.name, v.name) else u]
            readers.setdefault((u, section), []).append((v.name, j, cm.tables.edge[(src.name, v.name, j)]))
    for (u, section), reads in readers.items():
        if len(reads) == 1:  # one reader: the version it keeps follows from its strategy alone
            v, j, table = reads[0]
            size = {kv: cost.saved_bytes for (_, kv), cost in table.items() if cost is not None}
            for kv, nbytes in size.items():
                cm.terms.add(section, "act", nbytes / KIB, cm.choice[v][kv])
            continue
        for v, j, table in reads:
            _add_shared_version(cm, u, v, j, table, section)


def _add_shared_version(cm, u: str, v: str, j: int, table, section: str) -> None:
    """The ``kept`` rows of one of several saving reads of u (:func:`add_saved_versions`)."""
    groups: dict[tuple, tuple[set, set, float]] = {}
    for (ku, kv), cost in table.items():
        if cost is None or not cost.saved_bytes:
            continue
        sv = cm.strategies[v][kv]
        fused = gathers_for_partial_grad(sv, j, cm.strategies[u][ku].output)
        group = groups.setdefault((sv.inputs[j], fused, partial_grad_input(sv, j)),
                                  (set(), set(), cost.saved_bytes))
        group[0].add(ku)
        group[1].add(kv)
    for (version, fused, _), (us, vs, nbytes) in groups.items():
        c = _shared(cm, cm.kept_copy, (u, section, version, fused),
                    f"kept[{u},{version},{fused}]", section, {"act": nbytes / KIB})
        xu, xv = cm.choice[u], cm.choice[v]
        cm.model.Add(c >= sum(xu[k] for k in sorted(us)) + sum(xv[k] for k in sorted(vs)) - 1
                     ).WithName(f"kept[{u}->{v}]")
