"""cost_models against independent, published formulas and reference points.

Every expected value here is computed by hand (in the comment next to it) or is a
number printed in a paper, never by calling the function under test twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cost_models as cm
from cost_models import Cluster, DeviceSpec, LinkSpec

GB = 1e9
REPO = Path(__file__).resolve().parents[2]


# (cost_models imports neither torch nor autopar: tests/unit/test_layering.py)


# ------------------------------------------------------------------------ ZeRO (memory)
@pytest.mark.parametrize("stage, paper_gb, exact_gb", [
    (0, 120.0, 16 * 7.5),                 # (2 + 2 + 12) * 7.5e9
    (1, 31.4, 4 * 7.5 + 12 * 7.5 / 64),   # 30 + 1.40625
    (2, 16.6, 2 * 7.5 + 14 * 7.5 / 64),   # 15 + 1.640625
    (3, 1.9, 16 * 7.5 / 64),              # 1.875
])
def test_zero_paper_figures(stage, paper_gb, exact_gb):
    got = cm.model_state_bytes(7.5e9, stage, 64) / GB
    assert got == pytest.approx(exact_gb, rel=1e-12)
    # the paper prints one decimal (1.875 GB appears as 1.9 GB)
    assert got == pytest.approx(paper_gb, abs=0.05)


def test_zero_general_bytes_and_dp1():
    # fp32 params and grads, K = 12, d = 4, stage 2: 4 + (4 + 12)/4 = 8 bytes/param
    assert cm.model_state_bytes(1000, 2, 4, param_bytes=4, grad_bytes=4) == pytest.approx(8000)
    for stage in range(4):  # with d = 1 sharding changes nothing
        assert cm.model_state_bytes(10, stage, 1) == pytest.approx(160)


# ------------------------------------------------------------- Korthikanti activations
def test_activation_closed_forms_small_case():
    s, b, h, a = 4, 2, 8, 2          # s*b*h = 64, a*s/h = 1
    f = cm.transformer_layer_activation_bytes
    assert f(s, b, h, a) == pytest.approx(64 * (34 + 5))
    assert f(s, b, h, a, tp=2) == pytest.approx(64 * (10 + 12 + 2.5))
    assert f(s, b, h, a, tp=2, sequence_parallel=True) == pytest.approx(64 * (17 + 2.5))
    assert f(s, b, h, a, tp=2, recompute="selective") == pytest.approx(64 * 22)
    assert f(s, b, h, a, recompute="selective") == pytest.approx(64 * 34)
    assert f(s, b, h, a, tp=2, recompute="full") == pytest.approx(128)
    assert f(s, b, h, a, tp=2, sequence_parallel=True, recompute="full") == pytest.approx(64)


def test_activation_gpt3_175b_table2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8   # 5*a*s/h = 80
    sbh = s * b * h
    f = cm.transformer_layer_activation_bytes
    assert f(s, b, h, a) == pytest.approx(sbh * 114)                    # 34 + 80
    assert f(s, b, h, a, tp=t) == pytest.approx(sbh * 23)               # 10 + 3 + 10
    assert f(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(sbh * 14.25)


@pytest.mark.parametrize("s, b, h, a, t", [
    (2048, 1, 12288, 96, 8), (1024, 4, 4096, 32, 4), (512, 2, 1024, 16, 2), (128, 3, 768, 12, 1),
])
def test_tp_sp_selective_is_34_over_t(s, b, h, a, t):
    got = cm.transformer_layer_activation_bytes(s, b, h, a, tp=t, sequence_parallel=True,
                                                recompute="selective")
    assert got == pytest.approx(s * b * h * 34 / t)


def test_in_flight_micro_batches():
    assert cm.all_forwards_in_flight(4, 2, 16) == 16
    f = cm.one_forward_one_backward_in_flight
    assert [f(4, i, 16) for i in range(4)] == [4, 3, 2, 1]
    assert f(4, 0, 2) == 2
    p, v = 4, 2
    assert cm.interleaved_in_flight(p, 0, 8, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    later = [cm.interleaved_in_flight(p, i, 8, v) for i in range(p)]
    assert later == sorted(later, reverse=True) and later[-1] == pytest.approx(2.5)  # (4+1)/2


# --------------------------------------------------------------------------- pipeline
def test_bubble_fraction():
    assert cm.bubble_fraction(8, 32) == pytest.approx(7 / 32)
    assert cm.bubble_fraction(16, 64) == pytest.approx(15 / 64)
    assert cm.bubble_fraction(4, 8, 3) == pytest.approx(3 / 24)


@pytest.mark.parametrize("p, m, v", [(4, 3, 1), (4, 8, 1), (1, 5, 1), (4, 8, 2)])
def test_equal_stages_identity(p, m, v):
    t = 0.25
    got = cm.pipeline_step_time_s([t] * p, m, virtual_stages=v)
    assert got == pytest.approx((m + (p - 1) / v) * t)
    assert got == pytest.approx(m * t * (1 + cm.bubble_fraction(p, m, v)))


def test_unequal_stages_and_p2p():
    # (m-1)*max + sum: 3*2 + 4 = 10; with c = 0.5: 3*2.5 + 4 + 2*0.5 = 12.5
    assert cm.pipeline_step_time_s([1, 2, 1], 4) == pytest.approx(10)
    assert cm.pipeline_step_time_s([1, 2, 1], 4, p2p_time_s=0.5) == pytest.approx(12.5)
    # interleaved v=2, m=3: 3*max + (sum - max)/2 = 6 + 1
    assert cm.pipeline_step_time_s([1, 2, 1], 3, 2) == pytest.approx(7)
    # one stage sends nothing
    assert cm.pipeline_step_time_s([1.0], 4, p2p_time_s=9.0) == pytest.approx(4)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 24), (2, 2)])
def test_zb_h1_bubble_is_qi_et_al_table_2(p, m):
    """Equal stages F, B, W: 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W) (Qi et al. 2024,
    Table 2)."""
    f, b, w = 1.0, 1.0, 0.75
    t = f + b + w
    one_f_one_b = cm.pipeline_step_time_s([t] * p, m)
    zb = cm.pipeline_step_time_s([t] * p, m, deferred_weight_grad_s=[w] * p)
    assert one_f_one_b - m * t == pytest.approx((p - 1) * (f + b + w))
    assert zb - m * t == pytest.approx((p - 1) * (f + b - w))


def test_zb_h1_with_unequal_stages_keeps_the_slowest_stage_slot():
    # (m-1)*M + sum(t - 2w) + 2 max w = 3*2 + (0.8 + 1 + 0.8) + 1 = 9.6 (1F1B: 10)
    assert cm.pipeline_step_time_s([1, 2, 1], 4, deferred_weight_grad_s=[0.1, 0.5, 0.1]) == \
        pytest.approx(9.6)
    with pytest.raises(ValueError, match="one time per stage .* and v = 1"):
        cm.pipeline_step_time_s([1, 2, 1], 3, 2, deferred_weight_grad_s=[0.1] * 3)


# ------------------------------------------------------------------------------ comm
LINK_100 = LinkSpec("test link", bandwidth_gbps=100.0, latency_s=1e-5, source="test")


def test_ring_all_reduce_1gb_8gpus():
    # 2 * 7/8 * 1e9 B / 100e9 B/s = 17.5 ms, plus 2 * 7 * 10 us latency
    assert cm.all_reduce_time_s(1e9, 8, LINK_100) == pytest.approx(0.0175 + 14e-5)
    assert cm.collective_time_s("all_reduce", 1e9, 8, LINK_100) == pytest.approx(0.0175 + 14e-5)


def test_gather_scatter_p2p_and_trivial_groups():
    assert cm.all_gather_time_s(1e9, 4, LINK_100) == pytest.approx(0.0075 + 3e-5)
    assert cm.reduce_scatter_time_s(1e9, 4, LINK_100) == pytest.approx(0.0075 + 3e-5)
    assert cm.p2p_time_s(1e9, LINK_100) == pytest.approx(0.01 + 1e-5)
    assert cm.collective_time_s("p2p", 1e9, 2, LINK_100) == pytest.approx(0.01 + 1e-5)
    assert cm.all_reduce_time_s(1e9, 1, LINK_100) == 0.0


def test_group_link_dgx_a100():
    c = Cluster.dgx_a100(nodes=8)
    assert cm.group_link(c, 8, 1) == c.intra_node   # TP 8 inside a node
    assert cm.group_link(c, 8, 8) == c.inter_node   # DP 8 across nodes
    assert cm.group_link(c, 2, 4) == c.intra_node   # {r, r+4}: blocks of 8
    assert cm.group_link(c, 2, 3) == c.inter_node   # blocks of 6 straddle: {6, 9}
    assert cm.group_link(c, 1, 64) == c.intra_node
    assert cm.group_link(Cluster.dgx_a100(), 8, 1) == c.intra_node
    with pytest.raises(ValueError, match="spans 65 ranks"):
        cm.group_link(c, 2, 64)


# --------------------------------------------------------------------------- compute
def test_roofline():
    dev = Cluster.dgx_a100().device
    sustained = 312e12 * dev.matmul_efficiency  # FLOP/s of training GEMMs
    assert cm.matmul_time_s(sustained, dev) == pytest.approx(1.0)
    assert cm.memory_bound_time_s(2039e9, dev) == pytest.approx(1.0)
    assert cm.op_time_s(sustained, 2 * 2039e9, dev) == pytest.approx(2.0)


def test_host_dispatch_adds_on_a_cpu_rank_and_overlaps_on_a_gpu():
    """A CPU rank computes what it dispatches (sum); a GPU runs kernels its host launched
    earlier, so only kernels shorter than their launch wait on it (max)."""
    import dataclasses

    h200 = Cluster.dgx_h200().device
    assert h200.async_dispatch and h200.op_overhead_s == pytest.approx(22e-6)
    cpu = dataclasses.replace(h200, async_dispatch=False)
    assert cm.dispatched_time_s(1e-3, 2, cpu) == pytest.approx(1e-3 + 44e-6)
    assert cm.dispatched_time_s(1e-3, 2, h200) == pytest.approx(1e-3)  # a long kernel hides it
    assert cm.dispatched_time_s(5e-6, 2, h200) == pytest.approx(44e-6)  # a short one waits
    assert not Cluster.dgx_a100().device.async_dispatch  # fitted without it: unchanged
    with pytest.raises(ValueError, match=r"DeviceSpec\.async_dispatch must be true or false"):
        dataclasses.replace(h200, async_dispatch="yes")


def test_gpt3_175b_model_flops():
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    # by hand: 96*B*s*L*h^2 = 4.37740e18; 1 + 2048/73728 + 51200/18874368 = 1.030490
    full = cm.gpt_model_flops(B, s, L, h, V, recompute="full")
    assert full == pytest.approx(4.5110e18, rel=1e-4)
    # Narayanan 2021 eq. (4) approximation 8*Psi*B*s with Psi ~ 12*L*h^2 + V*h
    psi = 12 * L * h**2 + V * h
    assert full == pytest.approx(8 * psi * B * s, rel=0.03)
    assert cm.gpt_model_flops(B, s, L, h, V) == pytest.approx(full * 72 / 96)
    assert cm.gpt_model_flops(B, s, L, h, V, "selective") == pytest.approx(full * 72 / 96)


# ------------------------------------------------------------------- hardware presets
@pytest.mark.parametrize("name", cm.PRESET_NAMES)
def test_preset_round_trip(name, tmp_path):
    cluster = Cluster.from_name(name, 2)
    assert cluster.nodes == 2 and cluster.name == name
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    cluster.to_json_file(tmp_path / "c.json")
    assert Cluster.from_json_file(tmp_path / "c.json") == cluster


@pytest.mark.parametrize("path", sorted((REPO / "cost_models" / "presets").glob("*.json")))
def test_every_preset_number_has_a_source(path):
    def walk(node, where):
        for key, value in node.items():
            if isinstance(value, dict) and "value" in value:
                assert isinstance(value["source"], str) and value["source"], f"{where}.{key}"
            elif isinstance(value, dict):
                walk(value, f"{where}.{key}")
            else:
                assert not isinstance(value, (int, float)), f"{where}.{key} has no source"
    walk(json.loads(path.read_text()), path.stem)


def test_preset_values():
    a100, h100, v100 = Cluster.dgx_a100(4), Cluster.dgx_h100(), Cluster.dgx2h_v100()
    assert (a100.num_gpus, a100.device.peak_tflops) == (32, 312)
    assert 0.5 < a100.device.matmul_efficiency < 0.8  # calibrated on the GPT-3 175B run
    assert a100.device.memory_bytes == 80 * 2**30 and a100.inter_node.bandwidth_gbps <= 25
    assert (h100.device.peak_tflops, h100.device.memory_bandwidth_gbps) == (989, 3350)
    h200 = Cluster.dgx_h200()
    assert (h200.device.peak_tflops, h200.device.memory_bandwidth_gbps) == (989, 4800)
    assert (h100.attention, h200.attention, a100.attention) == ("flash", "flash", "math")
    assert (v100.gpus_per_node, v100.device.memory_gib, v100.inter_node.bandwidth_gbps <= 6.25) == (16, 32, True)
    cpu = Cluster.local_cpu(3)
    assert (cpu.gpus_per_node, cpu.nodes, cpu.num_gpus) == (3, 1, 3)
    assert "Narayanan" in a100.device.source


# ------------------------------------------------------------------------ errors
def _a100_kwargs(**changes):
    c = Cluster.dgx_a100()
    kwargs = dict(device=c.device, gpus_per_node=8, nodes=1, intra_node=c.intra_node,
                  inter_node=c.inter_node)
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize("call, pattern", [
    (lambda: Cluster(**_a100_kwargs(nodes=0)), r"Cluster\.nodes must be a positive int, got 0"),
    (lambda: Cluster(**_a100_kwargs(gpus_per_node=8.0)), r"Cluster\.gpus_per_node .* got 8\.0"),
    (lambda: Cluster(**_a100_kwargs(device={})), r"Cluster\.device must be a DeviceSpec"),
    (lambda: DeviceSpec("x", 1, 1, 1, 1.5, "s"), r"DeviceSpec\.matmul_efficiency .*\(0, 1\].*1\.5"),
    (lambda: DeviceSpec("x", -1, 1, 1, 0.5, "s"), r"DeviceSpec\.peak_tflops .*-1"),
    (lambda: DeviceSpec("x", 1, 1, 1, 0.5, ""), r"DeviceSpec\.source"),
    (lambda: LinkSpec("x", 0, 1e-6, "s"), r"LinkSpec\.bandwidth_gbps must be a positive"),
    (lambda: LinkSpec("x", 1, -1, "s"), r"LinkSpec\.latency_s"),
    (lambda: Cluster.from_name("dgx-b200"), r"valid names: dgx-a100, dgx-h100, dgx-h200, dgx-h800, dgx2h-v100, local-cpu"),
    (lambda: Cluster.local_cpu(0), r"processes must be a positive int"),
    (lambda: Cluster.from_dict({"device": {}}), r"Cluster is missing field.*gpus_per_node"),
    (lambda: Cluster.from_dict({**Cluster.dgx_a100().to_dict(), "gpu": 1}), r"unknown field.*'gpu'"),
    (lambda: cm.collective_time_s("broadcast", 1, 2, LINK_100), r"collective kind must be one of"),
    (lambda: cm.all_reduce_time_s(-1, 2, LINK_100), r"nbytes must be a non-negative"),
    (lambda: cm.all_gather_time_s(1, 0, LINK_100), r"group_size must be a positive int, got 0"),
    (lambda: cm.model_state_bytes(1, 4, 8), r"zero_stage must be 0, 1, 2 or 3, got 4"),
    (lambda: cm.model_state_bytes(1, 1, 0), r"dp must be a positive int, got 0"),
    (lambda: cm.gpt_model_flops(1, 1, 1, 1, 1, "some"), r"recompute must be one of"),
    (lambda: cm.transformer_layer_activation_bytes(1, 1, 1, 1, recompute="x"), r"recompute"),
    (lambda: cm.one_forward_one_backward_in_flight(2, 2, 4), r"stage must be an int in \[0, pp=2\)"),
    (lambda: cm.interleaved_in_flight(2, 0, 4, 0), r"virtual_stages must be a positive int"),
    (lambda: cm.pipeline_step_time_s([], 4), r"stage_times_s .* empty"),
    (lambda: cm.pipeline_step_time_s([1, 1], 0), r"num_micro_batches must be a positive"),
    (lambda: cm.bubble_fraction(2, 4, 0), r"virtual_stages must be a positive int"),
])
def test_errors_name_the_cause(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
