"""Rewrite pass 1b of :func:`autopar.rewrite.apply_plan`: context parallelism (the record:
:mod:`autopar.techniques.context_parallel`).

Under context parallelism of degree c each rank runs s/c tokens of every sequence, chunks
i and 2c−1−i (:func:`~autopar.runtime.context_parallel.shard_sequence`), so the rank's
program is the model's graph traced at s/c tokens (every view and reshape then has the
local length) with two kinds of nodes changed, in place so that their names (the plan's)
stay:

* each causal ``scaled_dot_product_attention`` becomes a call of
  :class:`ContextParallelAttention` over the CP group (the keys and values all-gathered,
  each local query chunk attending the keys up to its own last token). A call counts as
  causal with ``is_causal=True`` and no mask, or with a mask the graph computes from
  constants alone that equals the lower-triangular one (Hugging Face models build it from
  ``arange`` nodes): the pass evaluates it. The mask's nodes are then removed.
  Attention with dropout, or with any other mask (padding, sliding window, document
  masks), is refused by name: its mask would have to follow the chunks. Keys and values
  that Hugging Face's ``repeat_kv`` expanded for grouped-query attention are taken before
  the expansion (:func:`~autopar.graph.attention.unrepeated_kv`, SDPA's ``enable_gqa``): the CP group gathers the
  h_kv heads, as Megatron-Core and Llama 3 do, not their g-fold repeats.
* each ``arange(0, n)`` over the n = s/c local tokens (the token positions a learned or
  rotary position embedding reads, e.g. Hugging Face's ``cache_position``) becomes this
  rank's global positions (:func:`~autopar.techniques.context_parallel.local_positions`).

After tensor parallelism (pass 1), whose placements name the attention nodes as traced;
before the dropout pass and recompute, which checkpoints :class:`ContextParallelAttention`
as the attention core under selective recompute (the recomputation gathers K and V again).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.attention import unrepeated_kv
from autopar.graph.ops import SDPA_ARGS
from autopar.runtime.context_parallel import context_parallel_attention
from autopar.runtime.tp_ops import Group
from autopar.techniques.context_parallel import cp_problem, local_positions

__all__ = ["ContextParallelAttention", "apply_context_parallel", "cp_positions"]

_ARANGES = {torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start}
_SIZES = {torch.ops.aten.sym_size.int}


class ContextParallelAttention(nn.Module):
    """Causal attention of this CP rank's queries over the whole sequence (a module, so that
    selective recompute can checkpoint it): q (b, h, s/c, d), k, v (b, h_kv, s/c, d) ->
    (b, h, s/c, d) (:func:`~autopar.runtime.context_parallel.context_parallel_attention`).
    ``kwargs``: the call's ``scale`` and ``enable_gqa``."""

    def __init__(self, group: Group, kwargs: dict) -> None:
        super().__init__()
        self.group, self.kwargs = group, dict(kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.kwargs.items())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.group, **self.kwargs)


def cp_positions(length, start: int = 0, *, cp: int, cp_rank: int, dtype=None,
                 device=None) -> torch.Tensor:
    """The ``length`` = s/c global positions of CP rank ``cp_rank``'s tokens, from ``start``
    (what ``arange(start, start + length)`` gives without context parallelism)."""
    positions = local_positions(int(length) * cp, cp, cp_rank)
    return torch.tensor(positions, dtype=dtype or torch.int64, device=device) + start


def apply_context_parallel(gm: fx.GraphModule, *, cp: int, cp_rank: int, group: Group,
                           local_seq_len: int) -> list[str]:
    """Rewrite ``gm`` (traced at ``local_seq_len`` = s/c tokens) in place into CP rank
    ``cp_rank``'s program (module docstring); nothing at cp = 1. Returns the names of the
    attention nodes made context-parallel.

    Raises:
        ValueError: an attention with dropout (:func:`cp_problem`).
        NotImplementedError: an attention whose mask is not causal, or that the pass cannot
            read (a computed scale), naming the node.
    """
    if cp == 1:
        return []
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            kwargs = {**dict(zip(SDPA_ARGS, node.args[3:])), **node.kwargs}
            problem = cp_problem(cp, attention_dropout=kwargs.get("dropout_p") or 0.0)
            if problem:
                raise ValueError(f"{node.name}: {problem}")
            mask = kwargs.pop("attn_mask", None)
            causal = kwargs.pop("is_causal", False)
            if mask is None and not causal or mask is not None and causal:
                raise NotImplementedError(f"{node.name}: context parallelism runs causal "
                                          "attention only (is_causal=True, or a causal mask)")
            if mask is not None:
                _check_causal(gm, node, mask, local_seq_len)
            kwargs.pop("dropout_p", None)
            computed = [k for k, v in kwargs.items() if isinstance(v, fx.Node)]
            if computed:
                raise NotImplementedError(f"{node.name}: argument(s) {computed} are computed "
                                          "in the graph; context parallelism needs constants")
            q, k, v = node.args[:3]
            groups = unrepeated_kv(k, v)  # gather the h_kv heads, not their repeats
            if groups is not None:
                kwargs["enable_gqa"] = True
            target = f"cp_attention_{node.name}"
            gm.add_submodule(target, ContextParallelAttention(group, kwargs))
            node.op, node.target, node.kwargs = "call_module", target, {}
            node.args = (q, *groups) if groups is not None else (q, k, v)
            for repeated in (k, v) if groups is not None else ():
                _erase_unused(gm, repeated)
            if isinstance(mask, fx.Node):
                _erase_unused(gm, mask)
            done.append(node.name)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ARANGES and \
                _is_positions(node, local_seq_len):
            length, start = _arange_bounds(node)
            node.target = cp_positions
            node.args = (length,) if start == 0 else (length, start)
            node.kwargs = {"cp": cp, "cp_rank": cp_rank, "dtype": node.kwargs.get("dtype"),
                           "device": node.kwargs.get("device")}
    gm.graph.lint()
    gm.recompile()
    return done


def _arange_bounds(node: fx.Node) -> tuple:
    """(length, start) of an ``arange`` call: arange(end) or arange(start, end)."""
    if len(node.args) == 1:
        return node.args[0], 0
    return node.args[1] if node.args[0] == 0 else None, node.args[0]


def _is_positions(node: fx.Node, local_seq_len: int) -> bool:
    """Whether an ``arange`` node counts the local tokens from 0: its end is s/c (an int,
    as torch.export writes it) or the input's size along the sequence (``x.size(1)``)."""
    if len(node.args) > 2 or node.kwargs.get("step", 1) != 1 or not node.users:
        return False
    length, start = _arange_bounds(node)
    if start != 0:
        return False
    if isinstance(length, int) and not isinstance(length, bool):
        return length == local_seq_len
    if not isinstance(length, fx.Node):
        return False
    source = length.args[0] if length.args else None
    dim = length.args[1] if len(length.args) > 1 else None
    sized = (length.op == "call_method" and length.target == "size"
             or length.op == "call_function" and length.target in _SIZES)
    return sized and dim == 1 and isinstance(source, fx.Node) and source.op == "placeholder"


def _check_causal(gm: fx.GraphModule, node: fx.Node, mask, n: int) -> None:
    """Evaluate ``mask`` (a node: its graph from constants, the input a zero (1, n) batch) and
    check that it is the causal mask of n tokens; NotImplementedError otherwise."""
    refuse = (f"{node.name}: context parallelism runs causal attention only; its mask "
              f"({getattr(mask, 'name', 'a constant')}) is not the causal one")
    try:
        value = _evaluate(gm, mask, n) if isinstance(mask, fx.Node) else torch.as_tensor(mask)
    except Exception as exc:  # a mask reading the weights or the data: not a constant one
        raise NotImplementedError(f"{refuse} or cannot be evaluated from constants ({exc})"
                                  ) from None
    allowed = value if value.dtype == torch.bool else value == 0
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if allowed.shape[-2:] != (n, n) or not bool((allowed == causal).all()):
        raise NotImplementedError(refuse)


def _evaluate(gm: fx.GraphModule, target: fx.Node, n: int) -> torch.Tensor:
    """The value of ``target`` computed from its ancestors alone on the CPU (a graph traced
    on the meta device names it in its calls), the input ids a (1, n) zero tensor; raises
    when an ancestor is a parameter on the meta device."""
    need = {target}
    for node in reversed(list(gm.graph.nodes)):
        if node in need:
            need.update(node.all_input_nodes)
    interpreter, env, cpu = fx.Interpreter(gm), {}, torch.device("cpu")
    for node in gm.graph.nodes:
        if node not in need:
            continue
        if node.op == "placeholder":
            env[node] = torch.zeros(1, n, dtype=torch.int64)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        args = tuple(cpu if isinstance(a, torch.device) else a for a in args)
        kwargs = {k: cpu if isinstance(a, torch.device) else a for k, a in kwargs.items()}
        env[node] = getattr(interpreter, node.op)(node.target, args, kwargs)
        if isinstance(env[node], torch.Tensor) and env[node].is_meta:
            raise ValueError(f"{node.name} is on the meta device")
    return env[target]


def _erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and, transitively, the ancestors it alone used (the attention mask's
    construction), stopping at placeholders and at nodes others still use."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op in ("placeholder", "output"):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
