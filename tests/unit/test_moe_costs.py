"""cost_models.moe and the two-level all-to-all against hand-computed closed forms.

Every expected number is worked out by hand in the comment beside it (Mixtral 8x22B:
h = 6144, E = 8, k = 2, F = 16384; DeepSeek-V3: h = 7168, E = 256 routed experts, k = 8,
F = 2048, trained on 2,048 H800 with PP16 x EP64), never by calling the function under test
twice. pytest.approx fails on NaN, so no check here passes on a NaN.
"""

from __future__ import annotations

import math

import pytest

import cost_models as cm
from cost_models import Cluster, LinkSpec

NVLINK_160 = LinkSpec("NVLink (H800)", bandwidth_gbps=160.0, latency_s=5e-6, source="test")
IB_50 = LinkSpec("IB 400 Gb/s", bandwidth_gbps=50.0, latency_s=1e-5, source="test")

MIXTRAL = dict(tokens=4096, top_k=2, hidden=6144)       # micro-batch 1 x seq 4096
DEEPSEEK = dict(tokens=4096, top_k=8, hidden=7168)
MIXTRAL_BUFFER = 4096 * 2 * 6144 * 2                     # T*k*h*2 bytes = 100,663,296
DEEPSEEK_BUFFER = 4096 * 8 * 7168 * 2                    # = 469,762,048; /64 = 7,340,032


# ------------------------------------------------------------------- dispatch bytes
def test_mixtral_dispatch_bytes_at_ep8():
    # 4096 * 2 * 6144 * 2 * 7/8 = 88,080,384
    assert cm.moe_dispatch_bytes(**MIXTRAL, dtype_bytes=2, ep=8) == pytest.approx(88_080_384)
    assert MIXTRAL_BUFFER == 100_663_296


def test_deepseek_v3_dispatch_bytes_at_ep64_bf16_and_fp8():
    # 469,762,048 * 63/64 = 462,422,016; FP8 dispatch (1 byte): 231,211,008
    assert cm.moe_dispatch_bytes(**DEEPSEEK, dtype_bytes=2, ep=64) == pytest.approx(462_422_016)
    assert cm.moe_dispatch_bytes(**DEEPSEEK, dtype_bytes=1, ep=64) == pytest.approx(231_211_008)


def test_imbalance_scales_the_bytes_linearly_and_ep1_sends_nothing():
    # 88,080,384 * 1.25 = 110,100,480; * 2 = 176,160,768
    f = cm.moe_dispatch_bytes
    assert f(**MIXTRAL, dtype_bytes=2, ep=8, imbalance=1.25) == pytest.approx(110_100_480)
    assert f(**MIXTRAL, dtype_bytes=2, ep=8, imbalance=2.0) == pytest.approx(176_160_768)
    assert cm.SWITCH_CAPACITY_FACTOR == 1.25 and cm.BALANCED_ROUTING == 1.0
    assert f(**MIXTRAL, dtype_bytes=2, ep=1) == 0.0


def test_all_to_alls_per_layer():
    # dispatch + combine forward, their reverses backward; full recompute re-runs the forward
    assert cm.MOE_FORWARD_ALL_TO_ALLS == 2
    assert [cm.moe_all_to_alls_per_layer(r) for r in (False, True)] == [4, 6]


# ------------------------------------------------------------- all-to-all time
def test_one_level_all_to_all_closed_form():
    # 1e9 B over 8 ranks on 100 GB/s, 10 us: 7/8 * 1e9 / 100e9 + 7 * 10 us = 8.75 ms + 70 us
    link = LinkSpec("test link", bandwidth_gbps=100.0, latency_s=1e-5, source="test")
    assert cm.collective_time_s("all_to_all", 1e9, 8, link) == pytest.approx(8.75e-3 + 7e-5)
    assert cm.all_to_all_time_s(1e9, 8, 8, link, IB_50) == pytest.approx(8.75e-3 + 7e-5)
    assert cm.all_to_all_time_s(1e9, 8, 1, NVLINK_160, link) == pytest.approx(8.75e-3 + 7e-5)
    assert cm.collective_time_s("all_to_all", 1e9, 1, link) == 0.0
    assert cm.all_to_all_time_s(0, 8, 8, link, link) == 0.0


def test_mixtral_ep8_inside_one_node():
    # 7 peers on NVLink: 88,080,384 / 160e9 = 550.5024 us, + 7 * 5 us = 585.5024 us
    got = cm.moe_all_to_all_time_s(**MIXTRAL, dtype_bytes=2, ep=8, ranks_per_node_in_group=8,
                                   intra=NVLINK_160, inter=IB_50)
    assert got == pytest.approx(5.855024e-4)
    assert cm.all_to_all_time_s(MIXTRAL_BUFFER, 8, 8, NVLINK_160, IB_50) == \
        pytest.approx(5.855024e-4)


def test_deepseek_v3_ep64_over_8_nodes():
    # M/64 = 7,340,032 B per peer; 7 peers on NVLink, 56 on IB, concurrently:
    # NVLink 7 * (7,340,032 / 160e9 + 5 us) = 7 * 50.8752 us = 356.1264 us
    # IB    56 * (7,340,032 / 50e9 + 10 us) = 56 * 156.80064 us = 8,780.83584 us  <- the max
    got = cm.all_to_all_time_s(DEEPSEEK_BUFFER, 64, 8, NVLINK_160, IB_50)
    assert got == pytest.approx(8.78083584e-3)
    assert cm.moe_all_to_all_time_s(**DEEPSEEK, dtype_bytes=2, ep=64, ranks_per_node_in_group=8,
                                    intra=NVLINK_160, inter=IB_50) == pytest.approx(8.78083584e-3)
    # the bytes behind it: 7/63 of the 462,422,016 sent go on NVLink, 56/63 on IB
    assert 7 * DEEPSEEK_BUFFER / 64 == pytest.approx(462_422_016 * 7 / 63)  # 51,380,224
    # with an inter-node link as fast as NVLink the two parts still run side by side on
    # their own links: the 56 remote peers set it, 56 * 50.8752 us = 2,849.0112 us
    fast = LinkSpec("as fast as NVLink", 160.0, 5e-6, "test")
    assert cm.all_to_all_time_s(DEEPSEEK_BUFFER, 64, 8, NVLINK_160, fast) == \
        pytest.approx(2.8490112e-3)


def test_more_ib_share_is_slower():
    """A 64-rank group on fewer ranks per node sends a larger share of its peers over IB."""
    times = [cm.all_to_all_time_s(DEEPSEEK_BUFFER, 64, r, NVLINK_160, IB_50)
             for r in (64, 32, 16, 8, 4, 2, 1)]
    assert all(math.isfinite(t) and t > 0 for t in times)
    assert all(a < b for a, b in zip(times, times[1:])), times
    # r = 32: IB 32 * 156.80064 us = 5,017.62048 us against NVLink 31 * 50.8752 us
    assert times[1] == pytest.approx(5.01762048e-3)


def test_imbalance_scales_the_time_through_the_buffer():
    # f = 1.25 on the Mixtral case: 110,100,480 / 160e9 + 35 us = 723.1280 us
    got = cm.moe_all_to_all_time_s(**MIXTRAL, dtype_bytes=2, ep=8, ranks_per_node_in_group=8,
                                   intra=NVLINK_160, inter=IB_50, imbalance=1.25)
    assert got == pytest.approx(7.23128e-4)


# --------------------------------------------------------------------- FLOPs
def test_expert_and_router_flops():
    # 2 * 4096 * 2 * 6144 * 16384 * 3 = 4,947,802,324,992; not gated: * 2/3
    f = cm.moe_expert_flops
    assert f(4096, 2, 6144, 16384) == pytest.approx(4_947_802_324_992)
    assert f(4096, 2, 6144, 16384, gated=False) == pytest.approx(3_298_534_883_328)
    # router: 2 * 4096 * 6144 * 8 = 402,653,184
    assert cm.moe_router_flops(4096, 6144, 8) == pytest.approx(402_653_184)


def test_tokens_per_expert():
    # Mixtral, ep = 8: the group routes 8 * 4096 tokens, 2 copies each, over 8 experts: 8192
    assert cm.tokens_per_expert(8 * 4096, 2, 8) == pytest.approx(8192)
    assert cm.tokens_per_expert(8 * 4096, 2, 8, imbalance=1.25) == pytest.approx(10240)
    # DeepSeek-V3, ep = 64: 64 * 4096 * 8 / 256 = 8192
    assert cm.tokens_per_expert(64 * 4096, 8, 256) == pytest.approx(8192)


# ------------------------------------------------------------------- model states
def test_expert_params_and_ep_divides_them():
    # Mixtral 8x22B: 3 * 6144 * 16384 = 301,989,888 per expert; x 8 experts x 56 layers =
    # 135,291,469,824, the bulk of the published 141B total
    per_expert = cm.expert_params(6144, 16384)
    assert per_expert == pytest.approx(301_989_888)
    assert cm.expert_params(6144, 16384, gated=False) == pytest.approx(201_326_592)
    assert 0.9 * 141e9 < per_expert * 8 * 56 < 141e9
    f = cm.expert_param_count_per_rank
    assert f(8, 8, per_expert) == pytest.approx(301_989_888)
    assert f(8, 4, per_expert) == pytest.approx(603_979_776)
    assert f(8, 4, per_expert, expert_tp=2) == pytest.approx(301_989_888)
    # DeepSeek-V3: 256 experts of 3 * 7168 * 2048 = 44,040,192 at ep 64: 4 each, 176,160,768
    assert f(256, 64, 3 * 7168 * 2048) == pytest.approx(176_160_768)


def test_expert_data_parallel_size():
    # DeepSeek-V3: 2,048 H800, PP16, EP64, no expert TP: EDP = 2048 / (64 * 16) = 2
    assert cm.expert_data_parallel_size(2048, 64, 1, 16) == 2
    assert cm.expert_data_parallel_size(128, 8, expert_tp=1, pp=4) == 4
    assert cm.expert_data_parallel_size(128, 8, expert_tp=2, pp=4) == 2


def test_zero_over_edp_divides_the_optimizer_states():
    psi = 176_160_768  # DeepSeek-V3's experts of one layer on one rank at ep 64
    f = cm.expert_model_state_bytes
    # ZeRO-1 over EDP 2: (2 + 2) * psi + 12 * psi / 2 = 10 psi = 1,761,607,680
    assert f(256, 64, 44_040_192, zero_stage=1, edp=2) == pytest.approx(1_761_607_680)
    # plain DP: 16 psi = 2,818,572,288; ZeRO-3 over EDP 2: 8 psi = 1,409,286,144
    assert f(256, 64, 44_040_192, zero_stage=0, edp=2) == pytest.approx(2_818_572_288)
    assert f(256, 64, 44_040_192, zero_stage=3, edp=2) == pytest.approx(1_409_286_144)
    # doubling EDP under ZeRO-1 saves only the K term: 12 psi (1/2 - 1/4) = 3 psi
    saved = f(256, 64, 44_040_192, 1, 2) - f(256, 64, 44_040_192, 1, 4)
    assert saved == pytest.approx(3 * psi)


def test_dispatch_buffers():
    # send + receive buffers: 100,663,296 * (1 + 1) = 201,326,592; f = 1.25: * 2.25
    f = cm.moe_dispatch_buffer_bytes
    assert f(**MIXTRAL, dtype_bytes=2) == pytest.approx(201_326_592)
    assert f(**MIXTRAL, dtype_bytes=2, imbalance=1.25) == pytest.approx(226_492_416)


# ------------------------------------------------------------------- H800 preset
def test_h800_preset_is_an_h100_with_the_nvlink_cut():
    h800, h100 = Cluster.dgx_h800(256), Cluster.dgx_h100()
    assert "dgx-h800" in cm.PRESET_NAMES and Cluster.from_name("dgx-h800", 2).nodes == 2
    assert h800.num_gpus == 2048 and h800.name == "dgx-h800"
    dev = h800.device
    assert (dev.peak_tflops, dev.memory_gib, dev.memory_bandwidth_gbps, dev.sm_count) == \
        (989, 80, 3350, 132)
    assert (h800.intra_node.bandwidth_gbps, h800.inter_node.bandwidth_gbps) == (160, 44)
    assert "DeepSeek-V3" in h800.intra_node.source and "2505.09343" in h800.inter_node.source
    # an all-to-all inside one node: the bandwidth part is 370/160 times the H100's
    a2a = [cm.all_to_all_time_s(MIXTRAL_BUFFER, 8, 8, c.intra_node, c.inter_node) - 7 * 5e-6
           for c in (h800, h100)]
    assert a2a[0] / a2a[1] == pytest.approx(370 / 160)
    # DeepSeek-V3's ep 64 on it: IB 56 * (7,340,032 / 44e9 + 10 us) = 9,901.858909 us
    got = cm.all_to_all_time_s(DEEPSEEK_BUFFER, 64, 8, h800.intra_node, h800.inter_node)
    assert got == pytest.approx(9.901858909e-3)


# ------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("call, pattern", [
    (lambda: cm.expert_param_count_per_rank(8, 3, 1.0), r"ep=3 does not divide num_experts=8"),
    (lambda: cm.expert_model_state_bytes(256, 48, 1.0, 1, 2), r"ep=48 does not divide num_experts=256"),
    (lambda: cm.expert_data_parallel_size(2048, 64, 1, 3),
     r"expert_tp\*ep\*pp = 192 does not divide world_size=2048"),
    (lambda: cm.moe_dispatch_bytes(4096, 2, 0, 2, 8), r"hidden must be a positive number, got 0"),
    (lambda: cm.moe_dispatch_bytes(4096, 0, 6144, 2, 8), r"top_k must be a positive int, got 0"),
    (lambda: cm.moe_dispatch_bytes(-1, 2, 6144, 2, 8), r"tokens must be a non-negative number"),
    (lambda: cm.moe_dispatch_bytes(4096, 2, 6144, 2, 0), r"ep must be a positive int, got 0"),
    (lambda: cm.moe_dispatch_bytes(4096, 2, 6144, 2, 8, imbalance=0.9), r"imbalance must be a number >= 1"),
    (lambda: cm.moe_dispatch_bytes(4096, 2, 6144, 2, 8, imbalance=float("nan")), r"imbalance"),
    (lambda: cm.moe_all_to_all_time_s(4096, 2, 6144, 2, 0, 8, NVLINK_160, IB_50), r"ep must be a positive int"),
    (lambda: cm.all_to_all_time_s(1e6, 64, 3, NVLINK_160, IB_50),
     r"ranks_per_node_in_group=3 must divide group_size=64"),
    (lambda: cm.all_to_all_time_s(1e6, 8, 16, NVLINK_160, IB_50), r"ranks_per_node_in_group=16"),
    (lambda: cm.all_to_all_time_s(1e6, 8, 8, NVLINK_160, "ib"), r"inter must be a LinkSpec"),
    (lambda: cm.all_to_all_time_s(-1, 8, 8, NVLINK_160, IB_50), r"nbytes_per_rank must be a non-negative"),
    (lambda: cm.tokens_per_expert(10, 9, 8), r"top_k=9 exceeds num_experts=8"),
    (lambda: cm.moe_expert_flops(1, 1, 1, 0), r"expert_ffn must be a positive number"),
    (lambda: cm.moe_expert_flops(1, 1, 1, 1, gated="yes"), r"gated must be a bool"),
    (lambda: cm.moe_router_flops(1, 1, 0), r"num_experts must be a positive int"),
    (lambda: cm.moe_dispatch_buffer_bytes(1, 1, 1, 0), r"dtype_bytes must be a positive number"),
])
def test_refusals_name_the_cause(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
