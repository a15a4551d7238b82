"""The aten ops of an exported graph (:mod:`autopar.graph.export`) by what sharding can do
with them: the one table that annotation (kinds, FLOPs, saved tensors), the strategies and
the TP rewrite read. An op that is in no table is "other": replicated, always correct.

Leaf modules (``nn.Linear``, GPT-2's ``Conv1D``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.Dropout``) are ``call_module`` nodes again after export, so they are not here.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

__all__ = ["SDPA_ARGS", "POINTWISE", "SAVES_INPUTS", "VIEWS", "TRANSPOSES", "REDUCTIONS", "SOFTMAX",
           "MATMULS", "CREATION_OPS", "aten_kind", "linear_features", "is_conv1d", "packet",
           "op_name", "gemm_shapes", "GROUPED_MMS", "qualified_name", "is_grouped_mm",
           "is_parameter_read", "node_flops", "returns_tensors"]

aten = torch.ops.aten


SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""``scaled_dot_product_attention``'s arguments after q, k, v, in order."""


def packet(target):
    """The op's overload packet (``aten.add`` for ``aten.add.Tensor``), else None."""
    return getattr(target, "overloadpacket", None)


# element-wise with broadcasting: one output element from the same-index input elements
POINTWISE = {aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.rsqrt, aten.sqrt,
             aten.exp, aten.log, aten.tanh, aten.silu, aten.gelu, aten.relu, aten.sigmoid,
             aten.pow, aten.to, aten._to_copy, aten.clone, aten.contiguous, aten.alias,
             aten.detach, aten.type_as, aten.where, aten.masked_fill, aten.reciprocal,
             aten.abs, aten.square, aten.erf, aten.sin, aten.cos, aten.clamp, aten.minimum,
             aten.maximum, aten.lift_fresh_copy}
# their backward keeps an input (or the same-size output) for backward
SAVES_INPUTS = {aten.mul, aten.div, aten.rsqrt, aten.sqrt, aten.exp, aten.log, aten.tanh,
                aten.silu, aten.gelu, aten.sigmoid, aten.pow, aten.erf, aten.sin, aten.cos,
                aten.matmul, aten.bmm, aten._softmax, aten.softmax, aten._log_softmax}
VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
TRANSPOSES = {aten.transpose, aten.permute, aten.t}
REDUCTIONS = {aten.mean, aten.sum, aten.amax, aten.amin, aten.var}   # over dims in args[1]
SOFTMAX = {aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax}  # along args[1]
MATMULS = {aten.matmul, aten.bmm}
# make a tensor from sizes or another tensor's metadata (no arithmetic on its values)
CREATION_OPS = {"arange", "ones", "zeros", "full", "empty", "scalar_tensor", "new_ones",
                "new_zeros", "new_full", "new_empty", "ones_like", "zeros_like", "full_like",
                "empty_like", "rand", "randn", "rand_like", "randn_like"}
GROUPED_MMS = {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}
"""Grouped matmuls, one GEMM per group of rows (a mixture-of-experts layer's experts, the
rows sorted by expert, ``offs`` their cumulative counts): torch's ``_grouped_mm`` and the
custom op transformers 5.24 registers for when torch's does not run
(``transformers/integrations/moe.py``, ``grouped_mm_fallback``), same arguments."""
SHAPE_OPS = {aten.unsqueeze, aten.squeeze, aten.expand, aten.slice, aten.select, aten.cat,
             aten.flatten}


def aten_kind(target) -> str | None:
    """The kind (:class:`~autopar.graph.annotate.NodeInfo`) of an aten call, None if the
    target is not an aten op. Element-wise ops are "elementwise" ("add" for ``aten.add`` of
    two tensors is decided by the caller, "gelu" here), views "view", transposes
    "transpose", other shape ops their own name."""
    op = packet(target)
    if op is None:
        return None
    if op is aten.gelu:
        return "gelu"
    if op in (aten.contiguous, aten.clone):
        return "contiguous"
    if op in POINTWISE:
        return "elementwise"
    if op in VIEWS:
        return "view"
    if op in TRANSPOSES:
        return "transpose"
    if op in REDUCTIONS:
        return "reduce"
    if op in SOFTMAX:
        return "softmax"
    if op in MATMULS:
        return "matmul"
    if op in SHAPE_OPS:
        return op.__name__
    if op is aten.sym_size:
        return "nontensor"
    return "other"


def qualified_name(target) -> str:
    """"namespace::op" of an op overload ("aten::linear"), "" for other targets."""
    return getattr(packet(target), "_qualified_op_name", "")


def is_grouped_mm(node) -> bool:
    """Is fx ``node`` a grouped matmul (:data:`GROUPED_MMS`)?"""
    return node.op == "call_function" and qualified_name(node.target) in GROUPED_MMS


def is_parameter_read(node) -> bool:
    """Is fx ``node`` a parameter or buffer (``get_attr``), or a view, transpose, copy or
    cast of one (a stacked expert weight read as ``w.transpose(1, 2).to(x.dtype)``)?"""
    passing = VIEWS | TRANSPOSES | {aten.to, aten._to_copy, aten.contiguous, aten.clone,
                                    aten.alias}
    while node.op == "call_function" and packet(node.target) in passing and node.args \
            and hasattr(node.args[0], "op"):
        node = node.args[0]
    return node.op == "get_attr"


def returns_tensors(node) -> bool:
    """Does fx ``node`` return several tensors (top-k's values and indices)?"""
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def is_conv1d(mod: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: a Linear with an (in, out) weight (``addmm(bias, x, weight)``)."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "weight")


def linear_features(mod: nn.Module) -> tuple[int, int, int]:
    """(in_features, out_features, the weight's output dim) of an ``nn.Linear`` (dim 0) or
    a ``Conv1D`` (dim 1)."""
    if is_conv1d(mod):
        return mod.weight.shape[0], mod.nf, 1
    return mod.in_features, mod.out_features, 0


def op_name(node, gm: nn.Module) -> str:
    """A short name of the op ``node`` calls: the module class of a ``call_module``
    ("LayerNorm"), the op of an aten call without its overload ("cumsum", "and" for
    ``aten.__and__.Tensor``), the function or method name otherwise."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return str(node.target)
    op = packet(node.target)
    name = op.__name__ if op is not None else getattr(node.target, "__name__", str(node.target))
    return name.strip("_") or name


def gemm_shapes(node, kind: str, gm: nn.Module, numel: int) -> dict:
    """The forward GEMMs of a matmul node (``kind`` as annotation names it) for one
    sequence, for shape-aware pricing (:func:`cost_models.compute.gemm_time_s`):
    ``{"gemms": ((batch, m, n, k), ...),
    "gemm_folded": bool}``, where C (m x n) = A (m x k) B (k x n), ``batch`` independent
    ones; folded: the batch and sequence dims are folded into m (a Linear on (b, s, h):
    m = b*s tokens), else the micro-batch multiplies ``batch`` (attention's b*heads).
    Empty for other kinds or shapes it cannot read (they are priced by FLOPs alone)."""
    if kind == "linear":
        in_f, out_f, _ = linear_features(gm.get_submodule(node.target))
        return {"gemms": ((1, numel // out_f, out_f, in_f),), "gemm_folded": True}
    shape = lambda n: tuple(n.meta["tensor_meta"].shape)  # noqa: E731
    if kind == "sdpa":  # Q·Kᵀ (s x s_kv, depth hd), then P·V (s x hd, depth s_kv), per head
        _, nh, s, hd = shape(node.args[0])
        s_kv, hd_v = shape(node.args[1])[2], shape(node.args[2])[-1]
        return {"gemms": ((nh, s, s_kv, hd), (nh, s, hd_v, s_kv)), "gemm_folded": False}
    if kind == "other":
        return _weight_gemm_shapes(node, shape)
    if kind == "matmul" and len(node.args) >= 2:
        a, b = shape(node.args[0]), shape(node.args[1])
        if len(a) < 2 or len(b) < 2:
            return {}
        if len(b) == 2:  # x @ W: every leading dim of x is a row of one GEMM
            return {"gemms": ((1, numel // b[1], b[1], b[0]),), "gemm_folded": True}
        m, n = a[-2], b[-1]
        return {"gemms": ((numel // (m * n), m, n, a[-1]),), "gemm_folded": False}
    return {}


def _weight_gemm_shapes(node, shape) -> dict:
    """GEMMs of an op that :func:`aten_kind` leaves "other" (replicated) but that is a
    matmul: ``F.linear(x, w)`` on a weight that is not an ``nn.Linear`` (a MoE router),
    x (..., k) by w (n, k); a grouped matmul (:data:`GROUPED_MMS`), a (m, k) by b (g, k, n)
    with rows split into g groups by ``offs``, priced as g GEMMs of ceil(m/g) rows (the
    groups of a balanced routing: the planning assumption), or a (g, m, k) by b (g, k, n)
    without ``offs``. ``gemm_weights``: the second operand is a parameter (its gradient is
    a weight gradient). Empty when the shapes are none of these."""
    if len(node.args) < 2 or not all(
            hasattr(getattr(a, "meta", {}).get("tensor_meta"), "shape") for a in node.args[:2]):
        return {}
    a, b = shape(node.args[0]), shape(node.args[1])
    weights = {"gemm_weights": is_parameter_read(node.args[1])}
    if qualified_name(node.target) == "aten::linear" and len(b) == 2 and a and a[-1] == b[1]:
        return {"gemms": ((1, math.prod(a[:-1]), b[0], b[1]),), "gemm_folded": True, **weights}
    if not is_grouped_mm(node):
        return {}
    if len(a) == 2 and len(b) == 3 and a[1] == b[1]:
        return {"gemms": ((b[0], -(-a[0] // b[0]), b[2], a[1]),), "gemm_folded": True,
                "gemm_rows": a[0], **weights}
    if len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
        return {"gemms": ((a[0], a[1], b[2], a[2]),), "gemm_folded": False, **weights}
    return {}


def node_flops(node, kind: str, gm: nn.Module, numel: int, gemms: dict) -> float:
    """Forward FLOPs of fx ``node`` for one sequence (:class:`~autopar.graph.annotate.NodeInfo`
    ``flops``): 2 per multiply-add of its GEMMs (``gemms``: :func:`gemm_shapes`, a grouped
    matmul over every row once), attention's Q·Kᵀ and P·V, one per output element of an
    element-wise op, a norm or a reduction, and of an op without a formula."""
    if kind == "other" and "gemm_rows" in gemms:  # grouped: every row once, whatever its group
        (_, _, n, k), = gemms["gemms"]
        return 2.0 * gemms["gemm_rows"] * n * k
    if kind == "other" and gemms:  # a matmul left replicated (a router's F.linear)
        return sum(2.0 * batch * m * n * k for batch, m, n, k in gemms["gemms"])
    if kind == "linear":
        in_f, out_f, _ = linear_features(gm.get_submodule(node.target))
        return 2.0 * numel // out_f * in_f * out_f
    if kind == "matmul":
        return 2.0 * numel * node.args[0].meta["tensor_meta"].shape[-1]
    if kind == "sdpa":
        b, nh, s, hd = node.args[0].meta["tensor_meta"].shape
        s_kv = node.args[1].meta["tensor_meta"].shape[2]
        return 4.0 * b * nh * s * s_kv * hd  # Q·Kᵀ and attention·V
    if kind in ("layernorm", "gelu", "dropout", "add", "elementwise", "reduce", "softmax"):
        return float(numel)
    if kind in ("other", "nontensor") and op_name(node, gm) not in CREATION_OPS and any(
            hasattr(n.meta.get("tensor_meta"), "shape") for n in node.all_input_nodes):
        # no formula (cumsum, sort, a comparison ...): one FLOP per output element, a floor
        # that keeps the op visible (it is replicated: autopar.planner.strategies.replicated) not zero
        return float(_output_elems(node.meta.get("tensor_meta")))
    return 0.0


def _output_elems(meta) -> int:
    """Elements of a node's output tensors (a tuple for ops with several outputs)."""
    if hasattr(meta, "shape"):
        return math.prod(meta.shape)
    if isinstance(meta, (tuple, list)):
        return sum(_output_elems(m) for m in meta)
    return 0
