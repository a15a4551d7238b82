"""Failures end cleanly: a dead or stuck rank, and a run whose numbers blow up.

* A 4-rank tp2·pp2 run (TP all-reduces and pipeline sends) where rank 3 is killed, or hangs,
  at the start of step 3 (an unmetered step: the collective is named from the traceback):
  every other rank ends within the timeout given to ``parallelize`` plus a few seconds,
  with a CollectiveError naming the step and the collective, not torch's 30-minute
  default. These ranks run in a harness of their own
  (``launch`` stops at the first dead rank; here the survivors must report).
* An SGD whose second step leaves the weights infinite makes step 3's loss and gradient
  norm NaN (the one-process run checks it): every rank raises NonFiniteError naming step 3
  before the update; with on_nonfinite="skip" every rank drops that update and the
  parameters are those after step 2.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time

import pytest
import torch

import autopar
from autopar.models import GPT
from autopar.runtime.health import CollectiveError, NonFiniteError
from dist_utils import run_distributed, run_survivors
from helpers import BATCH, CONFIG, SEQ, batches, fast_cluster, seeded_gpt

TIMEOUT_S = 5.0  # parallelize(timeout=): every process group the program creates
SLACK_S = 15.0  # process teardown and a loaded two-core machine


def _plan(world: int, **layout) -> autopar.Plan:
    with torch.device("meta"):
        meta = GPT(CONFIG)
    return autopar.plan(meta, fast_cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**layout, recompute="none", dtype="fp32"))


def _fault_worker(rank: int, world: int, plan_json: str, fault: str) -> tuple:
    """One rank: 3 steps; rank world-1 dies (SIGKILL) or hangs at the start of step 3;
    the others report (elapsed seconds in step 3, the exception's type and message)."""
    pm = autopar.parallelize(seeded_gpt(), plan=autopar.Plan.from_json(plan_json),
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                             timeout=TIMEOUT_S)
    *first, (idx3, tgt3) = batches(3)
    for idx, tgt in first:
        pm.train_step(idx, tgt)
    if rank == world - 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    start = time.monotonic()
    try:
        pm.train_step(idx3, tgt3)
        return (time.monotonic() - start, None, "no error")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (time.monotonic() - start, type(exc).__name__, str(exc))


def _run_with_fault(fault: str, world: int = 4) -> dict[int, tuple]:
    plan = _plan(world, tp=2, pp=2, dp=1, micro_batch_size=1)
    return run_survivors(_fault_worker, world, plan.to_json(), fault, expected=world - 1)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_stuck_rank_ends_the_others_within_the_timeout(fault):
    results = _run_with_fault(fault)
    assert sorted(results) == [0, 1, 2], results  # every survivor reported
    for rank, (elapsed, kind, message) in results.items():
        assert kind == CollectiveError.__name__, (rank, kind, message)
        assert message.startswith(f"step 3 on rank {rank}: "), (rank, message)
        named = message.split(": ", 1)[1].split(" failed (a peer died")[0]
        assert named and named != "a collective", (rank, message)  # e.g. "all_reduce over the tp group"
        assert elapsed < TIMEOUT_S + SLACK_S, (rank, elapsed, message)


class _InfiniteAfterTwoSteps(torch.optim.SGD):
    """SGD (lr 0.1) whose second step leaves every weight it updates infinite, so that the
    third step's loss and gradient norm are NaN, on whatever CPU. (An overflowing learning
    rate, 1000, reached NaN at step 3 on one CPU model and stayed finite on another.)"""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        self.steps_taken += 1
        if self.steps_taken == 2:
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(math.inf)
        return out


def _nan_worker(rank: int, world: int, plan_json: str) -> dict:
    plan = autopar.Plan.from_json(plan_json)
    out = {}
    for action in ("raise", "skip"):
        pm = autopar.parallelize(seeded_gpt(), plan=plan, on_nonfinite=action,
                                 optimizer=_InfiniteAfterTwoSteps)
        losses, error, states = [], None, []
        for idx, tgt in batches(3):
            try:
                losses.append(pm.train_step(idx, tgt))
            except NonFiniteError as exc:
                error = str(exc)
                break
            states.append(pm.full_state_dict())  # collective: every rank calls it
        out[action] = {"losses": losses, "error": error, "steps_done": pm.steps_done,
                       "skipped": pm.last_step_stats().get("skipped"),
                       "unchanged": len(states) == 3 and all(
                           torch.equal(states[1][k], states[2][k]) for k in states[1])}
    return out


def test_a_nan_run_stops_at_the_first_bad_step():
    model = seeded_gpt()  # one process
    optim = _InfiniteAfterTwoSteps(model.parameters())
    losses, norms = [], []
    for idx, tgt in batches(3):
        optim.zero_grad()
        loss = model(idx, tgt)[1]
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        optim.step()
    assert all(map(math.isfinite, losses[:2] + norms[:2])), (losses, norms)
    assert math.isnan(losses[2]) and math.isnan(norms[2]), (losses, norms)
    plan = _plan(4, tp=2, pp=1, dp=2, micro_batch_size=2, zero_stage=1)
    per_rank = run_distributed(_nan_worker, 4, plan.to_json(), timeout_s=300)
    for rank, out in enumerate(per_rank):
        raised = out["raise"]
        assert raised["error"] is not None and raised["error"].startswith("step 3:"), (rank, raised)
        assert "gradient norm is nan" in raised["error"], raised["error"]
        assert len(raised["losses"]) == 2 and raised["steps_done"] == 2, (rank, raised)
        skipped = out["skip"]
        assert skipped["skipped"] is True and skipped["steps_done"] == 3, (rank, skipped)
        assert skipped["unchanged"], rank  # the skipped step left every parameter as it was
        for got, want in zip(raised["losses"], losses):
            assert abs(got - want) / want < 1e-4, (raised["losses"], losses)
