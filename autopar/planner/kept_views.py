"""Which kept tensors are views of a fused (flash) attention kernel's saved output.

A flash attention kernel keeps its output for backward (with the log-sum-exp). Its output
is laid out (b, s, heads, head_dim) in memory, so the usual ``transpose(1, 2)`` then
``view``/``reshape`` to (b, s, h) is a view of the same storage, and the projection that
keeps that view for backward (Megatron's row-parallel ``dense``, nanoGPT's ``c_proj``) adds
no bytes while the kernel's output is kept: measured with
:class:`~autopar.runtime.stats.SavedActivationTracker`, which counts a storage once.

Edges that read such a view get a role (:func:`flash_view_roles`), which
:func:`~autopar.planner.cost_tables.cost_tables` prices into
:attr:`~autopar.planner.cost_tables.EdgeCost.saved_bytes` and
:attr:`~autopar.planner.cost_tables.EdgeCost.selective_saved_bytes` when the cluster's
attention kernel is "flash":

* "keeper": a saving op reads the view. Read as produced (no reshard) it is the kernel's
  storage: nothing more while the attention core is kept, and the view's bytes once
  selective recompute drops the core (the checkpointed kernel keeps nothing, the keeper
  still holds the output). Read after a reshard it is a copy, kept either way.
* "chain": a view op reads the kernel's output or a view of it, on the way to a keeper. A
  reshard there makes a copy that the keeper holds instead of the kernel's storage: its
  bytes are kept while the core is kept, and the keeper's own entry counts them once the
  core is dropped.

A chain that reshards twice (or a keeper that reshards after a chain reshard) is counted
with one copy too many: over, never under, and no plan autopar makes does that.
"""

from __future__ import annotations

from autopar.graph.annotate import TracedModel, saves_inputs
from autopar.planner.strategies import tensor_inputs

__all__ = ["flash_view_roles", "kept_version_bytes", "VIEW_KINDS"]

VIEW_KINDS = ("view", "transpose", "contiguous")
"""Ops that return their input's storage when it is already laid out for them."""


def flash_view_roles(traced: TracedModel) -> dict[tuple[str, str, int], str]:
    """{(source, consumer, input index): "keeper" | "chain"} for the edges of ``traced``
    that read an attention output or a view of it (module docstring); a chain edge only
    where the view leads to a keeper."""
    nodes = traced.nodes
    graph = list(traced.gm.graph.nodes)
    views: set[str] = set()
    roles: dict[tuple[str, str, int], str] = {}
    for node in graph:
        info = nodes[node.name]
        if info.kind == "sdpa":
            views.add(node.name)
            continue
        ins = tensor_inputs(node, nodes)
        for j, src in enumerate(ins):
            if src.name not in views:
                continue
            if info.kind in VIEW_KINDS and len(ins) == 1:
                views.add(node.name)
                roles[(src.name, node.name, j)] = "chain"
            elif saves_inputs(info):
                roles[(src.name, node.name, j)] = "keeper"
    leads: set[str] = set()  # views from which some path of views reaches a keeper
    for node in reversed(graph):
        if node.name in views and any(
                roles.get((node.name, user.name, j)) == "keeper" or user.name in leads
                for user in node.users for j in range(len(tensor_inputs(user, nodes)))):
            leads.add(node.name)
    return {edge: role for edge, role in roles.items() if role == "keeper" or edge[1] in leads}


def kept_version_bytes(kept: float, role: str | None, read_as_produced: bool
                       ) -> tuple[float, float]:
    """(saved_bytes, selective_saved_bytes) of an edge whose consumer keeps ``kept`` bytes
    (its version of the tensor) for an edge ``role`` (module docstring; None: an ordinary
    edge, the same bytes under every recompute), ``read_as_produced``: no reshard."""
    if role == "keeper" and read_as_produced:  # the kernel's own storage
        return 0.0, kept
    if role == "chain":  # a copy the keeper holds, or the kernel's storage
        return (0.0 if read_as_produced else kept), 0.0
    return kept, kept
