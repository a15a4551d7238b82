"""Layers that differ are planned as groups of identical layers (autopar.graph.layer_groups):
DeepSeek-V3's dense first layer, Qwen2-MoE's experts on every second layer (or not on
``mlp_only_layers``), Llama 4's interleaved MoE layers. Each is captured with its grouping
(k leading layers in pre, groups of n), priced node by node (the step's FLOPs are the sum
over the real layers, not the template times L) and planned with pipeline cuts on group
boundaries that the pipeline rewrite maps to the right module layers."""

from __future__ import annotations

import pytest

import autopar
from autopar.frameworks.megatron import megatron_args
from autopar.graph.capture import trace_model
from autopar.graph.layer_groups import find_grouping, grouping_of, module_layers
from autopar.planner.cpsat.terms import template_map
from autopar.planner.search.configs import candidate_configs
from autopar.planner.strategies.megatron import linear_roles
from autopar.rewrite.pipeline import CHUNK, annotate_chunks
from helpers import load_script

SEQ, BATCH = 32, 8


@pytest.mark.parametrize("kinds, want", [
    ("aaaa", (0, 1, 0)),
    ("dmm", (1, 1, 0)),                 # DeepSeek-V3, first_k_dense_replace = 1
    ("d" * 3 + "m" * 58, (3, 1, 0)),    # DeepSeek-V3 at full depth: 58 groups
    ("dmdm", (0, 2, 0)),                # Qwen2-MoE, decoder_sparse_step = 2
    ("dmmm", (1, 1, 0)),                # Qwen2-MoE, mlp_only_layers = [0]
    ("abac", (0, 4, 0)),                # Llama 4's default 4 layers: MoE on 1, 3, no RoPE on 3
    ("abac" * 12, (0, 4, 0)),           # Llama 4 Maverick's 48 layers: 12 groups of 4
    ("ababa", (0, 2, 1)),               # 5 layers of period 2: the last one in post
    ("abc", (0, 3, 0)),                 # nothing repeats: one group
    (["Af", "Af", "Af", "A"], (0, 1, 1)),  # x = f(layer(x)): the last f is after the stack
])
def test_find_grouping(kinds, want):
    g = find_grouping(list(kinds))
    assert (g.prefix, g.period, g.suffix) == want
    assert g.prefix + g.groups * g.period + g.suffix == len(kinds)


def _hf_families(monkeypatch, **switches):
    """benchmarks/hf_families.py with its every-layer-MoE switches overridden by ``switches``."""
    pytest.importorskip("transformers")
    hf = load_script("benchmarks/hf_families.py")
    monkeypatch.setattr(hf, "MOE_EVERY_LAYER", {**hf.MOE_EVERY_LAYER, **switches})
    return hf


CASES = {  # model type, layers, switches -> (k, n, G, r)
    "deepseek_v3": ("deepseek_v3", 3, dict(first_k_dense_replace=1), (1, 1, 2, 0)),
    "qwen2_moe": ("qwen2_moe", 4, dict(decoder_sparse_step=2), (0, 2, 2, 0)),
    "qwen2_moe_dense_first": ("qwen2_moe", 4, dict(mlp_only_layers=[0]), (1, 1, 3, 0)),
    # 5 layers of period 2: the trailing dense layer joins post (the last stage)
    "qwen2_moe_odd": ("qwen2_moe", 5, dict(decoder_sparse_step=2), (0, 2, 2, 1)),
    "llama4_text": ("llama4_text", 4, dict(interleave_moe_layer_step=2, no_rope_layer_interval=2),
                    (0, 2, 2, 0)),
}


def _build(monkeypatch, case):
    from benchmarks.model_zoo import TINY
    model_type, layers, switches, want = CASES[case]
    hf = _hf_families(monkeypatch, **switches)
    return hf, hf.build_family(model_type, device="meta", d={**TINY, "layers": layers}), want


def _flops(traced, names) -> float:
    return sum(traced.nodes[n].flops for n in names)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouping_and_exact_flops(monkeypatch, case):
    _, model, (k, n, groups, r) = _build(monkeypatch, case)
    traced = trace_model(model, SEQ)
    g = grouping_of(traced)
    assert (g.prefix, g.period, g.groups, g.suffix) == (k, n, groups, r)
    assert traced.num_layers == groups and len(module_layers(traced)) == k + n * groups + r
    template_map(traced)  # the groups are one template (raised before)
    every = _flops(traced, traced.nodes)
    # what the CP-SAT model prices: pre (with the leading layers) + G x the template + post
    priced = (_flops(traced, traced.pre) + groups * _flops(traced, traced.layers[0])
              + _flops(traced, traced.post))
    assert priced == pytest.approx(every, rel=1e-12)
    layers = module_layers(traced)
    as_first = _flops(traced, traced.pre) - sum(_flops(traced, l) for l in layers[:k]) + \
        len(layers) * _flops(traced, layers[0]) + _flops(traced, traced.post)
    assert as_first != pytest.approx(every, rel=1e-6)  # layer 0 x L would misprice
    # Megatron's roles are read per transformer layer: the leading layers' Linears too
    assert set(linear_roles(traced)) == {name for names in layers for name in names
                                         if traced.nodes[name].kind == "linear"}


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen2_moe", "qwen2_moe_odd", "llama4_text"])
def test_plans_and_cuts_on_group_boundaries(monkeypatch, case):
    hf, model, (k, n, groups, r) = _build(monkeypatch, case)
    cluster = hf.tiny_cluster(4)
    traced = trace_model(model, SEQ)
    searched = {(c.tp, c.pp, c.dp) for c in candidate_configs(traced, cluster, BATCH, autopar.Layout())}
    assert {(2, 1, 2), (1, 2, 2), (1, 1, 4), (2, 2, 1)} <= searched
    autopar.plan(model, cluster, global_batch_size=BATCH, seq_len=SEQ, model_name=case)
    plan = autopar.plan(model, cluster, global_batch_size=BATCH, seq_len=SEQ, model_name=case,
                        layout=autopar.Layout(pp=2))
    assert plan.pp == 2 and plan.stage_layers == [[0, 1], [1, 2]] and len(plan.recompute) == 2
    with pytest.raises(ValueError, match=r"2 layers are groups of the model's \d transformer"):
        megatron_args(plan)  # Megatron-LM's flags count transformer layers: refused by name
    mfu_flops = plan.predicted.mfu * plan.predicted.step_time_s * plan.num_gpus * \
        cluster.device.peak_flops
    matmul = sum(i.flops for i in traced.nodes.values() if i.model_matmul)  # experts too
    assert mfu_flops == pytest.approx(3 * BATCH * matmul, rel=1e-9)
    # the pipeline rewrite: module layer i sits in the chunk of its group (leading layers: 0)
    annotate_chunks(traced, plan.stage_layers)
    chunk_of = {node.name: node.meta[CHUNK] for node in traced.gm.graph.nodes}
    g = grouping_of(traced)
    for i, names in enumerate(module_layers(traced)):
        group = (i - k) // n if k <= i < k + n * groups else None
        edge = 0 if i < k else len(plan.stage_layers) - 1  # leading: first, trailing: last
        want = edge if group is None else next(c for c, (lo, hi) in enumerate(plan.stage_layers)
                                            if lo <= group < hi)
        assert {chunk_of[name] for name in names} == {want}, i
        if group is not None:
            assert i in g.module_layers_of(group)
