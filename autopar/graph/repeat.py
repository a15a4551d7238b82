"""Capture a deep stack of identical layers by exporting three and repeating the last.

``torch.export``'s time grows with the graph, and most of it is per op (fake-tensor dispatch,
sympy on the dynamic batch dimension): the 80 layers of a Llama-3-70B-shaped model take
about 25 s on two cores, nearly all inside export. Transformer layers are the same code
over the same shapes, so :func:`autopar.graph.export.export_logits` exports the model with
its layer list cut to :data:`EXPORTED_LAYERS` layers (the same module objects) and writes
the other layers' nodes itself (:func:`repeat_last_layer`): copies of the last exported
layer with the layer index in module paths and parameter names moved on, reading the layer
before them where the copied layer read its own predecessor. The result is the graph a full
export gives, node for node (``tests/unit/test_export_capture.py`` compares the two).

Leading layers that differ from the rest (DeepSeek-V3's 3 dense layers before 58 MoE ones)
are exported as they are, before the three (:data:`MAX_LEADING_LAYERS`): its 61 layers take
6 layers' export, not 61. It is used only where the layers after them are interchangeable;
each check below failing means a full export instead, never a different graph:

1. every layer module has the same structure (:func:`layer_stack`): the classes of its
   submodules, the names, shapes and dtypes of its parameters and buffers, and the plain
   attributes of every submodule, an attribute equal to the layer's own index aside (a
   per-layer sliding window or attention type differs here);
2. in the exported graph the last layer is the one before it with the index moved on, op
   for op and argument for argument, reading its predecessor where that one read its own
   and the same nodes outside the stack (a constant that depends on the layer index, e.g.
   GPT-2's ``scale_attn_by_inverse_layer_idx``, differs here);
3. nothing after the stack reads a layer other than the last.

What the checks cannot see: a forward that branches on the layer index in a pattern
longer than the exported layers without storing it in an attribute, or that uses the
length of the layer list itself. Neither occurs in the Hugging Face families autopar runs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.graph.normalize import resolve

__all__ = ["EXPORTED_LAYERS", "MAX_LEADING_LAYERS", "layer_stack", "cut_stack",
           "repeat_last_layer"]

EXPORTED_LAYERS = 3
"""Layers exported when the rest are repeated: layer 0 (which reads the embedding), and
layers 1 and 2, compared to each other (check 2) before layer 2 is repeated."""

_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


MAX_LEADING_LAYERS = 8
"""Most leading layers that may differ from the rest (DeepSeek-V3's 3 dense layers before
its MoE ones, ``first_k_dense_replace``): exported as they are, before the repeated ones."""


# ------------------------------------------------------------------ check 1: the modules
def layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList, int] | None:
    """(path, list, lead) of ``model``'s stack of layers whose layers ``lead`` onwards are
    interchangeable, or None: the largest ``nn.ModuleList`` not inside another one's layers,
    with more than lead + :data:`EXPORTED_LAYERS` children of which all but the first
    ``lead`` (the fewest, at most :data:`MAX_LEADING_LAYERS`) pass check 1 of the module
    docstring."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) <= EXPORTED_LAYERS:
            continue
        nested = best is not None and path.startswith(best[0] + ".")
        if not nested and (best is None or len(mod) > len(best[1])):
            best = (path, mod)
    if best is None:
        return None
    layers = list(best[1])
    for lead in range(min(MAX_LEADING_LAYERS, len(layers) - EXPORTED_LAYERS - 1) + 1):
        if _interchangeable(layers[lead:], lead):
            return best[0], best[1], lead
    return None


def _same(x, y) -> bool:
    """Equal plain values (numbers, strings, dtypes, tuples of them) or the same object."""
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return isinstance(x, _PLAIN) and x == y


def _attributes(layer: nn.Module) -> dict[tuple[str, str], object]:
    """Per (submodule path, name): class, tensors' (shape, dtype, requires_grad), plain
    attributes (``vars``, private ones and the training flag aside)."""
    out: dict[tuple[str, str], object] = {}
    for path, mod in layer.named_modules():
        out[(path, "__class__")] = type(mod)
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                out[(path, name)] = None if t is None else (tuple(t.shape), t.dtype,
                                                             t.requires_grad)
        for name, value in vars(mod).items():
            if not name.startswith("_") and name != "training":
                out[(path, name)] = value
    return out


def _interchangeable(layers: list[nn.Module], first: int = 0) -> bool:
    """Do ``layers`` (layers ``first``, ``first`` + 1, ... of a stack) pass check 1?"""
    attrs = [_attributes(layer) for layer in layers]
    if any(a.keys() != attrs[0].keys() for a in attrs):
        return False
    for key in attrs[0]:
        values = [a[key] for a in attrs]
        if all(_same(v, values[0]) for v in values):
            continue
        if not all(type(v) is int and v == first + i for i, v in enumerate(values)):
            return False  # differs, and is not the layer's own index (e.g. layer_idx)
    return True


@contextlib.contextmanager
def cut_stack(model: nn.Module, path: str, keep: int):
    """Within the block, ``model``'s layer list at ``path`` holds its first ``keep`` layers
    (the same module objects); restored on exit."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = getattr(parent, name)
    setattr(parent, name, nn.ModuleList(list(full)[:keep]))
    try:
        yield
    finally:
        setattr(parent, name, full)


# ------------------------------------------------------------- checks 2 and 3, the copy
def _layer_of(node: fx.Node, prefix: str) -> int | None:
    """Index of the layer of ``prefix`` whose module ran ``node`` (export's
    ``nn_module_stack``, innermost first), None outside the stack."""
    stack = node.meta.get("nn_module_stack") or {}
    for value in reversed(list(stack.values())):
        path = value[0] if isinstance(value, tuple) else ""
        if path.startswith(prefix + "."):
            head = path[len(prefix) + 1:].split(".")[0]
            return int(head) if head.isdigit() else None
    return None


def _blocks(nodes: list[fx.Node], prefix: str, count: int) -> list[list[fx.Node]] | None:
    """The nodes of layers 0..count-1: consecutive runs in graph order, from a layer's first
    node to its last; None unless the layers are such runs, in order, back to back."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, node in enumerate(nodes):
        k = _layer_of(node, prefix)
        if k is not None:
            first.setdefault(k, i)
            last[k] = i
    if sorted(first) != list(range(count)):
        return None
    spans = [(first[k], last[k]) for k in range(count)]
    if any(b[0] != a[1] + 1 for a, b in zip(spans, spans[1:])):
        return None
    blocks = [nodes[lo:hi + 1] for lo, hi in spans]
    for k, block in enumerate(blocks):
        if any(_layer_of(n, prefix) not in (k, None) for n in block):
            return None
    return blocks


def _move(path: str, prefix: str, src: int, dst: int) -> str:
    """``path`` with ``prefix.src`` (a whole path component) replaced by ``prefix.dst``."""
    old = f"{prefix}.{src}"
    if path == old or path.startswith(old + "."):
        return f"{prefix}.{dst}" + path[len(old):]
    return path


def _moved_meta(meta: dict, prefix: str, src: int, dst: int) -> dict:
    """A copy of a node's meta whose ``nn_module_stack`` paths name layer ``dst``."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        moved = {}
        for key, value in stack.items():
            if isinstance(value, tuple) and value and isinstance(value[0], str):
                path = value[0]
                new = _move(path, prefix, src, dst)
                key = key[:-len(path)] + new if path and key.endswith(path) else key
                value = (new,) + value[1:]
            moved[key] = value
        out["nn_module_stack"] = moved
    return out


def _same_arg(x, y, match) -> bool:
    """Do arguments ``x`` (of the layer before) and ``y`` (of the last layer) correspond?
    Nodes through ``match(x, y)``, containers element-wise, other values by equality."""
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        return isinstance(x, fx.Node) and isinstance(y, fx.Node) and match(x, y)
    if isinstance(x, (tuple, list)) or isinstance(y, (tuple, list)):
        return (type(x) is type(y) and len(x) == len(y)
                and all(_same_arg(a, b, match) for a, b in zip(x, y)))
    if isinstance(x, dict) or isinstance(y, dict):
        return (type(x) is type(y) and x.keys() == y.keys()
                and all(_same_arg(x[k], y[k], match) for k in x))
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # a value without a plain equality: only itself corresponds
        return x is y


def _stack_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else "" for v in stack.values()]


def _repeats(blocks: list[list[fx.Node]], prefix: str) -> bool:
    """Check 2 of the module docstring: the last block is the one before it, moved on."""
    *_, before, prev, last = [None] + blocks
    k = len(blocks) - 1
    if len(prev) != len(last):
        return False
    pos_prev = {n: i for i, n in enumerate(prev)}
    pos_before = {n: i for i, n in enumerate(before or [])}
    pos_last = {n: i for i, n in enumerate(last)}
    in_stack = {n for block in blocks for n in block}

    def match(x: fx.Node, y: fx.Node) -> bool:
        if x in pos_prev:
            return pos_last.get(y) == pos_prev[x]
        if x in pos_before:
            return pos_prev.get(y) == pos_before[x]
        return x is y and x not in in_stack

    for x, y in zip(prev, last):
        target = _move(x.target, prefix, k - 1, k) if isinstance(x.target, str) else x.target
        if x.op != y.op or target != y.target:
            return False
        if [_move(p, prefix, k - 1, k) for p in _stack_paths(x)] != _stack_paths(y):
            return False
        if not (_same_arg(x.args, y.args, match) and _same_arg(x.kwargs, y.kwargs, match)):
            return False
    return True


def repeat_last_layer(graph: fx.Graph, root: dict, model: nn.Module, prefix: str,
                      total: int, lead: int = 0) -> fx.Graph | None:
    """The graph of ``total`` layers from ``graph``, an export of the stack at ``prefix``
    cut to ``lead`` + :data:`EXPORTED_LAYERS` layers (``lead`` leading layers that differ,
    :func:`layer_stack`): the layers after them are copies of the last exported one, named
    by their own index; their parameters and buffers (``get_attr`` targets) are added to
    ``root`` from ``model``. None when a check of the module docstring fails (``graph`` and
    ``root`` are then unchanged)."""
    nodes = list(graph.nodes)
    exported = lead + EXPORTED_LAYERS
    k = exported - 1
    blocks = _blocks(nodes, prefix, exported)
    if blocks is None or not _repeats(blocks, prefix):
        return None
    end = nodes.index(blocks[-1][-1])
    earlier = {n for block in blocks[:-1] for n in block}
    post = nodes[end + 1:]
    if any(a in earlier for n in post for a in n.all_input_nodes):
        return None  # check 3
    prev_pos = {n: i for i, n in enumerate(blocks[-2])}
    template = blocks[-1]
    new, env = fx.Graph(), {}
    for node in nodes[:end + 1]:
        env[node] = new.node_copy(node, env.__getitem__)
    latest = {n: env[n] for n in template}  # template node -> its copy in the newest layer
    added: dict[str, object] = {}
    for layer in range(exported, total):
        copies: dict[fx.Node, fx.Node] = {}

        def arg(x: fx.Node) -> fx.Node:
            if x in copies:
                return copies[x]
            if x in prev_pos:  # the layer before, in the template: the newest layer
                return latest[template[prev_pos[x]]]
            return env[x]

        for node in template:
            copy = new.node_copy(node, arg)
            if isinstance(node.target, str):
                copy.target = _move(node.target, prefix, k, layer)
                if node.op == "get_attr" and copy.target != node.target:
                    added[copy.target] = resolve(model, copy.target)
            copy.meta = _moved_meta(node.meta, prefix, k, layer)
            copies[node] = copy
        latest = {n: copies[n] for n in template}
    for node in post:
        env[node] = new.node_copy(node, lambda x: latest[x] if x in latest else env[x])
    if any(v is None for v in added.values()):
        return None
    root.update(added)
    return new
