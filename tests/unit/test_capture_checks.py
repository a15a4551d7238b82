"""A model autopar cannot plan gets a ValueError that says why, not an IndexError from deep
inside the solver: logits that are not (b, s, V), or no stack of transformer layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import cli

CLUSTER = autopar.Cluster.local_cpu(processes=2)


class Classifier(nn.Module):
    """A sequence classifier: (b, s) token ids -> (b, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 10)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


class Bigram(nn.Module):
    """Logits (b, s, V) but no transformer layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)

    def forward(self, idx):
        return self.head(self.emb(idx))


def classifier() -> nn.Module:
    return Classifier()


@pytest.mark.parametrize("model, match", [
    (Classifier, r"not a causal language model .* returned \(1, 10\)"),
    (Bigram, r"no stack of transformer layers .* nn.ModuleList"),
])
def test_plan_names_what_the_model_lacks(model, match):
    with torch.device("meta"):
        m = model()
    with pytest.raises(ValueError, match=match):
        autopar.plan(m, CLUSTER, global_batch_size=4, seq_len=16)


def test_the_cli_says_so_with_exit_2(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    argv = ["plan", "--model", "test_capture_checks:classifier", "--cluster", "local-cpu",
            "--nodes", "1", "--global-batch-size", "4", "--seq-len", "16"]
    assert cli.main(argv) == 2
    assert "not a causal language model" in capsys.readouterr().err


class _TwoLinearLM(nn.Module):
    """An embedding, two Linear "layers" and a head: h = 32, V = 64."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))


def _same_gradients(model: nn.Module, gm, idx) -> list[str]:
    """The parameters whose gradient of ``sum(logits)`` differs between ``model`` and its
    captured graph ``gm`` (None on one side only counts as different)."""
    params = dict(model.named_parameters())
    eager = torch.autograd.grad(model(idx).sum(), list(params.values()), allow_unused=True)
    graph = torch.autograd.grad(gm(idx).sum(), list(params.values()), allow_unused=True)
    return [k for k, a, b in zip(params, eager, graph)
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))]


class CycleLM(_TwoLinearLM):
    """Two layers run twice, the first pass under torch.no_grad() when ``stop`` (HRM's
    inner cycles), else only a buffer under it (a rotary table's way)."""

    def __init__(self, stop: bool) -> None:
        super().__init__()
        self.stop = stop
        self.register_buffer("scale", torch.ones(32))

    def forward(self, idx):
        x = self.emb(idx)
        with torch.no_grad():
            scale = self.scale * 2
            if self.stop:
                for layer in self.layers:
                    x = layer(x)
        for layer in self.layers:
            x = layer(x) * scale
        return self.head(x)


def test_a_no_grad_region_over_parameters_stops_gradients_as_eager():
    """HRM's way: the region's ops are kept, marked ``no_grad`` (no backward, nothing saved,
    priced forward only) and their outputs detached, so the captured graph's gradients are
    the eager model's, bit for bit."""
    from autopar.graph.annotate import saves_inputs
    from autopar.graph.capture import trace_model
    from autopar.graph.layer_groups import module_layers
    from autopar.planner.costs.node_cost import node_cost
    from autopar.planner.strategies import node_strategies

    traced = trace_model(CycleLM(stop=False), 8)  # a buffer under no_grad: nothing to stop
    assert len(module_layers(traced)) == 2  # (the first reads the buffer: one group of two)
    torch.manual_seed(0)
    model = CycleLM(stop=True)
    traced = trace_model(model, 8)
    region = [i for i in traced.nodes.values() if i.no_grad]
    assert [i.kind for i in region if i.kind in ("linear", "detach")] == ["linear", "linear"]
    assert sum(1 for n in traced.gm.graph.nodes if "detach" in n.name) == 2  # x and scale
    assert not any(saves_inputs(i) for i in region)
    first = region[[i.kind for i in region].index("linear")]
    strategies = node_strategies(traced, 2)[first.name]
    cost = node_cost(first, strategies[0], 1, CLUSTER, 2, 32 * 8, 4, "math")
    assert cost.fwd_s > 0 and cost.bwd_s == 0
    assert all(not any(s.partial_grad_inputs) for s in strategies)

    assert _same_gradients(model, traced.gm, torch.randint(0, 64, (2, 8))) == []


class HandBackLM(_TwoLinearLM):
    """A no_grad region that returns its input through a ``.to()`` that changes nothing
    (Dots3's indexer): eager hands back the tensor itself, gradient and all."""

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            with torch.no_grad():
                x = x.to(torch.float32)
                score = layer(x).amax(-1, keepdim=True)
            x = layer(x) * torch.sigmoid(score)
        return self.head(x)


def test_a_tensor_a_no_grad_region_hands_back_keeps_its_gradient():
    from autopar.graph.capture import trace_model

    torch.manual_seed(0)
    model = HandBackLM()
    traced = trace_model(model, 8)
    assert _same_gradients(model, traced.gm, torch.randint(0, 64, (2, 8))) == []


class SplitByCountLM(_TwoLinearLM):
    """A layer that splits its tokens by counts read from the data (JetMoE's dispatch)."""

    def forward(self, idx):
        x = self.emb(idx)
        counts = torch.stack([(idx < 32).sum(), (idx >= 32).sum()]).tolist()
        for layer in self.layers:
            pieces = layer(x).flatten(0, 1).split(counts)
            x = torch.cat([pieces[0] * 2, pieces[1]]).view_as(x)
        return self.head(x)


def test_shapes_read_from_the_data_are_refused_where_they_are():
    from autopar.graph.capture import trace_model

    with pytest.raises(ValueError, match=r"shape depends on the data .*test_capture_checks.py"):
        trace_model(SplitByCountLM(), 8)


class RepeatedTokensLM(_TwoLinearLM):
    """Every token repeated once per expert and viewed back per expert (Llama 4's MoE): a
    size guard that holds for every batch size but sympy cannot prove for all of them. A
    branch on a shape keeps fx's symbolic trace out, so export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 4)
        self.experts = nn.Parameter(torch.randn(4, 32, 32) / 32)

    def forward(self, idx):
        x = self.emb(idx).reshape(-1, 32)
        if x.shape[-1] != 32:
            raise ValueError("h = 32")
        for layer in self.layers:
            scores = self.router(x)
            routed = x.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
            out = torch.bmm(routed.view(4, -1, 32), self.experts).view(-1, 32)
            x = layer(x) + out.reshape(4, -1, 32).sum(0)
        return self.head(x).view(idx.shape[0], idx.shape[1], -1)


class BatchOfTwoLM(_TwoLinearLM):
    """A forward written for batches of exactly two sequences."""

    def forward(self, idx):
        x = self.emb(idx).view(2, -1)
        return self.head(x.view(2, idx.shape[1], 32))


def test_a_guard_true_for_every_batch_size_is_captured_and_a_fixed_batch_refused():
    from autopar.graph.capture import TraceError, trace_model

    torch.manual_seed(0)
    model = RepeatedTokensLM()
    idx = torch.randint(0, 64, (3, 8))
    gm = trace_model(model, 8).gm
    torch.testing.assert_close(gm(idx), model(idx), rtol=0, atol=0)
    assert _same_gradients(model, gm, idx) == []
    with pytest.raises(TraceError, match="BatchOfTwoLM.forward"):
        trace_model(BatchOfTwoLM(), 8)


class FoldedBatchLM(_TwoLinearLM):
    """Layers that run on every token of the batch as one row (x.reshape(1, -1, h):
    Inkling's shared experts) and unfold it again; captured by fx, or by export."""

    def __init__(self, exported: bool) -> None:
        super().__init__()
        self.exported = exported

    def forward(self, idx):
        x = self.emb(idx)
        if self.exported and x.shape[-1] != 32:  # a branch on a size: fx cannot, export can
            raise ValueError("h = 32")
        for layer in self.layers:
            folded = x.reshape(1, -1, 32)
            x = x + layer(folded).reshape(idx.shape[0], idx.shape[1], 32)
        return self.head(x)


@pytest.mark.parametrize("exported", [False, True])
def test_a_view_that_folds_the_batch_passes_no_sequence_shard(exported):
    from autopar.graph.capture import trace_model
    from autopar.planner.strategies import node_strategies

    traced = trace_model(FoldedBatchLM(exported), 8)
    strategies = node_strategies(traced, 2, sequence_parallel=True)
    views = [n for n, info in traced.nodes.items() if info.kind == "view"]
    assert views
    for name in views:  # at b = 1 each looks like the identity (1, 8, 32) -> (1, 8, 32)
        assert traced.nodes[name].shape == (1, 8, 32)
        keys = {s.key for s in strategies[name]}
        assert "replicate:R" in keys and "sharded:S1" not in keys, (name, keys)
    embedded = next(n for n, info in traced.nodes.items() if info.kind == "embedding")
    assert traced.nodes[embedded].extra["batch_dims"] == (0,)
    assert traced.nodes[views[0]].extra["batch_dims"] == (1,)
