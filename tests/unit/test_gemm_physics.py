"""GEMM time at its shape (tile and wave quantisation) and Megatron's scatter/gather pipeline
sends: the cost model's formulas against hand-computed values, and the planner using them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

import cost_models as cm
from autopar.graph.ops import gemm_shapes
from autopar.planner.costs.tables import Config, cost_tables, node_cost
from autopar.planner.strategies import node_strategies
from cost_models.hardware import Cluster, DeviceSpec
from helpers import tiny_meta_gpt

A100 = Cluster.dgx_a100().device


@pytest.fixture(scope="module")
def traced():
    """gpt-tiny traced at its full sequence length (s = 16)."""
    from autopar.graph.capture import trace_model

    return trace_model(tiny_meta_gpt(), 16, name="gpt-tiny")


def _tile_s(device: DeviceSpec, waves: int, k: int) -> float:
    """Seconds of ``waves`` waves of full 256x128 tiles ``k`` deep, by hand."""
    tm, tn, tk = device.gemm_tile
    per_sm = device.peak_flops * device.matmul_efficiency / device.sm_count
    return waves * 2 * tm * tn * math.ceil(k / tk) * tk / per_sm


def test_wave_quantisation_by_hand():
    # GPT-3 175B at t = 8, b = 1: the QKV GEMM (2048 x 4608, depth 12288) is 8 * 36 = 288
    # tiles of 256x128; on 108 SMs that is 3 waves, the last one 2/3 full: 288/324 = 0.889
    assert A100.sm_count == 108 and A100.gemm_tile[:2] == (256, 128)
    assert cm.gemm_time_s(2048, 4608, 12288, A100) == pytest.approx(_tile_s(A100, 3, 12288))
    assert cm.gemm_efficiency(2048, 4608, 12288, A100) == pytest.approx(288 / 324)
    # the FLOPs are the same as the flat model's, only the quantisation differs
    flat = cm.matmul_time_s(2 * 2048 * 4608 * 12288, A100)
    assert cm.gemm_time_s(2048, 4608, 12288, A100) == pytest.approx(flat * 324 / 288)


def test_utilisation_grows_with_the_matrix_sizes():
    # the MLP's second GEMM per TP rank: GPT-3 175B (h = 12288) vs 1T (h = 25600), t = 8
    small = cm.gemm_efficiency(2048, 12288, 6144, A100)
    large = cm.gemm_efficiency(2048, 25600, 12800, A100)
    assert small == pytest.approx(768 / 864) and large == pytest.approx(1600 / 1620)
    assert large > small
    # a GEMM smaller than one wave leaves SMs idle: 8 tiles on 108 SMs
    assert cm.gemm_efficiency(256, 1024, 4096, A100) == pytest.approx(8 / 108)


def test_tile_quantisation_and_orientation():
    # a 96-wide head (P·V of GPT-2 1.2B): 96 of 128 tile columns do useful work
    assert cm.gemm_efficiency(1024, 96, 1024, A100, batch=108 * 32) == pytest.approx(96 / 128)
    # k is stepped in slices of 32: k = 40 costs 64
    assert cm.gemm_efficiency(256, 128 * 108, 40, A100) == pytest.approx(40 / 64)
    # m = 128 rows fit the 128x256 orientation: one full wave, not two half-empty ones
    assert cm.gemm_time_s(128, 256 * 108, 4096, A100) == pytest.approx(_tile_s(A100, 1, 4096))
    assert cm.gemm_efficiency(128, 256 * 108, 4096, A100) == pytest.approx(1.0)


def test_batched_gemm_counts_every_tile():
    one = cm.gemm_time_s(2048, 2048, 128, A100, batch=1)   # 8 x 16 = 128 tiles: 2 waves
    assert one == pytest.approx(_tile_s(A100, 2, 128))
    # 12 heads: 1536 tiles share the waves, ceil(1536 / 108) = 15, not 12 x 2
    assert cm.gemm_time_s(2048, 2048, 128, A100, batch=12) == pytest.approx(one * 15 / 2)


def test_without_a_tile_model_it_is_the_flat_rate():
    cpu = Cluster.local_cpu(2).device
    assert cpu.sm_count is None and cpu.gemm_tile is None
    assert cm.gemm_time_s(33, 17, 5, cpu, batch=3) == pytest.approx(
        cm.matmul_time_s(2 * 3 * 33 * 17 * 5, cpu))
    assert cm.gemm_efficiency(33, 17, 5, cpu) == 1.0
    assert cm.gemm_time_s(0, 128, 128, A100) == 0.0


def test_cpu_rate_follows_hockneys_half_performance_length():
    """A CPU GEMM whose smallest dimension is d runs at r∞·d/(d + n½): (1024, 128, 512)
    with n½ = 64 takes 1.5x its FLOPs at peak; fused attention alike over min(s, hd)."""
    base = Cluster.local_cpu(2).device
    cpu = dataclasses.replace(base, gemm_half_dim=64.0, attention_half_dim=32.0,
                              attention_tflops=0.02)
    flat = cm.matmul_time_s(2 * 1024 * 128 * 512, base)
    assert cm.gemm_time_s(1024, 128, 512, cpu) == pytest.approx(1.5 * flat)
    assert cm.gemm_time_s(1024, 512, 128, cpu) == pytest.approx(1.5 * flat)
    assert cm.gemm_time_s(1024, 128, 512, base) == pytest.approx(flat)
    assert cm.compute.attention_time_s(1e9, cpu, 32) == pytest.approx(2 * 1e9 / 0.02e12)
    assert cm.compute.attention_time_s(1e9, cpu) == pytest.approx(1e9 / 0.02e12)  # shape unknown
    with pytest.raises(ValueError, match="gemm_half_dim"):
        dataclasses.replace(base, gemm_half_dim=-1.0)


def test_half_performance_fit_recovers_the_model():
    """Rates r∞·d/(d + n½) at three d give back (r∞, n½); rates that do not grow with d
    (noise) give n½ = 0 and their harmonic mean."""
    points = [(d, 80.0 * d / (d + 40.0)) for d in (64, 128, 256, 256)]
    assert cm.compute.fit_half_performance(points) == pytest.approx((80.0, 40.0))
    flat = cm.compute.fit_half_performance([(64, 50.0), (256, 40.0)])
    assert flat == pytest.approx((2 / (1 / 50 + 1 / 40), 0.0))
    assert cm.compute.fit_half_performance([(128, 30.0)]) == pytest.approx((30.0, 0.0))
    with pytest.raises(ValueError, match="rate"):
        cm.compute.fit_half_performance([(64, 0.0)])


def test_split_attention_heads_priced_at_their_head_size(traced):
    """The sdpa node's rate reads min(s, hd) of its per-head GEMMs (s = 16 here)."""
    cluster = Cluster.local_cpu(2)
    dev = dataclasses.replace(cluster.device, attention_tflops=0.02, attention_half_dim=16.0)
    name = next(n for n, i in traced.nodes.items() if i.kind == "sdpa")
    info = traced.nodes[name]
    head = min(min(g[1:]) for g in info.extra["gemms"])
    strat = node_strategies(traced, 1)[name][0]
    cost = node_cost(info, strat, 2, dataclasses.replace(cluster, device=dev), 1, 0,
                     attention="flash")
    assert cost.fwd_s >= 2 * info.flops / 0.02e12 * (1 + 16.0 / head) * (1 - 1e-9)


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_gemm_dimensions_are_checked(bad):
    with pytest.raises(ValueError, match="GEMM n must be an int >= 0"):
        cm.gemm_time_s(128, bad, 128, A100)


def test_device_tile_model_fields():
    base = dict(name="g", peak_tflops=100, memory_gib=10, memory_bandwidth_gbps=100,
                matmul_efficiency=0.5, source="s")
    with pytest.raises(ValueError, match="sm_count and DeviceSpec.gemm_tile go together"):
        DeviceSpec(**base, sm_count=80)
    with pytest.raises(ValueError, match=r"gemm_tile must be \(tile_m, tile_n, tile_k\)"):
        DeviceSpec(**base, sm_count=80, gemm_tile=(256, 128))
    with pytest.raises(ValueError, match=r"gemm_tile\[2\] must be a positive int"):
        DeviceSpec(**base, sm_count=80, gemm_tile=(256, 128, 0))
    spec = DeviceSpec(**base, sm_count=80, gemm_tile=[256, 128, 32])  # JSON gives a list
    assert spec.gemm_tile == (256, 128, 32)
    a100 = Cluster.dgx_a100()
    assert a100.to_dict()["device"]["gemm_tile"] == [256, 128, 32]  # JSON types, as read back
    assert Cluster.from_dict(a100.to_dict()) == a100
    presets = {n: Cluster.from_name(n).device.sm_count for n in ("dgx-a100", "dgx2h-v100", "dgx-h100")}
    assert presets == {"dgx-a100": 108, "dgx2h-v100": 80, "dgx-h100": 132}


# ------------------------------------------------------------------- pipeline sends
def test_scatter_gather_send_by_hand():
    c = Cluster.dgx_a100(nodes=2)
    ib, nvl = c.inter_node, c.intra_node
    nbytes = 2 * 2048 * 25600  # one 1T activation (b = 1), bf16
    whole = cm.p2p_time_s(nbytes, ib)
    sg = cm.pipeline_send_time_s(nbytes, 8, ib, nvl)
    assert sg == pytest.approx(ib.latency_s + nbytes / 8 / ib.bandwidth_bytes_per_s
                               + 7 / 8 * nbytes / nvl.bandwidth_bytes_per_s + 7 * nvl.latency_s)
    assert sg < whole / 4
    assert cm.pipeline_send_time_s(nbytes, 8, ib, nvl, sequence_sharded=True) == pytest.approx(
        cm.p2p_time_s(nbytes / 8, ib))
    assert cm.pipeline_send_time_s(nbytes, 1, ib, nvl) == whole
    assert cm.pipeline_send_time_s(nbytes, 8, ib, nvl, scatter_gather=False) == whole


def test_cost_tables_price_the_send_megatron_does(traced):
    nbytes = 2 * traced.boundary_numel()
    two_nodes = Cluster.dgx_a100(nodes=2)   # tp 8 x pp 2: the stages sit in different nodes
    tables = cost_tables(traced, node_strategies(traced, 8), two_nodes,
                         Config(tp=8, pp=2, dp=1, micro_batch_size=1, num_micro_batches=2))
    assert tables.p2p_s == pytest.approx(2 * cm.pipeline_send_time_s(
        nbytes, 8, two_nodes.inter_node, two_nodes.intra_node))
    one_node = Cluster.dgx_a100(nodes=1)    # tp 2 x pp 2 inside one node: a whole send
    tables = cost_tables(traced, node_strategies(traced, 2), one_node,
                         Config(tp=2, pp=2, dp=1, micro_batch_size=1, num_micro_batches=2))
    assert tables.p2p_s == pytest.approx(2 * cm.p2p_time_s(nbytes, one_node.intra_node))


# -------------------------------------------------------------- graph matmuls
def test_linear_node_priced_at_its_split_shape(traced):
    cluster = Cluster.dgx_a100()
    name = next(n for n, i in traced.nodes.items() if i.kind == "linear" and "c_fc" in n)
    info = traced.nodes[name]
    (batch, m, n, k), = info.extra["gemms"]
    assert (batch, 2 * batch * m * n * k) == (1, info.flops)
    by_name = {s.name: s for s in node_strategies(traced, 2)[name]}
    dev = cluster.device
    for strat, (mm, nn_, kk) in (("column", (4 * m, n // 2, k)), ("row", (4 * m, n, k // 2)),
                                 ("replicate", (4 * m, n, k))):
        cost = node_cost(info, by_name[strat], 4, cluster, 2, 0)
        assert cost.fwd_s == pytest.approx(cm.gemm_time_s(mm, nn_, kk, dev))
        assert cost.bwd_s == pytest.approx(cm.gemm_time_s(mm, kk, nn_, dev)
                                           + cm.gemm_time_s(kk, nn_, mm, dev))


def test_attention_and_matmul_shapes_carry_their_flops(traced):
    for info in traced.nodes.values():
        if info.kind in ("linear", "sdpa"):
            assert sum(2 * b * m * n * k for b, m, n, k in info.extra["gemms"]) == info.flops
    gm = fx.symbolic_trace(lambda q, k, x, w: (torch.matmul(q, k), torch.matmul(x, w)))
    ShapeProp(gm).propagate(torch.ones(2, 4, 8, 16), torch.ones(2, 4, 16, 8),
                            torch.ones(2, 8, 16), torch.ones(16, 32))
    scores, proj = [n for n in gm.graph.nodes if n.op == "call_function"][:2]
    assert gemm_shapes(scores, "matmul", gm, 2 * 4 * 8 * 8) == {
        "gemms": ((8, 8, 8, 16),), "gemm_folded": False}
    assert gemm_shapes(proj, "matmul", gm, 2 * 8 * 32) == {
        "gemms": ((1, 16, 32, 16),), "gemm_folded": True}


def test_matmul_kind_is_no_faster_than_its_flops_or_its_bytes():
    from autopar.graph.annotate import NodeInfo
    from autopar.planner.strategies.nodes import _replicate

    cluster = Cluster.dgx_a100()

    info = NodeInfo(name="mm", kind="matmul", shape=(1, 4, 2048, 2048), numel=4 * 2048 * 2048,
                    flops=2.0 * 4 * 2048 * 2048 * 64,
                    extra={"gemms": ((4, 2048, 2048, 64),), "gemm_folded": False})
    cost = node_cost(info, _replicate(2), 1, cluster, 1, 2 * 4 * 2048 * 64)
    memory = cm.memory_bound_time_s(2 * (2 * 4 * 2048 * 64 + info.numel), cluster.device)
    assert cost.fwd_s == pytest.approx(max(cm.gemm_time_s(2048, 2048, 64, cluster.device, 4), memory))
    assert cost.fwd_s > 0 and cost.bwd_s >= cost.fwd_s
