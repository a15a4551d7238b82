"""Work done once per repeated transformer layer gives what doing it per layer gives.

Shape propagation (:class:`autopar.graph.capture.RepeatedLayerShapeProp`) and the TP
strategies of every node (:func:`autopar.planner.strategies.node_strategies`) reuse layer
k - 1's (layer 1's) results for identical layers; both are compared here with the op-by-op
computation on autopar's GPT and Hugging Face GPT-2 and Llama shapes, and the reuse is
shown to happen (so a regression to op-by-op would also fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

import autopar
import autopar.graph.capture as capture
import autopar.planner.strategies.nodes as strategies
from autopar.graph.capture import trace_model
from autopar.graph.layer_groups import module_layers

MODELS = [("gpt-small-test", 64), ("hf:gpt2", 64), ("hf:llama", 64)]


def _small(spec: str):
    """The model ``spec`` names, with 6 layers for the Hugging Face ones (fast to trace)."""
    if spec.startswith("hf:"):
        import transformers
        from autopar.hf_models import hf_config

        config = hf_config(spec[3:])
        for name in ("num_hidden_layers", "n_layer"):
            if hasattr(config, name):
                setattr(config, name, 6)
        for name, value in (("hidden_size", 128), ("n_embd", 128), ("intermediate_size", 256),
                            ("num_attention_heads", 4), ("n_head", 4), ("num_key_value_heads", 2),
                            ("vocab_size", 512)):
            if hasattr(config, name):
                setattr(config, name, value)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    return autopar.load_model(spec)[0]


@pytest.mark.parametrize("spec, seq", MODELS)
def test_shape_propagation_once_per_layer_equals_op_by_op(spec, seq, monkeypatch):
    model = _small(spec)
    ran = []
    real = ShapeProp.run_node

    def counting(self, n):
        ran.append(n.name)
        return real(self, n)
    monkeypatch.setattr(ShapeProp, "run_node", counting)
    fast = trace_model(model, seq)
    fast_ran = len(ran)
    monkeypatch.setattr(capture.RepeatedLayerShapeProp, "run_node", counting)
    ran.clear()
    full = trace_model(model, seq)
    assert [n.meta.get("tensor_meta") for n in fast.gm.graph.nodes] == \
        [n.meta.get("tensor_meta") for n in full.gm.graph.nodes]
    assert fast.nodes == full.nodes
    per_layer = len(full.layers[0])
    assert fast_ran <= len(ran) - (len(full.layers) - 2) * per_layer // 2, (fast_ran, len(ran))


@pytest.mark.parametrize("spec, seq", MODELS)
def test_strategies_once_per_layer_equal_node_by_node(spec, seq, monkeypatch):
    traced = trace_model(_small(spec), seq)
    assert strategies._layer_twins(traced), "layers 2.. reuse layer 1's strategies"
    cases = [(2, False), (4, True)]
    fast = [strategies.node_strategies(traced, tp, sp) for tp, sp in cases]
    monkeypatch.setattr(strategies, "_layer_twins", lambda traced: {})
    assert fast == [strategies.node_strategies(traced, tp, sp) for tp, sp in cases]


class _WidthBlock(nn.Module):
    def __init__(self, h: int, ffn: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class WidthsLM(nn.Module):
    """Layers of one class and one op sequence whose Linears differ in width (Gemma 4's
    global layers have 512-wide heads where its sliding ones have 256)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.layers = nn.ModuleList(_WidthBlock(32, ffn) for ffn in (64, 128, 128))

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_layer_of_other_widths_is_propagated_not_copied():
    traced = trace_model(WidthsLM(), 8)
    ups = [traced.nodes[n].shape for layer in module_layers(traced) for n in layer if n.endswith("_up")]
    assert ups == [(1, 8, 64), (1, 8, 128), (1, 8, 128)]
