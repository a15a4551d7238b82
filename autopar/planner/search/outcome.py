"""What a search proved, in words: the solver status of a plan, and the errors of a search
that found none (step 3 of the flow, after :func:`autopar.planner.search.branch_and_bound.search`).

CP-SAT ends each config's solve in one of four states, and the search says which:

* OPTIMAL: the config's best plan (or, with the incumbent as cutoff, proof that it cannot
  beat it, reported by CP-SAT as INFEASIBLE);
* FEASIBLE: a plan, but CP-SAT stopped at its time limit before proving it best;
* INFEASIBLE without cutoff: no plan of the config fits memory (only the memory rows
  ``memory[stage i]`` can fail, :mod:`autopar.planner.cpsat`); :func:`binding_stages`
  names the stages in CP-SAT's infeasible core;
* UNKNOWN: CP-SAT stopped at its time limit with no plan: not proven infeasible.

A plan is "OPTIMAL" when no config stopped at the limit, else "FEASIBLE" with the gap
(step time − the least lower bound of the configs not proven) / step time
(:func:`solver_status`). No plan: :class:`InfeasibleError` when every config is proven not
to fit, :class:`SolverTimeLimitError` when some config only ran out of time.
"""

from __future__ import annotations

from autopar.contract.plan import Alternative, SolverStatus
from autopar.planner.costs.decision import InfeasibleError
from autopar.planner.costs.reserve import reserve_text

__all__ = ["SolverTimeLimitError", "STOPPED", "unsolved", "solver_status", "infeasible_message",
           "no_plan_error", "binding_stages"]

STOPPED = ("FEASIBLE", "UNKNOWN")
"""CP-SAT statuses of a solve that stopped at its time limit (not proven)."""


class SolverTimeLimitError(Exception):
    """CP-SAT stopped at its time limit before finding any plan for some config, and no
    other config gave one: nothing is proven infeasible. Raise the time limit."""


def unsolved(status: str, best_t: float) -> tuple[bool | None, str]:
    """(feasible, reason) of a config CP-SAT returned no plan for: with a cutoff
    (``best_t`` finite) INFEASIBLE means it cannot beat the best plan; without one only the
    memory rows can fail (:mod:`autopar.planner.cpsat`). Any other status means CP-SAT
    stopped at its time limit: not proven infeasible (feasible None), never "does not fit"."""
    if status == "INFEASIBLE" and best_t < float("inf"):
        return None, (f"cannot beat the best plan ({best_t:.3f} s) within memory "
                      f"(CP-SAT {status})")
    if status == "INFEASIBLE":
        return False, ("no plan fits device memory (CP-SAT INFEASIBLE: memory[stage i] "
                       "fails on some stage for every choice)")
    return None, (f"CP-SAT stopped at its time limit without a plan (status {status}): "
                  "not proven infeasible")


def solver_status(best_t: float, statuses: dict, lower_bounds: dict, configs: int,
                  time_limit_s: float) -> SolverStatus:
    """The :class:`SolverStatus` of a search whose best predicted step is ``best_t``
    seconds: ``statuses`` per solved config, ``lower_bounds`` their least step time
    (seconds: CP-SAT's objective bound, or the search's bound when larger)."""
    stopped = [cfg for cfg, status in statuses.items() if status in STOPPED]
    if not stopped:
        return SolverStatus("OPTIMAL", time_limit_s, 0.0, configs, 0)
    lower = min([best_t] + [lower_bounds.get(cfg, 0.0) for cfg in stopped])
    gap = max(0.0, (best_t - lower) / best_t) if best_t > 0 else 0.0
    return SolverStatus("FEASIBLE", time_limit_s, round(gap, 6), configs, len(stopped))


def binding_stages(model) -> list[int]:
    """The pipeline stages whose ``memory[stage i]`` rows form CP-SAT's infeasible core of
    ``model`` (a :class:`~autopar.planner.cpsat.ConfigModel` built with
    ``assume_memory=True``), solved with every ``fits[stage i]`` assumed; [] when the
    solve does not prove infeasibility."""
    model.model.AddAssumptions(model.memory_literals)
    status, solver = model.solve(1.0)
    if solver.StatusName(status) != "INFEASIBLE":
        return []
    index = {lit.Index(): i for i, lit in enumerate(model.memory_literals)}
    return sorted(index[k] for k in solver.SufficientAssumptionsForInfeasibility() if k in index)


def infeasible_message(cluster, seen: list[Alternative], statuses: dict,
                       binding: str | None = None) -> str:
    """Why no plan was found, per mesh shape: pruned by the memory lower bound, INFEASIBLE
    for CP-SAT (``binding``: the stages that bind for the most frugal such config), or
    stopped at CP-SAT's time limit (then the message says so)."""
    bounds = [s.min_memory_bytes for s in seen if s.min_memory_bytes is not None]
    need = (f"the most memory-frugal mesh shape needs at least {min(bounds) / 2**30:.2f} GiB per "
            "GPU" if bounds else "every mesh shape exceeds it once activations are counted")
    found = []
    if bounds:
        found.append(f"{len(bounds)} pruned by the memory lower bound (model states and "
                     f"full-recompute checkpoints: {min(bounds) / 2**30:.2f} GiB and up vs "
                     f"{cluster.device.memory_gib:.1f} GiB less the reserve)")
    rank0 = sum(1 for s in seen if "memory-time lower bound" in s.reason)
    if rank0:
        found.append(f"{rank0} where pipeline rank 0 cannot fit its layers with any "
                     "recompute (the binding stage is stage 0: memory-time lower bound of "
                     "autopar.planner.search.bounds)")
    infeasible = sum(1 for s in statuses.values() if s == "INFEASIBLE")
    if infeasible:
        found.append(f"{infeasible} INFEASIBLE for CP-SAT (memory[stage i] fails for every "
                     "strategy, split, recompute and ZeRO choice"
                     + (f"; binding: {binding}" if binding else "") + ")")
    return (f"no plan fits in {cluster.device.memory_gib:.1f} GiB per GPU "
            f"({cluster.device.name}, {cluster.num_gpus} GPUs) less the memory reserve "
            f"({reserve_text(cluster)}): {need}. Of the {len(seen)} "
            f"mesh shapes: {'; '.join(found)}. Use more GPUs, GPUs with more memory, a "
            "smaller global batch or micro-batch, a smaller --memory-headroom, or allow "
            "ZeRO / recompute")


def no_plan_error(cluster, seen: list[Alternative], statuses: dict, time_limit_s: float,
                  binding: str | None = None) -> Exception:
    """The error of a search without a plan: :class:`SolverTimeLimitError` when some config
    stopped at CP-SAT's time limit without one (nothing proves that nothing fits), else
    :class:`InfeasibleError` (:func:`infeasible_message`)."""
    stopped = sum(1 for s in statuses.values() if s in STOPPED)
    if stopped:
        return SolverTimeLimitError(
            f"CP-SAT stopped at its time limit ({time_limit_s:g} s of deterministic time per "
            f"config) without a plan on {stopped} of the {len(seen)} configs, and no other "
            "config gave one; nothing is proven not to fit (this is not an out-of-memory "
            "verdict). Raise the limit: --time-limit (time_limit_s=), e.g. "
            f"{max(2 * time_limit_s, 1.0):g}")
    return InfeasibleError(infeasible_message(cluster, seen, statuses, binding))
