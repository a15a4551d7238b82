"""What ``scaled_dot_product_attention`` keeps for backward, per kernel (one sequence).

"math" (the unfused kernel) keeps the softmax of the (b, a, s, s_kv) scores, and with
dropout its output and mask: Korthikanti et al. 2022's 5·a·s² bytes per sequence with
16-bit activations and 1-byte masks. A fused kernel (FlashAttention-2, Dao et al. 2023;
PyTorch's flash and memory-efficient kernels on GPUs, its flash kernel on CPUs) keeps its
output and the log-sum-exp of each row, b·a·s values in fp32 (``softmax_lse``), and
recomputes the scores in backward (Dao et al. 2022, Algorithm 2). The output it keeps is
often the very storage its consumer keeps: the kernel writes (b, s, a, hd) and returns a
(b, a, s, hd) view, so the usual ``y.transpose(1, 2).contiguous()`` before the output
projection copies nothing, and the projection's saved input is the kernel's output
(measured: ``benchmarks/gpu_check.py`` on an H200, saved activations equal to the
prediction to 0.1%; the CPU's flash kernel alike).

Its time differs too: a fused kernel with ``is_causal`` and no mask skips the tiles above
the diagonal (half the score FLOPs, as FlashAttention-2 counts causal attention:
``benchmarks/benchmark_flash_attention.py`` in Dao-AILab/flash-attention), and its backward
recomputes the scores (Q·Kᵀ once more: 2.5 times the forward FLOPs, the same source);
``extra["causal_skip"]`` says whether the first applies (:mod:`autopar.planner.costs.matmul_cost`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph.ops import SDPA_ARGS

__all__ = ["LSE_BYTES", "annotate_attention", "unrepeated_kv"]

LSE_BYTES = 4
"""Bytes per log-sum-exp value a fused kernel keeps: fp32 whatever the activations' dtype."""

_ALIASES = ("view", "transpose", "contiguous")
_RESHAPES = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.reshape}
_EXPANDS = {torch.ops.aten.expand.default}
_UNSQUEEZES = {torch.ops.aten.unsqueeze.default, torch.unsqueeze}
"""Node kinds that pass a fused attention output on without copying it."""


def annotate_attention(node: fx.Node, nodes: dict) -> None:
    """Set the attention-core fields of ``nodes[node.name]`` (a NodeInfo of kind "sdpa",
    output (b, a, s, hd) for q (b, a, s, hd) and k (b, a, s_kv, hd)): ``core_elems`` and
    ``core_mask_elems`` (math kernel), ``flash_elems`` (the output) and ``lse_elems``
    (fused kernel), ``extra["causal_skip"]`` (``is_causal`` without an explicit mask: a fused
    kernel skips the tiles above the diagonal), ``extra["flash_output_aliased"]`` (a
    consumer reached through views, transposes and ``contiguous`` saves the output
    already: without tensor parallelism it
    is the same storage; with it a placement may copy it on the way, a gather or a slice,
    so :meth:`NodeInfo.core_bytes_at` counts it then) and ``extra["score_passes_elems"]``.
    Call once every node's ``saved_elems`` is set."""
    info = nodes[node.name]
    b, nh, s, _ = node.args[0].meta["tensor_meta"].shape
    s_kv = node.args[1].meta["tensor_meta"].shape[2]
    scores = b * nh * s * s_kv
    kwargs = {**dict(zip(SDPA_ARGS, node.args[3:])), **node.kwargs}
    dropout = kwargs.get("dropout_p", 0.0) or 0.0
    # softmax output; with dropout also its output and its mask
    info.core_elems = scores * (2 if dropout > 0 else 1)
    info.core_mask_elems = scores if dropout > 0 else 0
    info.flash_elems = info.numel
    info.extra["flash_output_aliased"] = _kept_by_a_consumer(node, nodes)
    info.lse_elems = b * nh * s
    info.extra["causal_skip"] = bool(kwargs.get("is_causal")) and kwargs.get("attn_mask") is None
    # memory passes over the (b, nh, s, s) scores of unfused ("math") attention:
    # write QKᵀ, read+write scale/mask/softmax, read for ·V; dropout adds 3 more
    info.extra["score_passes_elems"] = scores * (4 + (3 if dropout > 0 else 0))


def _kept_by_a_consumer(node: fx.Node, nodes: dict) -> bool:
    """Is ``node``'s output, or an alias of it through views, transposes and
    ``contiguous``, saved for backward by a consumer (its ``saved_elems``)?"""
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if nodes[current.name].saved_elems:
            return True
        frontier.extend(u for u in current.users if nodes[u.name].kind in _ALIASES)
    return False


def unrepeated_kv(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(k0, v0) when ``k`` and ``v`` are Hugging Face's ``repeat_kv`` of them, (b, h_kv, s,
    d) -> (b, h_kv·g, s, d) as ``reshape(expand(unsqueeze(x, 2), (b, h_kv, g, s, d)))``
    (each key/value head repeated for its g query heads, SDPA's ``enable_gqa`` order), the
    same g for both; else None."""
    found = []
    for node in (k, v):
        expand = node.args[0] if node.op == "call_function" and node.target in _RESHAPES \
            and node.args else None
        unsqueeze = expand.args[0] if isinstance(expand, fx.Node) and \
            expand.target in _EXPANDS else None
        if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target in _UNSQUEEZES
                and tuple(unsqueeze.args[1:]) == (2,)):
            return None
        x = unsqueeze.args[0]
        shape, out = x.meta["tensor_meta"].shape, node.meta["tensor_meta"].shape
        if len(shape) != 4 or out[1] % shape[1] or tuple(out[2:]) != tuple(shape[2:]):
            return None
        found.append((x, out[1] // shape[1]))
    (k0, gk), (v0, gv) = found
    return (k0, v0) if gk == gv else None
