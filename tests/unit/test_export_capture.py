"""Capture of models as people write them (``autopar.graph.export``): nanoGPT as written
and a Hugging Face Llama, on CPU and on the meta device, one process.

The multi-process half (verify against one process) is tests/multiprocess/test_model_zoo.py;
planning every family of the zoo is tests/slow/test_model_zoo_plans.py.
"""

from __future__ import annotations

import pytest
import torch

from autopar.graph.capture import trace_model
from autopar.graph.export import causal_lm_logits
from autopar.contract.placement import Shard
from autopar.planner.strategies import node_strategies
from autopar.rewrite.tensor_parallel import BlockOrder, ShardSpec
from helpers import load_script

zoo = load_script("benchmarks/model_zoo.py")
SEQ = 16


@pytest.mark.parametrize("family", ["nanogpt", "llama", "gpt2"])
def test_captured_graph_computes_the_model(family):
    pytest.importorskip("transformers")
    model = zoo.build(family, "tiny")
    traced = trace_model(model, SEQ)
    idx = torch.randint(0, 128, (3, SEQ))  # b = 3: the batch dim is captured dynamic
    assert torch.equal(traced.gm(idx), causal_lm_logits(model, idx))
    assert traced.num_layers == 2
    params = {p for info in traced.nodes.values() for p in info.params}
    assert params == {name for name, _ in model.named_parameters()}  # the model's own FQNs


def test_nanogpt_as_written_keeps_its_names_tying_and_fused_qkv():
    model = zoo.build("nanogpt", "tiny")
    traced = trace_model(model, SEQ)
    with torch.device("meta"):
        meta = trace_model(zoo.build("nanogpt", "tiny", device="meta"), SEQ)
    assert [n.name for n in traced.gm.graph.nodes] == [n.name for n in meta.gm.graph.nodes]
    assert traced.tied_params == {"lm_head.weight": "transformer.wte.weight"}
    fused = traced.nodes["transformer_h_0_attn_c_attn"]
    assert fused.extra["out_blocks"] == (64, 64, 64)  # q | k | v of one Linear
    keys = {s.key for s in node_strategies(traced, 2)["transformer_h_0_attn_c_attn"]}
    assert "column:S2" in keys


def test_nanogpt_forward_without_targets_returns_last_position_only():
    """Why capture passes targets: nanoGPT's inference shortcut."""
    model = zoo.build("nanogpt", "tiny")
    logits, loss = model(torch.zeros(1, SEQ, dtype=torch.long))
    assert logits.shape[1] == 1 and loss is None
    assert causal_lm_logits(model, torch.zeros(1, SEQ, dtype=torch.long)).shape[1] == SEQ


def test_blocked_shards_round_trip():
    full = torch.arange(2 * 12, dtype=torch.float32).reshape(2, 12)
    spec = ShardSpec("w", dim=1, blocks=(4, 4, 4))
    parts = [spec.local(full, r, 2) for r in range(2)]
    assert parts[0].tolist()[0] == [0, 1, 4, 5, 8, 9]  # the first half of every block
    assert torch.equal(spec.whole(parts), full)
    to, back = BlockOrder((4, 4, 4), 2, 1, True), BlockOrder((4, 4, 4), 2, 1, False)
    assert torch.equal(to(full).chunk(2, 1)[1], parts[1])
    assert torch.equal(back(to(full)), full)


def test_gqa_heads_and_rmsnorm_run_on_shards():
    pytest.importorskip("transformers")
    traced = trace_model(zoo.build("llama", "tiny", device="meta"), SEQ)
    options = node_strategies(traced, 2, sequence_parallel=True)
    sdpa = next(n for n, i in traced.nodes.items() if i.kind == "sdpa")
    assert any(s.name == "heads" for s in options[sdpa])
    mean = next(n for n, i in traced.nodes.items() if i.kind == "reduce")  # RMSNorm's mean
    assert {s.output for s in options[mean]} >= {Shard(1)}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_chunks_recompute_side_inputs_and_chain_to_the_model(family):
    """The causal mask, rotary cos/sin and the batch size, computed once before the first
    layer, are recomputed in the chunk that reads them: each chunk takes one tensor, and
    the chunks run in sequence give the model's logits."""
    pytest.importorskip("transformers")
    from autopar.rewrite.pipeline import annotate_chunks, split_chunks

    model = zoo.build(family, "tiny")
    traced = trace_model(model, SEQ)
    annotate_chunks(traced, [[0, 1], [1, 2]])
    chunks = split_chunks(traced.gm, 2)
    for chunk in chunks:
        assert len([n for n in chunk.graph.nodes if n.op == "placeholder"]) == 1
    params = {id(p) for chunk in chunks for p in chunk.parameters()}
    assert params == {id(p) for p in model.parameters()}  # the model's own Parameters
    idx = torch.randint(0, 128, (3, SEQ))
    assert torch.equal(chunks[1](chunks[0](idx)), causal_lm_logits(model, idx))


def test_full_recompute_checkpoints_layers_that_read_side_inputs():
    """A Llama layer reads the causal mask, rotary cos/sin and the batch size besides the
    previous layer's output; checkpointing it whole keeps them as inputs, and gradients
    equal the model's."""
    pytest.importorskip("transformers")
    from autopar.rewrite.recompute import Checkpointed, apply_recompute

    model = zoo.build("llama", "tiny")
    traced = trace_model(model, SEQ)
    apply_recompute(traced.gm, traced.layers, ["full", "full"])
    assert sum(isinstance(m, Checkpointed) for m in traced.gm.modules()) == 2
    idx = torch.randint(0, 128, (3, SEQ))
    traced.gm(idx).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    causal_lm_logits(model, idx).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_bf16_plan_names_the_nodes_of_the_bf16_program():
    """Hugging Face's RMSNorm casts to fp32 and back: its bf16 graph has other casts than
    the fp32 one, so the plan is traced in the plan's dtype, as the runtime traces."""
    pytest.importorskip("transformers")
    import autopar
    from cost_models.hardware import Cluster

    plan = autopar.plan(zoo.build("llama", "tiny", device="meta"), Cluster.dgx_a100(1),
                        global_batch_size=8, seq_len=SEQ,
                        layout=autopar.Layout(tp=2, pp=1, dp=4, dtype="bf16"))
    local = trace_model(zoo.build("llama", "tiny").to(torch.bfloat16), SEQ)
    assert set(plan.placements) == {n.name for n in local.gm.graph.nodes}
    fp32 = trace_model(zoo.build("llama", "tiny"), SEQ)
    assert set(plan.placements) != {n.name for n in fp32.gm.graph.nodes}  # the case at hand


def _graph_record(gm) -> list[tuple]:
    """What the rest of autopar reads of a captured graph: names, ops, targets, arguments
    and the module path of every node."""
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs),
             [v[0] for v in (n.meta.get("nn_module_stack") or {}).values()])
            for n in gm.graph.nodes]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_repeated_layers_capture_the_same_graph_as_a_full_export(family):
    """Five layers exported as three, the last repeated (autopar.graph.repeat), give the
    graph of a full export node for node, and it computes the model."""
    pytest.importorskip("transformers")
    from autopar.graph import export, repeat

    model = zoo._hf(family, dict(zoo.TINY, layers=5)).eval()
    assert repeat.layer_stack(model) is not None
    cut = export.export_logits(model, SEQ, ValueError)
    full = export.export_logits(model, SEQ, ValueError, repeat_layers=False)
    assert _graph_record(cut) == _graph_record(full)
    assert cut.code == full.code
    idx = torch.randint(0, 128, (2, SEQ))
    assert torch.equal(cut(idx), causal_lm_logits(model, idx))


def test_leading_layers_that_differ_are_exported_before_the_repeated_ones(monkeypatch):
    """DeepSeek-V3's first dense layers before its MoE ones (``first_k_dense_replace``): the
    stack is exported cut to the 2 leading layers and 3 MoE layers, the last repeated, and
    gives the graph of a full export node for node."""
    pytest.importorskip("transformers")
    from autopar.graph import export, repeat

    families = load_script("benchmarks/hf_families.py")
    monkeypatch.setitem(families.MOE_EVERY_LAYER, "first_k_dense_replace", 2)
    model = families.build_family("deepseek_v3", d=dict(zoo.TINY, layers=7)).eval()
    assert repeat.layer_stack(model)[2] == 2
    cut = export.export_logits(model, SEQ, ValueError)
    full = export.export_logits(model, SEQ, ValueError, repeat_layers=False)
    assert _graph_record(cut) == _graph_record(full)
    idx = torch.randint(0, 128, (2, SEQ))
    assert torch.equal(cut(idx), causal_lm_logits(model, idx))


def test_layers_that_differ_are_exported_whole():
    """A layer with its own attribute value (not its index) is not repeated."""
    pytest.importorskip("transformers")
    from autopar.graph import repeat

    model = zoo._hf("llama", dict(zoo.TINY, layers=5))
    assert repeat.layer_stack(model)[0] == "model.layers"
    model.model.layers[4].self_attn.scaling = 0.5
    assert repeat.layer_stack(model) is None
    model.model.layers[4].self_attn.scaling = model.model.layers[3].self_attn.scaling
    model.model.layers[0].self_attn.scaling = 0.5  # a leading layer that differs: exported
    assert repeat.layer_stack(model)[2] == 1


def test_falcon_linears_written_as_matmul_are_lifted_and_devices_agree():
    """Falcon's ``FalconLinear`` computes ``x @ weight.T + bias`` in its own forward: the
    region is lifted to the Linear, so TP can split it; the ``torch.tensor`` constant its
    attention builds is copied on CPU and not on meta, and both capture one graph."""
    pytest.importorskip("transformers")
    model = zoo.build("falcon", "tiny")
    traced = trace_model(model, SEQ)
    linears = [name for name, info in traced.nodes.items() if info.kind == "linear"]
    assert len(linears) == 4 * 2 + 1  # qkv, dense, h_to_4h, 4h_to_h per layer; lm_head
    meta = trace_model(zoo.build("falcon", "tiny", device="meta"), SEQ)
    assert [n.name for n in meta.gm.graph.nodes] == [n.name for n in traced.gm.graph.nodes]
    idx = torch.randint(0, 128, (3, SEQ))
    assert torch.equal(traced.gm(idx), causal_lm_logits(model, idx))
