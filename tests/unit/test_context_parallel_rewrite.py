"""The context-parallel rewrite pass (autopar.rewrite.context_parallel), in process: which
nodes it changes in autopar's GPT (fx symbolic trace) and a Hugging Face Llama
(torch.export, a mask built from aranges), and what it refuses. That the rewritten
programs train equal to one process: tests/multiprocess/test_context_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.graph.capture import trace_model
from autopar.models import GPT
from autopar.rewrite.context_parallel import (ContextParallelAttention, apply_context_parallel,
                                              cp_positions)
from helpers import CONFIG, SEQ, load_script

zoo = load_script("benchmarks/model_zoo.py")


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_positions_are_the_ranks_two_chunks():
    assert cp_positions(8, cp=2, cp_rank=1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(4, 3, cp=2, cp_rank=0, dtype=torch.float32).tolist() == [3, 4, 9, 10]


def test_gpt_attention_and_positions_become_context_parallel():
    gm = trace_model(GPT(CONFIG), SEQ // 2).gm
    attention = [n.name for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is F.scaled_dot_product_attention]
    done = apply_context_parallel(gm, cp=2, cp_rank=1, group=None, local_seq_len=SEQ // 2)
    assert done == attention and len(done) == CONFIG.n_layer
    for name in done:  # the plan's names kept, now the CP module
        node = next(n for n in gm.graph.nodes if n.name == name)
        assert isinstance(gm.get_submodule(node.target), ContextParallelAttention)
    assert torch.arange not in _targets(gm) and _targets(gm).count(cp_positions) == 1
    assert F.scaled_dot_product_attention not in _targets(gm)


def test_cp_1_changes_nothing():
    gm = trace_model(GPT(CONFIG), SEQ).gm
    code = gm.code
    assert apply_context_parallel(gm, cp=1, cp_rank=0, group=None, local_seq_len=SEQ) == []
    assert gm.code == code


def test_a_hugging_face_causal_mask_is_checked_and_removed():
    n = zoo.TINY_SEQ // 2
    gm = trace_model(zoo.build("llama", "tiny", device="meta"), n).gm
    before = len(gm.graph.nodes)
    done = apply_context_parallel(gm, cp=2, cp_rank=0, group=None, local_seq_len=n)
    assert len(done) == 2  # the tiny Llama's layers
    ops = {getattr(t, "__name__", str(t)) for t in _targets(gm)}
    assert not {"le.Tensor", "cumsum.default", "diff.default"} & ops  # the mask's nodes gone
    assert _targets(gm).count(cp_positions) == 1  # cache_position, read by the rotary tables
    assert len(gm.graph.nodes) < before - 20
    for name in done:  # K and V gathered before repeat_kv: h_kv = 2 heads, SDPA's GQA
        node = next(n for n in gm.graph.nodes if n.name == name)
        assert [a.meta["tensor_meta"].shape[1] for a in node.args] == [4, 2, 2]
        assert gm.get_submodule(node.target).kwargs["enable_gqa"] is True
    assert "expand" not in " ".join(str(t) for t in _targets(gm))  # the repeats are gone


def test_attention_dropout_is_refused():
    gm = trace_model(GPT(dataclasses.replace(CONFIG, dropout=0.1)), SEQ // 2).gm
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        apply_context_parallel(gm, cp=2, cp_rank=0, group=None, local_seq_len=SEQ // 2)


class _Attend(nn.Module):
    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, x):  # x (b, h, 8, d)
        if self.window is None:
            return F.scaled_dot_product_attention(x, x, x)
        rows, cols = torch.arange(8)[:, None], torch.arange(8)[None, :]
        mask = (rows >= cols) & (rows - cols < self.window)  # sliding-window attention
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


@pytest.mark.parametrize("mask, match", [(None, "causal attention only"),
                                         (2, "mask .* is not the causal one")])
def test_attention_that_is_not_causal_is_refused(mask, match):
    gm = fx.symbolic_trace(_Attend(mask))
    with pytest.raises(NotImplementedError, match=match):
        apply_context_parallel(gm, cp=2, cp_rank=0, group=None, local_seq_len=8)
