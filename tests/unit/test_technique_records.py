"""The technique records (autopar.techniques): every value of every technique has a rule, a
price, a runner, a drawing and an answer for every framework target, and the flow reads
the records (the runtime, the targets, the CLI list exactly their values)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from helpers import framework_answer_gaps
from autopar.frameworks.targets import TARGETS
from autopar.contract.plan import SCHEDULES as PLAN_SCHEDULES
from autopar.report.schedule import makespan_s, simulate_schedule
from autopar.contract.support import RUNTIME_SUPPORT, pipeline_problem
from autopar.techniques.pipeline_schedules import (FRAMEWORK_TARGETS, PIPELINE_SCHEDULES,
                                                   SCHEDULES, PipelineSchedule, Refusal,
                                                   default_schedule, pipeline_schedule,
                                                   schedule_for)


def _example(record: PipelineSchedule) -> tuple[int, int, int, int]:
    """(p, m, v, L) every schedule runs: 2 stages, 4 micro-batches, 8 layers."""
    return 2, 4, 2 if record.interleaved else 1, 8


def missing(record: PipelineSchedule) -> list[str]:
    """What ``record`` lacks among rule, price, runner, drawing and framework answers."""
    out = []
    p, m, v, L = _example(record)
    if not callable(record.rule) or record.problem(p, m, v, L) is not None:
        out.append("rule: does not accept the example layout")
    elif record.problem(p, m, 2 if v == 1 else 1, L) is None:
        out.append("rule: accepts the wrong number of chunks per rank")
    try:
        held = [record.in_flight(p, i, m, v) for i in range(p)]
        step = record.step_time_s([1.0] * p, m, v, 0.1, weight_grad_s=[0.25] * p,
                                  forward_s=[0.35] * p)
    except Exception as exc:  # a price that cannot be evaluated is missing
        out.append(f"price: {exc}")
    else:
        if not all(math.isfinite(x) and 0 < x <= m for x in held):
            out.append(f"price: in-flight micro-batches {held} outside (0, m]")
        if not (math.isfinite(step) and step >= m * 1.0):
            out.append(f"price: step time {step} below the work of m micro-batches")
        unsplit = pipeline_schedule("1f1b").step_time_s([1.0] * p, m, v, 0.1)
        if record.split_backward and not step < unsplit:
            out.append("price: the weight gradients do not fill the bubble")
    runner = getattr(pipelining, record.runner, None)
    base = PipelineScheduleMulti if record.interleaved else (PipelineScheduleSingle,
                                                             PipelineScheduleMulti)
    if not (isinstance(runner, type) and issubclass(runner, base)):
        out.append(f"runner: torch.distributed.pipelining.{record.runner} is not a "
                   f"pipeline schedule{' taking several stages' if record.interleaved else ''}")
    # each (micro-batch, chunk): F and B, or split: F, B and W, or F and a whole "BW"
    whole = [["B", "F", "W"], ["BW", "F"]] if record.split_backward else [["B", "F"]]
    try:
        orders = [record.order(p, m, i, v) for i in range(p)]
        timeline = simulate_schedule(record.name, p, m, [1.0] * p, [2.0] * p, virtual_stages=v,
                                     weight_grad_s=[0.5] * p)
    except Exception as exc:  # a drawing that cannot be drawn is missing
        out.append(f"drawing: {exc}")
    else:
        def once(order) -> bool:
            kinds: dict[tuple[int, int], list[str]] = {}
            for kind, j, c in order:
                kinds.setdefault((j, c), []).append(kind)
            return (set(kinds) == {(j, c) for j in range(m) for c in range(v)}
                    and all(sorted(k) in whole for k in kinds.values()))

        if not all(once(order) for order in orders) or not makespan_s(timeline) > 0:
            out.append("drawing: a rank does not run each block exactly once")
    return out + framework_answer_gaps(record)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_has_a_rule_price_runner_drawing_and_framework_answers(name):
    assert missing(pipeline_schedule(name)) == []


@pytest.mark.parametrize("broken, lacks", [
    (dict(rule=lambda p, m, v, L: "never"), "rule"),
    (dict(in_flight=lambda p, i, m, v: float("nan")), "price"),
    (dict(runner="ScheduleThatDoesNotExist"), "runner"),
    (dict(order=lambda p, m, i, v: [("F", 0, 0)]), "drawing"),
    (dict(frameworks={"megatron": "1F1B", "torchtitan": "1F1B"}), "framework"),
    (dict(frameworks={"megatron": "1F1B", "torchtitan": "1F1B", "deepspeed": Refusal("")}),
     "framework"),
    (dict(split_backward=True), "drawing"),  # a split backward drawn without its W blocks
])
def test_the_registry_check_fails_when_a_record_lacks_one(broken, lacks):
    record = dataclasses.replace(pipeline_schedule("1f1b"), **broken)
    assert any(line.startswith(lacks) for line in missing(record)), missing(record)


def test_the_flow_lists_exactly_the_records():
    assert PLAN_SCHEDULES == SCHEDULES == tuple(PIPELINE_SCHEDULES) == RUNTIME_SUPPORT.schedules
    assert set(FRAMEWORK_TARGETS) == set(TARGETS) - {"autopar"}
    for target in FRAMEWORK_TARGETS:  # a target runs a schedule exactly when it names it
        named = {n for n, s in PIPELINE_SCHEDULES.items() if isinstance(s.frameworks[target], str)}
        assert set(TARGETS[target].schedules) == named
        for name in named:
            assert schedule_for(target, PIPELINE_SCHEDULES[name].frameworks[target]).name == name


def test_refusals_and_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="pipeline schedule 'zigzag' is not one of"):
        pipeline_schedule("zigzag")
    assert "is not one of" in pipeline_problem("zigzag", 2, 4, 8)
    with pytest.raises(ValueError, match="deepspeed cannot run pipeline schedule 'gpipe': "
                                         "DeepSpeed's PipelineEngine runs"):
        pipeline_schedule("gpipe").framework_name("deepspeed")
    with pytest.raises(ValueError, match=r"torchtitan pipeline schedule 'InterleavedZeroBubble': "
                                         r"autopar prices \['GPipe', '1F1B'"):
        schedule_for("torchtitan", "InterleavedZeroBubble")


@pytest.mark.parametrize("name, p, m, v, L, says", [
    ("1f1b", 4, 3, 1, 8, "m=3 < p=4"),
    ("1f1b", 2, 4, 2, 8, "virtual_stages=2 needs schedule 'interleaved_1f1b'"),
    ("gpipe", 4, 3, 2, 8, "virtual_stages=2 needs schedule 'interleaved_1f1b'"),
    ("interleaved_1f1b", 1, 4, 2, 8, "needs pp > 1"),
    ("interleaved_1f1b", 2, 3, 2, 8, "m=3, pp=2"),
    ("interleaved_1f1b", 2, 4, 3, 8, "not divisible by 6"),
    ("zb_h1", 1, 4, 1, 8, "ZB-H1 needs pp > 1"),
    ("zb_h1", 4, 3, 1, 8, "ZB-H1 needs at least as many micro-batches"),
    ("zb_h1", 4, 9, 1, 8, "rounds of equal size: m=9, p=4"),
])
def test_each_rule_names_what_to_change(name, p, m, v, L, says):
    assert says in pipeline_schedule(name).problem(p, m, v, L)
    assert pipeline_schedule("gpipe").problem(4, 3, 1, 8) is None  # GPipe runs any m


def _torch_order(record: PipelineSchedule, p: int, m: int, v: int,
                 rank: int) -> list[tuple[str, int, int]]:
    """The blocks torch's runner of ``record`` runs on ``rank`` of p ranks holding the v
    stages ``record.rank_chunks`` places there, as (kind, micro-batch, the rank's chunk),
    built on the fake process group (no communication: the schedule is computed at
    construction)."""
    import torch
    from framework_startup import fake_process_group

    mine = record.rank_chunks(p, p * v, rank)
    with fake_process_group(p, rank):
        x = torch.empty(1, 2, device="meta")
        stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), index, p * v,
                                           torch.device("cpu"), input_args=x, output_args=x)
                  for index in mine]
        schedule = getattr(pipelining, record.runner)(stages, m)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W",
             "FULL_BACKWARD": "BW"}
    actions = [sub for a in schedule.pipeline_order[rank] if a is not None  # an overlapped
               for sub in (getattr(a, "sub_actions", None) or (a,))]  # F and BW: both
    return [(kinds[a.computation_type.name], a.microbatch_index, mine.index(a.stage_index))
            for a in actions]


@pytest.mark.parametrize("name", [n for n, s in PIPELINE_SCHEDULES.items() if s.split_backward])
def test_a_split_backward_drawing_is_the_order_torch_runs(name):
    """The report draws what the runner runs: for every p <= 4 and p <= m <= 3p the rule
    accepts, each rank's F, B and W blocks in torch's own order (with the record's v:
    1 for ZB-H1, the V's 2 for ZB-V)."""
    record = pipeline_schedule(name)
    v, compared = _example(record)[2], 0
    for p in (2, 3, 4):
        for m in range(p, 3 * p + 1):
            if record.problem(p, m, v) is None:
                for rank in range(p):
                    assert record.order(p, m, rank, v) == _torch_order(record, p, m, v, rank)
                    compared += 1
    assert compared >= 20, compared  # the rule left cases to compare


@pytest.mark.parametrize("name", [n for n, s in PIPELINE_SCHEDULES.items() if s.split_backward])
@pytest.mark.parametrize("p, m, w", [(4, 8, 1.0), (4, 8, 0.5), (2, 4, 1.0), (8, 24, 0.9)])
def test_a_split_backward_drawing_takes_as_long_as_its_price(name, p, m, w):
    """Equal stages (F = 1, backward 2 of which W = w, c = 0): the timeline simulated from
    torch's order ends exactly at the priced pipeline time, e.g. 27 = 8·3 + 3·(3 − 2) at
    p = 4, m = 8, w = 1 for ZB-H1 (1F1B: 33), and below the unsplit schedule's on the
    same chunks (1F1B, or interleaved 1F1B for ZB-V's two)."""
    record = pipeline_schedule(name)
    v = _example(record)[2]
    timeline = simulate_schedule(name, p, m, [1.0] * p, [2.0] * p, weight_grad_s=[w] * p,
                                 virtual_stages=v)
    priced = record.step_time_s([3.0] * p, m, v, 0.0, weight_grad_s=[w] * p,
                                forward_s=[1.0] * p)
    assert makespan_s(timeline) == pytest.approx(priced)
    assert priced < default_schedule(v).step_time_s([3.0] * p, m, v)
    with pytest.raises(ValueError, match="one weight-gradient time when given"):
        simulate_schedule(name, p, m, [1.0] * p, [2.0] * p, weight_grad_s=[w])


def test_a_split_backward_refuses_full_recompute_at_every_door():
    """ZB-H1 with full recompute: torch's split backward recomputes a checkpointed layer per
    weight group (more recompute and TP traffic than priced), so the search never emits it,
    a pinned layout says why, and a plan carrying it is refused by the executability check."""
    import autopar
    from autopar.contract.errors import PlanError
    from autopar.contract.support import check_executable, unsupported
    from helpers import TINY_BATCH, TINY_SEQ, tiny_meta_gpt

    meta, cluster = tiny_meta_gpt(), autopar.Cluster.local_cpu(processes=2)
    kw = dict(global_batch_size=TINY_BATCH, seq_len=TINY_SEQ)
    with pytest.raises(ValueError, match="recompute='full' with schedule 'zb_h1': torch's "
                                         "split backward"):
        autopar.plan(meta, cluster, layout=autopar.Layout(pp=2, schedule="zb_h1",
                                                           recompute="full"), **kw)
    plan = autopar.plan(meta, cluster, layout=autopar.Layout(pp=2, schedule="zb_h1"), **kw)
    assert "full" not in plan.recompute
    full = dataclasses.replace(plan, recompute=["full"] * len(plan.recompute))
    problem = unsupported(full)
    assert (problem.field, problem.value) == ("recompute", "full")
    assert "full" not in problem.allowed and "weight-gradient pass" in problem.why
    with pytest.raises(PlanError, match="is 'full' with schedule 'zb_h1'"):
        check_executable(full)


def _gpt_on_one_h100_node(layers: int):
    """A GPT of ``layers`` layers (h 1024, 16 heads) on the meta device, one DGX H100 node
    and the batch of the zero-bubble tests."""
    import torch

    import autopar
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=16, n_embd=1024, vocab_size=50304,
                              block_size=1024))
    return model, autopar.Cluster.dgx_h100(nodes=1), dict(global_batch_size=32, seq_len=1024)


def test_the_search_chooses_zero_bubble_where_it_pays_and_the_report_says_why():
    """Four pipeline stages of an 8-layer GPT on one DGX H100 node: the search chooses ZB-V,
    which runs the weight gradients in the fill and drain, over 1F1B pinned on the same
    layout (its saved activations priced as torch's split backward holds them, each
    micro-batch's graph until its weight-gradient pass), and the report says why."""
    import autopar
    from autopar.report.sections import why_section

    model, cluster, kw = _gpt_on_one_h100_node(8)
    searched = autopar.plan(model, cluster, layout=autopar.Layout(tp=2, pp=4), **kw)
    assert searched.schedule == "zb_v"
    one_f_one_b = autopar.plan(model, cluster, **kw,
                               layout=autopar.Layout(tp=2, pp=4, schedule="1f1b"))
    assert searched.predicted.step_time_s < one_f_one_b.predicted.step_time_s
    text = "\n".join(why_section(searched))
    assert "ZB-V (Qi et al. 2024, ICLR, section 6)" in text and "the W's fill" in text, text


def test_the_search_chooses_zb_h1_where_v_placements_cannot_run():
    """A 12-layer GPT on the same node at tp 2, pp 4: 12 layers do not cut into the 2p = 8
    chunks of a V, so ZB-V and DualPipeV cannot run; the search chooses ZB-H1 (its head
    rank priced as torch holds it: the loss's softmax to B, the head's inputs to W), which
    beats 1F1B's step time, and the report says why."""
    import autopar
    from autopar.report.sections import why_section

    model, cluster, kw = _gpt_on_one_h100_node(12)
    searched = autopar.plan(model, cluster, layout=autopar.Layout(tp=2, pp=4), **kw)
    assert searched.schedule == "zb_h1", searched.layout()
    one_f_one_b = autopar.plan(model, cluster, layout=autopar.Layout(tp=2, pp=4, schedule="1f1b"),
                               **kw)
    assert searched.predicted.step_time_s < one_f_one_b.predicted.step_time_s
    text = "\n".join(why_section(searched))
    assert "ZB-H1 (Qi et al. 2024" in text and "the W's fill" in text, text


def test_a_v_placement_puts_both_ends_on_the_first_rank():
    """Round-robin: chunk c on rank c % p, the head on rank p - 1; a V: rank r holds chunks
    r and 2p - 1 - r, so rank 0 holds the first and the last (Qi et al. 2024, section 6)."""
    loop = pipeline_schedule("interleaved_1f1b")
    v = dataclasses.replace(loop, placement="v")
    assert [loop.chunk_rank(c, 4, 8) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [v.chunk_rank(c, 4, 8) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [v.rank_chunks(4, 8, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert (loop.head_rank(4, 2), v.head_rank(4, 2), pipeline_schedule("1f1b").head_rank(1)) \
        == (3, 0, 0)
    with pytest.raises(ValueError, match="placement 'zigzag' is not one of"):
        dataclasses.replace(loop, placement="zigzag")


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_critical_path_is_the_simulated_makespan(name):
    """For random per-rank forward, backward, weight-gradient and send times, the longest
    path through a schedule's blocks (what the CP-SAT model adds as a row,
    ``OrderedMakespan``) sums to the makespan simulated block by block."""
    import random

    from cost_models.pipeline import critical_path, simulate_orders

    record, rng = pipeline_schedule(name), random.Random(0)
    _, m, v, _ = _example(record)
    for p in (2, 3, 4):
        if record.problem(p, 2 * p, v) is not None:
            continue
        orders = [record.order(p, 2 * p, i, v) for i in range(p)]
        chunks = [record.rank_chunks(p, p * v, i) for i in range(p)]
        f, b = [rng.uniform(1, 2) for _ in range(p)], [rng.uniform(2, 4) for _ in range(p)]
        w = [rng.uniform(0, 1) for _ in range(p)] if record.split_backward else None
        c = rng.uniform(0, 0.5)
        blocks = simulate_orders(orders, lambda i, k: chunks[i][k], f, b, recompute_s=[0.0] * p,
                                 weight_grad_s=w, p2p_time_s=c, virtual_stages=v)
        simulated = max(blk[4] + blk[6] for rank in blocks for blk in rank)
        ws = w or [0.0] * p
        length = {"F": lambda i: f[i] / v + c / 2, "B": lambda i: (b[i] - ws[i]) / v + c / 2,
                  "W": lambda i: ws[i] / v, "BW": lambda i: b[i] / v + c / 2}
        makespan, path = critical_path(orders, lambda i, k: chunks[i][k],
                                       lambda kind, i: length[kind](i))
        assert makespan == pytest.approx(simulated, rel=1e-12)
        assert sum(n * length[kind](i) for (i, kind), n in path.items()) == \
            pytest.approx(makespan, rel=1e-12)
