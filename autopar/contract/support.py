"""What the runtime executes, and the one definition of the parallel-degree and pipeline rules.

The solver only emits plans inside :data:`RUNTIME_SUPPORT` (``autopar.plan``), so
``parallelize`` never receives a plan it cannot run; ``autopar.evaluate`` may still price any
layout the cost model understands (e.g. a published Megatron run with interleaving) for
comparison. The rules every step of the flow shares live here, each with a message that says
what to change: :func:`validate_degrees` (t·p·d against the world size),
:func:`validate_layout` (heads divisible by t, p <= L, the batch split over d),
:func:`pipeline_problem` (each schedule's record's rule,
:mod:`autopar.techniques.pipeline_schedules`: 1F1B needs m >= p; interleaved 1F1B needs
m % p == 0 and L % (p·v) == 0). The recompute names are :data:`autopar.contract.plan.RECOMPUTE_MODES`.

This module imports no torch.distributed code: planning must not load the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.contract.errors import PlanError
from autopar.contract.plan import DTYPES, RECOMPUTE_MODES, Layout, grad_dtype_of
from autopar.techniques.pipeline_schedules import (PIPELINE_SCHEDULES, SCHEDULES, interleaved_names,
                                                   pipeline_schedule)
from autopar.techniques.tensor_parallel import tensor_parallel_mode
from autopar.techniques.zero_stages import ZERO_STAGE_RECORDS, zero_stage

__all__ = ["RuntimeSupport", "RUNTIME_SUPPORT", "FULL_SPACE", "Unsupported", "unsupported", "check_executable",
           "check_pins",
           "pipeline_problem", "check_positive_ints", "validate_degrees", "validate_layout",
           "divisors", "plan_grad_dtype", "EXECUTED_ZERO_STAGES", "FULLY_SHARDED_STAGE"]

# Defined here, not in the runtime, so that planning loads no torch.distributed code
# (autopar.runtime.zero and autopar.runtime.fsdp import them from here).
EXECUTED_ZERO_STAGES: tuple[int, ...] = tuple(
    s for s, r in ZERO_STAGE_RECORDS.items() if r.runner.endswith(".DistributedOptimizer"))
"""ZeRO stages :class:`autopar.runtime.zero.DistributedOptimizer` executes (0: plain DP)."""
FULLY_SHARDED_STAGE: int = next(s for s, r in ZERO_STAGE_RECORDS.items() if r.shards_parameters)
"""The ZeRO stage :class:`autopar.runtime.fsdp.FullyShardedOptimizer` (FSDP2) executes."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def check_positive_ints(**values: int) -> None:
    """Raise ValueError naming the first of ``values`` (name=value) that is not a positive
    int (bools refused)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def validate_degrees(tp: int, pp: int, dp: int, world_size: int) -> None:
    """Check that tp, pp, dp are positive ints whose product is ``world_size``.

    Raises:
        ValueError: a degree is not a positive int, or tp*pp*dp != world_size (the
            message says how to launch or which plan to pass instead).
    """
    check_positive_ints(tp=tp, pp=pp, dp=dp)
    n = tp * pp * dp
    if n != world_size:
        raise ValueError(
            f"plan needs tp*pp*dp = N = {tp}*{pp}*{dp} = {n} GPUs but world size is {world_size}; "
            f"launch torchrun with --nproc-per-node {n} or pass a plan for {world_size} ranks"
        )


def validate_layout(layout: Layout, *, num_gpus: int, gpus_per_node: int, heads: int | None,
                    num_layers: int, global_batch_size: int) -> None:
    """The one validator of a (partial) layout's degrees against a model and a cluster,
    before any search: t divides the a attention ``heads`` (whole heads per rank, Shoeybi et
    al. 2019 section 3), p <= L, t·p·d = N GPUs, and d (and d·b) divides the global batch.

    Raises ValueError whose message says what to change, e.g. "96 attention heads are not
    divisible by tp=5; choose tp in [1, 2, 3, 4, 6, 8]".
    """
    n, L = num_gpus, num_layers
    if layout.tp is not None and heads is not None and heads % layout.tp:
        ok = [t for t in divisors(heads) if t <= gpus_per_node]
        raise ValueError(f"{heads} attention heads are not divisible by tp={layout.tp}; "
                         f"choose tp in {ok}")
    if layout.pp is not None and layout.pp > L:
        raise ValueError(f"pp={layout.pp} exceeds the model's {L} layers; choose pp <= {L}")
    fixed = [v for v in (layout.tp, layout.pp, layout.dp) if v is not None]
    prod = 1
    for v in fixed:
        prod *= v
    if len(fixed) == 3 and prod != n:
        raise ValueError(f"tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp} = {prod} but the "
                         f"cluster has {n} GPUs; make the product equal {n}")
    if n % prod:
        raise ValueError(f"the fixed degrees multiply to {prod}, which does not divide the "
                         f"{n} GPUs of the cluster; choose degrees whose product divides {n}")
    if layout.dp is not None and layout.micro_batch_size is not None and \
            global_batch_size % (layout.dp * layout.micro_batch_size):
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                         f"dp*micro_batch_size = {layout.dp}*{layout.micro_batch_size}; choose "
                         "a batch that is a multiple of it")
    if layout.dp is not None and global_batch_size % layout.dp:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                         f"dp={layout.dp}; choose a multiple of {layout.dp}")


def pipeline_problem(schedule: str, pp: int, num_micro_batches: int, num_layers: int | None,
                     virtual_stages: int = 1) -> str | None:
    """Why ``schedule`` cannot run p = ``pp`` stages over m = ``num_micro_batches``
    micro-batches of an L = ``num_layers`` layer model with v = ``virtual_stages`` chunks
    per rank, or None: the schedule's record's rule
    (:meth:`~autopar.techniques.pipeline_schedules.PipelineSchedule.problem`: v > 1 only
    interleaved; 1F1B m >= p; interleaved p > 1, v >= 2, L % (p·v) == 0, m % p == 0), the
    one pipeline rule of the solver, the search and the runtime. num_layers None skips the
    layer-count rule (the runtime, whose chunks are already cut)."""
    if schedule not in PIPELINE_SCHEDULES:
        return f"pipeline schedule {schedule!r} is not one of {SCHEDULES}"
    return PIPELINE_SCHEDULES[schedule].problem(pp, num_micro_batches, virtual_stages,
                                                num_layers)


@dataclass(frozen=True)
class RuntimeSupport:
    """Options the runtime can execute.

    schedules: pipeline schedules; zero_stages: ZeRO stages (see :meth:`zero_stages_for`
    for the ones a pipeline allows); recompute: recompute modes; sequence_parallel: allowed
    values at tp > 1 (tp = 1 runs without); virtual_stages: allowed v (v > 1 only with
    an interleaved schedule, see its record's rule); dtypes: training precisions
    ("bf16": bf16 parameters and activations with fp32 master weights); grad_dtypes: the
    gradient dtypes under bf16 (:data:`~autopar.contract.plan.GRAD_DTYPES`), the first the one
    planned when no layout pins it (the autopar runtime keeps bf16 gradients).

    The fields below describe what another framework's runner can express
    (:mod:`autopar.targets`); their defaults are the autopar runtime's:

    name: the target ("autopar", "megatron", "torchtitan", "deepspeed").
    placements: "any" (the solver's tensor-parallel placements, per op) or "megatron"
        (Megatron-LM's pattern only: :func:`autopar.planner.strategies.megatron.megatron_placements`,
        which a framework with a fixed TP plan runs).
    recompute_layout: "per_layer" (any mode per layer), "block" (Megatron-LM: one
        granularity, full recompute of the first k layers of every pipeline stage,
        ``--recompute-method block --recompute-num-layers k``, or selective on every layer;
        one mode for all layers under interleaving) or "uniform" (one mode for all layers).
    even_stages: layers split evenly over the stages (a runner that cannot cut them
        unevenly: :func:`~autopar.contract.stages.even_stage_layers`).
    max_tp: the largest tensor-parallel size the runner executes (None: no limit but the
        node and the heads).
    ddp_1d_only: plain data parallelism (ZeRO-0 over d > 1) only without TP and PP
        (torchtitan 0.2.2 ``parallelize_llama``: "DDP has not supported > 1D parallelism").
    pipeline_zero_stages: the ZeRO stages run with pp > 1 (None: every one but 2 and 3;
        DeepSpeed: ZeRO-1 only, its pipeline engine puts ZeRO-0 under ``BF16_Optimizer``,
        which shards the master weights and keeps a third gradient copy).
    mixed_precision_by_fsdp: bf16 training with TP or PP only under FSDP (ZeRO-3, d > 1);
        otherwise such a run trains in fp32 (torchtitan 0.2.2
        ``distributed/utils.py:maybe_enable_amp``: FSDP's ``MixedPrecisionPolicy``, or
        ``torch.autocast`` without TP and PP).
    attention_kernels: per training dtype, the attention kernels ("math", "flash":
        :attr:`cost_models.hardware.Cluster.attention`) the runner can run, as
        ``((dtype, kernels), ...)``; the cluster's kernel when it is one of them, else the
        first (:meth:`attention_for`). None: the cluster's kernel in every dtype (the
        model's own ``scaled_dot_product_attention`` call: the autopar runtime, DeepSpeed).
    as_written: the space the cost model prices (:data:`FULL_SPACE`), where a layout is
        evaluated as written, not searched: its schedule, v and sequence parallelism are
        priced as given (a free schedule is 1F1B, a free v is 2 under interleaving), every
        ZeRO stage is priced with any pipeline degree, and no runner's rule applies
        (``autopar.evaluate`` of a published layout, the hand layouts of the report).
    expert_parallel: the runner splits MoE experts over ep > 1 ranks folded over TP×DP
        (:mod:`autopar.techniques.expert_parallel`); a search then tries every ep it allows.
    expert_zero_stages: the ZeRO stages it runs at ep > 1, the experts' states sharded over
        their expert-data-parallel group (the autopar runtime: 0, expert gradients
        all-reduced over that group; the cost model also prices 1 and 2, as Megatron-Core's
        distributed optimizer shards expert states over it).
    moe_tp: a mixture-of-experts model runs with tp > 1 in every way the cost model prices
        it. False: Megatron-LM, whose experts under TP run split over the TP ranks
        (expert-TP = tp, its default) or whole on each rank's sequence shard (expert-TP 1),
        while the cost model prices them on the TP ranks' tokens only with ep > 1 and whole
        for all tokens at ep = 1 (:mod:`autopar.frameworks.megatron_moe`); a search then
        tries a MoE model at tp > 1 only with ep > 1 and sequence parallelism.
    context_parallel: the runner splits sequences over cp > 1 ranks (a search then tries cp > 1).
    """

    schedules: tuple[str, ...] = SCHEDULES
    zero_stages: tuple[int, ...] = (*EXECUTED_ZERO_STAGES, FULLY_SHARDED_STAGE)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    virtual_stages: tuple[int, ...] = (1, 2)
    dtypes: tuple[str, ...] = DTYPES
    grad_dtypes: tuple[str, ...] = ("bf16",)
    name: str = "autopar"
    placements: str = "any"
    recompute_layout: str = "per_layer"
    even_stages: bool = False
    max_tp: int | None = None
    ddp_1d_only: bool = False
    mixed_precision_by_fsdp: bool = False
    pipeline_zero_stages: tuple[int, ...] | None = None
    attention_kernels: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    as_written: bool = False
    expert_parallel: bool = True
    expert_zero_stages: tuple[int, ...] = (0,)
    moe_tp: bool = True
    context_parallel: bool = True

    @property
    def default_grad_dtype(self) -> str | None:
        """The gradient dtype planned under bf16 when no layout pins one: the first of
        :attr:`grad_dtypes`, or None (the training dtype's own) where there is none."""
        return self.grad_dtypes[0] if self.grad_dtypes else None

    def kernels_in(self, dtype: str) -> tuple[str, ...] | None:
        """The attention kernels the runner runs in ``dtype`` (:attr:`attention_kernels`), or
        None: the cluster's."""
        return dict(self.attention_kernels or ()).get(dtype)

    def attention_for(self, cluster_kernel: str, dtype: str) -> str:
        """The attention kernel a run in ``dtype`` uses on a cluster whose kernel is
        ``cluster_kernel`` (:meth:`kernels_in`)."""
        kernels = self.kernels_in(dtype)
        return cluster_kernel if not kernels or cluster_kernel in kernels else kernels[0]

    def zero_stages_for(self, pp: int, tp: int = 1, dp: int = 1) -> tuple[int, ...]:
        """ZeRO stages executable with ``pp`` pipeline stages: ZeRO-2 (DistributedOptimizer)
        and ZeRO-3 (FSDP2) reduce-scatter after every micro-batch, which needs the engine's
        micro-batch loop (pp == 1); as in DeepSpeed, neither is combined with pipelining.
        With :attr:`ddp_1d_only`, ZeRO-0 over ``dp`` > 1 ranks only at ``tp`` = ``pp`` = 1
        (maybe none is left: that mesh is not executable)."""
        if self.as_written:
            return self.zero_stages
        piped = self.pipeline_zero_stages if pp > 1 and self.pipeline_zero_stages else None
        return tuple(z for z in self.zero_stages if zero_stage(z).problem(pp) is None and not (
            self.ddp_1d_only and not zero_stage(z).shards_optimizer and dp > 1
            and (tp > 1 or pp > 1)) and (piped is None or z in piped))

    def dtype_for(self, dtype: str, tp: int, pp: int, dp: int) -> str:
        """The precision a run asked for in ``dtype`` trains in on a (tp, pp, dp) mesh:
        fp32 for bf16 with TP or PP and no data parallelism to shard under
        :attr:`mixed_precision_by_fsdp`, else ``dtype``."""
        if self.mixed_precision_by_fsdp and dtype == "bf16" and (tp > 1 or pp > 1) and dp == 1:
            return "fp32"
        return dtype

    def virtual_stages_for(self, schedule: str, num_layers: int, pp: int,
                           num_micro_batches: int) -> tuple[int, ...]:
        """The v executable with ``schedule``: (1,) for a schedule of one chunk per rank;
        for an interleaved one the declared v >= 2 its rule accepts (maybe none)."""
        record = pipeline_schedule(schedule)
        if not record.interleaved:
            return (1,)
        return tuple(v for v in self.virtual_stages
                     if record.problem(pp, num_micro_batches, v, num_layers) is None)


RUNTIME_SUPPORT = RuntimeSupport()
"""What the autopar runtime executes: the space ``autopar.plan`` searches by default."""

FULL_SPACE = RuntimeSupport(
    name="cost model", zero_stages=tuple(ZERO_STAGE_RECORDS), recompute=RECOMPUTE_MODES,
    virtual_stages=(), grad_dtypes=(), as_written=True, expert_parallel=True,
    expert_zero_stages=(0, 1, 2))
"""Everything the cost model prices, each layout as written (:attr:`RuntimeSupport.as_written`):
what ``autopar.evaluate`` and the report's hand layouts price, whether or not a runner
executes it."""


def plan_grad_dtype(plan) -> str:
    """The gradient dtype ``plan`` trains with (:func:`autopar.contract.plan.grad_dtype_of`)."""
    return grad_dtype_of(plan.dtype, plan.grad_dtype)


def check_pins(layout: Layout, support: RuntimeSupport = RUNTIME_SUPPORT) -> None:
    """Refuse, before any search, a pinned layout field that the runtime cannot execute
    (``autopar.plan`` only returns executable plans). Raises ValueError naming the rule:
    a ZeRO stage, recompute mode, dtype, schedule or v outside ``support``; ZeRO-2/3 with
    a pinned pp > 1 (:meth:`RuntimeSupport.zero_stages_for`); v > 1 with a schedule other
    than interleaved 1F1B; interleaving with pp = 1; sequence parallelism with tp = 1."""
    pins = [("zero_stage", layout.zero_stage, support.zero_stages),
            ("recompute", layout.recompute, support.recompute),
            ("dtype", layout.dtype, support.dtypes),
            ("grad_dtype", None if layout.dtype == "fp32" else layout.grad_dtype,
             support.grad_dtypes),
            ("schedule", layout.schedule, support.schedules),
            ("virtual_stages", layout.virtual_stages, support.virtual_stages),
            ("sequence_parallel", layout.sequence_parallel, support.sequence_parallel)]
    if layout.tp == 1:  # no tensor parallelism: nothing to split over sequences
        pins = [pin for pin in pins if pin[0] != "sequence_parallel" or pin[1]]
    for name, value, allowed in pins:
        if value is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is outside what the {support.name} runtime "
                             f"executes ({name} in {allowed}); choose one of them "
                             "(autopar.evaluate still prices it for comparison)")
    if support.max_tp is not None and layout.tp is not None and layout.tp > support.max_tp:
        raise ValueError(f"tp={layout.tp} is outside what the {support.name} runtime executes "
                         f"(tp <= {support.max_tp}); pin tp <= {support.max_tp}")
    if layout.zero_stage is not None and layout.pp is not None and \
            layout.zero_stage not in support.zero_stages_for(layout.pp, layout.tp or 1,
                                                             layout.dp or 1):
        problem = zero_stage(layout.zero_stage).problem(layout.pp)
        if problem:
            raise ValueError(f"zero_stage={layout.zero_stage} with pp={layout.pp}: {problem}")
        raise ValueError(f"zero_stage=0 with tp={layout.tp} pp={layout.pp} dp={layout.dp}: "
                         f"{support.name} runs plain data parallelism only without TP and PP; "
                         "pin zero_stage=3 with pp=1, or dp=1")
    v = layout.virtual_stages
    record = pipeline_schedule(layout.schedule) if layout.schedule else None
    if v is not None and v > 1 and record is not None and not record.interleaved:
        raise ValueError(f"virtual_stages={v} needs schedule {interleaved_names()}, got "
                         f"{record.name!r}; drop one of the two pins")
    if record is not None and record.interleaved and (layout.pp == 1 or v == 1):
        raise ValueError(record.problem(layout.pp or 2, 0, v or 2))
    if layout.sequence_parallel is not None and layout.tp is not None:
        problem = tensor_parallel_mode(layout.sequence_parallel).problem(layout.tp)
        if problem:
            raise ValueError(problem)


@dataclass(frozen=True)
class Unsupported:
    """A plan field outside what a runner executes: ``field`` is ``value``, the runner
    runs ``allowed``; ``why`` the rule behind it when the value alone is allowed (a ZeRO
    stage that this mesh excludes). The one message every door words it with:
    :meth:`message`."""

    field: str
    value: object
    allowed: tuple
    why: str = ""

    def message(self, runner: str) -> str:
        """The refusal as ``runner`` words it: "RUNNER cannot run FIELD=VALUE[why] (it runs
        FIELD in ALLOWED)"."""
        return (f"{runner} cannot run {self.field}={self.value!r}{self.why} (it runs "
                f"{self.field} in {self.allowed})")


def _mesh_rule(plan) -> str:
    """Why a ZeRO stage the runner has is excluded on ``plan``'s mesh
    (:meth:`RuntimeSupport.zero_stages_for`), for :attr:`Unsupported.why`."""
    problem = zero_stage(plan.zero_stage).problem(plan.pp)
    if problem:
        return f" with pp > 1 ({problem})"
    return f" with tp={plan.tp} pp={plan.pp} dp={plan.dp}"


def unsupported(plan, support: RuntimeSupport = RUNTIME_SUPPORT) -> Unsupported | None:
    """The first field of ``plan`` (a :class:`~autopar.contract.plan.Plan`) that ``support``'s runner
    does not execute, or None: the schedule, the ZeRO stage with this mesh
    (:meth:`RuntimeSupport.zero_stages_for`), v, sequence parallelism (at tp > 1), the
    dtype, the gradient dtype under bf16, each recompute mode, tp above ``max_tp``, cp > 1
    where the runner has no context parallelism. The
    one executability check of ``parallelize`` (:func:`check_executable`), plan files
    (:mod:`autopar.contract.plan_check`) and the framework targets
    (:func:`autopar.frameworks.targets.outside_target`)."""
    zeros = support.zero_stages_for(plan.pp, plan.tp, plan.dp * getattr(plan, "cp", 1))
    checks = [("schedule", plan.schedule, support.schedules), ("zero_stage", plan.zero_stage, zeros),
              ("virtual_stages", plan.virtual_stages, support.virtual_stages),
              ("dtype", plan.dtype, support.dtypes)]
    if plan.tp > 1:
        checks.append(("sequence_parallel", plan.sequence_parallel, support.sequence_parallel))
    if plan.dtype == "bf16":
        checks.append(("grad_dtype", plan_grad_dtype(plan), support.grad_dtypes))
    checks += [("recompute", mode, support.recompute) for mode in sorted(set(plan.recompute))]
    for field, value, allowed in checks:
        if value not in allowed:
            excluded = field == "zero_stage" and value in support.zero_stages  # by this mesh
            return Unsupported(field, value, tuple(allowed), _mesh_rule(plan) if excluded else "")
    record = PIPELINE_SCHEDULES[plan.schedule]
    refused = sorted(set(plan.recompute) & set(record.refused_recompute))
    if refused:
        return Unsupported("recompute", refused[0], record.recompute_modes(support.recompute),
                           f" with schedule {plan.schedule!r}: "
                           f"{record.refused_recompute[refused[0]]}")
    if support.max_tp is not None and plan.tp > support.max_tp:
        return Unsupported("tp", plan.tp, tuple(range(1, support.max_tp + 1)))
    if getattr(plan, "cp", 1) > 1 and not support.context_parallel:
        return Unsupported("cp", plan.cp, (1,))
    return None


def check_executable(plan, support: RuntimeSupport = RUNTIME_SUPPORT,
                     source: str = "plan") -> None:
    """Raise :class:`~autopar.contract.errors.PlanError` (``source``: where the plan came
    from) naming the first plan feature the runtime cannot run (:func:`unsupported`), a
    plan whose ``stage_layers`` does not hold pp·v chunks, or one that breaks
    :func:`pipeline_problem`: the one executability check of plan files
    (:func:`~autopar.contract.plan_check.check_plan`) and ``parallelize`` (no collective
    runs before it)."""
    problem = unsupported(plan, support)
    if problem is not None:
        raise PlanError(source, problem.field, f"is {problem.value!r}{problem.why}, which the "
                        f"{support.name} runtime does not execute (it runs {problem.field} in "
                        f"{problem.allowed})", "re-plan with autopar.plan, which emits only "
                        "executable plans")
    chunks = plan.pp * plan.virtual_stages
    if len(plan.stage_layers) != chunks:
        raise PlanError(source, "stage_layers", f"has {len(plan.stage_layers)} entries but pp*v "
                        f"= {plan.pp}*{plan.virtual_stages} = {chunks} model chunks")
    problem = pipeline_problem(plan.schedule, plan.pp, plan.num_micro_batches,
                               plan.stage_layers[-1][1], plan.virtual_stages)
    if problem:
        raise PlanError(source, "schedule", f"breaks the pipeline rule: {problem}")
