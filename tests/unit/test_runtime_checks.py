"""autopar.runtime's checks that run before any collective, in one process: the degree
validator's messages and the schedules ParallelModule refuses (the gloo runs:
tests/multiprocess/test_runtime.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.runtime.engine import ParallelModule
from autopar.runtime.mesh import ParallelGroups, validate_degrees

H, S, LR = 16, 8, 0.1  # hidden size, sequence length, learning rate


def test_validate_degrees_messages() -> None:
    validate_degrees(2, 2, 1, 4)
    with pytest.raises(ValueError, match=r"tp\*pp\*dp = N = 2\*2\*2 = 8 GPUs but world size is 4"):
        validate_degrees(2, 2, 2, 4)
    with pytest.raises(ValueError, match="--nproc-per-node 8"):
        validate_degrees(2, 2, 2, 4)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        validate_degrees(2, 2, 0, 4)


def test_unsupported_schedules_raise() -> None:
    groups = ParallelGroups((2, 1, 1), 0, 0, 0, 0, None, None, None, None)  # never used for comm
    kwargs = dict(micro_batch_size=1, num_micro_batches=2, seq_len=S, hidden_size=H,
                  optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR))
    with pytest.raises(ValueError, match="ModuleList of v >= 2 chunks"):
        ParallelModule(nn.Linear(H, H), groups, schedule="interleaved_1f1b", **kwargs)
    chunks = nn.ModuleList([nn.Linear(H, H), nn.Linear(H, H)])
    with pytest.raises(ValueError, match="m=3, pp=2; choose m in multiples of 2"):
        ParallelModule(chunks, groups, schedule="interleaved_1f1b",
                       **{**kwargs, "num_micro_batches": 3})
    with pytest.raises(NotImplementedError, match="zero_bubble"):
        ParallelModule(nn.Linear(H, H), groups, schedule="zero_bubble", **kwargs)
    with pytest.raises(ValueError, match="m=1 < p=2"):
        ParallelModule(nn.Linear(H, H), groups, schedule="1f1b", **{**kwargs, "num_micro_batches": 1})


@pytest.mark.parametrize("field, change, says", [
    ("zero_stage", dict(zero_stage=3, schedule="1f1b"),
     "zero_stage=3 with pp > 1 (ZeRO-3 reduce-scatters gradients after every"),
    ("recompute", dict(zero_stage=1, schedule="1f1b", recompute=["none", "offload"]),
     "recompute='offload'"),
    ("schedule", dict(zero_stage=1, schedule="zero_bubble"), "schedule='zero_bubble'"),
])
def test_every_door_refuses_an_unexecutable_plan_by_the_same_rule(field, change, says):
    """parallelize and plan files (check_plan, through check_executable: one error type,
    PlanError) and the framework targets (outside_target) ask one check,
    autopar.contract.support.unsupported, and word it alike."""
    import dataclasses

    from helpers import tiny_plan

    from autopar.frameworks.targets import outside_target, target_support
    from autopar.contract.plan_check import PlanError, check_plan
    from autopar.contract.support import check_executable, unsupported

    plan = dataclasses.replace(tiny_plan(1, 2), **change)
    problem = unsupported(plan)
    assert problem is not None and problem.field == field
    assert says in problem.message("x")
    with pytest.raises(PlanError, match=rf"^plan: plan field '{field}' .* which the autopar "
                       "runtime does not execute"):
        check_executable(plan)
    with pytest.raises(PlanError, match=rf"plan.json: plan field '{field}'"):
        check_plan(plan, source="plan.json", executable=True)
    deepspeed = unsupported(plan, target_support("deepspeed"))
    assert deepspeed.field == field
    assert outside_target(plan, "deepspeed").startswith(deepspeed.message("deepspeed"))
