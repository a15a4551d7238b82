"""The section vectors of the exhaustive check (:mod:`autopar.oracle.exhaustive`): every TP
assignment of one section (pre, one layer, post) reduced to the Pareto-minimal cost vectors
of :data:`FIELDS`, by dynamic programming in graph order over the live tensors (that
module's docstring says why the reduction is exact).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

from autopar.graph.annotate import TracedModel, last_saver_index
from autopar.planner.costs.tables import f_cost
from autopar.planner.costs.step import KIB, PARAM_UNIT
from autopar.planner.strategies import (gathers_for_partial_grad, param_split,
                                        partial_grad_input, tensor_inputs, tied_groups)

__all__ = ["FIELDS", "SectionOption", "section_options", "replicated_index", "ties_agree"]

# One micro-batch through one section (pre, one layer, post), per GPU:
FIELDS = ("time_s",        # forward + backward compute and TP communication (Megatron f too)
          "rec_s",         # what full recompute repeats: forward compute and TP comm up to
                           # the layer's last saved tensor (graph.last_saver_index)
          "core_s",        # what selective recompute repeats: the attention core's forward
          "act_bytes",     # activation bytes kept for backward
          "sel_act_bytes",  # ... with selective recompute (attention core dropped)
          "params",        # parameter elements held
          "params_p1",     # ... minus the tied weight counted in pre too (post at p = 1)
          "act_kib", "sel_act_kib", "param_units", "param_units_p1",  # solver rounding
          "bwd_s",         # backward compute and TP communication (what hides DP reduction)
          "temp_bytes", "temp_kib",  # the loss's fp32 temporaries (memory reserve), exact / KiB
          "wgrad_s",       # the weight-gradient part of bwd_s (a split backward defers it)
          "loss_act_bytes", "loss_act_kib")  # the part of act the loss keeps (its softmax)
_I = {name: i for i, name in enumerate(FIELDS)}
_ZERO = (0.0,) * len(FIELDS)


@dataclass(frozen=True)
class SectionOption:
    """A Pareto-minimal TP assignment of one section: its cost vector (see :data:`FIELDS`),
    strategy index per node name, and the weight split of its tied nodes."""

    vec: tuple[float, ...]
    choice: dict[str, int]
    ties: tuple[tuple[str, str], ...]

    def __getitem__(self, field: str) -> float:
        return self.vec[_I[field]]

    @functools.cached_property
    def fields(self) -> dict[str, float]:
        """Field name -> value (``option[f]`` as a dict: the exhaustive search reads
        about twenty per priced stage, millions of times)."""
        return dict(zip(FIELDS, self.vec))


def _key(vec: tuple) -> tuple:
    """Coordinates in which the step time and memory are non-decreasing: time_s is split
    into its non-backward part and bwd_s. More backward hides at most as much DP reduction
    (predict: max(0, D_i - B_i)) as it adds to its stage time, which the pipeline time
    counts at least once, so the step time is non-decreasing in bwd_s too; a split
    backward's step time is non-increasing in the weight-gradient seconds (they fill the
    bubble: ``cost_models.pipeline``), so wgrad_s enters negated."""
    return (vec[0] - vec[11],) + vec[1:14] + (-vec[14],)


def _pareto(entries: list) -> list:
    """Entries (vec, assignment) whose vec no other entry's vec dominates (duplicates: one)."""
    keyed = sorted(((_key(e[0]), e) for e in entries), key=lambda k: k[0])
    kept: list = []
    for key, e in keyed:
        bound = tuple(y + 1e-12 * abs(y) for y in key)  # once per entry, not per kept one
        if not any(all(x <= b for x, b in zip(k, bound)) for k, _ in kept):
            kept.append((key, e))
    return [e for _, e in kept]


def replicated_index(strategies, name: str) -> int:
    """Index of ``name``'s strategy with a replicated output (every node has one)."""
    return next(k for k, s in enumerate(strategies[name]) if s.output.is_replicated)


def _node_delta(tables, strategies, v: str, kv: int, ins, live: dict, node_rerun: bool,
                src_rerun: dict, tied_post: bool, loss: bool = False):
    """Cost vector of node ``v`` at strategy ``kv`` with its input reshards, the versions
    of its inputs it keeps for backward and Megatron f, each charged once per section and
    tensor (as
    ``predict.section_cost``); None when an input transition is not offered. Returns (delta, {input: (f charged, placement)})."""
    c, sv = tables.node[v][kv], strategies[v][kv]
    d = [0.0] * len(FIELDS)
    d[0], d[1], d[2] = c.fwd_s + c.bwd_s, c.rec_s if node_rerun else 0.0, c.core_fwd_s
    d[3], d[4] = c.saved_bytes, c.saved_bytes - c.core_saved_bytes
    d[5] = d[6] = c.param_numel
    akib, ckib = math.ceil(c.saved_bytes / KIB), math.ceil(c.core_saved_bytes / KIB)
    d[7], d[8] = akib, akib - ckib
    d[9] = d[10] = math.ceil(c.param_numel / PARAM_UNIT)
    d[11], d[12], d[13] = c.bwd_s, c.temp_bytes, math.ceil(c.temp_bytes / KIB)
    d[14] = c.wgrad_s
    if loss:  # the graph's output: the loss, whose saved softmax a split backward frees at B
        d[15], d[16] = c.saved_bytes, akib
    if tied_post:  # predict / ConfigModel: one tied tensor when pre and post share a stage
        d[6], d[10] = 0.0, 0
    used: dict = {}  # input -> (f charged here, placements resharded to here)
    for j, u in enumerate(ins):
        ku, flag, done = live[u]
        edge = tables.edge[(u, v, j)][(ku, kv)]
        if edge is None:
            return None, None
        f_now, placed = used.get(u, (False, ()))
        target = (sv.inputs[j], gathers_for_partial_grad(sv, j, strategies[u][ku].output))
        if (edge.fwd_kind or edge.bwd_kind) and target not in done and target not in placed:
            d[0] += edge.fwd_s + edge.bwd_s
            d[1] += edge.fwd_s if src_rerun[u] else 0.0
            d[11] += edge.bwd_s
            placed += (target,)
        copy = ("kept",) + target  # the version of u that v keeps for backward, once
        if edge.saved_bytes and copy not in done and copy not in placed:
            kib = math.ceil(edge.saved_bytes / KIB)
            for field, add in ((3, edge.saved_bytes), (4, edge.saved_bytes), (7, kib), (8, kib)):
                d[field] += add
            placed += (copy,)
        if partial_grad_input(sv, j) and not flag and not f_now:
            f_s = f_cost(tables, u, strategies[u][ku].output)[1]
            d[0] += f_s
            d[11] += f_s
            f_now = True
        used[u] = (f_now, placed)
    return d, used


def _start(traced, strategies, names, boundary):
    """Input lists, last in-section use, and what full recompute re-runs (nodes up to the
    last saver, collectives on tensors produced before it: ``graph.last_saver_index``)."""
    graph = {n.name: n for n in traced.gm.graph.nodes}
    members, ins = set(names), {}
    for v in names:
        ins[v] = [u.name for u in tensor_inputs(graph[v], traced.nodes)]
        bad = [u for u in ins[v] if u not in members and u != boundary]
        if bad:
            raise NotImplementedError(f"{v} reads {bad} across a section boundary; the "
                                      "exhaustive check expects only the layer boundary there")
    last_use = {u: i for i, v in enumerate(names) for u in ins[v]}
    last = last_saver_index(traced.nodes, names)
    rerun = {v: i <= last for i, v in enumerate(names)}
    rerun_src = {v: i < last for i, v in enumerate(names)}
    if boundary:
        rerun_src[boundary] = True
    return ins, last_use, rerun, rerun_src


def section_options(traced: TracedModel, strategies, tables, names: list[str],
                    boundary: str | None, replicated_out: bool,
                    prune: bool = True) -> list[SectionOption]:
    """Every TP assignment of section ``names`` reduced to its Pareto-minimal cost vectors.

    boundary: the node outside the section whose output (replicated) feeds it, or None.
    replicated_out: the section's last node must output "R" (a layer boundary).
    prune=False keeps every distinct vector (exact duplicates merged) instead.
    """
    ins, last_use, rerun, rerun_src = _start(traced, strategies, names, boundary)
    tied = {n: g for g in tied_groups(traced) for n in g}
    start = ((boundary, replicated_index(strategies, boundary), False, ()),) if boundary else ()
    frontier = {(start, ()): [(_ZERO, ())]}
    for i, v in enumerate(names):
        grown: dict = defaultdict(list)
        post_tie = v in tied and tied[v][-1] == v and v in traced.post
        for (live_t, ties), entries in frontier.items():
            live = {u: rest for u, *rest in live_t}
            for kv, sv in enumerate(strategies[v]):
                if replicated_out and i == len(names) - 1 and not sv.output.is_replicated:
                    continue  # a layer boundary is replicated (ConfigModel.add_boundaries)
                delta, used = _node_delta(tables, strategies, v, kv, ins[v], live, rerun[v],
                                          rerun_src, post_tie,
                                          traced.nodes[v].kind == "output")
                if delta is None:
                    continue
                nxt = {}
                for u, (k, f, done) in live.items():
                    if last_use[u] > i:
                        f_now, placed = used.get(u, (False, ()))
                        nxt[u] = (k, f or f_now, tuple(sorted(done + placed, key=str)))
                if last_use.get(v, -1) > i:
                    nxt[v] = (kv, False, ())
                key = (tuple(sorted((u,) + rest for u, rest in nxt.items())),
                       ties + (((v, param_split(sv)),) if v in tied else ()))
                for vec, assign in entries:
                    grown[key].append((tuple(a + b for a, b in zip(vec, delta)), assign + (kv,)))
        frontier = {k: (_pareto(e) if prune else list({x[0]: x for x in e}.values()))
                    for k, e in grown.items()}
    return [SectionOption(vec, dict(zip(names, assign)), ties)
            for (_, ties), entries in frontier.items() for vec, assign in entries]


def ties_agree(*options: SectionOption, groups) -> bool:
    """Do the sections' tied nodes (``groups``: :func:`tied_groups`) split their shared
    weight the same way (:meth:`~autopar.planner.cpsat.ConfigModel.add_tied`)?"""
    split = dict(t for o in options for t in o.ties)
    return all(len({split[n] for n in g if n in split}) <= 1 for g in groups)
