"""Embeddings as the models people bring write them, one process: a subclass of
``nn.Embedding`` with its own forward (Gemma scales by sqrt(h), OPT's learned positions
add an offset), a padding row (``padding_idx``: OPT, Gemma, Phi-3), lookups whose
gradient depends on the whole table (``max_norm``, ``scale_grad_by_freq``, ``sparse``),
and an embedding whose module also holds a buffer the graph reads (Gemma's
``embed_scale``). Multi-process verification of those families is
tests/multiprocess/test_model_zoo.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.graph.capture import trace_model
from autopar.graph.export import causal_lm_logits, export_logits
from autopar.planner.strategies.megatron import megatron_placements
from autopar.planner.strategies import node_strategies
from autopar.rewrite.tensor_parallel import apply_tensor_parallel
from autopar.runtime.vocab_parallel import VocabParallelEmbedding
from helpers import load_script

zoo = load_script("benchmarks/model_zoo.py")
V, H, SEQ = 16, 8, 6


class ScaledEmbedding(nn.Embedding):
    """Gemma's ``GemmaTextScaledWordEmbedding``: the lookup times a buffer."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim, padding_idx=0)
        self.embed_scale = nn.Buffer(torch.tensor(dim ** 0.5), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.embed_scale


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ScaledEmbedding(V, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))  # (b, s, V)


def test_lifted_embedding_subclass_runs_only_the_lookup():
    """export leaves the subclass's own ops (the scale) in the graph and lifts the
    lookup: the lifted module must be the lookup alone, or the scale applies twice."""
    torch.manual_seed(0)
    model = TinyLM()
    gm = export_logits(model, SEQ, RuntimeError)
    idx = torch.randint(0, V, (3, SEQ))
    assert torch.allclose(gm(idx), model(idx))
    lifted = gm.get_submodule("embed")
    assert lifted.weight is model.embed.weight  # same Parameter, so tying survives
    assert type(model.embed) is ScaledEmbedding  # the user's module is not changed


@pytest.mark.parametrize("family", ["gemma", "opt"])
def test_captured_graph_of_embedding_subclasses_computes_the_model(family):
    pytest.importorskip("transformers")
    model = zoo.build(family, "tiny")
    traced = trace_model(model, 16)
    idx = torch.randint(0, 128, (2, 16))
    assert torch.allclose(traced.gm(idx), causal_lm_logits(model, idx), atol=1e-6)


def test_vocab_parallel_embedding_keeps_the_padding_row_gradient_zero():
    torch.manual_seed(0)
    full = nn.Embedding(V, H, padding_idx=3)
    idx = torch.tensor([[3, 1, 9, 3, 15, 0]])
    full(idx).pow(2).sum().backward()
    shards = [VocabParallelEmbedding(full.weight.detach()[r * V // 2:(r + 1) * V // 2].clone(),
                                     r * V // 2, full.padding_idx) for r in range(2)]
    out = sum(s(idx) for s in shards)  # what the all-reduce after them completes
    out.pow(2).sum().backward()
    assert torch.allclose(out, full(idx))
    grad = torch.cat([s.weight.grad for s in shards])
    assert torch.equal(grad[3], torch.zeros(H))
    assert torch.allclose(grad, full.weight.grad)


@pytest.mark.parametrize("setting", [dict(max_norm=1.0), dict(scale_grad_by_freq=True),
                                     dict(sparse=True)])
def test_whole_table_lookups_are_not_split_by_vocabulary(setting):
    """max_norm renormalises the rows it reads, scale_grad_by_freq divides by counts over
    the whole batch, sparse gradients are not what the shard's optimizer expects: a
    rank's masked lookup would compute none of them as one table does."""
    from autopar.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=H, vocab_size=V, block_size=SEQ))
    for key, value in setting.items():
        setattr(model.transformer.wte, key, value)
    options = node_strategies(trace_model(model, SEQ), 2)
    assert all(s.name != "vocab" for s in options["transformer_wte"])


def test_tp_rewrite_drops_the_whole_weight_of_a_split_embedding_with_a_buffer():
    """Gemma's graph reads ``embed_tokens.embed_scale``; the split embedding's module
    must still leave the program, or its whole (V, h) weight stays a parameter."""
    pytest.importorskip("transformers")
    traced = trace_model(zoo.build("gemma", "tiny"), 16)
    placements = megatron_placements(traced, 2)
    assert placements["model_embed_tokens"] == "vocab:P"
    apply_tensor_parallel(traced, placements, tp=2, tp_rank=1, group=None)
    shapes = {name: tuple(p.shape) for name, p in traced.gm.named_parameters()
              if "embed_tokens" in name}
    assert list(shapes.values()) == [(64, 64)], shapes  # rows [64, 128) of the table only
