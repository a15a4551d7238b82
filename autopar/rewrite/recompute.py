"""Rewrite pass 3 of :func:`autopar.rewrite.apply_plan`: activation recomputation, per layer.

* ``full``: the layer's nodes move into a sub-GraphModule run through
  ``torch.utils.checkpoint.checkpoint`` (only the layer input is kept, with the side
  inputs a captured model computes once for all layers; the layer is recomputed in
  backward; Chen et al. 2016, Megatron's "full" recompute).
* ``selective``: only the attention core (scaled_dot_product_attention: QKᵀ, softmax,
  dropout, ·V) is checkpointed (Korthikanti et al. 2022, section 5).

Both appear in the rewritten code as ``call_module`` nodes named ``recompute_*``.

Recomputation must draw the same dropout masks as the forward. Checkpointing restores
the default generator by itself; the dropouts that run on the tracker's tensor-parallel
stream (:mod:`autopar.rewrite.dropout`) need the tracker's states of the forward back
during recomputation too, which ``Checkpointed`` does through checkpoint's ``context_fn``
(Megatron-LM: ``CheckpointFunction`` in ``megatron/core/tensor_parallel/random.py``).
"""

from __future__ import annotations

import contextlib

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from autopar.runtime.rng import RNGStatesTracker
from autopar.rewrite.context_parallel import ContextParallelAttention
from autopar.rewrite.dropout import AttentionCore, ForkedRNG, attention_core
from autopar.techniques.recompute_modes import recompute_mode

__all__ = ["Checkpointed", "apply_recompute"]


class Checkpointed(nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing; with a ``tracker``,
    the recomputation runs with the tracker's states of the forward (then the states
    current at backward time are put back), so forked dropouts redraw the same masks."""

    def __init__(self, body: nn.Module, tracker: RNGStatesTracker | None = None) -> None:
        super().__init__()
        self.body = body
        self.tracker = tracker

    def forward(self, *args):
        if self.tracker is None:
            return checkpoint(self.body, *args, use_reentrant=False)
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._rng_contexts)

    def _rng_contexts(self):
        """(forward context, recompute context); called by checkpoint when the forward starts.
        The recompute context can be entered more than once: a zero-bubble schedule's
        input-gradient and weight-gradient backwards each recompute the layer."""
        return contextlib.nullcontext(), _ForwardStates(self.tracker, self.tracker.get_states())


class _ForwardStates:
    """While entered, ``tracker`` holds the forward's ``states``; on exit the states current
    at entry are put back. Re-enterable, one entry at a time."""

    def __init__(self, tracker: RNGStatesTracker, states) -> None:
        self.tracker, self.states, self.current = tracker, states, None

    def __enter__(self) -> None:
        self.current = self.tracker.get_states()
        self.tracker.set_states(self.states)

    def __exit__(self, *exc) -> None:
        self.tracker.set_states(self.current)


def _extract(gm: fx.GraphModule, names: list[str]) -> tuple[fx.GraphModule, list[fx.Node], fx.Node]:
    """Move the nodes ``names`` (one layer, one output) into a sub-GraphModule whose inputs
    are what the layer reads from outside, in graph order: the previous layer's output and
    any side inputs (a captured model's causal mask, rotary cos/sin, batch size), which
    checkpoint keeps as they are (they are not the layer's activations)."""
    members = set(names)
    nodes = [n for n in gm.graph.nodes if n.name in members]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = sorted({a for n in nodes for a in n.all_input_nodes if a.name not in members},
                    key=order.__getitem__)
    last = nodes[-1]
    if any(n is not last for n in nodes for u in n.users if u.name not in members):
        raise NotImplementedError(f"full recompute needs a layer with one output ({last.name})")
    sub = fx.Graph()
    env = {a: sub.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[last])
    return fx.GraphModule(gm, sub, class_name="RecomputedLayer"), inputs, last


def apply_recompute(gm: fx.GraphModule, layer_nodes: list[list[str]], recompute: list[str], *,
                    tracker: RNGStatesTracker | None = None) -> None:
    """Apply each layer's recompute mode in place: the pass its record names
    (:data:`RUNNERS`). ``layer_nodes[l]``: node names of layer l in ``gm`` (after the TP
    pass, inserted collectives included). ``tracker``: the program's RNG tracker when
    dropouts fork it (their masks are then redrawn equal). ValueError for an unknown mode."""
    for layer, (names, mode) in enumerate(zip(layer_nodes, recompute)):
        RUNNERS[recompute_mode(mode).runner](gm, names, layer, tracker)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def keep_layer(gm: fx.GraphModule, names: list[str], layer: int,
               tracker: RNGStatesTracker | None) -> None:
    """Recompute nothing: autograd keeps every tensor the layer saves."""


def checkpoint_layer(gm: fx.GraphModule, names: list[str], layer: int,
                     tracker: RNGStatesTracker | None) -> None:
    """Move the layer's nodes into a sub-GraphModule run through checkpoint (module
    docstring, ``full``)."""
    body, inputs, last = _extract(gm, names)
    gm.add_submodule(f"recompute_layer_{layer}", Checkpointed(body, tracker))
    with gm.graph.inserting_after(last):
        new = gm.graph.call_module(f"recompute_layer_{layer}", tuple(inputs))
    new.meta.update({k: v for k, v in last.meta.items() if k.startswith("autopar")})
    last.replace_all_uses_with(new)
    for n in reversed([n for n in gm.graph.nodes if n.name in set(names)]):
        gm.graph.erase_node(n)


def checkpoint_attention_core(gm: fx.GraphModule, names: list[str], layer: int,
                              tracker: RNGStatesTracker | None) -> None:
    """Checkpoint each attention core: a plain scaled_dot_product_attention call, or the
    dropout pass's ``ForkedRNG(AttentionCore)`` module."""
    for n in [n for n in gm.graph.nodes if n.name in set(names)]:
        target = f"recompute_attention_{layer}_{n.name}"
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            core, tensors = attention_core(n)
            gm.add_submodule(target, Checkpointed(core, tracker))
            n.op, n.target, n.args, n.kwargs = "call_module", target, tensors, {}
        elif n.op == "call_module" and _is_core_module(gm.get_submodule(n.target)):
            gm.add_submodule(target, Checkpointed(gm.get_submodule(n.target), tracker))
            n.target = target


def _is_core_module(module: nn.Module) -> bool:
    """The dropout pass's ``ForkedRNG(AttentionCore)`` or the CP pass's attention."""
    return (isinstance(module, ForkedRNG) and isinstance(module.body, AttentionCore)
            or isinstance(module, ContextParallelAttention))


RUNNERS = {f.__name__: f for f in (keep_layer, checkpoint_layer, checkpoint_attention_core)}
"""The per-layer passes, by the name a recompute record's ``runner`` gives."""
