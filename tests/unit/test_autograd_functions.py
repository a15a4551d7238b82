"""A model's own ``torch.autograd.Function`` keeps its backward through capture.

Non-strict export traces a Function's forward op by op and drops its backward, so the
captured program would train with the gradient of the forward's ops (PhiMoE's router
gradient was 67% off at tp2). :mod:`autopar.graph.functions` keeps each call whole: the
captured graph calls the Function itself, so its gradient is the model's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from autopar.graph.capture import trace_model
from autopar.graph.functions import FunctionCall
from autopar.graph.layer_groups import module_layers
from autopar.planner.strategies import node_strategies
from stack_models import FunctionLM, ScaledStraightThrough


def test_a_custom_function_keeps_its_backward():
    torch.manual_seed(0)
    model = FunctionLM()
    traced = trace_model(model, 4)
    calls = [n for n in traced.gm.graph.nodes if isinstance(n.target, FunctionCall)]
    assert [c.target.cls for c in calls] == [ScaledStraightThrough] * 2
    assert len(module_layers(traced)) == 2
    assert all(len(node_strategies(traced, 2)[c.name]) == 1 for c in calls)  # whole on each rank

    idx = torch.randint(0, 16, (2, 4))
    params = list(model.parameters())
    eager = torch.autograd.grad(model(idx).sum(), params)
    graph = torch.autograd.grad(traced.gm(idx).sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(eager, graph))
    plain = torch.autograd.grad((model.emb.weight * 2.0).sum(), model.emb.weight)[0]
    assert eager[0].abs().sum() > 100 * plain.abs().sum()  # the custom rule, not 2 · g


class KeywordFunctionLM(FunctionLM):
    def forward(self, idx):
        x = self.emb(idx) * (1.0 if idx.size(1) > 1 else 2.0)
        for layer in self.layers:
            x = ScaledStraightThrough.apply(layer(x), k=2.0)
        return self.head(x)


def test_a_custom_function_called_with_keywords_is_refused_by_name():
    from autopar.graph.capture import TraceError

    with pytest.raises(TraceError, match=r"ScaledStraightThrough.apply is called with keyword"):
        trace_model(KeywordFunctionLM(), 4)
