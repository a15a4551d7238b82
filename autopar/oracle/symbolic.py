r"""Closed forms recovered from the traced graph, checked against the published ones.

The tracer sees concrete shapes only, so a closed form is *recovered*, not read off:
every node's cost is a monomial :math:`c\,b^{e_b} s^{e_s} h^{e_h} a^{e_a} t^{e_t}`, and
the exponents follow from log-ratios between traces that double one symbol at a time
(base point, then ``b→2b``, ``s→2s``, ``h→2h``, ``a→2a``, ``t→2t``). Each exponent must
come out an integer and the fitted monomial must reproduce a further trace where every
symbol changed at once, else :class:`SymbolicFitError` names the node. The sum over a
layer's nodes is then a sympy expression that ``sympy.simplify`` compares with the paper.

Activation bytes per layer (:func:`layer_activation_expr`) use exactly what the solver
uses: ``autopar.planner.costs.tables.cost_tables`` of the traced graph, with Megatron's placements found
by ``autopar.plan`` itself (``tp=8`` on one DGX A100 node, where tensor parallelism
pays); a tensor is divided by t when its placement is sharded, and b enters through the
micro-batch size of :class:`autopar.planner.costs.tables.Config`. Both exponents are fitted, not assumed.
They reproduce Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4 and Table 2), 16-bit activations and 1-byte dropout
masks (build the model with dropout > 0, as Megatron does):

* no parallelism: :math:`sbh(34 + 5as/h)`; tensor parallel: :math:`sbh(10 + 24/t + 5as/(ht))`;
* selective recompute drops the attention core :math:`5as/h` (÷t with TP);
* full recompute keeps the layer input, :math:`2sbh`.

Sequence parallelism (:math:`sbh(34/t + 5as/(ht))`) is listed by :func:`closed_form` for
reference; the cost model does not price it yet, so nothing is derived for it.

Model FLOPs per step (:func:`model_flops_expr`) are the traced matmul FLOPs the cost
adapter counts (``cost_tables``: 3 × forward matmul FLOPs per sequence, forward plus a
backward of twice the forward, plus one more forward of every layer with full recompute),
times the global batch B. They reproduce Narayanan et al. 2021 ("Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM"), eq. (3):
:math:`96BsLh^2(1 + s/(6h) + V/(16Lh))` with full recompute. The "72-factor variant"
without recompute is :math:`72BsLh^2(1 + s/(6h) + V/(12Lh))` (Korthikanti et al. 2022,
Appendix A, the MFU numerator): the logit layer is never recomputed, so its term is
V/(12Lh), not the V/(16Lh) of eq. (3)'s bracket; "72 × that bracket" (DESIGN.md,
``cost_models.compute.gpt_model_flops(recompute="none")``) undercounts by 1.5·B·s·h·V,
about 0.1% for GPT-3 175B. The ZeRO model-state figures (7.5B parameters, d = 64: 120 /
31.4 / 16.6 / 1.9 GB, Rajbhandari et al. 2020, Fig. 1) are checked in
``tests/unit/test_cost_models.py``. The same fit for a Hugging Face Llama layer (RMSNorm,
rotary, grouped-query attention, SwiGLU) is :mod:`autopar.oracle.symbolic_llama`; whole
plans against closed forms, :mod:`autopar.oracle.plan_forms`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import sympy
import torch
import torch.nn as nn

from cost_models.hardware import Cluster

from autopar.planner.costs.tables import Config, cost_tables
from autopar.planner.costs.predict import crosses_section
from autopar.models import GPT, GPTConfig
from autopar.contract.placement import REPLICATE, format_strategy_key
from autopar.contract.plan import RECOMPUTE_MODES
from autopar.techniques.recompute_modes import recompute_mode
from autopar.planner.strategies import node_strategies, strategies_by_key, tensor_inputs
from autopar.graph.capture import trace_model

__all__ = ["SYMBOLS", "SymbolicFitError", "closed_form", "closed_form_names", "fit_monomials",
           "layer_activation_expr", "model_flops_expr", "planned_placements", "layer_bytes",
           "activation_expr", "formulas_markdown"]

b, s, h, a, t, B, L, V = sympy.symbols("b s h a t B L V", positive=True)
kv, f = sympy.symbols("kv f", positive=True)  # grouped-query kv heads, MLP width (Llama)
SYMBOLS = {"b": b, "s": s, "h": h, "a": a, "t": t, "B": B, "L": L, "V": V, "kv": kv, "f": f}

# name -> (formula in sympy syntax, what it is, source). The formula text is the single
# source of the closed form: closed_form() parses it, formulas_markdown() prints it.
_CLOSED_FORMS: dict[str, tuple[str, str, str]] = {
    "activations": ("s*b*h*(34 + 5*a*s/h)", "activation bytes per layer, no parallelism",
                    "Korthikanti et al. 2022, Table 2"),
    "activations_tp": ("s*b*h*(10 + 24/t + 5*a*s/(h*t))",
                       "activation bytes per layer, tensor parallel",
                       "Korthikanti et al. 2022, Table 2"),
    "activations_selective": ("34*s*b*h", "same, selective recompute",
                              "Korthikanti et al. 2022, section 5"),
    "activations_tp_selective": ("s*b*h*(10 + 24/t)",
                                 "same, tensor parallel + selective recompute",
                                 "Korthikanti et al. 2022, Table 2 without the 5as/(ht) term"),
    "activations_full": ("2*s*b*h", "same, full recompute (the layer input)",
                         "Korthikanti et al. 2022, section 4.3"),
    "activations_tp_sp": ("s*b*h*(34/t + 5*a*s/(h*t))",
                          "same, tensor + sequence parallel (reference; not priced yet)",
                          "Korthikanti et al. 2022, Table 2"),
    "activations_tp_sp_selective": ("34*s*b*h/t",
                                    "same, tensor + sequence parallel + selective "
                                    "(reference; not priced yet)",
                                    "Korthikanti et al. 2022, Table 2"),
    "model_flops_full_recompute": ("96*B*s*L*h**2*(1 + s/(6*h) + V/(16*L*h))",
                                   "model FLOPs per step, full recompute",
                                   "Narayanan et al. 2021, eq. (3)"),
    "model_flops": ("72*B*s*L*h**2*(1 + s/(6*h) + V/(12*L*h))",
                    "model FLOPs per step, no recompute (MFU numerator)",
                    "Korthikanti et al. 2022, Appendix A"),
}

# base point of the fits, and the point every fit must then reproduce exactly
_LAYER_BASE = {"b": 1, "s": 16, "h": 128, "a": 8, "t": 2}
_LAYER_CHECK = {"b": 3, "s": 24, "h": 192, "a": 12, "t": 4}
_FLOPS_BASE = {"s": 16, "h": 128, "a": 8, "V": 64}
_FLOPS_CHECK = {"s": 24, "h": 192, "a": 12, "V": 96}
# the wide one-layer model planned once to find Megatron's placements (GPT-8.3B's layer)
_WIDE = {"n_head": 32, "n_embd": 3072, "block_size": 1024}
_PLACEMENT_TP = 8
_INPUT, _CORE = "layer input (kept by full recompute)", " (attention core)"

ModelSource = GPTConfig | Callable[[GPTConfig], nn.Module]


class SymbolicFitError(ValueError):
    """A node's cost is not a monomial in the symbols (the message names the node)."""


def closed_form_names() -> list[str]:
    """Names accepted by :func:`closed_form`."""
    return list(_CLOSED_FORMS)


def closed_form(name: str) -> sympy.Expr:
    """A published closed form as a sympy expression in :data:`SYMBOLS` (see the module
    docstring for the sources). ValueError lists the valid names."""
    if name not in _CLOSED_FORMS:
        raise ValueError(f"unknown closed form {name!r}; choose one of {closed_form_names()}")
    return sympy.sympify(_CLOSED_FORMS[name][0], locals=SYMBOLS)


# ------------------------------------------------------------------------ the fit
def _exponent(ratio: float, symbol: str, key: str) -> int:
    """log2 of a ratio between two traces that doubled ``symbol``; must be an integer."""
    if ratio <= 0:
        raise SymbolicFitError(f"{key}: doubling {symbol} changed the sign or zeroed it")
    e = math.log2(ratio)
    if abs(e - round(e)) > 1e-9:
        raise SymbolicFitError(f"{key}: doubling {symbol} scales it by {ratio:.6g}, not a "
                               "power of two, so it is not a monomial in the symbols")
    return int(round(e))


def fit_monomials(measure: Callable[[dict], Mapping[str, float]], base: dict[str, int],
                  check: dict[str, int]) -> dict[str, sympy.Expr]:
    """Recover ``{key: c·Π x^e}`` from ``measure(point) -> {key: value}``.

    One measurement at ``base``, one per symbol doubled, then every monomial must equal
    ``measure(check)`` exactly (rational arithmetic). Keys that are zero everywhere are
    dropped. Raises SymbolicFitError naming the first key that is not a monomial.
    """
    at_base = measure(base)
    doubled = {x: measure({**base, x: 2 * base[x]}) for x in base}
    at_check = measure(check)
    out: dict[str, sympy.Expr] = {}
    for key, value in at_base.items():
        if value == 0:
            if any(doubled[x][key] for x in base) or at_check[key]:
                raise SymbolicFitError(f"{key}: zero at the base point but not elsewhere")
            continue
        exps = {x: _exponent(doubled[x][key] / value, x, key) for x in base}
        scale = sympy.Mul(*(sympy.Integer(base[x]) ** e for x, e in exps.items()))
        symbols = sympy.Mul(*(SYMBOLS[x] ** e for x, e in exps.items()))
        mono = sympy.Rational(value) / scale * symbols
        got = mono.subs({SYMBOLS[x]: v for x, v in check.items()})
        if got != sympy.Rational(at_check[key]):
            raise SymbolicFitError(f"{key}: the fitted monomial {mono} gives {got} at {check}, "
                                   f"the trace {at_check[key]}")
        out[key] = mono
    return out


# ------------------------------------------------------------------ model plumbing
def _source(model: ModelSource, dropout: float) -> tuple[Callable, GPTConfig]:
    """(factory taking a GPTConfig, template config) for a config or a factory."""
    if isinstance(model, GPTConfig):
        return GPT, model
    if not callable(model):
        raise ValueError("expected a GPTConfig or a callable GPTConfig -> nn.Module, "
                         f"got {model!r}")
    return model, GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16,
                            dropout=dropout)


@functools.lru_cache(maxsize=64)
def _trace(factory: Callable, template: GPTConfig, sizes: tuple):
    """Trace a one-layer model of ``template`` with (s, h, a, V) replaced (meta device)."""
    sq, hid, heads, vocab = sizes
    cfg = dataclasses.replace(template, n_layer=1, n_head=heads, n_embd=hid,
                              block_size=sq, vocab_size=vocab or template.vocab_size)
    with torch.device("meta"):
        model = factory(cfg)
    return trace_model(model, sq, name="symbolic")


def planned_placements(factory: Callable = GPT, template: GPTConfig | None = None) -> dict[str, str]:
    """Per-node strategy keys that ``autopar.plan`` chooses at ``tp=8`` for a
    one-layer model with GPT-8.3B's layer (h = 3072, a = 32, s = 1024) on one DGX A100
    node: Megatron's column→row pattern ("column:S2", "row:P", "heads:S1", ...)."""
    return dict(_planned_placements(factory, template))


@functools.lru_cache(maxsize=8)
def _planned_placements(factory: Callable, template: GPTConfig | None) -> tuple:
    from autopar.api import plan
    from autopar.contract.plan import Layout

    template = template or GPTConfig(1, 4, 32, 51200, 16, dropout=0.1)
    cfg = dataclasses.replace(template, n_layer=1, **_WIDE)
    with torch.device("meta"):
        model = factory(cfg)
    chosen = plan(model, Cluster.dgx_a100(nodes=1), global_batch_size=_PLACEMENT_TP,
                  seq_len=cfg.block_size, layout=Layout(tp=_PLACEMENT_TP, pp=1, dp=1,
                                                sequence_parallel=False))
    return tuple(chosen.placements.items())


def _layer_bytes(factory, template, placements, point: dict) -> dict[str, float]:
    """Per node of layer 0: saved bytes and attention-core bytes at one point (b, s, h,
    a, t), priced by ``cost_tables`` under Megatron's placements."""
    traced = _trace(factory, template, (point["s"], point["h"], point["a"], 0))
    return layer_bytes(traced, placements, point["b"], point["t"])


def layer_bytes(traced, placements: dict[str, str], micro_batch: int, tp: int) -> dict[str, float]:
    """Per node of ``traced``'s layer 0, priced by ``cost_tables`` at micro-batch size
    ``micro_batch`` and TP size ``tp`` under ``placements`` (strategy keys by node name;
    replicated where absent or at tp = 1): "<node>" its saved bytes, "<node> (attention
    core)" the part selective recompute drops, and the layer input full recompute keeps.
    SymbolicFitError when a placement does not exist at these sizes."""
    strategies = node_strategies(traced, tp)
    tables = cost_tables(traced, strategies, Cluster.dgx_a100(nodes=1),
                         Config(tp=tp, pp=1, dp=1, micro_batch_size=micro_batch,
                                num_micro_batches=1))
    out: dict[str, float] = {_INPUT: tables.full_ckpt_bytes}
    replicated = format_strategy_key("replicate", REPLICATE)
    choice = {}
    for name in strategies:
        want = placements.get(name, replicated) if tp > 1 and name in traced.layers[0] \
            else replicated
        try:
            choice[name] = strategies[name].index(strategies_by_key(strategies[name], want, name, tp))
        except ValueError as exc:
            raise SymbolicFitError(str(exc)) from exc
    for name in traced.layers[0]:
        cost = tables.node[name][choice[name]]
        out[name] = cost.saved_bytes
        out[name + _CORE] = cost.core_saved_bytes
    # the tensors the layer's ops keep for backward, each version once (its input included)
    graph = {n.name: n for n in traced.gm.graph.nodes}
    for v in traced.layers[0]:
        strat = strategies[v][choice[v]]
        for j, u in enumerate(tensor_inputs(graph[v], traced.nodes)):
            if u.name not in traced.layers[0] and not crosses_section(traced, u.name, v):
                continue  # a side input, charged to the section that produces it
            edge = tables.edge[(u.name, v, j)][(choice[u.name], choice[v])]
            if edge.saved_bytes:
                out[f"kept {u.name} as {strat.inputs[j]}"] = edge.saved_bytes
    return out


def activation_expr(monomials: dict[str, sympy.Expr], recompute: str) -> sympy.Expr:
    """A layer's activation bytes from the fitted :func:`layer_bytes` monomials: the
    saved bytes of its nodes ("none"), less the attention core ("selective"), or the
    layer input alone ("full"); factored."""
    mode = recompute_mode(recompute)  # ValueError naming the modes
    core = [m for k, m in monomials.items() if k.endswith(_CORE)]
    saved = [m for k, m in monomials.items() if not k.endswith(_CORE) and k != _INPUT]
    # a node's saved bytes include its attention core, which selective drops
    return sympy.factor(mode.kept(sympy.Add(*saved), sympy.Add(*core), monomials[_INPUT]))


# --------------------------------------------------------------- derived closed forms
def layer_activation_expr(model: ModelSource = GPT, *, tp_symbolic: bool = True,
                          recompute: str = "none", dropout: float = 0.1) -> sympy.Expr:
    """Bytes one transformer layer keeps for backward, per micro-batch, per GPU, as a
    sympy expression in b, s, h, a (and t when ``tp_symbolic``), recovered from traces.

    model: a :class:`~autopar.models.GPTConfig` (the reference GPT with its dropout and
        vocabulary; the layer sizes are varied) or a factory ``GPTConfig -> nn.Module``
        built with ``dropout``. recompute: "none" | "selective" (attention core dropped)
        | "full" (the layer input only). With ``tp_symbolic=False``, t = 1.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    factory, template = _source(model, dropout)
    placements = planned_placements(factory, template)
    monomials = fit_monomials(lambda p: _layer_bytes(factory, template, placements, p),
                              _LAYER_BASE, _LAYER_CHECK)
    expr = activation_expr(monomials, recompute)
    return expr if tp_symbolic else sympy.factor(expr.subs(t, 1))


def _matmul_flops(factory, template, point: dict) -> dict[str, float]:
    """Forward matmul FLOPs per sequence of each node (what ``cost_tables`` sums), with
    layer-0 nodes keyed "layer:<name>" and the rest (embedding, head) "other:<name>"."""
    traced = _trace(factory, template, (point["s"], point["h"], point["a"], point["V"]))
    layer = set(traced.layers[0])
    return {f"{'layer' if n in layer else 'other'}:{n}": info.flops
            for n, info in traced.nodes.items() if info.kind in ("linear", "sdpa")}


def model_flops_expr(model: ModelSource = GPT, *, recompute: str = "full",
                     dropout: float = 0.1) -> sympy.Expr:
    """Model FLOPs of one training step in B, s, L, h, V (and a, which must cancel), as
    the cost adapter counts them: B·(3·(L·F_layer + F_other) + [full] L·F_layer) with F the
    forward matmul FLOPs per sequence (``autopar.planner.costs.tables.cost_tables``; Narayanan et al. 2021,
    section 5.1: backward = 2 × forward, full recompute = one more forward of each layer).
    recompute: "full" | "none" ("selective" counts like "none": its recomputed attention
    core is hardware work, not model FLOPs, as in Korthikanti et al. 2022)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    factory, template = _source(model, dropout)
    monomials = fit_monomials(lambda p: _matmul_flops(factory, template, p),
                              _FLOPS_BASE, _FLOPS_CHECK)
    per_layer = sympy.Add(*(m for k, m in monomials.items() if k.startswith("layer:")))
    other = sympy.Add(*(m for k, m in monomials.items() if k.startswith("other:")))
    # a recomputed layer runs a 4th pass; a recomputed core is not model FLOPs
    passes = 3 + recompute_mode(recompute).recomputed(1, 0)
    return sympy.expand(B * (passes * L * per_layer + 3 * other))


# ------------------------------------------------------------------------- report
def _pretty(formula: str) -> str:
    """``s*b*h*(34 + 5*a*s/h)`` -> ``s·b·h·(34 + 5·a·s/h)``; ``h**2`` -> ``h²``."""
    return formula.replace("**2", "²").replace("*", "·")


def formulas_markdown() -> str:
    """A Markdown section listing the closed forms the cost model reproduces, with their
    sources and the test that checks each (for the plan report to embed)."""
    checks = {
        "activations": "derived from the traced graph, `sympy.simplify(derived - closed) == 0`",
        "activations_tp": "derived (placements from `autopar.plan` at t = 8, t symbolic)",
        "activations_selective": "derived", "activations_tp_selective": "derived",
        "activations_full": "derived",
        "activations_tp_sp": "not derived: sequence parallelism is not priced yet",
        "activations_tp_sp_selective": "not derived: sequence parallelism is not priced yet",
        "model_flops_full_recompute": "derived, and equal to the traced count for GPT "
                                      "configs exactly",
        "model_flops": "derived (72·(eq. 3 bracket) would undercount the logits by 1.5·B·s·h·V)",
    }
    lines = ["### Closed forms the cost model reproduces", "",
             "b micro-batch, s sequence, h hidden, a heads, t tensor-parallel size, "
             "B global batch, L layers, V vocabulary; bytes assume 16-bit activations and "
             "1-byte dropout masks. Checked in `tests/unit/test_symbolic.py` "
             "(`autopar.oracle.symbolic`).", "",
             "| quantity | closed form | source | check |", "|---|---|---|---|"]
    for name, (formula, what, source) in _CLOSED_FORMS.items():
        lines.append(f"| {what} | {_pretty(formula)} | {source} | {checks[name]} |")
    lines.append("| model states, 7.5B parameters, d = 64 (ZeRO 0/1/2/3) | "
                 "120 / 31.4 / 16.6 / 1.9 GB | Rajbhandari et al. 2020, Fig. 1 | "
                 "`tests/unit/test_cost_models.py::test_zero_paper_figures` |")
    return "\n".join(lines) + "\n"
