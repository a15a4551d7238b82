"""Higher-order regions of an exported forward inlined into autopar's graph: export's
``wrap_with_set_grad_enabled(mode, body, *inputs)``, a ``torch.no_grad()`` (or
``enable_grad``) block of the model's forward.

A ``no_grad`` region's nodes are marked ``meta["no_grad"]`` (priced without a backward or
saved activations: :attr:`~autopar.graph.annotate.NodeInfo.no_grad`) and its tensor
outputs ``detach``-ed, so the program passes no gradient the model stops (DeepSeek-V3.2's
indexer scores, HRM's inner cycles) and computes the same values; an output that is one of
the region's inputs, as eager hands it back, keeps its gradient.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph.ops import packet

__all__ = ["inline_region", "mark_gradients"]

aten = torch.ops.aten


def inline_region(graph: fx.Graph, body: fx.GraphModule, args: list, meta: dict,
                  no_grad: bool = False) -> tuple:
    """Copy ``body``'s nodes into ``graph`` reading ``args`` (outer nodes); returns its
    outputs, marked and detached when ``no_grad`` (module docstring). ``meta``: the region
    node's, whose module stack and source line its nodes inherit where they lack one."""
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(args)
    for node in body.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            inputs = {id(a) for a in args}  # handed back: its gradient flows, as in eager
            outs = tuple(env[n] for n in node.args[0])
            return tuple(_detached(graph, out) if no_grad and id(_aliased(out)) not in inputs
                         else _with_grad(out) for out in outs)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            for key in ("nn_module_stack", "stack_trace"):
                if key not in env[node].meta and key in meta:
                    env[node].meta[key] = meta[key]
            if no_grad:
                env[node].meta["no_grad"] = True
    raise ValueError("higher-order op body without an output")


def _aliased(node):
    """The tensor ``node`` is, through ``.to()`` calls that change nothing (eager returns
    the tensor itself, with its gradient, even under ``no_grad``: Dots3's indexer hands
    back its ``hidden_states.to(dtype)``, which the attention then reads)."""
    while (isinstance(node, fx.Node) and packet(node.target) is aten.to and node.args
           and isinstance(node.args[0], fx.Node)):
        out, src = node.meta.get("val"), node.args[0].meta.get("val")
        if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)
                and (out.dtype, out.device, out.layout) == (src.dtype, src.device, src.layout)):
            break
        node = node.args[0]
    return node


def _with_grad(node):
    """``node``, its ``.to()`` chain back to the region's input unmarked: it carries the
    input's gradient (:func:`_aliased`)."""
    walk = node
    while isinstance(walk, fx.Node) and walk.meta.pop("no_grad", None) and walk.args:
        walk = walk.args[0]
    return node


def _detached(graph: fx.Graph, out):
    """``aten.detach(out)`` just after ``out``, for a tensor node."""
    if not isinstance(out, fx.Node) or not isinstance(out.meta.get("val"), torch.Tensor):
        return out
    with graph.inserting_after(out):
        new = graph.call_function(aten.detach.default, (out,))
    new.meta.update({k: v for k, v in out.meta.items() if k != "no_grad"})
    new.meta["no_grad"] = True
    return new


def mark_gradients(gm: fx.GraphModule, nodes: dict) -> None:
    """Set ``carries_grad`` of every node's :class:`~autopar.graph.annotate.NodeInfo`
    (``nodes``, by name; ``params`` filled): autograd's rule, forward in graph order. A
    parameter read (``get_attr``) or a module call holding parameters carries a gradient; a
    placeholder (token ids, targets), a buffer and a ``no_grad`` node do not; any other
    node does when one of its tensor inputs does and its output is floating point (an
    ``argmax`` or top-k index, an integer mask, is not differentiable; a node of several
    outputs, top-k's (values, indices), when one of them is)."""
    for node in gm.graph.nodes:
        info = nodes[node.name]
        val = node.meta.get("val", node.meta.get("tensor_meta"))
        values = val if isinstance(val, (tuple, list)) and not hasattr(val, "dtype") else (val,)
        floating = node.op == "call_module" or any(
            getattr(getattr(v, "dtype", None), "is_floating_point", False) for v in values)
        if node.op in ("placeholder", "output") or info.no_grad or not floating:
            info.carries_grad = False
        elif node.op == "get_attr" or (node.op == "call_module" and info.params):
            info.carries_grad = bool(info.params)
        else:
            info.carries_grad = any(nodes[u.name].carries_grad for u in node.all_input_nodes)
