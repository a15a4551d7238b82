"""The static forms of expert loops (autopar.graph.expert_loops) against the families' own
loops: the same outputs and gradients, empty experts and LongCat's identity experts
included, and the model exported with them."""

from __future__ import annotations

import pytest
import torch

from autopar.graph.expert_loops import static_experts

tf = pytest.importorskip("transformers")


def _randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def _outputs_and_grads(module, call, inputs):
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = call(module, *inputs)
    torch.manual_seed(1)
    weight = torch.randn_like(out)
    leaves = list(module.parameters()) + [x for x in inputs if x.requires_grad]
    grads = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]


def _assert_same_with_and_without(module, call, inputs) -> None:
    own, own_grads = _outputs_and_grads(module, call, inputs)
    with static_experts(module) as switched:
        assert switched >= 1
        static, static_grads = _outputs_and_grads(module, call, inputs)
    assert "forward" not in vars(module)
    assert torch.isfinite(own).all()
    torch.testing.assert_close(static, own)
    for a, b in zip(static_grads, own_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def _jetmoe_config():
    return tf.JetMoeConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                           num_experts_per_tok=2, kv_channels=8, num_key_value_heads=2,
                           num_attention_heads=4)


def test_jetmoe_mlp_and_attention_experts_equal_their_loops():
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoA, JetMoeMoE

    x = torch.randn(2, 5, 32)
    _assert_same_with_and_without(_randomised(JetMoeMoE(_jetmoe_config())),
                                  lambda m, x: m(x), [x])

    def map_reduce(m, x):
        heads, _, topo = m.map(x)
        return m.reduce(heads.tanh(), topo)

    _assert_same_with_and_without(_randomised(JetMoeMoA(_jetmoe_config()), 1), map_reduce, [x])


@pytest.mark.parametrize("zero_experts", [0, 3])
def test_longcat_experts_equal_their_loop_with_identity_and_empty_experts(zero_experts):
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    config = tf.LongcatFlashConfig(hidden_size=32, expert_ffn_hidden_size=16,
                                   n_routed_experts=4, zero_expert_num=zero_experts)
    experts = _randomised(LongcatFlashExperts(config))
    tokens, total = 7, 4 + zero_experts
    scores = torch.randn(tokens, total)
    scores[:, 2] = -10  # expert 2 gets no token
    top_k_index = scores.topk(2, dim=-1).indices
    if zero_experts:
        assert (top_k_index >= 4).any()
    inputs = [torch.randn(tokens, 32), top_k_index, torch.rand(tokens, 2)]
    _assert_same_with_and_without(experts, lambda m, *a: m(*a), inputs)


def test_a_jetmoe_model_is_captured_and_equals_eager():
    from autopar.graph.capture import trace_model

    config = _jetmoe_config()
    config.update(dict(num_hidden_layers=2, vocab_size=64))
    torch.manual_seed(0)
    model = tf.JetMoeForCausalLM(config).eval()
    idx = torch.randint(0, 64, (3, 8))
    gm = trace_model(model, 8).gm
    assert "forward" not in vars(model.model.layers[0].mlp.input_linear)
    torch.testing.assert_close(gm(idx), model(idx).logits)


def test_dbrx_experts_equal_their_loop_with_an_empty_expert():
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    config = tf.DbrxConfig(d_model=32, ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4,
                                                   "moe_top_k": 2}).ffn_config
    experts = _randomised(DbrxExperts(config))
    tokens = 7
    scores = torch.randn(tokens, 4)
    scores[:, 1] = -10  # expert 1 gets no token
    top_k_index = scores.topk(2, dim=-1).indices
    inputs = [torch.randn(1, tokens, 32), top_k_index, torch.rand(tokens, 2)]
    _assert_same_with_and_without(experts, lambda m, *a: m(*a), inputs)


def test_eager_experts_are_captured_in_their_grouped_form_and_switched_back():
    from autopar.graph.capture import trace_model

    config = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                              num_local_experts=4, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")
    traced = trace_model(model, 8)
    assert model.config._experts_implementation == "eager"
    # captured in the grouped form, whose ops then become one call of the experts module
    # priced as their two grouped GEMMs (gate|up and down of the one MoE layer)
    calls = [n for n in traced.gm.graph.nodes if n.op == "call_module"
             and n.target == "model.layers.0.mlp.experts"]
    assert len(calls) == 1 and len(traced.nodes[calls[0].name].extra["gemms"]) == 2
