r"""Per pipeline rank → per step: the arithmetic the CP-SAT model, ``predict`` and the
exhaustive oracle share (each walks the graph its own way, then calls these).

For pipeline rank i holding :math:`P_i` parameters (the tied weight counted once when
both ends share a rank, :func:`counts_tied_weight_once`), whose last micro-batch's backward takes
:math:`B_i` seconds, under ZeRO stage z over d data-parallel ranks:

* exposed DP time :math:`T_{dp} = \max_i \max((1 - f)\,\delta_z P_i,\ \delta_z P_i - B_i)`:
  bucketed gradient reduction overlaps the last backward and only the rest shows (PyTorch
  DDP / Megatron), as far as the device lets communication run beside compute (the
  fraction f, ``DeviceSpec.comm_overlap``: 1 on GPUs, where this is
  :math:`\max(0, \delta_z P_i - B_i)`),
  :math:`\delta_z` = :func:`~autopar.planner.costs.tables.dp_comm_s_per_param`, plus the
  latency the bucketed rate leaves out (``CostTables.dp_latency_s[z]``);
* optimizer time :math:`T_{opt} = \max_i \omega_z P_i`,
  :math:`\omega_z` = :func:`~autopar.planner.costs.tables.optimizer_s_per_param`;
* step time = pipeline time (``cost_models.pipeline``) + :math:`T_{dp}` + :math:`T_{opt}` +
  the all-reduces closing the step (``CostTables.step_end_s``);
* memory of rank i, bytes: model states by kind (Rajbhandari et al. 2020, Fig. 1: ZeRO
  shards optimizer states from stage 1, gradients from 2, parameters at 3) + activations.

The CP-SAT model needs the same quantities as integers: memory in KiB (:data:`KIB`),
parameters in units of :data:`PARAM_UNIT`, and the memory row multiplied by d·v so that every
coefficient is an integer (:func:`scaled_memory`).
"""

from __future__ import annotations


from autopar.planner.costs.tables import (Config, CostTables, bytes_per_param, dp_comm_s_per_param,
                                         expert_data_parallel,
                                         optimizer_s_per_param, state_bytes)
from autopar.planner.strategies import tied_groups
from autopar.techniques.expert_parallel import expert_data_parallel_size
from autopar.techniques.pipeline_schedules import pipeline_schedule

__all__ = ["KIB", "PARAM_UNIT", "expert_dp_saving_s_per_param",
           "expert_optimizer_extra_s_per_param", "expert_state_kib_times_d", "head_rank", "counts_tied_weight_once", "tied_param_numel", "exposed_dp_s",
           "optimizer_s", "step_time_s", "model_state_bytes_by_kind", "state_kib_times_d",
           "in_flight_times_v", "scaled_memory", "scaled_memory_limit"]

KIB = 1024
"""Bytes per memory unit of the CP-SAT model (memory rows are integer KiB)."""
PARAM_UNIT = 1024
"""Parameters per unit of the CP-SAT model (counts rounded up), so that parameter units
times bytes per parameter are KiB."""


def head_rank(cfg: Config) -> int:
    """The pipeline rank holding the post section (head and loss) under ``cfg``'s schedule:
    p - 1, or 0 under a V placement (the schedule record's ``head_rank``). The pre section
    (embedding) is always on rank 0."""
    return pipeline_schedule(cfg.schedule).head_rank(cfg.pp, cfg.virtual_stages)


def counts_tied_weight_once(cfg: Config) -> bool:
    """The tied weight (token embedding = lm_head) sits in both the pre and the post
    section; when both are on one rank (p == 1, or a V placement: :func:`head_rank` 0) it
    is one tensor, so the rank's parameter count subtracts it once
    (:func:`tied_param_numel`)."""
    return head_rank(cfg) == 0


def tied_param_numel(traced, tables: CostTables, choice: dict[str, int]) -> float:
    """Parameter elements (per GPU, under the chosen TP strategies ``choice``) of the tied
    weights the post section shares with the pre section."""
    return sum(tables.node[g[-1]][choice[g[-1]]].param_numel for g in tied_groups(traced)
               if g[-1] in traced.post)


def exposed_dp_s(zero_stage: int, cluster, cfg: Config, params: list[float],
                 bwd_s: list[float | tuple[float, ...]],
                 expert_params: list[float] | None = None) -> float:
    """Seconds of DP communication not hidden behind the backward of the last micro-batch,
    max over pipeline ranks: :math:`\\max_i \\max((1 - f)\\delta_z P_i, \\delta_z P_i - B_i)`
    with f the device's ``comm_overlap``. ``params``: :math:`P_i` (elements); ``bwd_s``:
    :math:`B_i`, backward compute + TP communication of one micro-batch on rank i
    (seconds), or its parts, subtracted one after the other. ``expert_params``: per rank,
    the part of :math:`P_i` that expert parallelism holds (:math:`X_i`, reduced over the
    expert-data-parallel group at its own rate :math:`\\delta_e`: :math:`\\delta_z (P_i -
    X_i) + \\delta_e X_i` in place of :math:`\\delta_z P_i`)."""
    per_param = dp_comm_s_per_param(zero_stage, cluster, cfg)
    serial = 1.0 - cluster.device.comm_overlap
    saving = expert_dp_saving_s_per_param(cluster, cfg, zero_stage)
    work = [per_param * pa - saving * x
            for pa, x in zip(params, expert_params or [0.0] * len(params))]
    return max(max(serial * w, _minus(w, bw)) for w, bw in zip(work, bwd_s))


def expert_dp_saving_s_per_param(cluster, cfg: Config, zero_stage: int = 0) -> float:
    """Seconds per step that one expert parameter's gradient reduction (ZeRO stage
    ``zero_stage``) saves under expert parallelism: the DP group's rate less the
    expert-data-parallel group's (t·d/ep ranks,
    :func:`~autopar.planner.costs.tables.expert_data_parallel`; negative when that group
    is the slower); 0 at ep = 1."""
    if cfg.ep == 1:
        return 0.0
    return (dp_comm_s_per_param(zero_stage, cluster, cfg)
            - dp_comm_s_per_param(zero_stage, cluster, expert_data_parallel(cfg)))


def expert_optimizer_extra_s_per_param(cluster, cfg: Config, zero_stage: int) -> float:
    """Seconds of the optimizer step that one expert parameter adds beyond a dense one's
    under ZeRO stage ``zero_stage``: its states are sharded over the expert-data-parallel
    group (t·d/ep ranks) instead of the d DP ranks (Megatron-Core's distributed optimizer
    shards expert states over that group); 0 at ep = 1 or ZeRO-0."""
    if cfg.ep == 1:
        return 0.0
    return (optimizer_s_per_param(zero_stage, cluster, expert_data_parallel(cfg))
            - optimizer_s_per_param(zero_stage, cluster, cfg))


def _minus(x: float, parts: float | tuple[float, ...]) -> float:
    for part in parts if isinstance(parts, tuple) else (parts,):
        x -= part
    return x


def optimizer_s(zero_stage: int, cluster, cfg: Config, params: list[float],
                expert_params: list[float] | None = None) -> float:
    """Seconds of the optimizer step, max over ranks: :math:`\\max_i \\omega_z P_i +
    (\\omega_{z,e} - \\omega_z) X_i` (``expert_params``: :math:`X_i`, see
    :func:`expert_optimizer_extra_s_per_param`)."""
    per_param = optimizer_s_per_param(zero_stage, cluster, cfg)
    extra = expert_optimizer_extra_s_per_param(cluster, cfg, zero_stage)
    return max(per_param * pa + extra * x
               for pa, x in zip(params, expert_params or [0.0] * len(params)))


def step_time_s(stage_s: list[float], params: list[float], bwd_s: list,
                tables: CostTables, cluster, cfg: Config, zero_stage: int, *,
                wgrad_s: list[float] | None = None,
                forward_s: list[float] | None = None,
                expert_params: list[float] | None = None) -> tuple[float, float, float, float]:
    """(step, pipeline, exposed DP, optimizer) seconds of one optimizer step from per-rank
    forward+backward seconds of one micro-batch ``stage_s``, parameters and backward
    seconds (:func:`exposed_dp_s`). The pipeline time is ``cost_models.pipeline``'s for
    ``cfg``'s schedule, m micro-batches, v chunks, the stage-to-stage send ``p2p_s`` and,
    for a schedule that splits the backward, the per-rank weight-gradient seconds
    ``wgrad_s`` (part of ``stage_s``) and, for one priced by its order (a V placement),
    the per-rank forward seconds ``forward_s``; ``expert_params``: :func:`exposed_dp_s`'s; the DP time adds ``tables.dp_latency_s``, the step
    the closing ``tables.step_end_s``."""
    pipe = pipeline_schedule(cfg.schedule).step_time_s(stage_s, cfg.num_micro_batches,
                                                       cfg.virtual_stages, tables.p2p_s,
                                                       wgrad_s, forward_s)
    dp_s = exposed_dp_s(zero_stage, cluster, cfg, params, bwd_s, expert_params) \
        + tables.dp_latency_s[zero_stage]
    opt_s = optimizer_s(zero_stage, cluster, cfg, params, expert_params)
    return pipe + dp_s + opt_s + tables.step_end_s, pipe, dp_s, opt_s


def model_state_bytes_by_kind(params: float, zero_stage: int, cfg: Config,
                              expert_params: float = 0.0) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer states for ``params`` elements,
    ``expert_params`` of them experts under expert parallelism: ZeRO shards optimizer
    states (z >= 1), gradients (z >= 2) and parameters (z = 3) over d, the experts' over
    the t·d/ep ranks of their expert-data-parallel group (Rajbhandari et al. 2020, Fig. 1);
    bytes per parameter from :func:`~autopar.planner.costs.tables.state_bytes`. ZeRO-1/2
    shard one flat buffer padded to a multiple of d elements (the runtime's
    ``DistributedOptimizer``, as Megatron's), so the dense ``params`` count padded."""
    b = state_bytes(cfg.dtype, cfg.grad_dtype, zero_stage)
    out = dict.fromkeys(("parameters", "gradients", "optimizer_states"), 0.0)
    e = expert_data_parallel_size(cfg.tp, cfg.dp, cfg.ep)
    dense = params - expert_params
    if zero_stage in (1, 2) and cfg.dp > 1 and dense == int(dense):
        dense = -(-int(dense) // cfg.dp) * cfg.dp
    for n, d in ((dense, cfg.dp), (expert_params, e)):
        out["parameters"] += n * b.param / (d if zero_stage >= 3 else 1)
        out["gradients"] += n * b.grad / (d if zero_stage >= 2 else 1)
        out["optimizer_states"] += n * b.optimizer / (d if zero_stage >= 1 else 1)
    return out


def state_kib_times_d(zero_stage: int, cfg: Config) -> int:
    """Model-state KiB per :data:`PARAM_UNIT` parameters, times d: an exact integer
    (bf16: 16d, 4d + 12, 2d + 14, 16 for ZeRO 0..3; fp32 gradients 18d, 6d + 12, 2d + 16,
    16)."""
    return round(bytes_per_param(zero_stage, cfg.dp, cfg.dtype, cfg.grad_dtype) * cfg.dp)


def expert_state_kib_times_d(zero_stage: int, cfg: Config) -> int:
    """What an expert parameter unit adds to :func:`state_kib_times_d` under expert
    parallelism: its states sharded over the t·d/ep ranks of its expert-data-parallel group
    instead of d (negative when that group is the larger); 0 at ep = 1 or ZeRO-0."""
    if cfg.ep == 1:
        return 0
    e = expert_data_parallel_size(cfg.tp, cfg.dp, cfg.ep)
    return round(bytes_per_param(zero_stage, e, cfg.dtype, cfg.grad_dtype) * cfg.dp) \
        - state_kib_times_d(zero_stage, cfg)


def in_flight_times_v(cfg: Config, rank: int) -> int:
    """Micro-batches whose activations rank ``rank`` holds at once, times v: an exact
    integer, chunk forwards in flight (the schedule record's ``in_flight``)."""
    inflight = pipeline_schedule(cfg.schedule).in_flight(cfg.pp, rank, cfg.num_micro_batches,
                                                         cfg.virtual_stages)
    return round(inflight * cfg.virtual_stages)


def scaled_memory(cfg: Config, rank: int, state_kib_d, act_kib, working_kib):
    """Rank ``rank``'s memory in KiB times d·v, with integer coefficients:
    :math:`v \\cdot S + d\\,(\\lfloor\\text{inflight}\\cdot v\\rceil \\cdot A + v\\,W)`, where
    ``state_kib_d`` S is model-state KiB times d (:func:`state_kib_times_d` × parameter
    units), ``act_kib`` A the activations kept per micro-batch in flight and
    ``working_kib`` W those held once (the working layer, the head and loss). Works on
    ints and on CP-SAT linear expressions alike."""
    v, d = cfg.virtual_stages, cfg.dp
    return v * state_kib_d + d * (in_flight_times_v(cfg, rank) * act_kib + v * working_kib)


def scaled_memory_limit(memory_bytes: float, cfg: Config) -> int:
    """``memory_bytes`` (what a rank may use: device memory less the reserve,
    :func:`autopar.planner.costs.reserve.usable_bytes`) in KiB, rounded down, times d·v: the
    right-hand side of :func:`scaled_memory` ≤ limit."""
    return int(memory_bytes // KIB) * cfg.dp * cfg.virtual_stages
