"""Mixture-of-experts layers of a captured model: router, routed experts, shared experts.

A MoE layer (Shazeer et al. 2017; Fedus et al. 2022, "Switch Transformers", section 2) scores
each token against E experts with a router (a (h, E) projection), keeps the top k scores
(softmax or sigmoid, before or after the top-k), and sums the k chosen experts' MLPs weighted
by those scores; some families add shared experts that every token runs (DeepSeekMoE, Dai et
al. 2024, section 3.2). In an exported graph the routed experts are stacked weights of shape
(E, ...) run by one of:

* a grouped matmul (:data:`autopar.graph.ops.GROUPED_MMS`): the token-expert pairs sorted by
  expert, T·k rows, one GEMM per expert (transformers' default ``grouped_mm`` experts and
  autopar's static forms of JetMoE and LongCat-Flash, :mod:`autopar.graph.expert_loops`);
* a batched matmul over all E experts (``bmm`` with a 3-D parameter operand): Llama 4's
  experts run every token through every expert, E/k times the FLOPs of the sparse layer,
  priced as written.

:func:`moe_blocks` finds them from the graph alone (no family table): the expert GEMMs
are the matmuls whose weight operand is a 3-D parameter; the block is their parent module;
the router is the block's matmul with E outputs; the shared experts are the block's
Linears that no expert GEMM depends on (a branch beside the routed experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from cost_models.moe import moe_expert_flops

from autopar.graph.annotate import TracedModel, module_paths
from autopar.graph.experts import experts_shape
from autopar.graph.layer_groups import module_layers
from autopar.graph.ops import is_grouped_mm, is_parameter_read, qualified_name

__all__ = ["MoEBlock", "moe_blocks", "check_router_losses", "ROUTER_LOSS_COEFFICIENTS"]


@dataclass(frozen=True)
class MoEBlock:
    """One mixture-of-experts layer of a :class:`~autopar.graph.annotate.TracedModel`.

    layer: transformer layer index (of the model's layers, not of the groups a planner
    solves when layers differ, :mod:`autopar.graph.layer_groups`); module: the block's module path ("model.layers.0.mlp");
    router: node name of the router's projection, (tokens, h) -> (tokens, E);
    score_function: "softmax" or "sigmoid", the first of them after the router ("" when
    the router's scores reach the top-k through neither, e.g. Phi-MoE's sparse mixer);
    num_experts: E; top_k: experts per token (the top-k's k, or the grouped matmul's rows
    per token when the routing has no top-k op); hidden_size: h; expert_ffn: the expert
    MLP's inner width F (the contraction of its last GEMM); experts: the expert GEMM nodes
    in graph order; form: "grouped_mm" (k rows per token) or "bmm" (every token through
    every expert); shared: the shared experts' Linear nodes (with a shared expert's gate),
    the block's Linears that the routed experts do not read;
    tokens: router rows for one sequence (s); gated: the expert MLP is gated (SwiGLU: its
    first GEMM is 2F wide, gate and up fused, or three GEMMs, DBRX's w1, v1 and w2);
    experts_module: the module path when the routed experts are one call of a transformers
    experts module (:mod:`autopar.graph.experts`; ``experts`` is then that call's node),
    which expert parallelism can shard; "" when they are ops of the graph.
    """

    layer: int
    module: str
    router: str
    score_function: str
    num_experts: int
    top_k: int
    hidden_size: int
    expert_ffn: int
    experts: tuple[str, ...]
    form: str
    shared: tuple[str, ...]
    tokens: int
    gated: bool
    experts_module: str = ""

    def routed_flops(self) -> float:
        """Forward FLOPs of the routed experts per sequence as the layer computes them
        (:func:`cost_models.moe.moe_expert_flops`: 6·s·k·h·F for a gated MLP; Llama 4's
        all-expert form runs s·E rows instead of s·k)."""
        copies = self.top_k if self.form == "grouped_mm" else self.num_experts
        return moe_expert_flops(self.tokens, copies, self.hidden_size, self.expert_ffn,
                                self.gated)


ROUTER_LOSS_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef", "moe_aux_loss_coef",
                            "router_z_loss_coef", "moe_loss_weight")
"""Config fields (transformers 5.24) that weight a router loss added to the language-model
loss when ``output_router_logits`` is on: the load-balancing loss of Fedus et al. 2022
(eq. 4; Mixtral, Qwen-MoE, OLMoE, DBRX's ``ffn_config.moe_loss_weight``) and the router
z-loss (Zoph et al. 2022, ST-MoE, eq. 5)."""


def check_router_losses(model) -> None:
    """Raise ValueError when ``model`` (a transformers MoE model) adds a router loss to its
    cross-entropy: its config has ``output_router_logits=True`` (weighted by the fields of
    :data:`ROUTER_LOSS_COEFFICIENTS` it has). autopar's program trains the cross-entropy of
    the logits; the router loss would be dropped, and training would silently differ from
    the model's own. The message names the weights and the fix."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return
    holders = [config, getattr(config, "ffn_config", None)]
    weights = {key: getattr(c, key) for c in holders if c is not None
               for key in ROUTER_LOSS_COEFFICIENTS if getattr(c, key, None) is not None}
    named = ", ".join(f"{k}={v}" for k, v in weights.items()) or "an unnamed weight"
    raise ValueError(
        f"{type(model).__name__}'s config sets output_router_logits=True, so its forward adds "
        f"a router loss ({named}) to the cross-entropy; autopar's program trains the "
        "cross-entropy of the logits only and would drop it; fix: set "
        "config.output_router_logits=False to train without it")


def _module_path(node: fx.Node) -> str:
    """The innermost module path export recorded for ``node`` ("" if none)."""
    paths = module_paths(node)
    return paths[-1] if paths else ""


def _block_path(node: fx.Node) -> str:
    """The MoE block of an expert GEMM: the module that calls the experts module the GEMM
    runs in (Mixtral's ``mlp`` around ``mlp.experts``; JetMoE's ``mlp`` around
    ``mlp.input_linear`` and ``mlp.output_linear``)."""
    if node.op == "call_module":  # the experts module itself: its caller is the block
        return str(node.target).rpartition(".")[0]
    paths = module_paths(node)
    return paths[-2] if len(paths) >= 2 else paths[-1].rsplit(".", 1)[0] if paths else ""


def _shape(node) -> tuple[int, ...]:
    meta = getattr(node, "meta", {}).get("tensor_meta")
    return tuple(meta.shape) if hasattr(meta, "shape") else ()


def _expert_weight(node: fx.Node, traced: TracedModel) -> tuple[int, ...] | None:
    """The (E, in, out) shape of an expert GEMM's stacked weight operand, else None."""
    if node.op == "call_module" and "experts" in node.meta:  # one experts module call
        shape = experts_shape(traced.gm.get_submodule(node.target))
        E, h, F = shape["num_experts"], shape["hidden_size"], shape["expert_ffn"]
        return [(E, h, 2 * F if shape["gated"] else F), (E, F, h)]
    if len(node.args) < 2 or not hasattr(node.args[1], "op"):
        return None
    grouped = is_grouped_mm(node)
    bmm = traced.nodes[node.name].kind == "matmul" and qualified_name(node.target) == "aten::bmm"
    weight = _shape(node.args[1])
    if (grouped or bmm) and len(weight) == 3 and is_parameter_read(node.args[1]):
        return weight
    return None


def _downstream(start: fx.Node, members: set[str]):
    """Nodes reachable from ``start`` through users inside ``members``, breadth first."""
    frontier, seen = list(start.users), set()
    while frontier:
        node = frontier.pop(0)
        if node.name in seen or node.name not in members:
            continue
        seen.add(node.name)
        yield node
        frontier.extend(node.users)


def _upstream(starts: list[fx.Node], members: set[str]) -> set[str]:
    """Names of the nodes inside ``members`` that ``starts`` depend on."""
    frontier, seen = [a for n in starts for a in n.all_input_nodes], set()
    while frontier:
        node = frontier.pop()
        if node.name not in seen and node.name in members:
            seen.add(node.name)
            frontier.extend(node.all_input_nodes)
    return seen


def _block(traced: TracedModel, layer: int, names: list[str], experts: list, by_name
           ) -> MoEBlock | None:
    """The block of expert GEMMs ``experts`` ((node, weight shape), one parent module) in
    layer ``layer`` (node ``names``), or None without a router."""
    num_experts = experts[0][1][0]
    module = _block_path(experts[0][0])
    members = set(names)
    inside = [by_name[n] for n in names if _module_path(by_name[n]).startswith(module + ".")
              or _module_path(by_name[n]) == module]
    routers = [n for n in inside if traced.nodes[n.name].extra.get("gemms")
               and traced.nodes[n.name].kind in ("linear", "other")
               and _expert_weight(n, traced) is None and _shape(n)[-1:] == (num_experts,)]
    if not routers:
        return None
    router = routers[0]
    tokens = math.prod(_shape(router)[:-1])
    after = list(_downstream(router, members))
    scores = next((op for n in after if (op := qualified_name(n.target).split("::")[-1])
                   in ("softmax", "_softmax", "sigmoid")), "").lstrip("_")
    topks = [n for n in after if qualified_name(n.target) == "aten::topk"
             and _shape(n.args[0])[-1:] == (num_experts,)]
    first, last = experts[0], experts[-1]
    call = first[0].op == "call_module"  # an experts module (autopar.graph.experts)
    form = "grouped_mm" if is_grouped_mm(first[0]) or call else "bmm"
    if topks:
        top_k = int(topks[-1].args[1])
    elif call:  # top_k_index (T, k)
        top_k = _shape(first[0].args[1])[-1]
    else:  # no top-k op (a sparse mixer's max): the grouped matmul has k rows per token
        top_k = _shape(first[0].args[0])[0] // tokens
    feeding = _upstream([n for n, _ in experts], members)  # the router, q/k/v of MoA ...
    shared = tuple(n.name for n in inside if traced.nodes[n.name].kind == "linear"
                   and n.name not in feeding)
    return MoEBlock(layer=layer, module=module, router=router.name, score_function=scores,
                    num_experts=num_experts, top_k=top_k, hidden_size=_shape(router.args[0])[-1],
                    expert_ffn=last[1][1], form=form, shared=shared, tokens=tokens,
                    experts=tuple(dict.fromkeys(n.name for n, _ in experts)),
                    gated=len(experts) == 3 or first[1][2] == 2 * last[1][1],
                    experts_module=str(first[0].target) if call else "")


def moe_blocks(traced: TracedModel) -> list[MoEBlock]:
    """The MoE blocks of ``traced``'s transformer layers in layer order (the leading and
    trailing layers a grouping puts in pre and post included), one per experts module (a dense
    layer has none; JetMoE's layers have two: its mixture of attention heads and of MLPs). A layer whose expert GEMMs have no router with E outputs in their
    block is not reported (its experts are priced as the ops they are, replicated)."""
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    found = []
    for layer, names in enumerate(module_layers(traced)):
        groups: dict[str, list] = {}  # expert GEMMs by their block
        for name in names:
            weight = _expert_weight(by_name[name], traced)
            for w in weight if isinstance(weight, list) else [weight] * (weight is not None):
                groups.setdefault(_block_path(by_name[name]), []).append((by_name[name], w))
        for experts in groups.values():
            block = _block(traced, layer, names, experts, by_name)
            if block is not None:
                found.append(block)
    return found
