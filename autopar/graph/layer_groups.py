"""Layers that differ, planned as groups of identical layers.

The planner solves one template layer for all (:func:`autopar.planner.cpsat.terms.template_map`)
and prices every layer as the template, so the layers it sees must be the same op sequence.
Mixture-of-experts models mix layer kinds: DeepSeek-V3's first ``first_k_dense_replace``
layers are dense, Qwen2/3-MoE put experts on every ``decoder_sparse_step``-th layer (and not
in ``mlp_only_layers``), Llama 4 on every ``interleave_moe_layer_step``-th (and drops RoPE
on every ``no_rope_layer_interval``-th), hybrids alternate attention with recurrent layers.

:func:`find_grouping` writes the module layers' op-kind sequences as

    L = k + G·n + r:  k leading layers (the prefix), then G groups of n consecutive layers
    (the period), each group the same op sequence as the first, then r trailing layers
    (the suffix: a partial group, or layers of another kind)

and :func:`group_layers` hands the planner a model whose layers are the G groups: the k
prefix layers join ``pre`` (before the first group, so on the first model chunk: pipeline
stage 0, whatever the schedule, as the embedding), the r suffix layers join ``post`` (the
last model chunk, as the LM head). Every node keeps its own FLOPs, bytes and strategies:
pre and post are priced node by node, and each group is priced as the template group, which
is exact because the groups are the same op sequence. Nothing is priced by another layer's
cost. A plan's "layers" (``Plan.stage_layers``, ``Plan.recompute``, the layer count) are
these groups; pipeline cuts fall on group boundaries, and full recompute checkpoints a
group as one region (its input kept), which is what the cost model prices for it. The
grouping is a function of the model's graph alone, so the runtime's capture finds the
same one and a plan file's layer indices mean the same groups there
(:meth:`LayerGrouping.module_layers_of` maps a group to its module layers).

Among the (k, n, r) that fit, the one with the fewest distinct layers k + n + r is taken
(the layers whose nodes the CP-SAT model holds: prefix, template, suffix), then the most
groups G (finer pipeline cuts), then the fewest layers outside groups, then the smallest k.
Two layers' nodes match when they have the same op kind, output shape, FLOPs, parameter
elements and gradient mode (:func:`_signature`), so a group priced as the template costs what it
runs. Llama 4's default 4-layer pattern (MoE on layers 1 and 3, no RoPE on layer 3) gives
(0, 4, 0): one group. Layers that are all alike give
(0, 1, 0), the model unchanged; DeepSeek-V3 (61 layers, 3 dense) gives (3, 1, 0), 58
groups; a model with no repeat at all gives (0, L, 0), one group (no pipeline cut); a loop
that applies an op after each layer call (``x = f(layer(x))``) puts the last layer's ``f``
after the stack; it is moved back into the last layer, so the layers read [A f] ... [A f]
again (:func:`_complete_last_layer`), (0, 1, 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.graph.annotate import TracedModel

__all__ = ["LayerGrouping", "GroupedTracedModel", "find_grouping", "group_layers",
           "grouping_of", "module_layers"]


@dataclass(frozen=True, kw_only=True)
class LayerGrouping:
    """How L module layers are planned: k + G·n + r (module docstring)."""

    prefix: int
    """k: leading module layers planned node by node in ``pre``"""
    period: int
    """n: module layers per group (the template)"""
    suffix: int
    """r: trailing module layers planned node by node in ``post``"""
    module_layers: int
    """L: the model's transformer layers"""

    @property
    def groups(self) -> int:
        """G: the planner's layers."""
        return (self.module_layers - self.prefix - self.suffix) // self.period

    @property
    def trivial(self) -> bool:
        """Every layer its own group (k = r = 0, n = 1): the model as captured."""
        return self.prefix == 0 and self.suffix == 0 and self.period == 1

    def module_layers_of(self, group: int) -> range:
        """The module layer indices of planner layer (group) ``group``."""
        start = self.prefix + group * self.period
        return range(start, start + self.period)

    def describe(self) -> str:
        """One line: "4 layers as 2 groups of 2 (no prefix, no suffix)"."""
        def some(count: int, what: str) -> str:
            return f"{count} {what} layer{'s' if count != 1 else ''}" if count else f"no {what}"
        return (f"{self.module_layers} layers as {self.groups} group"
                f"{'s' if self.groups != 1 else ''} of {self.period} ("
                f"{some(self.prefix, 'leading')} in pre, {some(self.suffix, 'trailing')} in post)")


def find_grouping(kinds: list[tuple]) -> LayerGrouping:
    """The grouping of layers whose op sequences are ``kinds`` (one hashable per layer): the
    (k, n, r) with the fewest distinct layers k + n + r, then the most groups, then the
    fewest layers outside groups (k + r), then the smallest k, such that layers k .. L - r - 1
    are groups of n that all equal the first, as many as match."""
    L = len(kinds)
    best, best_key = None, None
    for n in range(1, L + 1):
        for k in range(0, L - n + 1):
            groups = _matching_groups(kinds, k, n)
            r = L - k - groups * n
            key = (k + n + r, -groups, k + r, k)
            if best_key is None or key < best_key:
                best, best_key = (k, n, r), key
    k, n, r = best if best is not None else (0, max(L, 1), 0)
    return LayerGrouping(prefix=k, period=n, suffix=r, module_layers=L)


def _matching_groups(kinds: list[tuple], k: int, n: int) -> int:
    """How many consecutive groups of ``n`` layers from layer ``k`` equal the first."""
    first, count = kinds[k:k + n], 0
    while k + (count + 1) * n <= len(kinds) and kinds[k + count * n:k + (count + 1) * n] == first:
        count += 1
    return count


@dataclass
class GroupedTracedModel(TracedModel):
    """A :class:`TracedModel` whose ``layers`` are groups of module layers
    (:func:`group_layers`); ``grouping`` says which, ``module_layer_nodes`` keeps the node
    names of each module layer (for analyses that read one transformer layer at a time,
    e.g. Megatron's roles of the Linears)."""

    grouping: LayerGrouping
    module_layer_nodes: list[list[str]]


def group_layers(traced: TracedModel) -> TracedModel:
    """``traced`` with its layers grouped by :func:`find_grouping`: itself when every layer
    is the same op sequence, else a :class:`GroupedTracedModel` sharing ``gm`` and the node
    annotations, whose prefix layers' nodes are in ``pre`` (section "pre", no layer), suffix
    layers' nodes in ``post``, and each group's nodes one layer (``NodeInfo.layer`` = the
    group index). The annotations are updated in place, so use the returned model."""
    order = [n.name for n in traced.gm.graph.nodes]
    runs = list(traced.pre) + [n for names in traced.layers for n in names] + list(traced.post)
    if isinstance(traced, GroupedTracedModel) or not traced.layers or runs != order:
        return traced  # layers that are not back-to-back runs (a looped layer): as captured
    traced = _complete_last_layer(traced)
    grouping = find_grouping([tuple(_signature(traced.nodes[n]) for n in names)
                              for names in traced.layers])
    if grouping.trivial:
        return traced
    k, n, G = grouping.prefix, grouping.period, grouping.groups
    modules = [list(names) for names in traced.layers]
    head = [name for names in modules[:k] for name in names]
    tail = [name for names in modules[k + G * n:] for name in names]
    groups = [[name for names in modules[k + g * n:k + (g + 1) * n] for name in names]
              for g in range(G)]
    for names, section in ((head, "pre"), (tail, "post")):
        for name in names:
            traced.nodes[name].section, traced.nodes[name].layer = section, None
    for g, names in enumerate(groups):
        for name in names:
            traced.nodes[name].section, traced.nodes[name].layer = "layer", g
    fields = {f.name: getattr(traced, f.name) for f in dataclasses.fields(TracedModel)}
    fields.update(layers=groups, pre=list(traced.pre) + head, post=tail + list(traced.post))
    return GroupedTracedModel(**fields, grouping=grouping, module_layer_nodes=modules)


def _complete_last_layer(traced: TracedModel) -> TracedModel:
    """``traced`` with the ops that follow the last layer's module and repeat what every
    other layer ends with moved from ``post`` into the last layer: a loop
    ``x = f(layer(x))`` runs ``f`` outside the layer's module, so capture puts each ``f``
    in the layer before it, the last one in ``post``; the layers are then alike again
    ([A f] ... [A f]) instead of [A f] ... [A] (one group too coarse to cut into pipeline
    stages). ``f`` stays on the last pipeline stage either way. Unchanged otherwise."""
    layers = traced.layers
    signs = [[_signature(traced.nodes[n]) for n in names] for names in layers]
    first, last = signs[0], signs[-1]
    missing = len(first) - len(last)
    if len(layers) < 2 or missing <= 0 or first[:len(last)] != last \
            or any(sign != first for sign in signs[:-1]):
        return traced
    moved = list(traced.post[:missing])
    if [_signature(traced.nodes[n]) for n in moved] != first[len(last):]:
        return traced
    for name in moved:
        traced.nodes[name].section, traced.nodes[name].layer = "layer", len(layers) - 1
    return dataclasses.replace(traced, layers=layers[:-1] + [list(layers[-1]) + moved],
                               post=list(traced.post[missing:]))


def _signature(info) -> tuple:
    """What two layers' nodes must share for one to be priced as the other: the op kind,
    output shape, forward FLOPs, parameter elements and gradient mode."""
    return info.kind, info.shape, info.flops, info.param_numel, info.no_grad


def grouping_of(traced: TracedModel) -> LayerGrouping:
    """The grouping ``traced`` is planned with ((0, 1, 0) for a model not grouped)."""
    if isinstance(traced, GroupedTracedModel):
        return traced.grouping
    return LayerGrouping(prefix=0, period=1, suffix=0, module_layers=len(traced.layers))


def module_layers(traced: TracedModel) -> list[list[str]]:
    """The node names of each module (transformer) layer, prefix and suffix included."""
    if isinstance(traced, GroupedTracedModel):
        return traced.module_layer_nodes
    return traced.layers
