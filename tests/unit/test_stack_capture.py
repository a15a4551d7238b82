"""Capturing model definitions of other stacks (issue 32): a read every layer shares goes
to the prelude; layers that still differ are refused naming where."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.graph.capture import trace_model


def test_a_table_every_layer_reads_belongs_to_the_prelude():
    """torchtitan hands its freqs_cis to every layer, which slices it: the read moves to
    the prelude, and the layers are one op sequence."""
    from stack_models import StackConfig, TitanStyleLlama

    with torch.device("meta"):
        model = TitanStyleLlama(StackConfig(n_layer=3))
    traced = trace_model(model, 16)
    assert "freqs_cis" in traced.pre
    kinds = [[traced.nodes[n].kind for n in layer] for layer in traced.layers]
    assert len(kinds) == 3 and kinds[0] == kinds[1] == kinds[2]


class _Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 1:  # one layer differs
            return torch.tanh(self.fc(x))
        return x + self.fc(x)


class _Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.h = nn.ModuleList(_Block(i) for i in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_layers_that_differ_plan_as_one_group_or_are_refused_naming_the_op_and_its_line():
    """Two layers with no repeat are planned as one group of two (issue 34,
    autopar.graph.layer_groups); the same layers left ungrouped are refused by the template
    map, naming the first op that differs."""
    from dataclasses import fields

    from autopar.graph.annotate import TracedModel
    from autopar.graph.layer_groups import grouping_of, module_layers
    from autopar.planner.cpsat.terms import template_map

    traced = trace_model(_Uneven(), 8)
    g = grouping_of(traced)
    assert (g.prefix, g.period, g.suffix, traced.num_layers) == (0, 2, 0, 1)
    plan = autopar.plan(_Uneven(), autopar.Cluster.local_cpu(processes=1), global_batch_size=2,
                        seq_len=8)
    assert plan.stage_layers == [[0, 1]] and len(plan.recompute) == 1
    ungrouped = TracedModel(**{f.name: getattr(traced, f.name) for f in fields(TracedModel)}
                            | {"layers": module_layers(traced)})
    with pytest.raises(NotImplementedError, match=r"layer 0 op 1 is add \(add\), layer 1 "
                                                  r"op 1 is tanh \(elementwise\)"):
        template_map(ungrouped)
