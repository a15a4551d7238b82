"""autopar.runtime.expert_parallel in one process: dispatch_bytes on hand routings and the
modules ExpertParallelExperts refuses (before any process group is asked)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import compat
from autopar.runtime.expert_parallel import ExpertParallelExperts, dispatch_bytes
from cost_models.moe import moe_dispatch_bytes
from expert_builders import experts


def test_dispatch_bytes_counts_only_rows_that_leave_the_rank():
    # ep = 2, E = 4: rank 0 holds experts 0, 1; rank 1 holds 2, 3
    routing = [torch.tensor([[0, 2], [3, 1]]),  # rank 0: 2 pairs stay, 2 go to rank 1
               torch.tensor([[0, 1], [2, 3], [2, 0]])]  # rank 1: 3 pairs go to rank 0
    h, nbytes = 8, 4
    assert dispatch_bytes(routing, 4, 2, 0, h, nbytes) == {
        "dispatch_sent": 2 * h * nbytes, "dispatch_received": 3 * h * nbytes,
        "combine_sent": 3 * h * nbytes, "combine_received": 2 * h * nbytes,
        "count_exchange": 2 * 8}
    assert dispatch_bytes(routing, 4, 2, 1, h, nbytes)["dispatch_sent"] == 3 * h * nbytes


def test_balanced_routing_moves_tkh_bytes_times_ep_minus_one_over_ep():
    ep, E, T, k, h, nbytes = 4, 8, 8, 2, 16, 2
    # token t of every rank goes to both experts of rank t % ep: T·k/ep pairs to each rank
    one = torch.stack([2 * (torch.arange(T) % ep), 2 * (torch.arange(T) % ep) + 1], dim=1)
    expected = moe_dispatch_bytes(T, k, h, nbytes, ep)  # the planner's price
    assert expected == T * k * h * nbytes * 3 / 4
    for rank in range(ep):
        got = dispatch_bytes([one] * ep, E, ep, rank, h, nbytes)
        assert got["dispatch_sent"] == got["dispatch_received"] == expected


def test_dispatch_bytes_needs_every_ranks_routing():
    with pytest.raises(ValueError, match="one routing per EP rank"):
        dispatch_bytes([torch.zeros(3, 2, dtype=torch.long)], 4, 2, 0, 8, 4)


class _Plain(torch.nn.Module):
    """Stacked experts that do not come from transformers' experts interface."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 4))
        self.down_proj = torch.nn.Parameter(torch.zeros(4, 4, 4))


def test_a_module_outside_the_experts_interface_is_refused():
    with pytest.raises(TypeError, match="_Plain is not built by transformers' "
                       "use_experts_implementation .missing has_gate"):
        ExpertParallelExperts(_Plain())


def test_a_post_expert_norm_is_refused():
    module = experts("mixtral", 4)
    module.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="MixtralExperts applies a post-expert norm"):
        ExpertParallelExperts(module)


def test_experts_already_sharded_by_transformers_are_refused():
    module = experts("qwen3_moe", 4)
    module._is_expert_parallel = True
    with pytest.raises(ValueError, match="Qwen3MoeExperts is already sharded"):
        ExpertParallelExperts(module)


def test_unknown_parameters_and_parameterised_sub_modules_are_refused():
    module = experts("olmoe", 4)
    module.extra = torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(TypeError, match=r"OlmoeExperts has parameters .* expects exactly "
                       r"\['gate_up_proj', 'down_proj'\]"):
        ExpertParallelExperts(module)
    module = experts("olmoe", 4)
    module.act_fn = torch.nn.BatchNorm1d(4, affine=False)  # buffers, no parameters
    with pytest.raises(NotImplementedError, match=r"sub-modules with parameters or buffers "
                       r"\(\['act_fn'\]\)"):
        ExpertParallelExperts(module)


def test_the_private_torch_names_resolve_on_this_torch():
    assert callable(compat.all_to_all_single_autograd) and callable(compat.grouped_mm)
    assert callable(compat.resolve_group_name)


def _calls_experts(experts_module: torch.nn.Module) -> torch.fx.GraphModule:
    """A GraphModule whose graph calls ``experts_module`` as submodule "experts"."""
    graph = torch.fx.Graph()
    args = [graph.placeholder(n) for n in ("hidden_states", "top_k_index", "top_k_weights")]
    graph.output(graph.call_module("experts", tuple(args)))
    root = torch.nn.Module()
    root.experts = experts_module
    return torch.fx.GraphModule(root, graph)


def test_experts_inside_a_recompute_checkpoint_are_sharded_too():
    # full recompute wraps a layer's graph in a Checkpointed "body": the experts call is in
    # that nested graph, not the chunk's (it was missed: each rank kept all E experts)
    from framework_startup import fake_process_group

    from autopar.graph.experts import is_experts_module
    from autopar.rewrite.recompute import Checkpointed
    from autopar.runtime.expert_parallel import shard_experts

    body = _calls_experts(experts("mixtral", 4, torch.float32))
    graph = torch.fx.Graph()
    args = [graph.placeholder(n) for n in ("hidden_states", "top_k_index", "top_k_weights")]
    graph.output(graph.call_module("recompute_layer_0", tuple(args)))
    root = torch.nn.Module()
    root.recompute_layer_0 = Checkpointed(body)
    chunk = torch.fx.GraphModule(root, graph)
    with fake_process_group(rank=1, world_size=2):
        slices = shard_experts([chunk], None, is_experts_module)
    sharded = chunk.get_submodule("recompute_layer_0.body.experts")
    assert isinstance(sharded, ExpertParallelExperts)
    assert slices == {"recompute_layer_0.body.experts.gate_up_proj": slice(2, 4),
                      "recompute_layer_0.body.experts.down_proj": slice(2, 4)}
    assert sharded.down_proj.shape[0] == 2


def test_experts_called_outside_the_graphs_are_reported_not_left_whole():
    from framework_startup import fake_process_group

    from autopar.graph.experts import is_experts_module
    from autopar.runtime.expert_parallel import shard_experts

    class Opaque(torch.nn.Module):  # an experts call fx cannot see
        def __init__(self) -> None:
            super().__init__()
            self.experts = experts("mixtral", 4, torch.float32)

        def forward(self, x, index, weights):
            return self.experts(x, index, weights)

    graph = torch.fx.Graph()
    args = [graph.placeholder(n) for n in ("hidden_states", "top_k_index", "top_k_weights")]
    graph.output(graph.call_module("moe", tuple(args)))
    root = torch.nn.Module()
    root.moe = Opaque()
    with fake_process_group(rank=0, world_size=2):
        with pytest.raises(RuntimeError, match=r"\['moe.experts'\].*not sharded over EP"):
            shard_experts([torch.fx.GraphModule(root, graph)], None, is_experts_module)
