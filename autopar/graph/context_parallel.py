"""The graph one context-parallel rank runs, annotated for pricing (the record:
:mod:`autopar.techniques.context_parallel`; the runtime:
:mod:`autopar.rewrite.context_parallel`).

Under context parallelism of degree c every rank runs s/c tokens of each sequence, so
autopar prices the model traced at s/c tokens, the program the runtime runs, as a layout
with c·d data-parallel ranks over c·B sequences of s/c tokens (the same tokens per rank, the
gradients averaged over the same c·d ranks), and corrects what that trace cannot see, per
attention node (:func:`context_parallel_trace`):

* its queries read the keys and values of the whole sequence, all-gathered over the CP
  group: Q·Kᵀ and P·V run at s_kv = s (``flops`` and ``gemms`` times c). A fused kernel
  with a lower-right causal mask computes the tiles on and below the diagonal, half
  (``causal_skip``): with head-tail chunks exactly 1/c of the causal attention of the
  whole sequence (Llama 3, arXiv:2407.21783, section 3.3.2). The unfused ("math") kernel
  computes every score of each local chunk against the keys up to its end: chunks i and
  2c−1−i of s/2c queries see (i + 1) + (2c − i) = 2c + 1 chunks of keys, (2c + 1)/(4c) of
  the local × whole scores (``extra["cp_score_fraction"]``), and keeps that softmax
  (``core_elems``). The fused price is Megatron-Core's (Transformer Engine's causal
  kernels); autopar's runtime passes each chunk a boolean mask, which a GPU's kernels run
  without skipping tiles, (2c + 1)/(2c) of the priced score work (torch's lower-right
  ``CausalBias``, which would skip them, is a tensor subclass that the runtime's
  dispatch-mode byte meter cannot carry: measured, torch 2.13);
* the all-gather of the local K and V (``extra["cp_gather_elems"]``, k + v elements in,
  c·(k + v) out) in forward and the reduce-scatter of their gradients in backward run over
  the CP group (:func:`autopar.planner.costs.node_cost.node_cost`); K and V that Hugging
  Face's ``repeat_kv`` expanded for grouped-query attention are gathered before the
  expansion (:func:`~autopar.graph.attention.unrepeated_kv`): h_kv heads;
* it keeps the gathered K and V for backward, c·(k + v), where the trace counts the local
  ones (expanded, when repeated) on its input edges: ``extra["cp_kv_elems"]`` is the
  difference, part of the attention core (selective recompute drops them and gathers
  again), never below 0 (with more query groups g than c, the expanded local copies the
  trace counts, which the rewritten program does not make, stay counted: an over-count);
  and its output is a concatenation of the chunks' outputs, not a view of the kernel's
  (``flash_output_aliased`` False).
"""

from __future__ import annotations

import torch

from dataclasses import replace

from autopar.contract.plan import Layout
from autopar.graph.annotate import TracedModel
from autopar.graph.attention import unrepeated_kv
from autopar.graph.capture import trace_model
from autopar.techniques.context_parallel import cp_problem

__all__ = ["context_parallel_trace", "annotate_context_parallel", "trace_cp", "folded_layout"]


def context_parallel_trace(model: torch.nn.Module, seq_len: int, cp: int, **trace_kw
                           ) -> TracedModel:
    """``model`` traced at ``seq_len``/``cp`` tokens (:func:`~autopar.graph.capture.trace_model`,
    ``trace_kw`` its keywords) and annotated for context parallelism of degree ``cp``
    (module docstring); the plain trace at cp = 1. Raises ValueError unless 2·cp divides
    ``seq_len``, and trace_model's errors."""
    problem = cp_problem(cp, seq_len)
    if problem:
        raise ValueError(problem)
    traced = trace_model(model, seq_len // cp, **trace_kw)
    annotate_context_parallel(traced, cp)
    return traced


def trace_cp(traced: TracedModel) -> int:
    """The context-parallel degree ``traced`` is annotated for (1: a plain trace)."""
    return max((i.extra.get("cp", 1) for i in traced.nodes.values() if i.kind == "sdpa"),
               default=1)


def folded_layout(layout: Layout, cp: int) -> Layout:
    """``layout`` as the search on the trace at s/c sees it: dp = c·d (a pinned d times c),
    cp settled (the trace's)."""
    return replace(layout, dp=None if layout.dp is None else layout.dp * cp, cp=None)


def annotate_context_parallel(traced: TracedModel, cp: int) -> None:
    """Correct, in place, the attention nodes of ``traced`` (a trace at s/c tokens) for
    context parallelism of degree ``cp`` (module docstring); nothing at cp = 1. Raises
    ValueError when a layer computes attention without ``scaled_dot_product_attention``
    (the context-parallel rewrite splits only that call)."""
    if cp == 1:
        return
    plain = [i for i, layer in enumerate(traced.layers)
             if not any(traced.nodes[n].kind == "sdpa" for n in layer)]
    if plain:
        raise ValueError(f"cp={cp}: layer {plain[0]} of {traced.name} computes attention "
                         "without F.scaled_dot_product_attention, which context parallelism "
                         "splits (eager attention's matmuls are not); use cp=1 or an SDPA "
                         "attention implementation (Hugging Face: attn_implementation='sdpa')")
    graph_nodes = {n.name: n for n in traced.gm.graph.nodes}
    for info in traced.nodes.values():
        if info.kind != "sdpa" or info.extra.get("cp"):
            continue
        node = graph_nodes[info.name]
        k_elems, v_elems = (node.args[j].meta["tensor_meta"].shape.numel() for j in (1, 2))
        kv = unrepeated_kv(node.args[1], node.args[2])  # the h_kv heads the rewrite gathers
        local = sum(n.meta["tensor_meta"].shape.numel() for n in kv) if kv else k_elems + v_elems
        gemms = info.extra["gemms"]
        (heads, s_q, s_kv, _), (_, _, hd_v, _) = gemms
        chunk = s_q // 2
        info.flops *= cp
        info.extra["gemms"] = ((heads, s_q, s_kv * cp, gemms[0][3]),
                               (heads, s_q, hd_v, s_kv * cp))
        softmax = heads * chunk * chunk * (2 * cp + 1)  # per sequence (b = 1)
        scale = softmax / (heads * s_q * s_kv)
        info.core_elems = round(info.core_elems * scale)
        info.core_mask_elems = round(info.core_mask_elems * scale)
        if info.extra.get("score_passes_elems"):
            info.extra["score_passes_elems"] = round(info.extra["score_passes_elems"] * scale)
        info.extra.update(cp=cp, cp_score_fraction=(2 * cp + 1) / (4 * cp),
                          cp_kv_elems=max(0, cp * local - k_elems - v_elems),
                          cp_gather_elems=local, flash_output_aliased=False)
