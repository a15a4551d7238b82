"""How autopar prices context parallelism (autopar.graph.context_parallel): the trace at
s/c with each attention node corrected, the K/V all-gather in the predicted bytes, the
degrees a search tries, and what plan and evaluate do with a cp."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.graph.capture import trace_model
from autopar.graph.context_parallel import context_parallel_trace, trace_cp
from autopar.models import GPT
from autopar.techniques.context_parallel import CP_MIN_LOCAL_TOKENS, cp_degrees
from helpers import BATCH, CONFIG, SEQ, fast_cluster


def _sdpa(traced):
    return [i for i in traced.nodes.values() if i.kind == "sdpa"]


def test_the_degrees_a_search_tries():
    assert cp_degrees(131072, 16384) == [1, 2, 4, 8, 16]  # s/c >= 8K: Llama 3's 128K run
    assert cp_degrees(8192, 16384) == [1] and cp_degrees(2 * CP_MIN_LOCAL_TOKENS, 6) == [1, 2]
    assert cp_degrees(64, 8, pinned=4) == [4]


def test_the_trace_at_s_over_c_attends_the_whole_sequence():
    with torch.device("meta"):
        model = GPT(CONFIG)
    whole, cp2 = trace_model(model, SEQ), context_parallel_trace(model, SEQ, 2)
    assert (trace_cp(whole), trace_cp(cp2), cp2.seq_len) == (1, 2, SEQ // 2)
    for full, local in zip(_sdpa(whole), _sdpa(cp2)):
        assert local.flops == full.flops / 2  # the local queries against every key: 1/c
        (heads, s_q, s_kv, hd), (_, _, hd_v, s_kv2) = local.extra["gemms"]
        assert (s_q, s_kv, s_kv2) == (SEQ // 2, SEQ, SEQ)
        assert local.extra["cp_gather_elems"] == 2 * (SEQ // 2) * CONFIG.n_embd  # k + v
        assert local.extra["cp_kv_elems"] == local.extra["cp_gather_elems"]  # (c - 1)·(k + v)
        assert local.extra["cp_score_fraction"] == 5 / 8  # (2c + 1)/(4c): chunks' keys only
    with pytest.raises(ValueError, match="2·cp=8 equal chunks"):
        context_parallel_trace(model, 12, 4)


def test_evaluate_prices_the_all_gather_of_k_and_v():
    with torch.device("meta"):
        model = GPT(CONFIG)
    b, cp = BATCH // 2, 2
    plan = autopar.evaluate(model, fast_cluster(2), autopar.Layout(
        tp=1, pp=1, dp=1, cp=cp, micro_batch_size=b, dtype="fp32"),
        global_batch_size=BATCH // 2, seq_len=SEQ)
    assert (plan.cp, plan.dp, plan.num_gpus, plan.num_micro_batches) == (2, 1, 2, 1)
    local = 4 * 2 * b * (SEQ // cp) * CONFIG.n_embd * CONFIG.n_layer  # fp32 k + v per layer
    comm = plan.predicted.comm_bytes_by_kind
    assert (comm["cp_all_gather"], comm["cp_reduce_scatter"]) == (local, cp * local)
    assert plan.predicted.time_s_by_kind["cp_comm"] > 0
    # the same tokens per rank as the plain data-parallel pair: the same parameter FLOPs
    dp2 = autopar.evaluate(model, fast_cluster(2), autopar.Layout(
        tp=1, pp=1, dp=2, micro_batch_size=b // 2, dtype="fp32"),
        global_batch_size=BATCH // 2, seq_len=SEQ)
    assert plan.predicted.mfu * plan.predicted.step_time_s == pytest.approx(
        dp2.predicted.mfu * dp2.predicted.step_time_s)


def test_plan_takes_a_pinned_cp_and_refuses_a_target_without_one():
    with torch.device("meta"):
        model = GPT(CONFIG)
    plan = autopar.plan(model, fast_cluster(4), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(cp=2))
    assert plan.cp == 2 and plan.num_gpus == 4 and plan.global_batch_size == BATCH
    assert plan.dp * plan.micro_batch_size * plan.num_micro_batches == BATCH
    with pytest.raises(ValueError, match="torchtitan target runs no context parallelism"):
        autopar.plan(model, fast_cluster(4), global_batch_size=BATCH, seq_len=SEQ,
                     layout=autopar.Layout(cp=2), target="torchtitan")


def test_the_cli_takes_cp(tmp_path):
    from autopar.contract.plan import Plan
    from helpers import run_cli

    out = tmp_path / "plan.json"
    code, stdout, stderr = run_cli(["evaluate", "--model", "gpt-tiny", "--cluster", "local-cpu",
                                    "--nodes", "1", "--global-batch-size", "8", "--tp", "1",
                                    "--cp", "2", "--pp", "1", "--dp", "2", "--mbs", "1",
                                    "-o", str(out)])
    assert code == 0, stderr
    plan = Plan.from_json(out.read_text())
    assert (plan.cp, plan.dp, plan.num_gpus) == (2, 2, 4) and " cp=2 " in stdout


def test_the_reports_rank_groups_are_the_runtimes():
    from autopar.report.ranks import rank_groups
    from autopar.techniques.context_parallel import cp_ranks

    groups = rank_groups(tp=2, pp=2, dp=2, cp=2)  # rank = t + 2·(c + 2·(d + 2·p))
    assert groups["CP"][:2] == [[0, 2], [1, 3]] and groups["DP"][:2] == [[0, 4], [1, 5]]
    assert sorted(r for g in groups["CP"] for r in g) == list(range(16))
    for group in groups["CP"]:  # the record's CP groups (the runtime's), per stage
        stage = group[0] // 8
        assert [r + 8 * stage for r in cp_ranks(group[0] % 8, 2, 2, 2)[1]] == group
    assert "CP" not in rank_groups(tp=2, pp=1, dp=2)
