"""Closed forms recovered from the traced graph equal the published ones (autopar.oracle.symbolic).

Korthikanti et al. 2022 (activation bytes per layer, Table 2) and Narayanan et al. 2021
eq. (3) / Korthikanti et al. 2022 Appendix A (model FLOPs per step). The ZeRO figures of
Rajbhandari et al. 2020 are checked in tests/test_cost_models.py::test_zero_paper_figures.
"""

from __future__ import annotations

import pytest
import sympy
import torch

import autopar
from autopar.oracle import symbolic
from autopar.planner.costs.tables import Config, cost_tables
from autopar.models import GPT, GPTConfig, preset
from autopar.planner.strategies import node_strategies
from autopar.oracle.symbolic import SYMBOLS, closed_form, layer_activation_expr, model_flops_expr
from autopar.graph.capture import trace_model
from cost_models.memory import transformer_layer_activation_bytes

b, s, h, a, t, B, L, V = (SYMBOLS[k] for k in "b s h a t B L V".split())
CONFIG = GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=51200, block_size=16, dropout=0.1)


@pytest.mark.parametrize("tp_symbolic, recompute, name", [
    (False, "none", "activations"),
    (True, "none", "activations_tp"),
    (False, "selective", "activations_selective"),
    (True, "selective", "activations_tp_selective"),
    (False, "full", "activations_full"),
    (True, "full", "activations_full"),
])
def test_layer_activations_simplify_to_korthikanti(tp_symbolic, recompute, name):
    derived = layer_activation_expr(CONFIG, tp_symbolic=tp_symbolic, recompute=recompute)
    assert sympy.simplify(derived - closed_form(name)) == 0
    assert (t in derived.free_symbols) == (tp_symbolic and recompute != "full")


def test_derived_bytes_equal_cost_models_closed_form_at_gpt_8_3b():
    """The derived expression, evaluated at GPT-8.3B (s=1024, h=3072, a=32), equals the
    independent implementation in cost_models.memory for t = 1, 2, 8 and b = 1, 4."""
    derived = layer_activation_expr(CONFIG)
    for tp in (1, 2, 8):
        for mbs in (1, 4):
            value = derived.subs({b: mbs, s: 1024, h: 3072, a: 32, t: tp})
            assert value == sympy.Rational(transformer_layer_activation_bytes(1024, mbs, 3072, 32, tp=tp))


def test_megatron_placements_come_from_the_planner():
    p = symbolic.planned_placements(GPT, CONFIG)
    assert p["transformer_h_0_attn_c_q"] == "column:S2" and p["transformer_h_0_mlp_c_fc"] == "column:S2"
    assert p["transformer_h_0_attn_c_proj"] == "row:P" and p["transformer_h_0_mlp_c_proj"] == "row:P"
    assert p["scaled_dot_product_attention"] == "heads:S1"


def test_model_flops_simplify_to_narayanan_eq3_and_korthikanti_appendix_a():
    full = model_flops_expr(CONFIG, recompute="full")
    none = model_flops_expr(CONFIG, recompute="none")
    assert sympy.simplify(full - closed_form("model_flops_full_recompute")) == 0
    assert sympy.simplify(none - closed_form("model_flops")) == 0
    assert a not in full.free_symbols  # heads cancel: 4·s²·h per layer for attention
    # "72 × eq. (3)'s bracket" would count the never-recomputed logit layer 3/4 times
    bracket72 = closed_form("model_flops_full_recompute") * sympy.Rational(72, 96)
    assert sympy.simplify(none - bracket72 - sympy.Rational(3, 2) * B * s * h * V) == 0


@pytest.mark.parametrize("name, seq_len", [("gpt-1.3b", 2048), ("gpt-8.3b", 1024)])
def test_traced_flops_equal_eq3_exactly(name, seq_len):
    """The count autopar.planner.costs.tables uses (3 × forward matmuls + one forward of every layer),
    per sequence, equals eq. (3) with B = 1 exactly (integers below 2**53)."""
    cfg = preset(name)
    with torch.device("meta"):
        traced = trace_model(GPT(cfg), seq_len)
    tables = cost_tables(traced, node_strategies(traced, 1), autopar.Cluster.dgx_a100(1),
                         Config(1, 1, 1, 1, 1))
    counted = tables.model_flops_per_seq + cfg.n_layer * tables.layer_fwd_flops_per_seq
    sizes = {B: 1, s: seq_len, L: cfg.n_layer, h: cfg.n_embd, V: cfg.vocab_size}
    assert sympy.Rational(counted) == closed_form("model_flops_full_recompute").subs(sizes)
    assert sympy.Rational(tables.model_flops_per_seq) == closed_form("model_flops").subs(sizes)


def test_reported_tflops_use_eq3():
    """Prediction.tflops_per_gpu × step time × GPUs is eq. (3)'s count for the batch."""
    with torch.device("meta"):
        model = GPT(preset("gpt-1.3b"))
    plan = autopar.evaluate(model, autopar.Cluster.dgx_a100(1),
                            autopar.Layout(tp=2, pp=2, dp=2, micro_batch_size=1, recompute="full"),
                            global_batch_size=16, seq_len=2048)
    p = plan.predicted
    flops = p.tflops_per_gpu * 1e12 * p.step_time_s * plan.num_gpus
    exact = closed_form("model_flops_full_recompute").subs(
        {B: 16, s: 2048, L: 24, h: 2048, V: 51200})
    assert flops == pytest.approx(float(exact), rel=1e-9)


def test_fit_rejects_a_non_monomial_and_names_it():
    def measure(p):
        return {"x²+x": float(p["x"] ** 2 + p["x"]), "3x": 3.0 * p["x"]}

    with pytest.raises(symbolic.SymbolicFitError, match=r"x²\+x"):
        symbolic.fit_monomials(measure, {"s": 1, "x": 4}, {"s": 1, "x": 6})
    good = symbolic.fit_monomials(lambda p: {"3x": 3.0 * p["s"]}, {"s": 4}, {"s": 6})
    assert good == {"3x": 3 * s}


def test_closed_form_names_and_errors():
    assert sympy.simplify(closed_form("activations_tp_sp").subs(t, 1)
                          - closed_form("activations")) == 0
    with pytest.raises(ValueError, match="unknown closed form 'nope'"):
        closed_form("nope")
    with pytest.raises(ValueError, match="recompute must be"):
        layer_activation_expr(CONFIG, recompute="most")


def test_formulas_markdown_lists_formulas_with_sources():
    text = symbolic.formulas_markdown()
    assert "s·b·h·(10 + 24/t + 5·a·s/(h·t))" in text and "Korthikanti et al. 2022" in text
    assert "96·B·s·L·h²·(1 + s/(6·h) + V/(16·L·h))" in text and "Narayanan et al. 2021" in text
    assert "120 / 31.4 / 16.6 / 1.9 GB" in text
    assert text.count("\n| ") == len(symbolic.closed_form_names()) + 2  # header + ZeRO row


def test_report_formula_table_equals_the_oracle():
    """The report's static table (it imports no sympy) is exactly what the oracle prints;
    after changing a closed form, paste ``symbolic.formulas_markdown()`` into
    autopar/report/formulas.py."""
    from autopar.report.formulas import FORMULAS_MARKDOWN

    assert symbolic.formulas_markdown() == FORMULAS_MARKDOWN


# ------------------------------------------------------------------------------ Llama
LLAMA_CASES = [(False, "none", "activations"), (True, "none", "activations_tp"),
               (False, "selective", "activations_selective"),
               (True, "selective", "activations_tp_selective"), (True, "full", "activations_full")]


@pytest.mark.parametrize("tp_symbolic, recompute, name", LLAMA_CASES)
def test_llama_layer_activations_simplify_to_the_hand_derivation(tp_symbolic, recompute, name):
    """Traced HF Llama layers (RMSNorm, rotary, GQA, SwiGLU) priced under Megatron's
    placements give the closed forms derived in autopar.oracle.symbolic_llama."""
    pytest.importorskip("transformers")
    from autopar.oracle import symbolic_llama as sl

    derived = sl.llama_layer_activation_expr(tp_symbolic=tp_symbolic, recompute=recompute)
    assert sympy.simplify(derived - sl.llama_closed_form(name)) == 0


def test_llama_layer_flops_simplify_to_the_hand_derivation():
    pytest.importorskip("transformers")
    from autopar.oracle import symbolic_llama as sl

    derived = sl.llama_layer_flops_expr()
    assert sympy.simplify(derived - sl.llama_closed_form("layer_flops")) == 0
    kv, f = SYMBOLS["kv"], SYMBOLS["f"]
    assert derived.free_symbols == {s, h, a, kv, f}  # GQA's kv heads enter through K and V


def test_megatron_placements_split_llama_like_megatron():
    """Found by role (reads the residual stream or another Linear), not by module name:
    rotary and SwiGLU's product pass the shards through."""
    pytest.importorskip("transformers")
    from autopar.planner.strategies.megatron import megatron_placements
    from autopar.oracle import symbolic_llama as sl

    traced = trace_model(sl.build_llama(s=16, h=256, a=16, kv=4, f=192, vocab=64), 16)
    p = megatron_placements(traced, 2)
    prefix = "model_layers_0_"
    for name in ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "mlp_gate_proj",
                 "mlp_up_proj"):
        assert p[prefix + name] == "column:S2"
    assert p[prefix + "self_attn_o_proj"] == p[prefix + "mlp_down_proj"] == "row:P"
    assert p["scaled_dot_product_attention"] == "heads:S1"
    assert p["model_embed_tokens"] == "vocab:P" and p["output"] == "vocab_parallel:S2"
    assert p["to_6"] == "replicate:R"  # RMSNorm stays whole without sequence parallelism


def _reference_plan(model, layout, recompute, seq, batch):
    """``layout`` evaluated, per-layer ``recompute`` and Megatron's placements set, priced."""
    import dataclasses

    from autopar.planner.strategies.megatron import megatron_placements
    from autopar.planner.costs.decision import decision_from_plan
    from autopar.planner.costs.predict import predict

    cluster = autopar.Cluster.dgx_a100(1)
    plan = autopar.evaluate(model, cluster, layout, global_batch_size=batch, seq_len=seq)
    traced = trace_model(model, seq)
    plan = dataclasses.replace(plan, recompute=recompute,
                               placements=megatron_placements(traced, plan.tp))
    decision, tables, strategies = decision_from_plan(traced, cluster, plan)
    return dataclasses.replace(plan, predicted=predict(traced, strategies, tables, cluster,
                                                       decision, global_batch_size=batch))


@pytest.mark.parametrize("family, schedule", [("gpt", "interleaved_1f1b"), ("llama", "interleaved_1f1b"),
                                              ("gpt", "zb_h1")])
def test_plan_memory_and_flops_equal_the_closed_forms(family, schedule):
    """autopar.oracle.plan_forms against the cost model on a small model: memory per rank
    and kind (interleaved 1F1B with ZeRO-2; ZB-H1, whose head rank holds its inputs to W
    and the loss's softmax to B, with ZeRO-1; mixed recompute) and FLOPs, to float
    rounding."""
    from autopar.oracle import plan_forms

    if family == "gpt":
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=256, vocab_size=512, block_size=64,
                                  dropout=0.1))
    else:
        pytest.importorskip("transformers")
        from autopar.oracle.symbolic_llama import build_llama

        model = build_llama(s=64, h=256, a=16, kv=4, f=512, layers=8, vocab=512)
    v = 2 if schedule == "interleaved_1f1b" else 1
    layout = autopar.Layout(tp=2, pp=2, dp=2, micro_batch_size=2, zero_stage=3 - v,
                            schedule=schedule, virtual_stages=v)
    recompute = ["none", "selective", "full", "none", "selective", "none", "full", "none"]
    if schedule == "zb_h1":  # a split backward does not recompute whole layers
        recompute = [m.replace("full", "selective") for m in recompute]
    plan = _reference_plan(model, layout, recompute, 64, 32)
    shape = plan_forms.ModelShape.of(model)
    closed = plan_forms.stage_memory_bytes(shape, plan)
    for got, want in zip(plan.predicted.memory_bytes_by_stage, closed):
        assert got == pytest.approx(want, rel=1e-12)
    pred = plan_forms.predicted_flops(plan, autopar.Cluster.dgx_a100(1).device.peak_flops)
    assert pred == pytest.approx(plan_forms.step_flops(shape, plan), rel=1e-12)
