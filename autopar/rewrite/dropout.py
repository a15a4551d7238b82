"""Rewrite pass 2 of :func:`autopar.rewrite.apply_plan`: dropout on the right RNG stream.

A dropout's random mask must be the same on every TP rank when its tensor is
replicated (placement R) and different on every TP rank when the tensor is sharded
(placement S<d>: the attention core on whole heads, or a residual/LayerNorm/dropout
region split along the sequence under sequence parallelism). Megatron-LM gets this by
running the sharded dropouts inside ``get_cuda_rng_tracker().fork()`` (Shoeybi et al.
2019, section 3; Korthikanti et al. 2022, section 4.2.2); see :mod:`autopar.runtime.rng`.

This pass reads each dropout node's placement from the plan (the output placement of
its strategy key ``"<name>:<placement>"``, see :mod:`autopar.contract.placement`)
and wraps every dropout on a sharded tensor in a :class:`ForkedRNG` module that runs it
inside ``tracker.fork("tensor-parallel")``. Dropouts on replicated tensors stay as they
are, on the default stream, which is seeded identically across the TP group. The ops:

* ``nn.Dropout`` modules (``call_module``) with p > 0;
* ``F.dropout`` calls with p > 0;
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (fx tracing bakes
  ``dropout_p`` as a constant from ``self.training`` at trace time), made a call of
  :class:`AttentionCore` so that selective recompute can checkpoint the same module.

In ``print(gm.code)`` a forked dropout reads ``tp_rng_<node> = self.tp_rng_<node>(x)``.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.ops import SDPA_ARGS
from autopar.runtime.rng import TENSOR_PARALLEL, RNGStatesTracker
from autopar.contract.placement import parse_strategy_key

__all__ = ["AttentionCore", "ForkedRNG", "apply_dropout_rng", "attention_core"]

_DROPOUT_ARGS = ("p", "training", "inplace")  # after input


class AttentionCore(nn.Module):
    """``scaled_dot_product_attention(q, k, v, [attn_mask], **kwargs)`` as a module: q, k, v
    (b, nh, s, hd), an optional mask broadcastable to (b, nh, s, s) -> (b, nh, s, hd). A
    module so that it can be forked or checkpointed."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = dict(kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.kwargs.items())

    def forward(self, q, k, v, attn_mask=None):
        if attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, **self.kwargs)
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def attention_core(node: fx.Node) -> tuple[AttentionCore, tuple]:
    """An ``F.scaled_dot_product_attention`` call node as (AttentionCore, its tensor
    arguments q, k, v and the mask when the graph computes one). Raises
    NotImplementedError when another argument is computed in the graph."""
    kwargs = dict(zip(SDPA_ARGS, node.args[3:]))
    kwargs.update(node.kwargs)
    mask = kwargs.pop("attn_mask", None)
    if not isinstance(mask, fx.Node):
        if mask is not None:
            kwargs["attn_mask"] = mask
        mask = None
    computed = [k for k, v in kwargs.items() if isinstance(v, fx.Node)]
    if computed:
        raise NotImplementedError(f"{node.name}: argument(s) {computed} are computed in the "
                                  "graph; autopar needs them to be constants")
    return AttentionCore(kwargs), tuple(node.args[:3]) + ((mask,) if mask is not None else ())


class FunctionalDropout(nn.Module):
    """``F.dropout(x, **kwargs)`` as a module (the traced call's constant arguments)."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = dict(kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.kwargs.items())

    def forward(self, x):
        return F.dropout(x, **self.kwargs)


class ForkedRNG(nn.Module):
    """Runs ``body`` with the tracker's ``stream`` as the default generator: the
    random draws inside differ per TP rank (Megatron: ``with get_cuda_rng_tracker().fork()``)."""

    def __init__(self, body: nn.Module, tracker: RNGStatesTracker, stream: str = TENSOR_PARALLEL) -> None:
        super().__init__()
        self.body = body
        self.tracker = tracker  # shared with every other ForkedRNG of the program
        self.stream = stream

    def extra_repr(self) -> str:
        return f"stream={self.stream!r}"

    def forward(self, *args):
        with self.tracker.fork(self.stream):
            return self.body(*args)


def _const_kwargs(node: fx.Node, n_tensors: int, names: tuple[str, ...]) -> dict:
    """The call's non-tensor arguments by name (positional ones after the first
    ``n_tensors`` included). Raises NotImplementedError if one of them is a graph value."""
    kwargs = dict(zip(names, node.args[n_tensors:]))
    kwargs.update(node.kwargs)
    computed = [k for k, v in kwargs.items() if isinstance(v, fx.Node)]
    if computed:
        raise NotImplementedError(f"{node.name}: argument(s) {computed} are computed in the graph; "
                                  "the dropout pass needs them to be constants")
    return kwargs


def _dropout_body(gm: fx.GraphModule, node: fx.Node) -> tuple[nn.Module, tuple] | None:
    """(module doing the node's work, its tensor arguments) if ``node`` draws random
    numbers, else None."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.Dropout) and mod.p > 0:
            return mod, node.args
    elif node.op == "call_function" and node.target is F.dropout:
        kwargs = _const_kwargs(node, 1, _DROPOUT_ARGS)
        if kwargs.get("p", 0.5) > 0 and kwargs.get("training", True):
            return FunctionalDropout(kwargs), node.args[:1]
    elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
        core, tensors = attention_core(node)
        if (core.kwargs.get("dropout_p") or 0.0) > 0:
            return core, tensors
    return None


def apply_dropout_rng(gm: fx.GraphModule, placements: dict[str, str],
                      tracker: RNGStatesTracker) -> list[str]:
    """Wrap, in place, every dropout whose plan placement is sharded in a
    :class:`ForkedRNG` on ``tracker``'s tensor-parallel stream (see the module doc).

    placements: the plan's node name -> strategy key (nodes the TP pass inserted have
        none and draw no random numbers). Returns the names of the wrapped nodes.
    """
    forked = []
    for node in list(gm.graph.nodes):
        if node.name not in placements or not parse_strategy_key(placements[node.name]).output.is_sharded:
            continue
        found = _dropout_body(gm, node)
        if found is None:
            continue
        body, tensors = found
        target = f"tp_rng_{node.name}"
        gm.add_submodule(target, ForkedRNG(body, tracker))
        node.op, node.target, node.args, node.kwargs = "call_module", target, tuple(tensors), {}
        forked.append(node.name)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return forked
