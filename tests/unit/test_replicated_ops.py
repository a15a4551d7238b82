"""The ops tensor parallelism leaves whole (issue 10): the plan lists the compute ops that
have no TP strategy (and, apart, those the solver replicated by choice) with their share of
the model's forward FLOPs; the summary, the CLI and the report show them; the list survives
the plan's JSON and an old plan without it still loads.
"""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar import cli
from autopar.graph.capture import trace_model
from autopar.contract.plan import Plan, ReplicatedOps, format_share
from autopar.planner.strategies.replicated import replicated_ops
from autopar.planner.strategies import node_strategies
from autopar.report import render_markdown, write_report
from helpers import fast_cluster, load_script, tiny_meta_gpt, tiny_plan
from tests_factory import cumsum_gpt

SEQ, HIDDEN = 8, 16  # cumsum_gpt's block_size and n_embd


def _by_op(ops) -> dict[str, int]:
    return {name: count for name, count, _ in ReplicatedOps.by_op(ops)}


@pytest.fixture(scope="module")
def cumsum_plan() -> Plan:
    with torch.device("meta"):
        model = cumsum_gpt()
    return autopar.plan(model, fast_cluster(2), global_batch_size=8, seq_len=SEQ,
                        layout=autopar.Layout(tp=2, pp=1, dp=1), model_name="cumsum-gpt")


def test_cumsum_on_the_residual_stream_is_listed_with_its_share(cumsum_plan):
    with torch.device("meta"):
        traced = trace_model(cumsum_gpt(), SEQ)
    rep = cumsum_plan.replicated_ops
    cumsums = [r for r in rep.no_strategy if r.op == "cumsum"]
    assert [(r.section, r.layer) for r in cumsums] == [("layer", 0), ("layer", 1)]
    model_flops = sum(info.flops for info in traced.nodes.values())
    assert rep.tp == 2 and rep.model_flops == model_flops
    for r in cumsums:  # one add per element of the (1, s, h) residual stream
        assert r.flops == SEQ * HIDDEN and r.kind == "other" and r.per_sequence
        assert r.share == pytest.approx(SEQ * HIDDEN / model_flops, rel=1e-12)
        assert r.reason == "no sharding rule for this op"
        assert cumsum_plan.placements[r.node] == "replicate:R"
    # the Linears carry almost all FLOPs, so a share of the whole is small but not zero
    assert 0 < sum(r.share for r in cumsums) < 0.05
    assert "cumsum (2)" in cumsum_plan.summary().splitlines()[1]
    assert not {r.node for r in rep.no_strategy} & {r.node for r in rep.chosen}


def test_sort_with_two_outputs_counts_both():
    from autopar.models import Block

    class SortBlock(Block):
        def forward(self, x):
            values, _ = torch.sort(super().forward(x), dim=-1)
            return x + values

    with torch.device("meta"):
        model = cumsum_gpt()
        model.transformer.h = torch.nn.ModuleList([SortBlock(model.config) for _ in range(2)])
    traced = trace_model(model, SEQ)
    rep = replicated_ops(traced, node_strategies(traced, 2), {}, 2)
    sorts = [r for r in rep.no_strategy if r.op == "sort"]
    assert [r.layer for r in sorts] == [0, 1]
    assert all(r.flops == 2 * SEQ * HIDDEN for r in sorts)  # values and indices


def test_gpt_replicates_its_layernorms_unless_sequence_parallel():
    """autopar's GPT: LayerNorm splits only on sequence shards (Megatron-3), and the
    embedding sum (tokens (b, s, h) + positions (s, h)) broadcasts; arange is no compute."""
    traced = trace_model(tiny_meta_gpt(), 16)
    plain = replicated_ops(traced, node_strategies(traced, 2), {}, 2)
    assert _by_op(plain.no_strategy) == {"LayerNorm": 5, "add": 1}
    assert [r.section for r in plain.no_strategy if r.op == "add"] == ["pre"]
    sp = replicated_ops(traced, node_strategies(traced, 2, True), {}, 2, sequence_parallel=True)
    assert _by_op(sp.no_strategy) == {"add": 1}


def test_tp1_plan_lists_what_tp_could_not_split_and_chooses_nothing():
    traced = trace_model(tiny_meta_gpt(), 16)
    rep = replicated_ops(traced, node_strategies(traced, 1), {}, 1)
    assert rep.tp == 2 and _by_op(rep.no_strategy) == {"LayerNorm": 5, "add": 1}
    assert rep.chosen == []


def test_chosen_are_megatron_plans_replicated_ops_with_alternatives():
    plan = tiny_plan(2, 1, sequence_parallel=False)  # Megatron's, re-priced by evaluate_plan
    traced = trace_model(tiny_meta_gpt(), plan.seq_len)
    options = node_strategies(traced, 2)
    chosen = plan.replicated_ops.chosen
    assert chosen and "Linear" not in _by_op(chosen)  # Megatron splits every Linear
    for r in chosen:
        assert plan.placements[r.node].startswith("replicate:") and len(options[r.node]) > 1


def test_llama_replicates_only_mask_and_position_work_before_the_first_layer():
    pytest.importorskip("transformers")
    zoo = load_script("benchmarks/model_zoo.py")
    traced = trace_model(zoo.build("llama", "tiny", device="meta"), 16)
    rep = replicated_ops(traced, node_strategies(traced, 2, True), {}, 2, True)
    assert rep.no_strategy and {r.section for r in rep.no_strategy} == {"pre"}
    assert not any(r.per_sequence for r in rep.no_strategy)  # causal mask, positions
    assert {"le", "cumsum"} <= set(_by_op(rep.no_strategy))
    assert "arange" not in _by_op(rep.no_strategy)  # creation: no arithmetic


def test_json_round_trip_and_an_old_plan_without_the_field(cumsum_plan):
    back = Plan.from_json(cumsum_plan.to_json())
    assert back == cumsum_plan and isinstance(back.replicated_ops, ReplicatedOps)
    old = json.loads(cumsum_plan.to_json())
    del old["replicated_ops"]
    legacy = Plan.from_dict(old)
    assert legacy.replicated_ops is None and "replicated" not in legacy.summary()
    assert legacy.summary().splitlines()[0] == legacy.headline()
    assert "saved before autopar recorded them" in render_markdown(legacy)


def test_report_has_a_section_with_the_ops(cumsum_plan, tmp_path):
    path = write_report(cumsum_plan, tmp_path, chart=False)
    text = path.read_text()
    section = text[text.index("## Ops every tensor-parallel rank runs whole"):]
    row = next(line for line in section.splitlines() if line.startswith("| `cumsum`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    share = sum(r.share for r in cumsum_plan.replicated_ops.no_strategy if r.op == "cumsum")
    assert cells[1:3] == ["2", "layers 0–1"] and cells[4] == format_share(share)
    assert "no sharding rule" in cells[5]
    assert "<code>cumsum</code>" in path.with_suffix(".html").read_text()


def test_format_share():
    assert [format_share(x) for x in (0.0, 5e-5, 0.0033, 0.25)] == \
        ["0%", "<0.01%", "0.33%", "25.0%"]


def test_cli_plan_prints_the_line_and_json_holds_the_list(capsys):
    args = ["plan", "--model", "tests_factory:cumsum_gpt", "--cluster", "local-cpu",
            "--nodes", "1", "--global-batch-size", "8", "--tp", "2", "--no-sequence-parallel"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("replicated (no TP strategy"))
    assert line.startswith("replicated (no TP strategy at t=2): 8 ops (1 before the first layer)")
    assert "cumsum (2)" in line and "LayerNorm (5)" in line
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["replicated_ops"]
    assert [r["op"] for r in data["no_strategy"]].count("cumsum") == 2
