"""A flash attention kernel's saved output and the views of it that a projection keeps are
one storage (autopar.planner.kept_views): counted once, and kept by the projection when
selective recompute drops the kernel's. The runtime's measured bytes against these
predictions: tests/multiprocess/test_parallelize.py (its flash cluster, Megatron's
placements)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT
from autopar.planner.decision import decision_from_plan
from autopar.planner.kept_views import flash_view_roles, kept_version_bytes
from autopar.planner.megatron import megatron_placements
from autopar.planner.predict import section_cost
from helpers import BATCH, CONFIG, SEQ, fast_cluster


def _layer_costs(attention: str) -> dict[str, float]:
    """Layer 0's section costs under Megatron's placements at tp 2, fp32, b = 2."""
    with torch.device("meta"):
        meta = GPT(CONFIG)
    cluster = dataclasses.replace(fast_cluster(2), attention=attention)
    layout = autopar.Layout(tp=2, pp=1, dp=1, micro_batch_size=2, sequence_parallel=False)
    plan = autopar.plan(meta, cluster, global_batch_size=BATCH, seq_len=SEQ, layout=layout)
    traced = trace_model(meta, SEQ)
    plan = dataclasses.replace(plan, placements=megatron_placements(traced, 2))
    decision, tables, strategies = decision_from_plan(traced, cluster, plan)
    return section_cost(traced, strategies, tables, decision.strategy, traced.layers[0])


def test_roles_follow_the_attention_output_to_its_projection():
    with torch.device("meta"):
        traced = trace_model(GPT(CONFIG), SEQ)
    roles = {(u, v): role for (u, v, _), role in flash_view_roles(traced).items()
             if u in traced.layers[0]}
    proj = next(n for n in traced.layers[0] if n.endswith("attn_c_proj"))
    assert roles == {("scaled_dot_product_attention", "transpose_3"): "chain",
                     ("transpose_3", "reshape"): "chain", ("reshape", proj): "keeper"}


def test_flash_output_is_counted_once_and_kept_under_selective():
    lse = 4 * 2 * (CONFIG.n_head // 2) * SEQ  # fp32, b = 2, this rank's heads
    flash, math = _layer_costs("flash"), _layer_costs("math")
    # selective frees only the log-sum-exp: the projection still holds the output
    assert flash["core_act_bytes"] == pytest.approx(lse)
    # the kernel's output and the projection's input are one tensor; math attention
    # keeps the projection's input (a new tensor) beside its core
    flash_without_core = flash["act_bytes"] - flash["core_act_bytes"]
    assert flash_without_core == pytest.approx(math["act_bytes"] - math["core_act_bytes"])
    assert flash["act_bytes"] - flash_without_core == pytest.approx(lse)


@pytest.mark.parametrize("role, as_produced, want", [
    (None, True, (8.0, 8.0)), (None, False, (8.0, 8.0)),
    ("keeper", True, (0.0, 8.0)),   # the kernel's storage: kept by the projection once the core goes
    ("keeper", False, (8.0, 8.0)),  # a resharded copy
    ("chain", True, (0.0, 0.0)),    # still the kernel's storage
    ("chain", False, (8.0, 0.0)),   # a copy the keeper holds (its own entry under selective)
])
def test_kept_version_bytes(role, as_produced, want):
    assert kept_version_bytes(8.0, role, as_produced) == want
