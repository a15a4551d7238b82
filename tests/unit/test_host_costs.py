"""What a CPU process pays that a GPU hides (issue 13): the host's per-node dispatch, the
checkpoint's bookkeeping under full recompute, fused attention at its own measured rate,
communication that does not overlap compute, and ZeRO-1/2's parameter all-gather after the
optimizer step, gloo's reduce-scatter run as an all-reduce, and the all-reduces that close
every step. Each term against a hand-computed value; the GPU presets price none of the
host terms (their fields default to 0 / None / full overlap)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.planner.costs.tables import (Config, dp_comm_s_per_param, node_cost,
                                         optimizer_s_per_param)
from autopar.planner.costs.node_cost import dispatches
from autopar.planner.costs.matmul_cost import CAUSAL_SKIP_FRACTION
from autopar.planner.costs.step import exposed_dp_s
from autopar.planner.strategies import node_strategies
from cost_models import comm
from cost_models.hardware import Cluster
from helpers import tiny_meta_gpt

CPU = Cluster.local_cpu(2)


@pytest.fixture(scope="module")
def traced():
    from autopar.graph.capture import trace_model

    return trace_model(tiny_meta_gpt(), 16, name="gpt-tiny")


def _cost(traced, cluster, name, b=1):
    info = traced.nodes[name]
    strat = node_strategies(traced, 1, False)[name][0]
    node = next(n for n in traced.gm.graph.nodes if n.name == name)
    in_numel = sum(traced.nodes[a.name].numel for a in node.all_input_nodes
                   if traced.nodes[a.name].shape is not None)
    return node_cost(info, strat, b, cluster, 1, in_numel, 4, cluster.attention)


def _first(traced, kind):
    return next(n for n in traced.layers[0] if traced.nodes[n].kind == kind)


def test_views_pay_dispatch_and_move_no_bytes(traced):
    dev = CPU.device
    for kind in ("view", "transpose"):
        c = _cost(traced, CPU, _first(traced, kind))
        assert dispatches(traced.nodes[_first(traced, kind)])
        assert (c.fwd_s, c.bwd_s) == pytest.approx((dev.op_overhead_s, 2 * dev.op_overhead_s))
    # gpt-tiny has no dropout (p = 0): the module passes its input through, one dispatch
    drop = _first(traced, "dropout")
    assert traced.nodes[drop].mask_elems == 0
    assert _cost(traced, CPU, drop).fwd_s == pytest.approx(dev.op_overhead_s)
    # on a GPU preset the host terms are 0: a view is free, as before
    a100 = Cluster.dgx_a100()
    assert _cost(traced, a100, _first(traced, "view")).fwd_s == 0.0


def test_full_recompute_repeats_the_forward_plus_the_checkpoint_bookkeeping(traced):
    dev = CPU.device
    assert dev.recompute_overhead_s > 0
    for name in traced.layers[0]:
        c = _cost(traced, CPU, name)
        extra = dev.recompute_overhead_s if dispatches(traced.nodes[name]) else 0.0
        assert c.rec_s == pytest.approx(c.fwd_s + extra)
    sdpa = _cost(traced, CPU, _first(traced, "sdpa"))
    assert sdpa.core_fwd_s == pytest.approx(sdpa.rec_s)  # selective re-runs it under checkpoint
    gpu = _cost(traced, Cluster.dgx_a100(), _first(traced, "linear"))
    assert gpu.rec_s == gpu.fwd_s


def test_fused_attention_at_its_measured_rate(traced):
    name = _first(traced, "sdpa")
    info, dev = traced.nodes[name], CPU.device
    c = _cost(traced, CPU, name, b=2)
    fwd = 2 * info.flops / (dev.attention_tflops * 1e12)
    assert c.fwd_s == pytest.approx(fwd + dev.op_overhead_s)
    assert c.bwd_s == pytest.approx(2 * fwd + 2 * dev.op_overhead_s)
    # without a measured rate its GEMMs are priced like any other (the GPU presets), the
    # flash kernel's on the causal half of the scores (nanoGPT's is_causal=True)
    plain = dataclasses.replace(CPU, device=dataclasses.replace(dev, attention_tflops=None))
    assert CPU.attention == "flash" and info.extra["causal_skip"]
    gemm = CAUSAL_SKIP_FRACTION * 2 * info.flops / (dev.peak_flops * dev.matmul_efficiency)
    assert _cost(traced, plain, name, b=2).fwd_s == pytest.approx(gemm + dev.op_overhead_s)


def test_dp_reduction_hides_only_as_far_as_the_device_overlaps():
    cfg = Config(tp=1, pp=1, dp=2, micro_batch_size=1, num_micro_batches=1, dtype="fp32")
    delta = dp_comm_s_per_param(0, CPU, cfg)
    params, bwd = 1e6, 1.0  # a backward far longer than the reduction
    assert CPU.device.comm_overlap == 0.0  # gloo's copies run on the cores that compute
    assert exposed_dp_s(0, CPU, cfg, [params], [bwd]) == pytest.approx(delta * params)
    half = dataclasses.replace(CPU, device=dataclasses.replace(CPU.device, comm_overlap=0.5))
    assert exposed_dp_s(0, half, cfg, [params], [bwd]) == pytest.approx(0.5 * delta * params)
    full = dataclasses.replace(CPU, device=dataclasses.replace(CPU.device, comm_overlap=1.0))
    assert exposed_dp_s(0, full, cfg, [params], [bwd]) == 0.0
    assert exposed_dp_s(0, full, cfg, [params], [0.0]) == pytest.approx(delta * params)


def test_zero_parameter_all_gather_follows_the_optimizer_step():
    cfg = Config(tp=1, pp=1, dp=2, micro_batch_size=1, num_micro_batches=3, dtype="fp32")
    link, bucket = CPU.intra_node, 25 * 2**20
    all_reduce = comm.all_reduce_time_s(bucket, 2, link) * 4 / bucket
    gather = comm.all_gather_time_s(bucket, 2, link) * 4 / bucket
    adam = CPU.device.optimizer_bytes_per_param / (CPU.device.memory_bandwidth_gbps * 1e9)
    assert dp_comm_s_per_param(0, CPU, cfg) == pytest.approx(all_reduce)
    # gloo reduce-scatters as a whole all-reduce: ZeRO-1 pays one, ZeRO-2 one per micro-batch
    assert CPU.intra_node.reduce_scatter_as_all_reduce
    assert dp_comm_s_per_param(1, CPU, cfg) == pytest.approx(all_reduce)
    assert dp_comm_s_per_param(2, CPU, cfg) == pytest.approx(all_reduce * 3)
    nccl = dataclasses.replace(CPU, intra_node=dataclasses.replace(
        link, reduce_scatter_as_all_reduce=False))
    assert dp_comm_s_per_param(1, nccl, cfg) == pytest.approx(all_reduce / 2)  # ring RS
    assert dp_comm_s_per_param(2, nccl, cfg) == pytest.approx(all_reduce * 3 / 2)
    assert optimizer_s_per_param(0, CPU, cfg) == pytest.approx(adam)
    for z in (1, 2):
        assert optimizer_s_per_param(z, CPU, cfg) == pytest.approx(adam / 2 + gather)
    assert optimizer_s_per_param(3, CPU, cfg) == pytest.approx(adam / 2)


def test_device_fields_refuse_bad_values():
    dev = CPU.device
    for field, bad in (("comm_overlap", 1.5), ("comm_overlap", -0.1), ("recompute_overhead_s", -1),
                       ("attention_tflops", 0.0)):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(dev, **{field: bad})


def test_reduce_scatter_costs_an_all_reduce_where_the_backend_runs_one():
    link = CPU.intra_node
    ring = dataclasses.replace(link, reduce_scatter_as_all_reduce=False)
    for nbytes in (4.0, 2.0**20):
        assert comm.reduce_scatter_time_s(nbytes, 2, link) == comm.all_reduce_time_s(nbytes, 2, link)
        assert comm.reduce_scatter_time_s(nbytes, 2, ring) == pytest.approx(
            comm.all_reduce_time_s(nbytes, 2, ring) / 2)
    assert not Cluster.dgx_a100().intra_node.reduce_scatter_as_all_reduce  # NCCL
    # the latency part alone: two ring passes for gloo's reduce-scatter, one for NCCL's
    assert comm.ring_latency_s("reduce_scatter", 3, link) == pytest.approx(4 * link.latency_s)
    assert comm.ring_latency_s("reduce_scatter", 3, ring) == pytest.approx(2 * ring.latency_s)
    assert comm.ring_latency_s("all_gather", 3, link) == pytest.approx(2 * link.latency_s)
    with pytest.raises(ValueError, match="kind"):
        comm.ring_latency_s("p2p", 2, link)
    with pytest.raises(ValueError, match="reduce_scatter_as_all_reduce"):
        dataclasses.replace(link, reduce_scatter_as_all_reduce="yes")


def test_an_all_gather_pays_its_own_measured_latency_where_the_link_sets_one():
    link = dataclasses.replace(CPU.intra_node, latency_s=1e-3, bandwidth_gbps=1.0)
    assert link.all_gather_latency_s is None  # the presets: the ring model's alpha
    measured = dataclasses.replace(link, all_gather_latency_s=1.6e-3)
    for n in (2, 4):
        bandwidth = (n - 1) / n * 2**20 / 1e9
        assert comm.all_gather_time_s(2**20, n, link) == pytest.approx(bandwidth + (n - 1) * 1e-3)
        assert comm.all_gather_time_s(2**20, n, measured) == pytest.approx(
            bandwidth + (n - 1) * 1.6e-3)
        assert comm.ring_latency_s("all_gather", n, measured) == pytest.approx((n - 1) * 1.6e-3)
        # the other collectives keep latency_s
        assert comm.all_reduce_time_s(2**20, n, measured) == comm.all_reduce_time_s(2**20, n, link)
        assert comm.p2p_time_s(2**20, measured) == comm.p2p_time_s(2**20, link)
    cluster = dataclasses.replace(CPU, intra_node=measured)
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    with pytest.raises(ValueError, match="all_gather_latency_s"):
        dataclasses.replace(link, all_gather_latency_s=-1e-3)


def test_every_step_ends_with_the_loss_and_norm_all_reduce_and_the_tied_gradient_sum(traced):
    from autopar.planner.costs.tables import cost_tables, state_bytes
    from autopar.planner.strategies import tied_groups

    alpha = CPU.intra_node.latency_s

    def end(tp, pp, dp):
        cfg = Config(tp=tp, pp=pp, dp=dp, micro_batch_size=1, num_micro_batches=2, dtype="fp32")
        return cost_tables(traced, node_strategies(traced, tp, False), CPU, cfg).step_end_s
    assert end(1, 1, 1) == 0.0  # one rank: no collective
    assert end(1, 1, 2) == pytest.approx(2 * alpha)  # 16 B over 2 ranks: two latencies
    tied = [g[-1] for g in tied_groups(traced) if g[-1] in traced.post]
    assert tied  # gpt-tiny ties lm_head to the token embedding
    numel = sum(traced.nodes[n].param_numel for n in tied)
    sync = comm.all_reduce_time_s(numel * state_bytes("fp32").reduce, 2, CPU.intra_node)
    assert end(1, 2, 1) == pytest.approx(2 * alpha + sync)


def test_dp_latency_the_bucketed_rate_leaves_out():
    from autopar.planner.costs.tables import dp_latency_s

    alpha = CPU.intra_node.latency_s  # gloo: a reduce-scatter is a whole all-reduce
    cfg = Config(tp=1, pp=1, dp=2, micro_batch_size=1, num_micro_batches=3, dtype="fp32")
    assert dp_latency_s(0, CPU, cfg, 4) == pytest.approx(2 * alpha)  # the 1 MiB first bucket
    assert dp_latency_s(1, CPU, cfg, 4) == pytest.approx(alpha + 2 * alpha)  # + its all-gather
    assert dp_latency_s(2, CPU, cfg, 4) == pytest.approx(alpha + 3 * 2 * alpha)
    # FSDP2: per micro-batch and unit (4 layers + root) two all-gathers and a reduce-scatter
    assert dp_latency_s(3, CPU, cfg, 4) == pytest.approx(3 * 5 * (2 * alpha + 2 * alpha))
    one = Config(tp=2, pp=1, dp=1, micro_batch_size=1, num_micro_batches=3, dtype="fp32")
    assert all(dp_latency_s(z, CPU, one, 4) == 0.0 for z in range(4))


def test_gelu_and_the_loss_pay_a_transcendental_per_element(traced):
    from autopar.planner.costs.tables import loss_cost
    from cost_models import compute

    name = _first(traced, "gelu")
    info = traced.nodes[name]
    slow = dataclasses.replace(CPU, device=dataclasses.replace(
        CPU.device, transcendental_gelems_per_s=1e-3, op_overhead_s=0.0))  # 1e6 erf/s
    assert _cost(traced, slow, name).fwd_s == pytest.approx(info.numel / 1e6)
    assert _cost(traced, slow, name).bwd_s == pytest.approx(2 * info.numel / 1e6)
    fast = dataclasses.replace(slow, device=dataclasses.replace(
        slow.device, transcendental_gelems_per_s=None))  # memory-bound, as on a GPU
    assert _cost(traced, fast, name).fwd_s < info.numel / 1e6
    assert compute.elementwise_time_s(8.0, 0.0, slow.device) == compute.memory_bound_time_s(
        8.0, slow.device)
    strat = node_strategies(traced, 1, False)[name][0]  # not vocab-parallel: whole logits
    loss = loss_cost(strat, 1000.0, 10.0, 1, slow, slow.intra_node)
    assert loss.fwd_s == pytest.approx(1000 / 1e6) and loss.bwd_s == pytest.approx(2000 / 1e6)
    with pytest.raises(ValueError, match="transcendental_gelems_per_s"):
        dataclasses.replace(CPU.device, transcendental_gelems_per_s=0.0)
