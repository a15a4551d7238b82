"""The plan: the contract between the solver, the report and the runtime.

A :class:`Layout` is what a person writes (Megatron flags: ``tp=8, pp=16, dp=8, mbs=1``);
any field left ``None`` is for the solver to choose. A :class:`Plan` is a fully decided
layout plus everything the rewriter needs (stage boundaries, per-node placements) and the
cost model's prediction. Plans are versioned JSON: ``Plan.from_json(plan.to_json()) == plan``,
and a saved plan can be reported or executed without solving again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

from autopar.contract.stages import equal_chunks, rank_layers  # re-exported: the plan's vocabulary
from autopar.contract.plan_alternatives import Alternative
from autopar.contract.plan_memory import memory_line
from autopar.contract.plan_replicated import ReplicatedOp, ReplicatedOps, format_share
from autopar.techniques.pipeline_schedules import SCHEDULES  # one record per schedule

__all__ = ["Layout", "Plan", "Prediction", "Alternative", "ReplicatedOp", "ReplicatedOps", "SolverStatus",
           "format_share", "SCHEDULES", "RECOMPUTE_MODES", "recompute_counts", "DTYPES", "GRAD_DTYPES",
           "grad_dtype_of", "ATTENTION_KERNELS", "ZERO_STAGES", "SOLVER_STATUSES", "COMM_KINDS", "PLAN_VERSION", "rank_layers", "equal_chunks"]

PLAN_VERSION = 3  # 2: ``solver`` added, solve times left out; 3: the memory reserve and margin (stage_phase_s, added then too, may be absent)
# The one definition of these names (the rules over them: autopar.contract.support).
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation per layer: none, selective (the attention core; Korthikanti et
al. 2022), full (keep only the layer's input)."""


def recompute_counts(modes: list[str]) -> str:
    """Per-layer recompute modes (``Plan.recompute``) counted, e.g. ``none×90+full×6`` (modes
    in name order): how the report's layout line and the framework refusals write them."""
    return "+".join(f"{m}×{modes.count(m)}" for m in sorted(set(modes)))
DTYPES = ("bf16", "fp32")
"""Training precisions: bf16 mixed precision (fp32 master weights) or fp32."""
GRAD_DTYPES = ("bf16", "fp32")
"""Gradient precisions under bf16 training: the dtype of the gradient buffer and of its
data-parallel reduction. "bf16": the autopar runtime, Megatron-LM with
``--grad-reduce-in-bf16``; "fp32": Megatron-LM's default main gradients under ``--bf16``
(``accumulate_allreduce_grads_in_fp32``), FSDP2 with ``reduce_dtype=torch.float32``
(torchtitan), DDP under ``torch.autocast``. fp32 training has fp32 gradients."""

ATTENTION_KERNELS = ("math", "flash")
"""Attention kernels the cost model prices (:attr:`cost_models.hardware.Cluster.attention`):
"math" keeps the softmax and runs every score, "flash" keeps output and log-sum-exp, skips
causal tiles and recomputes the scores in backward (:mod:`autopar.graph.attention`)."""


def grad_dtype_of(dtype: str, grad_dtype: str | None) -> str:
    """The gradients' dtype of a run in ``dtype`` (``grad_dtype`` None: the dtype's own)."""
    return "fp32" if dtype == "fp32" else (grad_dtype or "bf16")
ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages the cost model prices (Rajbhandari et al. 2020): 0 is plain DP."""
COMM_KINDS = ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "pp_p2p", "dp_all_reduce",
              "dp_reduce_scatter", "dp_all_gather", "other", "ep_all_to_all", "cp_all_gather",
              "cp_reduce_scatter")  # of last_step_stats()["comm_bytes"], Prediction.stage_stats


@dataclass(frozen=True)
class Layout:
    """A (partial) parallel layout; ``None`` means "let the solver choose".

    tp: tensor-parallel size t (must divide the head count and GPUs per node).
    pp: pipeline-parallel size p.
    dp: data-parallel size d.
    micro_batch_size: b, sequences per micro-batch.
    zero_stage: 0 (plain DP), 1, 2 or 3 (Rajbhandari et al. 2020).
    recompute: "none" | "selective" | "full", applied to every layer when fixed.
    schedule: a pipeline schedule's name (:data:`SCHEDULES`: "gpipe" | "1f1b" |
        "interleaved_1f1b"; :mod:`autopar.techniques.pipeline_schedules`).
    virtual_stages: v, model chunks per pipeline rank (interleaved schedule only).
    sequence_parallel: Megatron-3 sequence parallelism in the non-TP regions.
    dtype: "bf16" (mixed precision) or "fp32"; None: the cluster's ``dtype``.
    grad_dtype: the gradients' dtype under bf16 (:data:`GRAD_DTYPES`); None: bf16 (the
        autopar runtime's), fp32 under fp32 training.
    ep: expert-parallel size: each MoE layer's experts split over ep of the d data-parallel
        ranks (:mod:`autopar.techniques.expert_parallel`); 1 for a dense model.
    cp: context-parallel size c: each sequence's tokens split over c ranks
        (:mod:`autopar.techniques.context_parallel`); N = t·c·p·d GPUs.
    """

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    zero_stage: int | None = None
    recompute: str | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    sequence_parallel: bool | None = None
    dtype: str | None = None
    grad_dtype: str | None = None
    ep: int | None = None
    cp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch_size", "virtual_stages", "ep", "cp"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"Layout.{name} must be a positive int or None, got {value!r}")
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool)
                                            or self.zero_stage not in ZERO_STAGES):
            raise ValueError(f"Layout.zero_stage must be one of {ZERO_STAGES}, got "
                             f"{self.zero_stage!r}")
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"Layout.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}"
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"Layout.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"Layout.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"Layout.grad_dtype must be one of {GRAD_DTYPES}, got "
                             f"{self.grad_dtype!r}")
        if self.grad_dtype == "bf16" and self.dtype == "fp32":
            raise ValueError("Layout.grad_dtype='bf16' with dtype='fp32': fp32 training keeps "
                             "fp32 gradients; drop grad_dtype or train in bf16")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise ValueError("Layout.sequence_parallel must be True, False or None, got "
                             f"{self.sequence_parallel!r}")

    def is_complete(self) -> bool:
        """True when tp, pp, dp and micro_batch_size are all fixed."""
        return None not in (self.tp, self.pp, self.dp, self.micro_batch_size)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse ``"tp=8,pp=16,dp=8,mbs=1,recompute=full"`` (Megatron-style flags)."""
        aliases = {"mbs": "micro_batch_size", "zero": "zero_stage", "sp": "sequence_parallel",
                   "v": "virtual_stages"}
        kwargs: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in {f.name for f in fields(cls)}:
                raise ValueError(f"cannot parse layout item {item!r} in {text!r}; expected "
                                 "key=value with keys tp, pp, dp, ep, cp, mbs, zero_stage, "
                                 "recompute, schedule, virtual_stages, sequence_parallel, dtype, "
                                 "grad_dtype")
            value = value.strip()
            if key in ("recompute", "schedule", "dtype", "grad_dtype"):
                kwargs[key] = value
            elif key == "sequence_parallel" and value.lower() in ("1", "true", "yes", "on",
                                                                  "0", "false", "no", "off"):
                kwargs[key] = value.lower() in ("1", "true", "yes", "on")
            elif key != "sequence_parallel" and value.lstrip("-").isdigit():
                kwargs[key] = int(value)
            else:
                want = "true or false" if key == "sequence_parallel" else "an integer"
                raise ValueError(f"cannot parse layout item {item!r} in {text!r}; {key} "
                                 f"takes {want}")
        return cls(**kwargs)


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one training step of a plan.

    step_time_s: predicted wall time of one optimizer step (seconds).
    tflops_per_gpu: model FLOPs per second per GPU, in TFLOP/s, counting recomputed
        forward work the way Megatron reports it (Narayanan et al. 2021, eq. 3).
    mfu: model FLOPs utilisation (model FLOPs without recompute / peak).
    hfu: hardware FLOPs utilisation (includes recompute).
    peak_memory_bytes: the largest per-GPU memory over stages.
    memory_bytes_by_stage: per pipeline stage, bytes per GPU by kind
        (parameters, gradients, optimizer_states, activations).
    time_s_by_kind: seconds per step by kind (compute, recompute, tp_comm, pp_p2p,
        dp_comm, bubble, optimizer).
    comm_bytes_by_kind: payload bytes per GPU per step by collective kind.
    stage_time_s: per stage, forward+backward seconds of one micro-batch.
    stage_stats: per pipeline stage, what each of its ranks should measure in one step
        (the keys of ``ParallelizedModel.last_step_stats()``): comm_bytes (payload bytes
        by kind), model_state_bytes, saved_activation_bytes, step_time_s.
    stage_phase_s: per pipeline stage, seconds of one micro-batch through all its chunks by
        phase: "forward", "backward", "recompute" (compute with its TP communication; they
        sum to ``stage_time_s``) and "p2p" (c, one chunk boundary's send forward and back);
        a chunk takes 1/v of each (``autopar.report.schedule``); "weight_grad", the part of
        "backward" that computes weight gradients (W of a zero-bubble schedule; saved since
        the zero-bubble schedules came). Empty in older plans.
    memory_reserve_bytes_by_stage: per pipeline stage, bytes per GPU the process holds
        besides ``memory_bytes_by_stage`` (``cost_models.reserve.RESERVE_KINDS``: CUDA
        context, NCCL buffers, loss logits, p2p buffers, DP bucket, fragmentation, headroom).
    memory_margin_bytes: the least over stages of device memory - reserve - peak (>= 0 when
        the plan fits).
    """

    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    memory_bytes_by_stage: list[dict[str, float]]
    time_s_by_kind: dict[str, float]
    comm_bytes_by_kind: dict[str, float]
    stage_time_s: list[float]
    stage_stats: list[dict] = field(default_factory=list)
    stage_phase_s: list[dict[str, float]] = field(default_factory=list)
    memory_reserve_bytes_by_stage: list[dict[str, float]] = field(default_factory=list)
    memory_margin_bytes: float = 0.0


SOLVER_STATUSES = ("OPTIMAL", "FEASIBLE", "EVALUATED")  # of a plan (INFEASIBLE, UNKNOWN: errors)


@dataclass(frozen=True)
class SolverStatus:
    """What the search proved, deterministically (CP-SAT: one worker, deterministic time),
    so it is saved in the plan; wall-clock time is not (:attr:`Plan.solve_wall_s`).

    status: "OPTIMAL" (every config solved to optimality, proven unable to beat the plan or
        pruned by a bound) or "FEASIBLE" (CP-SAT stopped at its time limit on ``stopped``
        of the ``configs``: a faster plan may exist, by at most ``gap`` of the step time)
        or "EVALUATED" (a hand layout priced as written by ``autopar.evaluate``, no search).
    time_limit_s: CP-SAT's deterministic time limit per config (``--time-limit``).
    """

    status: str = "OPTIMAL"
    time_limit_s: float = 1.0
    gap: float = 0.0
    configs: int = 0
    stopped: int = 0

    def line(self) -> str:
        """One line for summaries and reports."""
        if self.status == "EVALUATED":
            return "solver: none, a hand layout priced as written (autopar.evaluate)"
        if self.status == "OPTIMAL":
            return (f"solver: OPTIMAL, the fastest of {self.configs} configs under the cost "
                    f"model (CP-SAT limit {self.time_limit_s:g} s per config)")
        return (f"solver: FEASIBLE, not proven optimal: CP-SAT stopped at its time limit "
                f"({self.time_limit_s:g} s per config) on {self.stopped} of {self.configs} "
                f"configs; a faster plan may exist, by at most {self.gap:.1%} of the step "
                "time (gap); raise --time-limit (time_limit_s=) to prove optimality")


@dataclass(frozen=True)
class Plan:
    """A fully decided parallel training plan (JSON version ``PLAN_VERSION``).

    model: model name or ``module:factory`` it was planned for; model_config its shape.
    cluster: the cluster as ``Cluster.to_dict()``.
    global_batch_size, seq_len: B and s of one step.
    tp, pp, dp, micro_batch_size, num_micro_batches, schedule, zero_stage,
    virtual_stages, sequence_parallel, dtype, grad_dtype, ep, cp: the layout (grad_dtype None
    in a plan saved before autopar priced it: the dtype's own; ep and cp 1, left out of the
    JSON, for a plan without expert or context parallelism);
    B = dp · micro_batch_size · num_micro_batches (cp splits each sequence, not the batch).
    attention: the attention kernel the plan is priced with, "math" or "flash"
        (:data:`ATTENTION_KERNELS`), when its target fixes one other than the cluster's
        (:meth:`autopar.contract.support.RuntimeSupport.attention_for`: torchtitan runs flash in
        bf16); None: the cluster's (``cluster["attention"]``). :attr:`attention_kernel`
        gives the one in force.
    recompute: one mode per transformer layer (length L). A model whose layers differ
        (mixture-of-experts layers beside dense ones) is planned as groups of identical
        layers (:mod:`autopar.graph.layer_groups`); then "layer" here and in
        ``stage_layers`` means a group, L the number of groups, and the leading (trailing)
        layers outside any group run on the first (last) chunk with the embedding (head).
        The grouping is found again from the model's graph wherever the plan is applied.
    stage_layers: per model chunk, in chunk order, [first_layer, last_layer_exclusive);
        pp·v contiguous chunks covering the L layers, placed by the schedule's record
        (``chunk_rank``): chunk c on pipeline rank c % pp (Megatron-LM's round-robin), so
        rank r holds chunks r, r + pp, ..., or ZB-V's V, rank r holding chunks r and
        2pp - 1 - r (:func:`rank_layers`);
        v = 1 (GPipe, 1F1B): one [first, last) per pipeline stage.
    placements: per traced node name, its tensor-parallel strategy key
        ``"<strategy>:<output placement>"``, e.g. "column:S2", "row:P", "replicate:R"
        (read and written only by :mod:`autopar.contract.placement`; the strategies are those of
        :func:`autopar.planner.strategies.node_strategies`).
    predicted: the cost model's :class:`Prediction`.
    alternatives: the best other configs the search visited (:class:`Alternative`).
    binding: human-readable binding constraints (memory, divisibility ...).
    replicated_ops: the compute ops every TP rank runs whole (:class:`ReplicatedOps`); None
        in a plan saved before autopar recorded them.
    solver: what the search proved (:class:`SolverStatus`).
    solve_wall_s: wall seconds the search took; not saved (``to_json`` leaves it out, so
        the same inputs give byte-identical plan files) and not compared.
    """

    model: str
    model_config: dict
    cluster: dict
    global_batch_size: int
    seq_len: int
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str
    zero_stage: int
    recompute: list[str]
    stage_layers: list[list[int]]
    placements: dict[str, str]
    predicted: Prediction
    virtual_stages: int = 1
    sequence_parallel: bool = False
    dtype: str = "bf16"
    grad_dtype: str | None = None
    attention: str | None = None
    ep: int = 1
    cp: int = 1
    alternatives: list[Alternative] = field(default_factory=list)
    binding: list[str] = field(default_factory=list)
    replicated_ops: ReplicatedOps | None = None
    solver: SolverStatus = field(default_factory=SolverStatus)
    version: int = PLAN_VERSION
    solve_wall_s: float = field(default=0.0, compare=False)

    @property
    def num_gpus(self) -> int:  # N = t·c·p·d
        return self.tp * self.cp * self.pp * self.dp

    def layout(self) -> Layout:
        """The plan's layout (recompute given only when uniform across layers)."""
        modes = set(self.recompute)
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, micro_batch_size=self.micro_batch_size,
                      zero_stage=self.zero_stage,
                      recompute=modes.pop() if len(modes) == 1 else None,
                      schedule=self.schedule, virtual_stages=self.virtual_stages,
                      sequence_parallel=self.sequence_parallel, dtype=self.dtype,
                      grad_dtype=grad_dtype_of(self.dtype, self.grad_dtype), ep=self.ep,
                      cp=self.cp)

    @property
    def attention_kernel(self) -> str:
        """The attention kernel the plan is priced with: :attr:`attention`, else the
        cluster's ("math" for a cluster saved without one, :class:`~cost_models.hardware.
        Cluster`'s default)."""
        return self.attention or self.cluster.get("attention", "math")

    def to_dict(self) -> dict:
        """The plan as JSON-able data: every field but :attr:`solve_wall_s` (and
        :attr:`attention` when None, so plans priced with the cluster's kernel read as
        before)."""
        data = asdict(self)
        del data["solve_wall_s"]
        data["alternatives"] = [a.to_dict() for a in self.alternatives]
        if data["attention"] is None:
            del data["attention"]
        for name in ("ep", "cp"):
            if data[name] == 1:
                del data[name]
        return data

    def to_json(self, indent: int | None = 2) -> str:  # keys sorted: equal plans, equal bytes
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> "Plan":
        """:meth:`to_dict` data read back through the one plan validator
        (:func:`autopar.contract.plan_check.plan_from_dict`: PlanError naming ``source``)."""
        from autopar.contract.plan_check import plan_from_dict

        return plan_from_dict(data, source)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        """:meth:`to_json` text read back (:func:`autopar.contract.plan_check.plan_from_json`)."""
        from autopar.contract.plan_check import plan_from_json

        return plan_from_json(text, source)

    def decision_digest(self) -> str:
        """SHA-256 of what the runtime executes (layout, stages, recompute, placements);
        predictions and solve times are left out, so two solves of one plan agree."""
        keys = ("global_batch_size", "seq_len", "tp", "pp", "dp", "micro_batch_size",
                "num_micro_batches", "schedule", "zero_stage", "recompute", "stage_layers",
                "placements", "virtual_stages", "sequence_parallel", "dtype", "version")
        data = {k: getattr(self, k) for k in keys}
        if grad_dtype_of(self.dtype, self.grad_dtype) != grad_dtype_of(self.dtype, None):
            data["grad_dtype"] = self.grad_dtype  # digests of plans before it unchanged
        data.update({k: getattr(self, k) for k in ("ep", "cp") if getattr(self, k) != 1})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def summary(self) -> str:
        """The :meth:`headline`, the solver's line when it did not prove optimality
        (:meth:`SolverStatus.line`), (when there are any) a line naming the ops that no
        tensor-parallel strategy splits (:meth:`ReplicatedOps.line`), then the memory line
        (peak + reserve against the device, the margin: :func:`autopar.contract.plan_memory.memory_line`)."""
        rep, gib = self.replicated_ops, self.cluster.get("device", {}).get("memory_gib")
        solver = f"\n{self.solver.line()}" if self.solver.status == "FEASIBLE" else ""
        return (self.headline() + solver + (f"\n{rep.line()}" if rep and rep.no_strategy else "")
                + "\n" + memory_line(self.predicted, gib and gib * 2**30))

    def headline(self) -> str:
        """One line: the layout and its predicted speed."""
        p = self.predicted
        rec = ",".join(sorted(set(self.recompute)))
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep} mbs={self.micro_batch_size} "
                f"m={self.num_micro_batches} {self.schedule} zero={self.zero_stage} "
                f"recompute={rec}: step {p.step_time_s:.3f} s, {p.tflops_per_gpu:.1f} TFLOP/s/GPU, "
                f"MFU {p.mfu:.1%}, peak memory {p.peak_memory_bytes / 2**30:.1f} GiB")

