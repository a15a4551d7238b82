"""Rewrite pass 2: activation recomputation, per layer as the plan says.

* ``full``: the layer's nodes move into a sub-GraphModule run through
  ``torch.utils.checkpoint.checkpoint`` (only the layer input is kept; the layer is
  recomputed in backward; Chen et al. 2016, Megatron's "full" recompute).
* ``selective``: only the attention core (scaled_dot_product_attention: QKᵀ, softmax,
  dropout, ·V) is checkpointed (Korthikanti et al. 2022, section 5).

Both appear in the rewritten code as ``call_module`` nodes named ``recompute_*``.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["Checkpointed", "apply_recompute"]


class Checkpointed(nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args):
        return checkpoint(self.body, *args, use_reentrant=False)


class _AttentionCore(nn.Module):
    """scaled_dot_product_attention(q, k, v, **kwargs) as a module (for checkpointing)."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = dict(kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.kwargs.items())

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def _extract(gm: fx.GraphModule, names: list[str]) -> tuple[fx.GraphModule, fx.Node, fx.Node]:
    """Move the nodes ``names`` (one layer: one tensor in, one out) into a sub-GraphModule."""
    members = set(names)
    nodes = [n for n in gm.graph.nodes if n.name in members]
    inputs = {a for n in nodes for a in n.all_input_nodes if a.name not in members}
    if len(inputs) != 1:
        raise NotImplementedError(
            f"full recompute needs a layer with one input; {nodes[0].name}.. reads "
            f"{sorted(a.name for a in inputs)}")
    (x,) = inputs
    last = nodes[-1]
    if any(n is not last for n in nodes for u in n.users if u.name not in members):
        raise NotImplementedError(f"full recompute needs a layer with one output ({last.name})")
    sub = fx.Graph()
    env = {x: sub.placeholder("x")}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[last])
    return fx.GraphModule(gm, sub, class_name="RecomputedLayer"), x, last


def apply_recompute(gm: fx.GraphModule, layer_nodes: list[list[str]], recompute: list[str]) -> None:
    """Apply each layer's recompute mode in place. ``layer_nodes[l]``: node names of layer l
    in ``gm`` (after the TP pass, inserted collectives included)."""
    for layer, (names, mode) in enumerate(zip(layer_nodes, recompute)):
        if mode == "selective":
            _checkpoint_attention(gm, names, layer)
        elif mode == "full":
            body, x, last = _extract(gm, names)
            gm.add_submodule(f"recompute_layer_{layer}", Checkpointed(body))
            with gm.graph.inserting_after(last):
                new = gm.graph.call_module(f"recompute_layer_{layer}", (x,))
            new.meta.update({k: v for k, v in last.meta.items() if k.startswith("autopar")})
            last.replace_all_uses_with(new)
            for n in reversed([n for n in gm.graph.nodes if n.name in set(names)]):
                gm.graph.erase_node(n)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _checkpoint_attention(gm: fx.GraphModule, names: list[str], layer: int) -> None:
    for n in [n for n in gm.graph.nodes if n.name in set(names)]:
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            target = f"recompute_attention_{layer}_{n.name}"
            gm.add_submodule(target, Checkpointed(_AttentionCore(n.kwargs)))
            n.op, n.target, n.kwargs = "call_module", target, {}
