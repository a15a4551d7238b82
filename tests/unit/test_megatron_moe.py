"""Megatron-LM's TP pattern on an MoE block (``autopar.planner.strategies.megatron``): the router stays
whole on every rank, the shared expert is split like a dense MLP, and a row-parallel output
of the block's (tokens, h) rows is all-reduced (it has no sequence dim to reduce-scatter
over), so ``autopar.evaluate`` prices the layout instead of refusing its placements."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.graph.capture import trace_model
from autopar.planner.strategies.megatron import linear_roles, megatron_placements, moe_routers

SEQ = 16


@pytest.fixture(scope="module")
def qwen2_moe():
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                            intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, shared_expert_intermediate_size=64)
    with torch.device("meta"):
        return tf.Qwen2MoeForCausalLM(cfg)


def test_router_is_whole_and_the_shared_expert_split_like_an_mlp(qwen2_moe):
    traced = trace_model(qwen2_moe, SEQ)
    assert moe_routers(traced) == set()  # Qwen2-MoE's router is F.linear on its weight
    placements = megatron_placements(traced, 2, sequence_parallel=True)
    topk = next(n for n in traced.gm.graph.nodes
                if n.name in traced.layers[0] and n.target is torch.ops.aten.topk.default)
    router = topk.args[0].args[0]  # topk(softmax(linear(h, gate.weight)))
    assert router.target is torch.ops.aten.linear.default
    assert placements[router.name].startswith("replicate")
    shared = "model_layers_0_mlp_shared_expert_"
    roles = linear_roles(traced)
    assert roles[shared + "up_proj"] == "in" and roles[shared + "down_proj"] == "out"
    assert placements[shared + "up_proj"].startswith("column")
    assert placements[shared + "down_proj"].startswith("row")


def test_evaluate_prices_megatrons_moe_layout(qwen2_moe):
    layout = autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=2, sequence_parallel=True,
                            recompute="selective", dtype="fp32")
    plan = autopar.evaluate(qwen2_moe, autopar.Cluster.local_cpu(processes=2), layout,
                            global_batch_size=2, seq_len=SEQ)
    assert plan.solver.status == "EVALUATED" and plan.predicted.step_time_s > 0
