"""In-place writes of a captured graph: which tensors change after the node that makes them.

torch.export's training IR keeps in-place ops. DeepSeek-V2/V3's multi-head latent
attention builds its keys as a buffer filled through views of it::

    new_empty = aten.new_empty(k_pass, [b, nh, s, nope + rope])   # (b, nh, s, hd), garbage
    slice_16 = aten.slice(new_empty, 3, 0, nope);  copy_ = aten.copy_(slice_16, k_pass)
    slice_17 = aten.slice(new_empty, 3, nope);     copy__1 = aten.copy_(slice_17, k_rot)
    sdpa(q, new_empty, v)                                         # reads the filled buffer

so ``new_empty``'s value is complete only after the last ``copy_``, not where the node
stands. Two consequences for tensor parallelism, both handled by the callers:

* a collective that reads such a tensor (a slice for a consumer on head shards, a gather,
  Megatron's f) must run after the writes that precede its consumer, not right after the
  producer (:func:`last_write_before`; the TP rewrite's anchor);
* a write into a *copy* is lost, and a copy taken before a write misses it: the
  writers, and every tensor (root or view) of a storage that a later node writes, keep
  one placement, or a reshard between them (a slice, a gather) would hand the write, or
  a later reader of the view, a fresh tensor; the strategies keep them replicated
  (:func:`written_later`). A view made after the last write is final and free.

Aliasing is read from the ops' schemas (``Tensor(a)`` returns a view of its ``Tensor(a)``
argument, ``Tensor(a!)`` is written), so it covers every aten view and in-place op; a
"may alias" op (``reshape``, ``to``) counts as a view, which is the safe side.
"""

from __future__ import annotations

import operator

import torch.fx as fx

__all__ = ["alias_root", "in_place_writes", "written_later", "last_write_before"]


def _schema_args(node: fx.Node):
    """(schema argument, value passed) of an aten call ``node``; [] for anything else."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    pairs = list(zip(schema.arguments, node.args))
    pairs += [(a, node.kwargs[a.name]) for a in schema.arguments[len(node.args):]
              if a.name in node.kwargs]
    return pairs


def _viewed(node: fx.Node) -> fx.Node | None:
    """The tensor ``node``'s output is (or may be) a view of, or None."""
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]  # an element of split / unbind / chunk's list of views
        return src if isinstance(src, fx.Node) and _viewed(src) is not None else None
    returns = getattr(getattr(node.target, "_schema", None), "returns", ())
    sets = {s for r in returns if r.alias_info is not None for s in r.alias_info.before_set}
    for arg, value in _schema_args(node):
        info = arg.alias_info
        if isinstance(value, fx.Node) and info is not None and (
                info.before_set & sets or "*" in info.after_set):
            return value
    return None


def alias_root(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` views: itself unless it is a view (or in-place
    op's result) of another node."""
    seen = node
    while (up := _viewed(seen)) is not None:
        seen = up
    return seen


def in_place_writes(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Every node that shares storage with a tensor written in place (the written tensor's
    root, its views, the writers' results) -> the nodes that write into that storage, in
    graph order; nodes whose storage is never written are absent."""
    writes: dict[fx.Node, list[fx.Node]] = {}  # alias root -> writers
    for node in graph.nodes:
        for arg, value in _schema_args(node):
            if isinstance(value, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
                writes.setdefault(alias_root(value), []).append(node)
                break
    if not writes:
        return {}
    roots = {node: alias_root(node) for node in graph.nodes}
    return {node: writes[root] for node, root in roots.items() if root in writes}


def written_later(graph: fx.Graph) -> set[str]:
    """Names of the nodes whose storage a node at or after them writes in place: the
    writers themselves, and every tensor (root or view) that a later write changes. A view
    made after the last write holds its final value and is not among them."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    return {node.name for node, writers in in_place_writes(graph).items()
            if order[writers[-1]] >= order[node]}


def last_write_before(node: fx.Node, consumer: fx.Node, writes: dict[fx.Node, list[fx.Node]],
                      order: dict[fx.Node, int]) -> fx.Node:
    """The last in-place write into ``node``'s storage between ``node`` and ``consumer``
    (``writes`` from :func:`in_place_writes` and ``order``, the nodes' positions, both taken
    from the graph before it was rewritten), or ``node`` itself when there is none: the
    point from which ``node`` holds the value ``consumer`` reads."""
    if node not in order or consumer not in order:  # a node a rewrite inserted
        return node
    between = [w for w in writes.get(node, ()) if order[node] < order[w] < order[consumer]]
    return between[-1] if between else node
