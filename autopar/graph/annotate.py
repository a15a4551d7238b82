"""Node roles, FLOPs, bytes and transformer-layer grouping of a traced model.

Everything here is for ONE sequence (b = 1); the cost adapter scales by micro-batch size.
Activation bytes assume 16-bit activations and 1-byte dropout masks, the accounting of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1): a tensor is counted once, when some consumer saves it for backward.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.attention import LSE_BYTES, annotate_attention
from autopar.graph.no_grad import mark_gradients
from autopar.graph.ops import (SAVES_INPUTS, aten_kind, gemm_shapes, is_conv1d, returns_tensors,
                               is_parameter_read, node_flops, packet)

__all__ = ["NodeInfo", "TracedModel", "annotate", "node_kind", "saves_inputs", "last_saver_index",
           "layer_of_nodes", "module_paths"]

ACTIVATION_BYTES = 2  # 16-bit activations
MASK_BYTES = 1        # dropout masks

# ops whose backward saves their tensor inputs (Korthikanti et al. 2022, section 4.1)
_SAVES_INPUT = {"linear", "layernorm", "gelu", "sdpa", "matmul"}
_ELEMENTWISE_FUNCS = {operator.add, operator.mul, operator.sub, operator.truediv, torch.add,
                      torch.mul, F.gelu, F.relu, torch.tanh, F.dropout}
_VIEW_METHODS = {"view", "reshape"}
_SHAPE_ONLY_METHODS = {"transpose", "permute", "contiguous"}


@dataclass
class NodeInfo:
    """Annotation of one fx node for one sequence.

    kind: "linear" | "embedding" | "layernorm" | "sdpa" | "gelu" | "dropout" | "add" |
        "view" | "transpose" | "contiguous" | "input" | "output" | "nontensor" | "other".
    shape: output shape (b = 1) or None when the output is not a tensor.
    numel: output elements; flops: forward FLOPs (2 per multiply-add; an op without a
        formula, kind "other" or several outputs, counts one per output element, except the
        matmuls kind "other" holds, a router's ``F.linear`` and a MoE layer's grouped
        matmuls: their GEMMs, :func:`autopar.graph.ops.gemm_shapes`).
    params: canonical parameter names (tied weights appear under their first name).
    param_numel: elements of those parameters.
    saved_elems: elements of this output saved for backward by its consumers.
    mask_elems: elements of this node's own dropout mask (1 byte each).
    core_elems / core_mask_elems: attention-core activations (softmax output and, with
        dropout, its output) and mask that selective recompute drops: with 16-bit
        activations 5·a·s² bytes for b = 1 (Korthikanti et al. 2022).
    flash_elems / lse_elems: what a fused (flash) attention kernel keeps instead of the
        core: its output, b·a·s·hd, and the fp32 log-sum-exp, b·a·s
        (:mod:`autopar.graph.attention`).
    per_sequence: the output grows with the batch (False for e.g. position embeddings).
    layer: transformer layer index or None; section: "pre" | "layer" | "post".
    no_grad: the op runs in a ``torch.no_grad()`` region of forward (its output reaches the
        rest through ``detach``, :mod:`autopar.graph.no_grad`): it has no backward,
        saves nothing for one and makes no gradient partial.
    carries_grad: the output gets a gradient in backward (a float tensor computed from a
        parameter outside a no_grad region; not the token ids, buffers and what only they
        feed, rotary cos/sin, masks, routing indices: :func:`~autopar.graph.no_grad.
        mark_gradients`), so collectives of its gradient run.
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None
    numel: int
    flops: float
    params: tuple[str, ...] = ()
    param_numel: int = 0
    saved_elems: int = 0
    mask_elems: int = 0
    core_elems: int = 0
    core_mask_elems: int = 0
    flash_elems: int = 0
    lse_elems: int = 0
    per_sequence: bool = True
    layer: int | None = None
    section: str = "pre"
    no_grad: bool = False
    carries_grad: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def model_matmul(self) -> bool:
        """Do this node's FLOPs count as the model's (MFU; Narayanan et al. 2021, eq. 3: the
        GEMMs of linears and attention)? Also a router's ``F.linear`` and a MoE layer's
        grouped expert matmuls (kind "other" with GEMMs: the k active experts' work)."""
        return self.kind in ("linear", "sdpa") or (self.kind == "other" and
                                                   bool(self.extra.get("gemms")))

    def saved_bytes_at(self, activation_bytes: int = ACTIVATION_BYTES) -> float:
        """Bytes saved for backward (attention core excluded) at ``activation_bytes`` per element."""
        return activation_bytes * self.saved_elems + MASK_BYTES * self.mask_elems

    def core_bytes_at(self, activation_bytes: int = ACTIVATION_BYTES, attention: str = "math",
                      tp: int = 1) -> float:
        """Attention-core bytes (dropped by selective recompute) for the "math" kernel
        (softmax kept) or the "flash" kernel (output + log-sum-exp kept; the output not
        again where a consumer keeps the same storage, which ``tp`` = 1 guarantees), and
        under context parallelism the gathered K and V beyond the local ones
        (``extra["cp_kv_elems"]``, :mod:`autopar.graph.context_parallel`)."""
        kv = activation_bytes * self.extra.get("cp_kv_elems", 0)  # context parallelism's
        if attention == "flash":
            aliased = tp == 1 and self.extra.get("flash_output_aliased", False)
            output = 0 if aliased else activation_bytes * self.flash_elems
            return output + LSE_BYTES * self.lse_elems + kv
        return activation_bytes * self.core_elems + MASK_BYTES * self.core_mask_elems + kv


@dataclass
class TracedModel:
    """A traced model: the fx graph plus per-node annotations for one sequence.

    gm: GraphModule over the original modules, output = logits (b, s, V).
    nodes: NodeInfo by node name, in graph order.
    layers: node names of each transformer layer, in order; pre / post: the rest.
    layer_prefix: module path of the layer list (e.g. "transformer.h").
    """

    gm: fx.GraphModule
    name: str
    seq_len: int
    nodes: dict[str, NodeInfo]
    layers: list[list[str]]
    pre: list[str]
    post: list[str]
    layer_prefix: str
    tied_params: dict[str, str]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def boundary_numel(self) -> int:
        """Elements (b = 1) of the activation that crosses a pipeline cut between layers."""
        return self.nodes[self.layers[0][-1]].numel

    @cached_property
    def tied_weight_groups(self) -> tuple[tuple[str, ...], ...]:
        """Groups of node names, in graph order, whose modules share a weight (e.g. wte and
        lm_head); computed once (a walk of every node; the planner asks for it per config)."""
        by_param: dict[str, list[str]] = {}
        for name, info in self.nodes.items():
            for p in info.params:
                if p.endswith("weight"):
                    by_param.setdefault(p, []).append(name)
        return tuple(tuple(names) for names in by_param.values() if len(names) > 1)

    def total_params(self) -> int:
        seen: set[str] = set()
        total = 0
        for info in self.nodes.values():
            for name in info.params:
                if name not in seen:
                    seen.add(name)
                    total += info.extra["param_sizes"][name]
        return total


def last_saver_index(nodes: dict[str, NodeInfo], names: list[str]) -> int:
    """Index in ``names`` (a layer, in graph order) of the last op that saves a tensor for
    backward. Non-reentrant ``torch.utils.checkpoint`` stops recomputing there ("early
    stop"), so under full recompute only ``names[: index + 1]`` and the collectives placed
    before that op run again in backward."""
    savers = [i for i, n in enumerate(names) if saves_inputs(nodes[n]) or nodes[n].mask_elems
              or nodes[n].extra.get("inner", (0,))[0]]  # an experts call keeps its own
    return max(savers, default=len(names) - 1)


def saves_inputs(info: NodeInfo) -> bool:
    """Does this op keep its tensor inputs for backward (never under ``no_grad``)?"""
    return not info.no_grad and (info.kind in _SAVES_INPUT or info.extra.get("saves_inputs", False))


def node_kind(node: fx.Node, gm: fx.GraphModule) -> str:
    """Classify an fx node into the op kinds strategies know about (aten ops of an
    exported graph: :func:`autopar.graph.ops.aten_kind`; a parameter or buffer read by
    ``get_attr``: "param")."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        return "nontensor"
    if node.op == "get_attr":
        return "param"
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if is_conv1d(mod):
            return "linear"
        for cls, kind in ((nn.Linear, "linear"), (nn.Embedding, "embedding"),
                          (nn.LayerNorm, "layernorm"), (nn.GELU, "gelu"), (nn.Dropout, "dropout")):
            if isinstance(mod, cls):
                return kind
        return "other"
    if node.op == "call_function" and packet(node.target) is not None:
        kind = aten_kind(node.target)
        tensors = [n for n in node.all_input_nodes if hasattr(n.meta.get("tensor_meta"), "shape")]
        if kind == "elementwise" and packet(node.target) is torch.ops.aten.add and len(tensors) == 2 \
                and all(tuple(n.meta["tensor_meta"].shape) == tuple(meta.shape) for n in tensors):
            return "add"
        return kind
    if node.op == "call_function":
        if node.target is F.scaled_dot_product_attention:
            return "sdpa"
        if node.target in (operator.add, torch.add):
            return "add"
        if node.target is F.gelu:
            return "gelu"
        return "elementwise" if node.target in _ELEMENTWISE_FUNCS else "other"
    if node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return "view"
        if node.target in ("transpose", "permute"):
            return "transpose"
        if node.target == "contiguous":
            return "contiguous"
    return "other"


def module_paths(node: fx.Node) -> list[str]:
    """The module paths export recorded for ``node`` (``nn_module_stack``), outermost first,
    ending with the module a ``call_module`` node calls."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else k for k, v in stack.items()]
    return paths + [str(node.target)] if node.op == "call_module" else paths


def _layer_of(node: fx.Node, prefix: str) -> int | None:
    for path in reversed(module_paths(node)):
        if path.startswith(prefix + "."):
            return int(path[len(prefix) + 1:].split(".")[0])
    return None


def layer_of_nodes(gm: fx.GraphModule) -> list[int | None]:
    """Per node of ``gm`` in graph order, the index of the transformer layer whose module
    it runs in (module paths ``P.<i>.…`` under the layer stack's prefix), or None."""
    prefix = _layer_prefix(gm)
    return [_layer_of(node, prefix) if prefix else None for node in gm.graph.nodes]


def _layer_prefix(gm: fx.GraphModule) -> str:
    """Module path of the stack of transformer layers: the prefix ``P`` for which module
    paths ``P.<i>.…`` have the most distinct indices ``i`` (e.g. "transformer.h")."""
    indices: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        parts = node.target.split(".")
        for k, part in enumerate(parts):
            if part.isdigit():
                indices.setdefault(".".join(parts[:k]), set()).add(part)
                break
    return max(indices, key=lambda k: len(indices[k]), default="")


def _params(node: fx.Node, gm: fx.GraphModule, canon: dict[int, str]) -> dict[str, int]:
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return {canon[id(obj)]: obj.numel()} if isinstance(obj, nn.Parameter) else {}
    if node.op != "call_module":
        return {}
    mod = gm.get_submodule(node.target)
    return {canon[id(p)]: p.numel() for p in mod.parameters(recurse=True)}


def annotate(gm: fx.GraphModule, *, seq_len: int, name: str,
             model: nn.Module | None = None) -> TracedModel:
    """Annotate every node of a shape-propagated ``gm`` (see :class:`NodeInfo`). A
    parameter shared by several modules (tied) is named by its first FQN in ``model``
    (the module ``gm`` was captured from; default ``gm``), as ``model.named_parameters()``
    and ``state_dict()`` name it."""
    canon: dict[int, str] = {}
    tied: dict[str, str] = {}
    for pname, p in (model or gm).named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), pname)
    for pname, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in canon and canon[id(p)] != pname:
            tied[pname] = canon[id(p)]
        canon.setdefault(id(p), pname)
    prefix = _layer_prefix(gm)
    nodes: dict[str, NodeInfo] = {}
    for node in gm.graph.nodes:
        kind = node_kind(node, gm)
        meta = node.meta.get("tensor_meta")
        shape = tuple(meta.shape) if kind not in ("nontensor", "output") and meta is not None \
            and hasattr(meta, "shape") else None
        numel = math.prod(shape) if shape is not None else 0
        params = _params(node, gm, canon)
        experts = node.meta.get("experts")  # one call of an experts module: its ops' price
        gemms = {k: v for k, v in experts.items() if k != "flops"} if experts else \
            gemm_shapes(node, kind, gm, numel)
        nodes[node.name] = NodeInfo(
            name=node.name, kind=kind, shape=shape, numel=numel,
            flops=experts["flops"] if experts else node_flops(node, kind, gm, numel, gemms),
            params=tuple(params),
            param_numel=sum(params.values()), layer=_layer_of(node, prefix) if prefix else None,
            no_grad=bool(node.meta.get("no_grad")),
            extra={"param_sizes": params,
                   "saves_inputs": (packet(node.target) in SAVES_INPUTS and kind != "other")
                   or ("gemm_weights" in gemms and not experts), "param_read": is_parameter_read(node),
                   **gemms},
        )
    _add_saved_bytes(gm, nodes)
    _mark_per_sequence(gm, nodes)
    mark_gradients(gm, nodes)
    _mark_fused_blocks(gm, nodes)
    layers, pre, post = _group_layers(gm, nodes)
    return TracedModel(gm=gm, name=name, seq_len=seq_len, nodes=nodes, layers=layers,
                       pre=pre, post=post, layer_prefix=prefix, tied_params=tied)


def _mark_fused_blocks(gm: fx.GraphModule, nodes: dict[str, NodeInfo]) -> None:
    """A Linear whose output is read only by slices along its last dim that tile it (q|k|v
    of a fused QKV projection, gate|up of a fused MLP) is a fused projection: its
    ``extra["out_blocks"]`` are the tiles' sizes and each slice's ``extra["block"]`` its
    (start, end), so that a column split can give every rank its part of each block."""
    for node in gm.graph.nodes:
        info = nodes[node.name]
        if info.kind != "linear" or not node.users or info.shape is None:
            continue
        last, spans = len(info.shape) - 1, []
        for user in node.users:
            if nodes[user.name].kind != "slice" or user.args[0] is not node \
                    or user.args[1] % (last + 1) != last:
                break
            spans.append((user.args[2], min(user.args[3], info.shape[last]), user))
        else:
            spans.sort(key=lambda span: span[:2])
            tiles = (len(spans) >= 2 and spans[0][0] == 0 and spans[-1][1] == info.shape[last]
                     and all(a[1] == b[0] for a, b in zip(spans, spans[1:])))
            if tiles:
                info.extra["out_blocks"] = tuple(end - start for start, end, _ in spans)
                for start, end, user in spans:
                    nodes[user.name].extra["block"] = (start, end)


def _mark_per_sequence(gm: fx.GraphModule, nodes: dict[str, NodeInfo]) -> None:
    """A tensor grows with the batch iff it depends on a graph input (the token ids) through
    tensor data; sizes (``idx.size(1)``) and creation ops (``arange``) do not carry it."""
    for node in gm.graph.nodes:
        info = nodes[node.name]
        if node.op == "placeholder":
            info.per_sequence = True
            continue
        ins = [n for n in node.all_input_nodes if nodes[n.name].shape is not None
               or returns_tensors(n)]  # top-k's (values, indices)
        info.per_sequence = any(nodes[n.name].per_sequence for n in ins)


def _add_saved_bytes(gm: fx.GraphModule, nodes: dict[str, NodeInfo]) -> None:
    for node in gm.graph.nodes:
        info = nodes[node.name]
        if info.shape is None:
            continue
        if any(saves_inputs(nodes[u.name]) for u in node.users) and not info.extra["param_read"]:
            info.saved_elems += info.numel  # a parameter (or a view of one) is model state
        if info.kind == "dropout" and gm.get_submodule(node.target).p > 0:
            info.mask_elems += info.numel
    for node in gm.graph.nodes:  # once every output's saved_elems is known
        if nodes[node.name].kind == "sdpa":
            annotate_attention(node, nodes)


def _group_layers(gm: fx.GraphModule, nodes: dict[str, NodeInfo]):
    order = [n.name for n in gm.graph.nodes]
    layer_ids = [nodes[n].layer for n in order]
    known = [i for i, lid in enumerate(layer_ids) if lid is not None]
    if not known:
        return [], [n for n in order], []
    first, last = known[0], known[-1]
    current = layer_ids[first]
    layers: dict[int, list[str]] = {}
    pre, post = [], []
    for i, name in enumerate(order):
        info = nodes[name]
        if i < first:
            info.section, info.layer = "pre", None
            pre.append(name)
        elif i > last:
            info.section, info.layer = "post", None
            post.append(name)
        else:
            current = info.layer if info.layer is not None else current
            info.layer, info.section = current, "layer"
            layers.setdefault(current, []).append(name)
    return [layers[k] for k in sorted(layers)], pre, post
