"""What the runtime executes today: the one source of truth for the solver's search space.

The solver only emits plans inside this space (``autopar.plan``), so ``parallelize`` never
receives a plan it cannot run; ``autopar.evaluate`` may still price any layout the cost
model understands (e.g. a published Megatron run with interleaving) for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RuntimeSupport", "RUNTIME_SUPPORT", "check_executable", "interleaving_problem",
           "EXECUTED_ZERO_STAGES", "FULLY_SHARDED_STAGE"]

# Defined here, not in the runtime, so that planning loads no torch.distributed code
# (autopar.runtime.zero and autopar.runtime.fsdp import them from here).
EXECUTED_ZERO_STAGES: tuple[int, ...] = (0, 1, 2)
"""ZeRO stages :class:`autopar.runtime.zero.DistributedOptimizer` executes (0: plain DP)."""
FULLY_SHARDED_STAGE = 3
"""The ZeRO stage :class:`autopar.runtime.fsdp.FullyShardedOptimizer` (FSDP2) executes."""


def interleaving_problem(num_layers: int, pp: int, virtual_stages: int,
                         num_micro_batches: int) -> str | None:
    """Why interleaved 1F1B with v = ``virtual_stages`` chunks per rank cannot run, or None.

    The rules (Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``; Narayanan et al.
    2021, section 2.2.2): p > 1 (with one rank the chunks would not interleave), v >= 2
    (v = 1 is plain 1F1B), L divisible by p·v (p·v equal chunks of L/(p·v) layers; chunk c
    runs on pipeline rank c % p), m divisible by p (the schedule runs rounds of p
    micro-batches; ``cost_models.pipeline`` prices the same condition). The solver, the
    test matrix and :func:`check_executable` share this one rule.
    """
    L, p, v, m = num_layers, pp, virtual_stages, num_micro_batches
    if p < 2:
        return f"interleaved 1F1B needs pp > 1, got pp={p}; use schedule='1f1b'"
    if v < 2:
        return (f"interleaved 1F1B needs virtual_stages >= 2, got v={v} (v=1 is plain "
                "1F1B: use schedule='1f1b')")
    if L % (p * v):
        ok = [k for k in range(2, L // p + 1) if L % (p * k) == 0]
        return (f"interleaved 1F1B cuts the {L} layers into pp*v = {p}*{v} equal chunks, but "
                f"{L} is not divisible by {p * v}; choose virtual_stages in {ok or '(none)'} "
                "or schedule='1f1b'")
    if m % p:
        return (f"interleaved 1F1B needs num_micro_batches divisible by pp: m={m}, pp={p}; "
                f"choose m in multiples of {p} (global batch = dp * micro_batch_size * m) or "
                "schedule='1f1b'")
    return None


@dataclass(frozen=True)
class RuntimeSupport:
    """Options the runtime can execute.

    schedules: pipeline schedules; zero_stages: ZeRO stages (see :meth:`zero_stages_for`
    for the ones a pipeline allows); recompute: recompute modes; sequence_parallel: allowed
    values; virtual_stages: allowed v (v > 1 only with "interleaved_1f1b", see
    :func:`interleaving_problem`); dtypes: training precisions ("bf16": bf16
    parameters, gradients and activations with fp32 master weights).
    """

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
    zero_stages: tuple[int, ...] = (*EXECUTED_ZERO_STAGES, FULLY_SHARDED_STAGE)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    virtual_stages: tuple[int, ...] = (1, 2)
    dtypes: tuple[str, ...] = ("fp32", "bf16")

    def zero_stages_for(self, pp: int) -> tuple[int, ...]:
        """ZeRO stages executable with ``pp`` pipeline stages: ZeRO-2 (DistributedOptimizer)
        and ZeRO-3 (FSDP2) reduce-scatter after every micro-batch, which needs the engine's
        micro-batch loop (pp == 1); as in DeepSpeed, neither is combined with pipelining."""
        return tuple(z for z in self.zero_stages if not (z >= 2 and pp > 1))

    def virtual_stages_for(self, schedule: str, num_layers: int, pp: int,
                           num_micro_batches: int) -> tuple[int, ...]:
        """The v executable with ``schedule``: (1,) for GPipe/1F1B; for interleaved 1F1B
        the declared v >= 2 that :func:`interleaving_problem` accepts (maybe none)."""
        if schedule != "interleaved_1f1b":
            return (1,)
        return tuple(v for v in self.virtual_stages
                     if interleaving_problem(num_layers, pp, v, num_micro_batches) is None)


RUNTIME_SUPPORT = RuntimeSupport()


def check_executable(plan, support: RuntimeSupport = RUNTIME_SUPPORT) -> None:
    """Raise NotImplementedError naming the first plan feature the runtime cannot run, or
    ValueError for an interleaved plan that breaks :func:`interleaving_problem` or whose
    ``stage_layers`` does not hold pp·v chunks (no collective runs before either)."""
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
    chunks = plan.pp * plan.virtual_stages
    if len(plan.stage_layers) != chunks:
        raise ValueError(f"plan.stage_layers has {len(plan.stage_layers)} entries but pp*v = "
                         f"{plan.pp}*{plan.virtual_stages} = {chunks} model chunks; re-plan "
                         "with autopar.plan")
    if plan.virtual_stages > 1 and plan.schedule != "interleaved_1f1b":
        raise ValueError(f"virtual_stages={plan.virtual_stages} needs schedule "
                         f"'interleaved_1f1b', got {plan.schedule!r}; use virtual_stages=1")
    if plan.schedule == "interleaved_1f1b":
        problem = interleaving_problem(plan.stage_layers[-1][1], plan.pp, plan.virtual_stages,
                                       plan.num_micro_batches)
        if problem:
            raise ValueError(problem)
