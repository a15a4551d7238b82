"""A module called more than once (looped depth: Dory, Universal Transformers) is one
``call_module`` node per call after export capture, so the TP rewrite gives every call the
rank's shard. Before, only the first call was lifted: the second ran ``aten.linear`` on the
whole weight, whose gradient never reached the shard (verify: 55% gradient difference).
A graph that reads a split weight whole outside its module's call is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.capture import trace_model
from autopar.planner.strategies.megatron import megatron_placements
from autopar.rewrite.tensor_parallel import apply_tensor_parallel
from stack_models import LoopedLM, StackConfig

CONFIG = StackConfig(n_layer=2, n_head=4, n_embd=48, vocab_size=64, block_size=16)


def test_every_call_of_a_looped_layer_is_a_module_call():
    torch.manual_seed(0)
    traced = trace_model(LoopedLM(CONFIG), 16)
    gm = traced.gm
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("w1")]
    assert calls == ["layers.0.feed_forward.w1", "layers.1.feed_forward.w1"] * 2
    weights = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("weight")
               and "feed_forward" in n.target]
    assert weights == []  # no aten.linear reads a Linear's weight whole

    apply_tensor_parallel(traced, megatron_placements(traced, 2), tp=2, tp_rank=1, group=None)
    shards = {n.target: gm.get_submodule(n.target).weight for n in gm.graph.nodes
              if n.op == "call_module" and "feed_forward_w1" in n.target}  # hidden 4·48·2/3 = 128
    assert len(shards) == 2 and all(w.shape == (128 // 2, 48) for w in shards.values()), shards


class FunctionalTie(nn.Module):
    """Logits from ``F.linear(x, self.wte.weight)``: the embedding's weight read outside
    its module's call."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))
                                    for _ in range(2))

    def forward(self, idx):
        x = self.wte(idx) * (1.0 if idx.size(1) > 1 else 2.0)
        for layer in self.layers:
            x = x + layer(x)
        return F.linear(x, self.wte.weight)


def test_a_split_weight_read_whole_is_refused():
    traced = trace_model(FunctionalTie(), 16)
    placements = megatron_placements(traced, 2)
    assert placements["wte"].startswith("vocab")
    with pytest.raises(NotImplementedError, match=r"reads the whole wte.weight, which the plan "
                                                  r"splits along dim 0"):
        apply_tensor_parallel(traced, placements, tp=2, tp_rank=0, group=None)
