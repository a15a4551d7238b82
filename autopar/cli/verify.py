"""``autopar verify PLAN.json``: run a saved plan's program against one device.

Launches ``tp·pp·dp`` local CPU processes joined in a gloo process group (or, under
``torchrun``, uses the processes it was started in), builds the same seeded model on each,
and runs :func:`autopar.verify.check.verify`: a few SGD steps of the parallel program and of the
single-device model on the same random batch, compared per step, stage and parameter.
Rank 0 prints the report (a table, or JSON with ``--json``). The flags are
:mod:`autopar.cli.parser`'s.

Exit codes (those of :mod:`autopar.cli.commands`, plus one): 0 the program matches · 5 it does not,
or a loss, gradient or parameter is NaN/inf on either side (:data:`EXIT_VERIFY_FAILED`; the
message names the first non-finite step) · 2 bad input (missing plan file, a model the plan was not
made for, a plan the runtime cannot execute, more processes than a local run allows) ·
1 internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

__all__ = ["run_verify", "EXIT_VERIFY_FAILED"]

EXIT_OK, EXIT_VERIFY_FAILED = 0, 5  # 1-4 are autopar.cli.commands's (internal, bad input, infeasible, trace)


def _check_inputs(args: argparse.Namespace):
    """(plan, model spec, tolerances): everything checked before a process is started,
    the plan by the one plan validator (:func:`autopar.contract.plan_check.read_plan`, executable)
    and against the model (:func:`autopar.planner.plan_fit.check_plan_fits_model`)."""
    import autopar
    from autopar.contract.plan_check import read_plan
    from autopar.planner.plan_fit import check_plan_fits_model
    from autopar.verify.check import Tolerances
    from autopar.verify.claims import claim_problem

    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else None
    plan = read_plan(args.plan_file, world_size=world, executable=True)
    spec = args.model or plan.model
    meta_model, _ = autopar.load_model(spec)
    check_plan_fits_model(plan, meta_model, source=str(args.plan_file))
    tol = Tolerances.for_dtype(plan.dtype)
    if args.tolerance is not None:
        tol = Tolerances(loss=args.tolerance, grad=args.tolerance, param=args.tolerance,
                         floor=tol.floor)
    return plan, spec, tol, claim_problem(meta_model, plan)


def _verify_here(plan, spec: str, tol, args: argparse.Namespace) -> dict:
    """Run verify on this rank (process group initialised); the outcome as plain data."""
    from autopar.models import load_model
    from autopar.verify.check import verify

    model, _ = load_model(spec, device="cpu", seed=args.seed)  # the same weights on every rank
    report = verify(model, plan, steps=args.steps, seed=args.seed, tolerances=tol,
                    optimizer=lambda params: torch.optim.SGD(params, lr=args.lr),
                    raise_on_failure=False)
    return {"ok": report.ok, "report": report.to_dict(), "table": report.table(),
            "message": "" if report.ok else report.failure_message()}


def _verify_rank(rank: int, world: int, payload: tuple) -> dict | None:
    """One launched rank: verify; rank 0 returns the outcome (the others None)."""
    result = _verify_here(*payload)
    return result if rank == 0 else None


def _spawn(world: int, payload: tuple, timeout_s: float) -> dict:
    """Run ``_verify_here`` on ``world`` local processes (:func:`autopar.runtime.launch.launch`,
    gloo process group timeout 120 s); rank 0's outcome.

    Raises RuntimeError naming the first rank that failed (its traceback in the message
    after the first line), or TimeoutError past ``timeout_s``.
    """
    from autopar.runtime.launch import launch

    return launch(_verify_rank, world, payload, timeout_s=timeout_s, pg_timeout_s=120)[0]


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_in_torchrun(plan, payload: tuple) -> tuple[dict, bool]:
    """Already launched by torchrun: verify in this process. (outcome, is rank 0); the
    outcome is the same on every rank."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != plan.num_gpus:
        raise ValueError(f"the plan needs tp*pp*dp = {plan.num_gpus} processes but torchrun "
                         f"started {world}; use --nproc-per-node {plan.num_gpus}")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return _verify_here(*payload), dist.get_rank() == 0


def run_verify(args: argparse.Namespace) -> int:
    """``autopar verify``: check inputs, launch, print rank 0's report; the exit code.

    Raises ValueError for bad input (exit 2 in autopar.cli.commands), RuntimeError / TimeoutError
    when a process fails (exit 1).
    """
    plan, spec, tol, claims = _check_inputs(args)
    if claims:  # no process is started for a plan that is not what it says
        print(f"autopar verify: FAILED before running: {claims}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    payload = (plan, spec, tol, args)
    show = True
    if _under_torchrun():
        result, show = _run_in_torchrun(plan, payload)
    else:
        if plan.num_gpus > args.max_processes:
            raise ValueError(
                f"the plan needs tp*pp*dp = {plan.tp}*{plan.pp}*{plan.dp} = {plan.num_gpus} "
                f"processes, more than --max-processes {args.max_processes} for a local run on "
                f"this machine ({os.cpu_count()} CPU cores); verify a plan of the same model "
                "with fewer ranks (e.g. `autopar plan --cluster local-cpu --tp 2 ...`), or raise "
                "--max-processes")
        try:
            result = _spawn(plan.num_gpus, payload, args.timeout)
        except RuntimeError as exc:
            first, _, rest = str(exc).partition("\n")
            if args.debug:
                print(rest, file=sys.stderr)
            raise RuntimeError(first) from None
    if show:  # under torchrun only rank 0 prints; every rank returns the same code
        print(json.dumps(result["report"], indent=2) if args.json else result["table"])
        if not result["ok"]:
            print(f"autopar verify: {result['message']}", file=sys.stderr)
    if not result["ok"]:
        return EXIT_VERIFY_FAILED
    return EXIT_OK
