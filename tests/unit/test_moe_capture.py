"""Mixture-of-experts layers as the cost model sees them: six transformers families (tiny
configs, meta device) captured, their MoE blocks found from the graph (router, top-k,
experts, shared experts), and the expert and router matmuls priced at their FLOPs and GEMM
shapes instead of one FLOP per output element.

Expected FLOPs per sequence of s tokens (Fedus et al. 2022, section 2; a gated MLP's three
GEMMs, Shazeer 2020): routed experts 6·s·k·h·F, router 2·s·h·E; Llama 4's experts run every
token through every expert (``bmm`` over E), 6·s·E·h·F as written.
"""

from __future__ import annotations

import pytest

from helpers import load_script

from autopar.graph.capture import trace_model
from autopar.graph.moe import moe_blocks
from autopar.graph.ops import is_grouped_mm
from autopar.planner.costs.node_cost import node_cost
from autopar.planner.strategies import node_strategies
from cost_models.hardware import Cluster

pytest.importorskip("transformers")
families = load_script("benchmarks/hf_families.py")
zoo = load_script("benchmarks/model_zoo.py")

SEQ = 16
# family: (shared experts, score function, how the experts run)
CASES = {
    "mixtral": (False, "softmax", "grouped_mm"),
    "qwen2_moe": (True, "softmax", "grouped_mm"),    # shared expert with a sigmoid gate
    "deepseek_v3": (True, "sigmoid", "grouped_mm"),  # MLA, group-limited sigmoid routing
    "olmoe": (False, "softmax", "grouped_mm"),
    "gpt_oss": (False, "softmax", "grouped_mm"),     # expert biases, transposed weights
    "llama4_text": (True, "sigmoid", "bmm"),         # every token through every expert
}


def _expert_ffn(cfg) -> int:
    return getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size


def _num_experts(cfg) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(cfg, key, None):
            return getattr(cfg, key)
    raise AssertionError(f"no expert count in {type(cfg).__name__}")


@pytest.fixture(scope="module", params=sorted(CASES))
def captured(request):
    model = families.build_family(request.param, device="meta")
    return request.param, model.config, trace_model(model, SEQ)


def test_every_layer_has_one_moe_block_with_the_config_sizes(captured):
    family, cfg, traced = captured
    shared, scores, form = CASES[family]
    blocks = moe_blocks(traced)
    assert [b.layer for b in blocks] == list(range(cfg.num_hidden_layers))
    for block in blocks:
        assert (block.num_experts, block.top_k, block.hidden_size, block.expert_ffn) == (
            _num_experts(cfg), cfg.num_experts_per_tok, cfg.hidden_size, _expert_ffn(cfg))
        assert (bool(block.shared), block.score_function, block.form) == (shared, scores, form)
        assert block.tokens == SEQ and block.gated


def test_expert_and_router_matmuls_are_priced_at_their_flops(captured):
    family, cfg, traced = captured
    h, k, E, F = cfg.hidden_size, cfg.num_experts_per_tok, _num_experts(cfg), _expert_ffn(cfg)
    rows = SEQ * (E if CASES[family][2] == "bmm" else k)
    for block in moe_blocks(traced):
        experts = sum(traced.nodes[n].flops for n in block.experts)
        assert experts == 6.0 * rows * h * F == block.routed_flops()
        assert traced.nodes[block.router].flops == 2.0 * SEQ * h * E


def test_a_grouped_matmul_is_priced_as_gemms_with_a_weight_gradient(captured):
    family, _, traced = captured
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    block = moe_blocks(traced)[0]
    if CASES[family][2] == "bmm":  # Llama 4: batched matmuls over all E experts
        assert [traced.nodes[n].extra["gemms"][0][0] for n in block.experts] == [
            block.num_experts] * 2
        return
    # transformers' experts module: one call (autopar.graph.experts), its two grouped GEMMs
    call, = (by_name[n] for n in block.experts)
    assert call.op == "call_module" and call.target == block.experts_module
    info = traced.nodes[call.name]
    m = -(-SEQ * block.top_k // block.num_experts)
    E, h, F = block.num_experts, block.hidden_size, block.expert_ffn
    assert info.extra["gemms"] == ((E, m, 2 * F, h), (E, m, h, F))
    strategy = node_strategies(traced, 1)[info.name][0]  # tp = 1: the one, replicated
    cost = node_cost(info, strategy, 1, Cluster.dgx_a100(1), 1, info.numel)
    # forward, backward = dX and dW GEMMs, dW deferred by a zero-bubble schedule
    assert 0 < cost.wgrad_s < cost.bwd_s and cost.fwd_s > 0
    # what the replaced ops kept for backward: at least the k rows of h per token gathered
    # for the first GEMM and their 2F-wide output
    saved, moved, ops = info.extra["inner"]
    assert saved >= SEQ * block.top_k * (h + 2 * F) and moved > 0 and ops > 5
    assert cost.saved_bytes >= 2 * saved


def test_the_static_form_of_a_family_without_an_experts_module_stays_grouped_matmuls():
    traced = trace_model(families.build_family("dbrx", device="meta"), SEQ)
    block = moe_blocks(traced)[0]
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    assert not block.experts_module and len(block.experts) == 3
    assert all(is_grouped_mm(by_name[n]) for n in block.experts)
    assert all(traced.nodes[n].extra["saves_inputs"] for n in block.experts)


def test_bf16_capture_prices_torch_grouped_mm_the_same_way():
    model = families.build_family("mixtral", device="meta")
    fp32, bf16 = trace_model(model, SEQ), trace_model(model, SEQ, dtype="bf16")
    flops = [[fp32.nodes[n].flops for n in b.experts] for b in moe_blocks(fp32)]
    assert [[bf16.nodes[n].flops for n in b.experts] for b in moe_blocks(bf16)] == flops


def test_a_router_loss_the_program_would_drop_is_refused_by_name():
    model = families.build_family("mixtral", device="meta")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True.*router_aux_loss_coef=0.001"):
        trace_model(model, SEQ)
    model.config.output_router_logits = False  # the fix the message names
    assert moe_blocks(trace_model(model, SEQ))


def test_blocks_are_found_in_every_layer_when_dense_and_moe_layers_alternate(monkeypatch):
    monkeypatch.setitem(families.MOE_EVERY_LAYER, "decoder_sparse_step", 2)
    model = families.build_family("qwen2_moe", device="meta", d=dict(zoo.TINY, layers=5))
    traced = trace_model(model, SEQ)
    assert [b.layer for b in moe_blocks(traced)] == [1, 3]  # MoE every 2nd layer, 1-based


def test_only_tensors_that_get_a_gradient_carry_one():
    # autograd's rule on the graph (NodeInfo.carries_grad): a TP collective of a gradient
    # that never exists (the rotary tables', the routing indices') is neither run nor priced
    traced = trace_model(families.build_family("mixtral", device="meta"), SEQ)
    graph, info = {n.name: n for n in traced.gm.graph.nodes}, traced.nodes
    block = moe_blocks(traced)[0]
    hidden, index, weights = graph[block.experts[0]].args[:3]
    assert info[hidden.name].carries_grad and info[weights.name].carries_grad
    assert not info[index.name].carries_grad  # top-k's int64 indices
    topk = next(n for n, g in graph.items() if "topk" in str(g.target))
    assert info[topk].carries_grad  # (values, indices): the values do
    assert info[block.router].carries_grad
    assert not any(info[n].carries_grad for n, g in graph.items()
                   if g.op == "placeholder" or (g.op == "get_attr" and not info[n].params))
    assert all(info[n].carries_grad for n, g in graph.items()
               if g.op == "get_attr" and info[n].params)
    rotary = [n for n, g in graph.items() if g.op == "call_function" and "cos" in str(g.target)]
    assert rotary and not any(info[n].carries_grad for n in rotary)
    # top-k's outputs grow with the batch like its input (priced per sequence)
    assert all(info[n.name].per_sequence for n in (hidden, index, weights))
