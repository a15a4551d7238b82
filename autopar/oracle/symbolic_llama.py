r"""Closed forms of a Llama layer recovered from the traced graph: the method of
:mod:`autopar.oracle.symbolic` (trace at a base point and with one symbol doubled at a
time, fit one monomial per node, compare the sum with a hand-derived closed form in sympy)
applied to Hugging Face ``LlamaForCausalLM`` (one layer, meta device).

Symbols: b micro-batch, s sequence, h hidden size, a query heads, kv key/value heads
(grouped-query attention), f MLP width (``intermediate_size``), t tensor-parallel size.

**Hand derivation.** Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1) count, per layer, the tensors each op keeps for its
backward; the same count for the Llama layer as ``transformers`` writes it (RMSNorm
computed in fp32, rotary embeddings, grouped-query attention whose k and v are repeated to
a heads before SDPA, a SwiGLU MLP, no dropout, no biases), with autopar's accounting
(:mod:`autopar.graph.annotate`: every activation element 2 bytes whatever its dtype, a
tensor counted once, when some consumer keeps it, in the layer of its producer):

* each RMSNorm ``w · (x·rsqrt(mean(x²) + ε))``: x cast to fp32 (kept by ``pow`` and by the
  product) 2sbh, ``mean + ε`` and its ``rsqrt`` (kept by ``rsqrt`` and the product) 2·2sb,
  the normalised x cast back (kept by the weight product) 2sbh, and the output, kept by
  the projections after it, 2sbh (the weight the product keeps is a parameter: model
  state, not an activation). Two norms: 12sbh + 8sb. The layer input itself is kept by nobody (the norm keeps
  its fp32 copy; the residual adds keep nothing), so it is counted in the layer before;
* attention: q and k after the projections (kept by the product with cos) and their
  ``rotate_half`` (kept by the product with sin) 2·2sbh + 2·2sbh·kv/a; cos and sin
  unsqueezed for the layer (not per sequence) 2·2s·h/a; the rotated q and k, v repeated
  to a heads (``repeat_kv``; SDPA keeps all three) 3·2sbh; the attention output kept by
  ``o_proj`` 2sbh; the attention core, softmax over the s×s scores kept by math SDPA
  (no dropout, so Korthikanti's 5as²b becomes) 2as²b;
* SwiGLU MLP: the gate projection (kept by SiLU and the product), SiLU(gate) and the up
  projection (kept by the product), their product (kept by ``down_proj``): 4·2sbf.

No parallelism: :math:`A = sbh(24 + 4kv/a + 8f/h + 8/h + 2as/h) + 4sh/a`. Tensor
parallel with Megatron's placements (:func:`~autopar.planner.strategies.megatron.megatron_placements`): q/k/v and
the MLP's gate/up split by columns, o_proj and down_proj by rows, so everything between
them is split over t while the norms (no sequence parallelism), their outputs and cos/sin
stay whole: :math:`A_t = sbh(12 + 8/h + (12 + 4kv/a + 8f/h + 2as/h)/t) + 4sh/a`.
Selective recompute drops the core (2as²b/t); full recompute keeps the layer input, 2sbh.

The solver is free to do better than that pattern and does: RMSNorm is element-wise aten
ops here (not an ``nn.LayerNorm``), which may run on sequence or hidden shards, so
``autopar.plan`` at t = 8 for a Llama-3-8B layer keeps only the two fp32 copies of the norm
inputs whole and runs the rest of each norm on sequence shards between a slice (free
forward) and the all-gather before the column Linears, Korthikanti's sequence-parallel
pattern found by the solver: :math:`sbh(4 + (20 + 4kv/a + 8f/h + 8/h + 2as/h)/t) +
4sh/a`. Such choices are ties or near-ties in time that CP-SAT breaks either way, so the
closed forms here are for the fixed reference pattern.

Forward FLOPs of one layer per sequence (2 per multiply-add, the matmuls): Q, K, V
projections 2sh(h + 2h·kv/a), o_proj 2sh², gate, up and down 3·2shf, QKᵀ and AV 2·2s²h
(the whole s×s scores: causal masking does not halve the count, as in Narayanan et al.
2021, eq. 3, and ``annotate._flops``): :math:`F = 2sh(2h + 2h·kv/a + 3f + 2s)`.
"""

from __future__ import annotations

import functools

import sympy
import torch

from autopar.oracle.symbolic import SYMBOLS, activation_expr, fit_monomials, layer_bytes
from autopar.planner.strategies.megatron import megatron_placements

__all__ = ["llama_closed_form", "llama_closed_form_names", "llama_layer_activation_expr",
           "llama_layer_flops_expr", "build_llama"]

# Megatron-LM's column- and row-parallel Linears by module name: autopar's GPT
# (c_q, c_k, c_v, c_fc | c_proj) and Llama (q/k/v, gate/up | o_proj, down_proj)

# name -> (formula in sympy syntax, what it is): the module docstring derives them
_CLOSED_FORMS: dict[str, tuple[str, str]] = {
    "layer_flops": ("2*s*h*(2*h + 2*h*kv/a + 3*f + 2*s)",
                    "forward matmul FLOPs of one layer, per sequence"),
    "activations": ("s*b*h*(24 + 4*kv/a + 8*f/h + 8/h + 2*a*s/h) + 4*s*h/a",
                    "activation bytes per layer, no parallelism"),
    "activations_tp": ("s*b*h*(12 + 8/h + (12 + 4*kv/a + 8*f/h + 2*a*s/h)/t) + 4*s*h/a",
                       "activation bytes per layer, tensor parallel"),
    "activations_selective": ("s*b*h*(24 + 4*kv/a + 8*f/h + 8/h) + 4*s*h/a",
                              "same, selective recompute"),
    "activations_tp_selective": ("s*b*h*(12 + 8/h + (12 + 4*kv/a + 8*f/h)/t) + 4*s*h/a",
                                 "same, tensor parallel + selective recompute"),
    "activations_full": ("2*s*b*h", "same, full recompute (the layer input)"),
}

# base point of the fits (t divides kv; kv < a, as transformers skips repeat_kv when kv = a;
# an even head_dim for rotary) and the point every monomial must then reproduce
_BASE = {"b": 1, "s": 16, "h": 256, "a": 16, "kv": 4, "f": 192, "t": 2}
_CHECK = {"b": 3, "s": 24, "h": 192, "a": 24, "kv": 12, "f": 320, "t": 4}


def llama_closed_form_names() -> list[str]:
    """Names accepted by :func:`llama_closed_form`."""
    return list(_CLOSED_FORMS)


def llama_closed_form(name: str) -> sympy.Expr:
    """A hand-derived closed form of the module docstring as a sympy expression in
    :data:`~autopar.oracle.symbolic.SYMBOLS`. ValueError lists the valid names."""
    if name not in _CLOSED_FORMS:
        raise ValueError(f"unknown Llama closed form {name!r}; choose one of "
                         f"{llama_closed_form_names()}")
    return sympy.sympify(_CLOSED_FORMS[name][0], locals=SYMBOLS)


def build_llama(*, s: int, h: int, a: int, kv: int, f: int, layers: int = 1,
                vocab: int = 64, rope_theta: float = 10000.0) -> torch.nn.Module:
    """A ``transformers`` LlamaForCausalLM of these sizes on the meta device (random
    weights, nothing downloaded; ``max_position_embeddings`` = s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=a,
                      num_key_value_heads=kv, intermediate_size=f, vocab_size=vocab,
                      max_position_embeddings=s, rope_theta=rope_theta)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@functools.lru_cache(maxsize=16)
def _trace(s: int, h: int, a: int, kv: int, f: int):
    from autopar.graph.capture import trace_model

    return trace_model(build_llama(s=s, h=h, a=a, kv=kv, f=f), s, name="symbolic-llama")


def _traced_at(point: dict):
    return _trace(point["s"], point["h"], point["a"], point["kv"], point["f"])


def llama_layer_activation_expr(*, tp_symbolic: bool = True,
                                recompute: str = "none") -> sympy.Expr:
    """Bytes one Llama layer keeps for backward, per micro-batch, per GPU, as a sympy
    expression in b, s, h, a, kv, f (and t when ``tp_symbolic``; else t = 1), recovered
    from traces priced by ``cost_tables`` under :func:`~autopar.planner.strategies.megatron.megatron_placements`. recompute:
    "none" | "selective" | "full" (:func:`autopar.oracle.symbolic.activation_expr`)."""
    def measure(p: dict) -> dict[str, float]:
        traced = _traced_at(p)
        return layer_bytes(traced, megatron_placements(traced, p["t"]), p["b"], p["t"])

    monomials = fit_monomials(measure, _BASE, _CHECK)
    expr = activation_expr(monomials, recompute)
    return expr if tp_symbolic else sympy.factor(expr.subs(SYMBOLS["t"], 1))


def llama_layer_flops_expr() -> sympy.Expr:
    """Forward matmul FLOPs of one Llama layer per sequence (what ``cost_tables`` sums
    into ``layer_fwd_flops_per_seq``), a sympy expression in s, h, a, kv, f."""
    point_keys = ("s", "h", "a", "kv", "f")

    def measure(p: dict) -> dict[str, float]:
        traced = _traced_at(p)
        return {n: traced.nodes[n].flops for n in traced.layers[0]
                if traced.nodes[n].kind in ("linear", "sdpa")}

    monomials = fit_monomials(measure, {k: _BASE[k] for k in point_keys},
                              {k: _CHECK[k] for k in point_keys})
    return sympy.factor(sympy.Add(*monomials.values()))
