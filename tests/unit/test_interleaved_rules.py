"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) without processes.

* A plan whose m is not a multiple of pp is a ValueError naming the fix, raised before any
  collective (so the other ranks do not hang).
* The search offers interleaving only where the shared rule allows it.

The round-robin chunks on real ranks: tests/multiprocess/test_interleaved.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.graph.capture import trace_model
from autopar.models import GPT
from autopar.planner.search import candidate_configs
from autopar.contract.support import check_executable
from autopar.techniques.pipeline_schedules import interleaving_problem, pipeline_schedule
from helpers import BATCH, CONFIG, SEQ
from helpers import fast_cluster as _cluster, interleaved_plan as _plan


def test_invalid_interleaved_plans_are_clear_errors_without_processes():
    plan = _plan()
    check_executable(plan)
    with pytest.raises(ValueError, match=r"m=3, pp=2; choose m in multiples of 2"):
        check_executable(dataclasses.replace(plan, num_micro_batches=3))
    with pytest.raises(ValueError, match=r"needs schedule 'interleaved_1f1b'"):
        check_executable(dataclasses.replace(plan, schedule="1f1b"))
    with pytest.raises(ValueError, match=r"4 entries but pp\*v = 2\*1 = 2"):
        check_executable(dataclasses.replace(plan, virtual_stages=1))
    assert "not divisible by 8" in interleaving_problem(4, 4, 2, 8)
    assert "pp > 1" in interleaving_problem(4, 1, 2, 8)


def test_search_offers_interleaving_only_where_valid():
    with torch.device("meta"):
        traced = trace_model(GPT(CONFIG), SEQ)
    configs = candidate_configs(traced, _cluster(4), BATCH, autopar.Layout())
    interleaved = [c for c in configs if c.schedule == "interleaved_1f1b"]
    assert interleaved, "pp=2 with 4 layers and m % 2 == 0 should be offered"
    for c in configs:
        if c.schedule == "interleaved_1f1b":
            assert interleaving_problem(CONFIG.n_layer, c.pp, c.virtual_stages,
                                        c.num_micro_batches) is None, c
            assert c.pp > 1 and c.virtual_stages == 2 and CONFIG.n_layer % (2 * c.pp) == 0
        record = pipeline_schedule(c.schedule)  # every config within its schedule's rule
        assert record.problem(c.pp, c.num_micro_batches, c.virtual_stages, CONFIG.n_layer) is None
        assert (c.virtual_stages > 1) == record.interleaved, c
    assert not any(c.pp == 4 for c in interleaved)  # 8 chunks of a 4-layer model
