"""Normalisation passes of an exported graph (:mod:`autopar.graph.export`), in the order
export runs them: lift known leaf modules back to ``call_module`` nodes, turn
``split`` + ``getitem`` into slices, and name nodes by op and position."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.ops import is_conv1d as _is_conv1d
from autopar.graph.ops import SDPA_ARGS, packet

__all__ = ["lift_modules", "split_to_slices", "renamed", "resolve", "set_module"]

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unsafe_split.Tensor}


def _module_path(node: fx.Node) -> str:
    """The innermost module of ``node`` in export's ``nn_module_stack``, "" if none."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    value = list(stack.values())[-1]
    return value[0] if isinstance(value, tuple) else ""


def resolve(model: nn.Module, fqn: str):
    """``model``'s attribute at dotted path ``fqn`` (None if there is none)."""
    obj = model
    for part in fqn.split("."):
        obj = getattr(obj, part, None)
    return obj


def renamed(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes are named by op and position (``mul_3`` = the fourth
    ``aten.mul``), modules and attributes by their path: export numbers nodes by its own
    trace, which differs between devices (meta for planning, the runtime's device), and a
    plan names nodes."""
    def base(node: fx.Node) -> str:
        if node.op in ("placeholder", "output"):
            return node.name
        if node.op in ("call_module", "get_attr"):
            return node.target.replace(".", "_")
        op = packet(node.target)
        return op.__name__ if op is not None else getattr(node.target, "__name__", "op")

    new, env, counts = fx.Graph(), {}, {}
    for node in graph.nodes:
        b = base(node)
        k = counts.get(b, 0)
        counts[b] = k + 1
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        if node.op == "output":
            new.output(args[0])
            continue
        env[node] = new.create_node(node.op, node.target, args, kwargs,
                                    name=b if k == 0 else f"{b}_{k}", type_expr=node.type)
        env[node].meta = dict(node.meta)
    return new


def _attr(gm: fx.GraphModule, arg):
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return resolve(gm, arg.target)
    return None


def _leaf_call(gm: fx.GraphModule, node: fx.Node, mod: nn.Module) -> tuple | None:
    """The input of ``node`` if it is the op of ``mod``'s class's own forward, with ``mod``'s
    parameters and settings (padding row, eps, p), else None."""
    t = node.target
    a = node.args
    if t is aten.linear.default and isinstance(mod, nn.Linear):
        bias = a[2] if len(a) > 2 else node.kwargs.get("bias")
        if _attr(gm, a[1]) is mod.weight and (_attr(gm, bias) is mod.bias):
            return (a[0],)
    if t is aten.matmul.default and isinstance(mod, nn.Linear) and _is_weight_t(gm, a[1], mod):
        # ``x @ weight.T`` (+ bias): a Linear subclass with its own forward (Falcon's)
        bias = _bias_add(gm, node, mod)
        if mod.bias is None or bias is not None:
            return (a[0],)
    if t is aten.addmm.default and _is_conv1d(mod) and not node.kwargs:
        if _attr(gm, a[2]) is mod.weight and _attr(gm, a[0]) is mod.bias:
            flat = a[1]  # Conv1D.forward: x.view(-1, nx) -> addmm -> view(*x.shape[:-1], nf)
            if (isinstance(flat, fx.Node) and packet(flat.target) in (aten.view, aten.reshape)
                    and _module_path(flat) == _module_path(node)):
                return (flat.args[0],)
            return (a[1],)
    if t is aten.embedding.default and isinstance(mod, nn.Embedding):
        padding = mod.padding_idx if mod.padding_idx is not None else -1
        if _attr(gm, a[0]) is mod.weight and tuple(a[2:]) == (padding, mod.scale_grad_by_freq,
                                                              mod.sparse)[:len(a) - 2]:
            return (a[1],)
    if t is aten.layer_norm.default and isinstance(mod, nn.LayerNorm):
        w = a[2] if len(a) > 2 else None
        b = a[3] if len(a) > 3 else None
        eps = a[4] if len(a) > 4 else 1e-5
        if (_attr(gm, w) is mod.weight and _attr(gm, b) is mod.bias and eps == mod.eps
                and tuple(a[1]) == tuple(mod.normalized_shape)):
            return (a[0],)
    if t is aten.dropout.default and isinstance(mod, nn.Dropout) and a[1] == mod.p:
        return (a[0],)
    return None


def _is_weight_t(gm: fx.GraphModule, arg, mod: nn.Linear) -> bool:
    """Whether ``arg`` is ``mod.weight`` transposed (``.T``, ``.t()``, ``.mT``,
    ``transpose(0, 1)``, ``permute(1, 0)``)."""
    if not isinstance(arg, fx.Node) or _attr(gm, arg.args[0] if arg.args else None) is not mod.weight:
        return False
    return (arg.target in (aten.t.default, aten.numpy_T.default, aten.mT.default)
            or (arg.target is aten.transpose.int and sorted(arg.args[1:]) in ([0, 1], [-2, -1]))
            or (arg.target is aten.permute.default and list(arg.args[1]) == [1, 0]))


def _bias_add(gm: fx.GraphModule, node: fx.Node, mod: nn.Linear) -> fx.Node | None:
    """The single user ``node + mod.bias``, if that is what reads ``node``."""
    users = list(node.users)
    if (mod.bias is not None and len(users) == 1 and users[0].target is aten.add.Tensor
            and users[0].args[0] is node and _attr(gm, users[0].args[1]) is mod.bias):
        return users[0]
    return None


def lift_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    graph = gm.graph
    used: set[str] = set()
    erased: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node in erased:
            continue
        path = _module_path(node)
        mod = resolve(model, path) if path else None
        call = _leaf_call(gm, node, mod) if isinstance(mod, nn.Module) else None
        replaced = node
        if call is not None:  # every call: a module run twice (a looped layer) is two nodes
            if path not in used:
                used.add(path)
                set_module(gm, path, _as_leaf(mod))
            users = list(node.users)
            if (_is_conv1d(mod) and call[0] is not node.args[1] and len(users) == 1
                    and packet(users[0].target) in (aten.view, aten.reshape)):
                replaced = users[0]  # the region view -> addmm -> view is the module's call
            if node.target is aten.matmul.default and mod.bias is not None:
                replaced = _bias_add(gm, node, mod)  # the region matmul -> add
            with graph.inserting_before(node):
                new = graph.create_node("call_module", path, call, {},
                                        name=path.replace(".", "_"))
        elif node.target is aten.scaled_dot_product_attention.default:
            kwargs = dict(zip(SDPA_ARGS, node.args[3:]))
            kwargs.update(node.kwargs)
            with graph.inserting_before(node):
                new = graph.call_function(F.scaled_dot_product_attention, node.args[:3], kwargs)
        elif node.target in (aten.contiguous.default, aten.lift_fresh_copy.default):
            # whether export records .contiguous() depends on the device's fake strides,
            # and a copy of a tensor constant (torch.tensor(...) in forward) appears on
            # CPU, not on meta: drop both, so every device captures one graph (reshapes
            # copy where needed; the graph is functional, nothing writes the constant)
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            erased.add(node)
            continue
        elif node.target in (aten.view.default, aten._unsafe_view.default):
            # export elides .contiguous() when its fake kernel's layout made it a no-op;
            # another kernel (meta, another device, a shard) may not: reshape copies then
            node.target = aten.reshape.default
            continue
        elif node.target is aten.dropout.default:
            p, train = node.args[1], node.args[2]
            with graph.inserting_before(node):
                new = graph.call_function(F.dropout, (node.args[0],), {"p": p, "training": train})
        else:
            continue
        new.meta.update(replaced.meta)
        replaced.replace_all_uses_with(new)
        for old in (replaced, node):
            if old not in erased and not old.users:
                graph.erase_node(old)
                erased.add(old)


_LEAF_BASES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Dropout)


def _as_leaf(mod: nn.Module) -> nn.Module:
    """``mod`` itself, or, when it subclasses a leaf module and overrides its ``forward``
    (Gemma's ``embed_tokens`` multiplies by sqrt(h); OPT's ``embed_positions`` takes an
    attention mask and adds an offset of 2 to its cumsum), a view of it as the base class:
    the same Parameter and buffer objects and attributes, the base class's ``forward``.
    Only the base op was lifted; the subclass's own ops stay in the graph as aten nodes,
    so calling the subclass's ``forward`` would apply them twice."""
    base = next((b for b in _LEAF_BASES if isinstance(mod, b)), None)
    if base is None or type(mod).forward is base.forward:
        return mod
    view = base.__new__(base)
    view.__dict__.update(vars(mod))
    for slot in ("_parameters", "_buffers", "_modules"):  # own dicts: the user's stay as they are
        setattr(view, slot, dict(getattr(mod, slot)))
    return view


def set_module(gm: fx.GraphModule, path: str, mod: nn.Module) -> None:
    """Put the user's module at ``path``, replacing the holder GraphModule made for its
    parameters' ``get_attr`` (the same tensor objects)."""
    parent_path, _, name = path.rpartition(".")
    if parent_path:
        gm.add_submodule(parent_path, _get_or_none(gm, parent_path) or nn.Module())
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, name, mod)


def _get_or_none(gm: nn.Module, path: str):
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def split_to_slices(gm: fx.GraphModule) -> None:
    """``getitem(split(x, sizes, dim), i)`` -> ``aten.slice(x, dim, start_i, end_i)``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) is None:
            continue
        if node.target not in _SPLITS:
            continue
        x = node.args[0]
        size = x.meta["val"].shape
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(size)
        total = int(size[dim])
        if node.target is aten.chunk.default:
            step = -(-total // node.args[1])
            sizes = [min(step, total - k) for k in range(0, total, step)]
        elif isinstance(node.args[1], int):
            step = node.args[1]
            sizes = [min(step, total - k) for k in range(0, total, step)]
        else:
            sizes = list(node.args[1])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise NotImplementedError(f"{node.name}: a split whose pieces are not read "
                                          "by indexing")
            i = user.args[1]
            with graph.inserting_before(user):
                piece = graph.call_function(aten.slice.Tensor,
                                            (x, dim, starts[i], starts[i] + sizes[i]))
            piece.meta.update(user.meta)
            user.replace_all_uses_with(piece)
            graph.erase_node(user)
        graph.erase_node(node)
