"""A transformers experts module as one ``call_module`` node of the captured graph.

``transformers`` 5.x runs the routed experts of most mixture-of-experts families through one
module class per family, built by ``transformers.integrations.moe.use_experts_implementation``
(MixtralExperts, Qwen3MoeExperts, OlmoeExperts, DeepseekV3NaiveMoe's experts, GptOssExperts,
...): ``forward(hidden_states (T, h), top_k_index (T, k), top_k_weights (T, k)) -> (T, h)``
over stacked expert weights (E, ...). Export records its body op by op (the sort by expert,
the gathers, two grouped matmuls, the gate, the weighted sum); :func:`collapse_experts`
puts back one call of the module in their place, so that

* expert parallelism can swap the module for its sharded form
  (:class:`autopar.runtime.expert_parallel.ExpertParallelExperts`) the way tensor
  parallelism shards a Linear, and checkpoints keep the experts under their own names;
* the runtime runs the family's own experts code (its configured implementation), the code
  verify's single-device reference runs.

The node keeps the price of the ops it replaces (:func:`experts_price`, read by
:func:`autopar.graph.annotate.annotate` from ``node.meta["experts"]``): their GEMMs, FLOPs,
the activations they keep for backward and the memory traffic of the rest; and, in
``extra["experts"]``, E, h, F, gated (:func:`experts_shape`), k and the T·k routed rows
per sequence, what expert parallelism prices.

A region is collapsed only when it is a clean call: its ops read exactly three tensors from
outside (one integer tensor, the routing, and the two floating ones, told apart by shape)
and one of its ops is read outside. Otherwise its ops stay (priced and replicated as ops;
no expert parallelism for that block).
"""

from __future__ import annotations

import math

import torch.fx as fx
import torch.nn as nn

from autopar.graph.annotate import NodeInfo, module_paths, saves_inputs
from autopar.graph.normalize import set_module, resolve

__all__ = ["EXPERTS_INTERFACE", "is_experts_module", "collapse_experts", "experts_price",
           "experts_shape"]

EXPERTS_INTERFACE = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
"""Attributes ``use_experts_implementation`` gives an experts class (transformers 5.24)."""

_PASSIVE = ("view", "transpose", "input", "output", "nontensor", "param")


def is_experts_module(module: nn.Module | None) -> bool:
    """Is ``module`` a transformers experts module (:data:`EXPERTS_INTERFACE`) with stacked
    expert weights (``num_experts`` and a ``down_proj`` of 3 dims)?"""
    return (module is not None and all(hasattr(module, a) for a in EXPERTS_INTERFACE)
            and isinstance(getattr(module, "num_experts", None), int)
            and getattr(getattr(module, "down_proj", None), "dim", lambda: 0)() == 3)


def experts_shape(module: nn.Module) -> dict:
    """(E, h, F, gated) of an experts module as a dict ``num_experts``, ``hidden_size``,
    ``expert_ffn``, ``gated``: from ``down_proj`` (E, h, F), or (E, F, h) when the module's
    weights are stored transposed (``is_transposed``), and ``has_gate``."""
    E, a, b = module.down_proj.shape
    h, F = (b, a) if module.is_transposed else (a, b)
    return {"num_experts": E, "hidden_size": h, "expert_ffn": F, "gated": bool(module.has_gate)}


def experts_price(region: list[fx.Node], nodes: dict[str, NodeInfo]) -> dict:
    """What the ops ``region`` (one experts call, graph order) cost, for the node that
    replaces them: ``flops`` (their GEMMs': the grouped matmuls, balanced routing assumed,
    :func:`autopar.graph.ops.gemm_shapes`), ``gemms`` / ``gemm_folded`` / ``gemm_weights``
    (for :func:`autopar.planner.costs.matmul_cost.gemm_times_s`) and ``inner`` = (saved
    elements: the activations their backward keeps, a tensor read from outside counted when
    an op inside keeps it; moved elements: inputs and outputs of the ops that are not GEMMs,
    priced memory-bound; ops: how many dispatch), for one sequence."""
    names = {n.name for n in region}
    gemms, flops, saved, moved, ops = [], 0.0, 0, 0, 0
    outside_saved: set[str] = set()
    for node in region:
        info = nodes[node.name]
        if info.kind in _PASSIVE:
            continue
        ops += 1
        if info.extra.get("gemms"):
            gemms.extend(info.extra["gemms"])
            flops += info.flops
        else:
            moved += info.numel + sum(nodes[a.name].numel for a in node.all_input_nodes)
        saved += info.mask_elems
        if node.users and all(u.name in names for u in node.users):
            saved += info.saved_elems
        if saves_inputs(info):
            outside_saved |= {a.name for a in node.all_input_nodes if a.name not in names
                              and not nodes[a.name].extra.get("param_read")}
    saved += sum(nodes[n].numel for n in outside_saved)
    return {"flops": flops, "gemms": tuple(gemms), "gemm_folded": True,
            "gemm_weights": bool(gemms), "inner": (saved, moved, ops)}


def _regions(gm: fx.GraphModule, model: nn.Module) -> dict[str, list[fx.Node]]:
    """Experts module path -> its ops in graph order (every node whose module stack holds
    the path)."""
    regions: dict[str, list[fx.Node]] = {}
    known: dict[str, bool] = {}
    for node in gm.graph.nodes:
        for path in module_paths(node):
            if path not in known:
                known[path] = is_experts_module(resolve(model, path))
            if known[path]:
                regions.setdefault(path, []).append(node)
                break
    return regions


def _call_args(region: list[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(hidden_states, top_k_index, top_k_weights) the region reads from outside, or None
    when it reads other tensors or they cannot be told apart."""
    inside = set(region)
    outside = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                 if a not in inside))
    tensors = [a for a in outside if hasattr(a.meta.get("tensor_meta"), "shape")]
    if len(tensors) != 3:
        return None
    ints = [a for a in tensors if not a.meta["tensor_meta"].dtype.is_floating_point]
    if len(ints) != 1:
        return None
    index = ints[0]
    k_shape = tuple(index.meta["tensor_meta"].shape)
    floats = [a for a in tensors if a is not index]
    weights = [a for a in floats if tuple(a.meta["tensor_meta"].shape) == k_shape]
    if len(weights) != 1:
        return None
    hidden = next(a for a in floats if a is not weights[0])
    return hidden, index, weights[0]


def collapse_experts(gm: fx.GraphModule, model: nn.Module, nodes: dict[str, NodeInfo]
                     ) -> dict[str, str]:
    """Replace each experts module's ops in ``gm`` (annotated as ``nodes``) by one
    ``call_module`` of the module (``model``'s, at its own path) on (hidden_states,
    top_k_index, top_k_weights), carrying :func:`experts_price` in ``meta["experts"]``.
    Returns {new node name: name of the op whose output it replaces} (the caller
    annotates ``gm`` again); {} when there is nothing to collapse."""
    replaced: dict[str, str] = {}
    graph = gm.graph
    for path, region in _regions(gm, model).items():
        args = _call_args(region)
        inside = set(region)
        results = [n for n in region if any(u not in inside for u in n.users)]
        if args is None or len(results) != 1:
            continue
        result = results[0]
        index = args[1].meta["tensor_meta"].shape  # (T, k)
        price = {**experts_price(region, nodes), "experts": {
            **experts_shape(resolve(model, path)), "top_k": index[-1], "rows": math.prod(index)}}
        set_module(gm, path, resolve(model, path))
        with graph.inserting_before(result):
            call = graph.create_node("call_module", path, args, {},
                                     name=path.replace(".", "_"))
        call.meta.update(result.meta)
        call.meta["experts"] = price
        result.replace_all_uses_with(call)
        for node in reversed(region):
            graph.erase_node(node)
        replaced[call.name] = result.name
    if replaced:
        graph.lint()
        gm.recompile()
    return replaced
