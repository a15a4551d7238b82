"""What the runtime executes today: the one source of truth for the solver's search space.

The solver only emits plans inside this space (``autopar.plan``), so ``parallelize`` never
receives a plan it cannot run; ``autopar.evaluate`` may still price any layout the cost
model understands (e.g. a published Megatron run with interleaving) for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fsdp import FULLY_SHARDED_STAGE
from .zero import EXECUTED_ZERO_STAGES

__all__ = ["RuntimeSupport", "RUNTIME_SUPPORT", "check_executable"]


@dataclass(frozen=True)
class RuntimeSupport:
    """Options the runtime can execute.

    schedules: pipeline schedules; zero_stages: ZeRO stages (see :meth:`zero_stages_for`
    for the ones a pipeline allows); recompute: recompute modes; sequence_parallel: allowed
    values; virtual_stages: allowed v; dtypes: training precisions ("bf16": bf16
    parameters, gradients and activations with fp32 master weights).
    """

    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    zero_stages: tuple[int, ...] = (*EXECUTED_ZERO_STAGES, FULLY_SHARDED_STAGE)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    virtual_stages: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("fp32", "bf16")

    def zero_stages_for(self, pp: int) -> tuple[int, ...]:
        """ZeRO stages executable with ``pp`` pipeline stages: ZeRO-2 (DistributedOptimizer)
        and ZeRO-3 (FSDP2) reduce-scatter after every micro-batch, which needs the engine's
        micro-batch loop (pp == 1); as in DeepSpeed, neither is combined with pipelining."""
        return tuple(z for z in self.zero_stages if not (z >= 2 and pp > 1))


RUNTIME_SUPPORT = RuntimeSupport()


def check_executable(plan, support: RuntimeSupport = RUNTIME_SUPPORT) -> None:
    """Raise NotImplementedError naming the first plan feature the runtime cannot run."""
    checks = [
        ("schedule", plan.schedule, support.schedules),
        ("zero_stage", plan.zero_stage, support.zero_stages),
        ("sequence_parallel", plan.sequence_parallel, support.sequence_parallel),
        ("virtual_stages", plan.virtual_stages, support.virtual_stages),
        ("dtype", plan.dtype, support.dtypes),
        ("zero_stage (with pp > 1)", plan.zero_stage, support.zero_stages_for(plan.pp)),
    ] + [("recompute", mode, support.recompute) for mode in set(plan.recompute)]
    for name, value, allowed in checks:
        if value not in allowed:
            raise NotImplementedError(
                f"the autopar runtime cannot execute {name}={value!r} yet (supported: "
                f"{allowed}); re-plan with autopar.plan, which only emits executable plans")
