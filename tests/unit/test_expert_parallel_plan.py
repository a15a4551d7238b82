"""Expert parallelism as the planner prices it (tiny Mixtral, h=64, E=4, k=2, F=128, 2 layers,
s=16): ep folds over the tensor- and data-parallel ranks, each MoE layer's experts call holds E/ep experts,
sends its routed rows to the other EP ranks and back in four all-to-alls per micro-batch,
and reduces its experts' gradients over the d/ep ranks holding the same experts.

Balanced routing is the planning assumption (cost_models.moe.BALANCED_ROUTING): each rank
sends (ep-1)/ep of its b·s·k routed rows of h values in each all-to-all.
"""

from __future__ import annotations

import pytest

from helpers import load_script

import autopar
from autopar.contract.plan import Layout, Plan
from autopar.graph.capture import trace_model
from autopar.graph.moe import moe_blocks
from autopar.techniques.expert_parallel import ep_problem, expert_ranks
from cost_models.hardware import Cluster

pytest.importorskip("transformers")
families = load_script("benchmarks/hf_families.py")

SEQ, BATCH = 16, 16


@pytest.fixture(scope="module")
def mixtral():
    return families.build_family("mixtral", device="meta")


def _evaluate(model, layout: str) -> Plan:
    return autopar.evaluate(model, Cluster.dgx_a100(1), Layout.parse(layout + ",mbs=1"),
                            global_batch_size=BATCH, seq_len=SEQ)


@pytest.fixture(scope="module")
def by_ep(mixtral):
    return {ep: _evaluate(mixtral, f"tp=1,pp=1,dp=8,ep={ep},zero_stage=0") for ep in (1, 2, 4)}


def test_all_to_all_bytes_are_four_per_layer_and_micro_batch(mixtral, by_ep):
    block = moe_blocks(trace_model(mixtral, SEQ))[0]
    h, k, E, layers = block.hidden_size, block.top_k, block.num_experts, 2
    for ep, plan in by_ep.items():
        m = plan.num_micro_batches
        sent = SEQ * k * h * 2 * (ep - 1) / ep  # one all-to-all, bf16, balanced routing
        counts = (E - E // ep) * 8              # rows per expert, int64, before each dispatch
        expected = m * layers * (4 * sent + counts) if ep > 1 else 0.0
        assert plan.predicted.comm_bytes_by_kind["ep_all_to_all"] == expected
        assert plan.predicted.stage_stats[0]["comm_bytes"]["ep_all_to_all"] == expected
        assert ("ep_comm" in plan.predicted.time_s_by_kind) == (ep > 1)
    assert by_ep[2].predicted.time_s_by_kind["ep_comm"] < by_ep[4].predicted.time_s_by_kind["ep_comm"]


def test_under_tp_each_rank_routes_its_tp_ranks_share_of_the_tokens(mixtral):
    """At tp = 2 with ep = 2 the experts call runs on the rank's sequence shard (placement
    S0 of its (T, h) rows, Megatron-Core's expert-TP 1) and the EP group spans the TP pair:
    each all-to-all moves s/t routed rows per sequence, so half of tp = 1's per micro-batch,
    and the experts' share of the step's FLOPs per rank is halved too."""
    block = moe_blocks(trace_model(mixtral, SEQ))[0]
    h, k, E, layers, ep, t = block.hidden_size, block.top_k, block.num_experts, 2, 2, 2
    plan = _evaluate(mixtral, f"tp={t},pp=1,dp=4,ep={ep},zero_stage=0,sp=1")
    experts = {n: key for n, key in plan.placements.items() if n.endswith("mlp_experts")}
    assert len(experts) == layers and set(experts.values()) == {"sharded:S0"}
    sent = SEQ / t * k * h * 2 * (ep - 1) / ep
    counts = (E - E // ep) * 8
    assert plan.predicted.comm_bytes_by_kind["ep_all_to_all"] == \
        plan.num_micro_batches * layers * (4 * sent + counts)
    # at ep = 1 the experts stay whole on every TP rank for all the tokens
    whole = _evaluate(mixtral, f"tp={t},pp=1,dp=4,ep=1,zero_stage=0,sp=1")
    assert {k for n, k in whole.placements.items() if n.endswith("mlp_experts")} == \
        {"replicate:R"}


def test_expert_states_are_split_over_ep_and_their_gradients_reduced_over_d_over_ep(mixtral, by_ep):
    traced = trace_model(mixtral, SEQ)
    experts = sum(traced.nodes[b.experts[0]].param_numel for b in moe_blocks(traced))
    dense = traced.total_params() - experts
    assert experts > dense  # the experts hold most of a MoE model
    for ep, plan in by_ep.items():
        memory = plan.predicted.memory_bytes_by_stage[0]
        # ZeRO-0, bf16 parameters and gradients (2 + 2 bytes), fp32 Adam with master (12)
        assert memory["parameters"] == 2 * (dense + experts / ep)
        assert memory["optimizer_states"] == 12 * (dense + experts / ep)
        # all-reduce of every gradient this rank holds: d/ep = 8/ep ranks share its experts
        assert plan.predicted.comm_bytes_by_kind["dp_all_reduce"] == 2 * (dense + experts / ep)
    # t·d = ep (the EP group spans TP): no other rank holds these experts, so only the rest
    # is all-reduced; at ep = 2 the two ranks of the other EP group hold them
    for ep, all_reduced in ((4, 0), (2, 1)):
        plan = _evaluate(mixtral, f"tp=2,pp=2,dp=2,ep={ep},zero_stage=0,sp=1")
        held = plan.predicted.memory_bytes_by_stage[0]["parameters"] / 2  # layer 0 on stage 0
        assert plan.predicted.stage_stats[0]["comm_bytes"]["dp_all_reduce"] == 2 * (
            held - (1 - all_reduced) * experts / 2 / ep)


def test_zero_shards_expert_states_over_their_expert_data_parallel_group(mixtral):
    """ZeRO-1/2 as Megatron-Core's distributed optimizer runs them under EP (priced by
    evaluate; the autopar runtime runs ZeRO-0 at ep > 1, so a plan keeps to it): the dense
    optimizer states over the d DP ranks, the experts' over the t·d/ep ranks holding them
    (4 of the 8 here); under ZeRO-2 the gradients alike."""
    traced = trace_model(mixtral, SEQ)
    experts = sum(traced.nodes[b.experts[0]].param_numel for b in moe_blocks(traced))
    dense = traced.total_params() - experts
    d, ep = 8, 2
    e = d // ep  # t·d/ep ranks hold each expert
    for zero in (1, 2):
        plan = _evaluate(mixtral, f"tp=1,pp=1,dp={d},ep={ep},zero_stage={zero}")
        memory = plan.predicted.memory_bytes_by_stage[0]
        assert memory["optimizer_states"] == pytest.approx(12 * (dense / d + experts / ep / e))
        grads = 2 * (dense / d + experts / ep / e) if zero == 2 else 2 * (dense + experts / ep)
        assert memory["gradients"] == pytest.approx(grads)
        assert memory["parameters"] == pytest.approx(2 * (dense + experts / ep))
        assert plan.predicted.time_s_by_kind["optimizer"] > 0
    with pytest.raises(ValueError, match="ep=2 with zero_stage=1"):
        autopar.plan(mixtral, Cluster.dgx_a100(1), global_batch_size=BATCH, seq_len=SEQ,
                     layout=Layout.parse("dp=8,ep=2,zero_stage=1"))


def test_plan_json_keeps_ep_and_leaves_it_out_when_one(by_ep):
    assert "ep" not in by_ep[1].to_dict()
    assert all("ep" not in a.layout for a in by_ep[1].alternatives)
    plan = by_ep[2]
    assert plan.to_dict()["ep"] == 2 and "ep=2" in plan.headline()
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.decision_digest() != by_ep[1].decision_digest()


def test_the_search_tries_ep_where_the_target_runs_it_and_pins_are_kept(mixtral):
    cluster = Cluster.dgx_a100(1)
    pinned = autopar.plan(mixtral, cluster, global_batch_size=32, seq_len=SEQ,
                          layout=Layout.parse("dp=4,ep=4"))
    assert (pinned.dp, pinned.ep, pinned.zero_stage) == (4, 4, 0)


@pytest.mark.parametrize("layout, message", [
    ("tp=1,pp=1,dp=8,ep=3,zero_stage=0", "ep=3 does not divide tp·dp=8"),
    ("tp=1,pp=1,dp=8,ep=8,zero_stage=0", "ep=8 does not divide the 4 experts"),
    ("tp=1,pp=1,dp=8,ep=2,zero_stage=3", "ep=2 with zero_stage=3"),
])
def test_layouts_expert_parallelism_cannot_run_are_refused_by_name(mixtral, layout, message):
    with pytest.raises(ValueError, match=message):
        _evaluate(mixtral, layout)


def test_a_dense_model_refuses_expert_parallelism():
    assert "no mixture-of-experts layer" in ep_problem(2, 4, 0, [])
    assert ep_problem(1, 4, 3, []) is None  # ep = 1: nothing to check


def test_expert_groups_fold_over_the_tensor_and_data_parallel_ranks_of_a_stage():
    # t·d = 8, ep = 4: EP groups {0..3}, {4..7}; EDP groups hold the same experts: {r, r+4}
    assert expert_ranks(5, 8, 4) == (1, [4, 5, 6, 7], [1, 5])
    assert expert_ranks(0, 4, 4) == (0, [0, 1, 2, 3], [0])
    with pytest.raises(ValueError, match="ep=3 must divide the 8 tensor- and data-parallel"):
        expert_ranks(0, 8, 3)
    # the EP group spans TP (t = 2, d = 2, ep = 4): every rank of the stage in one group
    assert ep_problem(4, 2, 0, [4], tp=2) is None
    assert "does not divide tp·dp=4" in ep_problem(8, 2, 0, [8], tp=2)
    # under TP each rank routes s/t tokens of a sequence: t must divide s
    assert "which tp does not divide" in ep_problem(2, 2, 0, [4], tp=2, seq_len=15)
    assert ep_problem(2, 2, 0, [4], tp=2, seq_len=16) is None


def test_an_ep_group_straddling_nodes_unevenly_is_priced_with_fewer_ranks_per_node():
    from autopar.planner.costs.expert_cost import ranks_per_node_in_group

    nodes = Cluster.dgx_a100(4)  # 8 GPUs per node
    # aligned groups: all their ranks in a node up to the node's size
    assert [ranks_per_node_in_group(nodes, ep, tp) for ep, tp in
            [(2, 1), (8, 2), (64, 1), (4, 16)]] == [2, 4, 8, 1]
    # 6 ranks of stride 2 (0, 2, 4, 6 | 8, 10): an equal count per node that divides 6
    assert ranks_per_node_in_group(nodes, 6, 2) == 2
