"""The memory reserve (issue 13): what a process holds besides model states and activations.

Terms against a hand computation for a small config, every planner plan fitting device memory
less the reserve, ``--memory-headroom`` shrinking what fits (InfeasibleError naming the
reserve), the plan file round trip of the reserve fields (and version 2 files refused), and
the summary / report text with the margin.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar.cli import main as cli_main
from autopar.models import GPT, GPTConfig
from autopar.contract.plan import Plan
from autopar.contract.plan_check import PlanError
from autopar.report import render_markdown
from cost_models.hardware import Cluster
from helpers import fast_cluster
from cost_models.reserve import (RESERVE_KINDS, MemoryReserve, loss_temporary_bytes,
                                 nccl_peers, p2p_buffer_bytes)

GIB, MIB = 2**30, 2**20
SMALL = GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=32)


def _meta(cfg: GPTConfig = SMALL) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


@pytest.fixture(scope="module")
def hand_plan() -> Plan:
    """tp=2 pp=2 dp=2 b=2 m=4 on 8 A100s with nearly free communication (fp32), so TP
    splits the layers and the loss is vocabulary-parallel."""
    layout = autopar.Layout(tp=2, pp=2, dp=2, micro_batch_size=2)
    return autopar.evaluate(_meta(), fast_cluster(8), layout, global_batch_size=16,
                            seq_len=32, model_name="small")


def test_reserve_terms_match_a_hand_computation(hand_plan):
    p = hand_plan.predicted
    b, s, h, V, t, act = 2, 32, 64, 256, 2, 4  # fp32 activations (fast_cluster)
    assert hand_plan.placements["output"].startswith("vocab_parallel")  # the loss on V/t
    peers = 2 + 2 + 2  # TP ring, DP ring, previous/next pipeline stage
    p2p = act * b * s * h
    in_flight = [2, 1]  # 1F1B: min(p - i, m) with p = 2, m = 4
    for i, reserve in enumerate(p.memory_reserve_bytes_by_stage):
        assert list(reserve) == list(RESERVE_KINDS)
        last = i == 1
        loss = b * s * (V // t) * 2 * 4 if last else 0.0  # 2 fp32 copies (fp32 logits: no cast)
        temps = {"loss_logits": loss, "pp_p2p_buffers": p2p * (in_flight[i] + 1),
                 "dp_bucket": 25 * MIB}
        peak = sum(p.memory_bytes_by_stage[i].values())
        want = {"cuda_context": 0.5 * GIB, "nccl_buffers": 4 * MIB * 16 * peers, "headroom": 0.0,
                **temps, "fragmentation": 0.05 * (peak + sum(temps.values()))}
        assert reserve == pytest.approx(want, rel=1e-12), i
    margins = [80 * GIB - sum(r.values()) - sum(m.values())
               for r, m in zip(p.memory_reserve_bytes_by_stage, p.memory_bytes_by_stage)]
    assert p.memory_margin_bytes == pytest.approx(min(margins), rel=1e-12)
    assert 0 < p.memory_margin_bytes < 80 * GIB - p.peak_memory_bytes - 0.5 * GIB


def test_cost_model_functions_by_hand():
    assert nccl_peers(1, 1, 1) == 0 and nccl_peers(8, 16, 8) == 6 and nccl_peers(1, 4, 1) == 2
    assert loss_temporary_bytes(1000, 2) == 1000 * 10  # bf16: 2 fp32 copies + the bf16 logits
    assert loss_temporary_bytes(1000, 4) == 1000 * 8  # fp32: .float() is the tensor itself
    assert p2p_buffer_bytes(100, 3) == 400
    r = MemoryReserve()
    limit = r.allocator_limit_bytes(80 * GIB, 6, headroom_gib=2)
    assert limit == pytest.approx((80 * GIB - 0.5 * GIB - 384 * MIB - 2 * GIB) / 1.05)
    kinds = r.by_kind(limit - 10, {"dp_bucket": 10.0}, 6, headroom_gib=2)
    assert sum(kinds.values()) + limit - 10 == pytest.approx(80 * GIB)  # fills exactly at the limit
    none = MemoryReserve.none()
    assert none.allocator_limit_bytes(GIB, 6) == GIB and not none.step_temporaries
    for bad in ({"fragmentation": 1.0}, {"fragmentation": -0.1}, {"nccl_channels": 1.5},
                {"cuda_context_gib": float("nan")}, {"step_temporaries": 1}):
        with pytest.raises(ValueError, match="MemoryReserve"):
            MemoryReserve(**bad)


def test_presets_carry_a_sourced_reserve_and_clusters_round_trip():
    for name in ("dgx-a100", "dgx-h100", "dgx2h-v100", "local-cpu"):
        cluster = Cluster.from_name(name)
        assert "NCCL_BUFFSIZE" in cluster.memory_reserve.source
        assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_name("local-cpu").memory_reserve.nccl_channels == 0  # gloo
    data = Cluster.dgx_a100(1).to_dict()
    del data["memory_reserve"], data["memory_headroom_gib"]  # a file written before the reserve
    assert Cluster.from_dict(data).memory_reserve == MemoryReserve()
    data["memory_reserve"] = {"fragmentation": {"value": 0.1, "source": "measured"}}
    assert Cluster.from_dict(data).memory_reserve.fragmentation == 0.1
    data["memory_headroom_gib"] = -1
    with pytest.raises(ValueError, match="memory_headroom_gib"):
        Cluster.from_dict(data)


def _fits(plan: Plan) -> None:
    """Every stage's peak + reserve within device memory, and the margin says so."""
    device = plan.cluster["device"]["memory_gib"] * GIB
    p = plan.predicted
    assert len(p.memory_reserve_bytes_by_stage) == plan.pp
    for mem, reserve in zip(p.memory_bytes_by_stage, p.memory_reserve_bytes_by_stage):
        assert sum(mem.values()) + sum(reserve.values()) <= device
        assert reserve["cuda_context"] > 0 and reserve["fragmentation"] > 0
    assert 0 <= p.memory_margin_bytes < device - p.peak_memory_bytes


def _tight_cluster(gib: float) -> Cluster:
    """Two A100s on one node with ``gib`` of memory each."""
    base = Cluster.dgx_a100(1)
    return dataclasses.replace(base, gpus_per_node=2,
                               device=dataclasses.replace(base.device, memory_gib=gib))


MEDIUM = GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, block_size=256)


def test_every_plan_fits_under_memory_less_reserve():
    """A memory where the reserve binds: without it the plan would use more than memory less
    the reserve; with it the planner's plan (and its alternatives' winner) fits."""
    free = autopar.plan(_meta(MEDIUM), dataclasses.replace(_tight_cluster(80), memory_reserve=
                        MemoryReserve.none()), global_batch_size=16, seq_len=256)
    gib = free.predicted.peak_memory_bytes / GIB + 0.5  # the CUDA context alone eats the slack
    tight = autopar.plan(_meta(MEDIUM), _tight_cluster(gib), global_batch_size=16, seq_len=256)
    _fits(tight)
    assert tight.predicted.peak_memory_bytes < free.predicted.peak_memory_bytes
    assert tight.predicted.step_time_s >= free.predicted.step_time_s
    for cluster in (Cluster.local_cpu(4), Cluster.dgx_a100(1)):
        _fits(autopar.plan(_meta(), cluster, global_batch_size=16, seq_len=32))


def test_memory_headroom_reduces_what_fits(capsys):
    args = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8"]
    assert cli_main(args + ["--memory-headroom", "0"]) == 0
    assert "margin" in capsys.readouterr().out
    assert cli_main(args + ["--memory-headroom", "7.9"]) == 3  # 8 GiB per process
    err = capsys.readouterr().err
    assert "memory reserve" in err and "headroom 7.9 GiB" in err and "--memory-headroom" in err
    assert cli_main(args + ["--memory-headroom", "-1"]) == 2
    with pytest.raises(autopar.InfeasibleError, match="less the memory reserve"):
        autopar.plan(_meta(), dataclasses.replace(Cluster.local_cpu(4), memory_headroom_gib=7.9),
                     global_batch_size=16, seq_len=32)


def test_plan_file_round_trip_and_old_versions(hand_plan):
    back = Plan.from_json(hand_plan.to_json())
    assert back == hand_plan
    assert back.predicted.memory_reserve_bytes_by_stage == \
        hand_plan.predicted.memory_reserve_bytes_by_stage
    data = json.loads(hand_plan.to_json())
    old = dict(data, version=2)
    with pytest.raises(PlanError, match="version 3 prices the memory reserve"):
        Plan.from_dict(old)
    missing = json.loads(hand_plan.to_json())
    del missing["predicted"]["memory_margin_bytes"]
    with pytest.raises(PlanError, match="memory_margin_bytes"):
        Plan.from_dict(missing)
    bad = json.loads(hand_plan.to_json())
    bad["predicted"]["memory_reserve_bytes_by_stage"][0]["cuda_context"] = -1
    with pytest.raises(PlanError, match=r"memory_reserve_bytes_by_stage\[0\]"):
        Plan.from_dict(bad)


def test_summary_and_report_show_reserve_and_margin(hand_plan):
    margin = hand_plan.predicted.memory_margin_bytes / GIB
    summary = hand_plan.summary().splitlines()[-1]
    assert summary.startswith("memory per GPU (stage") and f"margin {margin:.2f} GiB" in summary
    assert "CUDA context 512 MiB" in summary
    markdown = render_markdown(hand_plan)
    assert "| memory margin per GPU |" in markdown and "| memory reserve per GPU |" in markdown
    assert "| reserve | margin |" in markdown  # the per-stage memory table
    assert "memory[stage" in hand_plan.binding[0] and "margin" in hand_plan.binding[0]
