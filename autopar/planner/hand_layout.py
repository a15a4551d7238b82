"""A hand-written layout priced as written: the Decision ``autopar.evaluate`` prices.

A layout such as Megatron-LM's GPT-3 175B flags (``tp=8, pp=16, dp=8, mbs=1,
recompute=full``) fixes everything but where each op runs; Megatron-LM fixes that too:
column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out, vocabulary-parallel
embedding and head (Shoeybi et al. 2019, section 3; :func:`~autopar.planner.strategies.megatron.megatron_placements`),
sequence parallelism only when the layout turns it on (Korthikanti et al. 2022), layers
split evenly over the pipeline ranks with the embedding on the first and the head on the
last (:func:`~autopar.contract.stages.even_stage_layers`), one recompute mode for every layer. So
:func:`hand_decision` builds that Decision directly, with no CP-SAT search, and
:func:`~autopar.planner.costs.predict.predict` prices it like any plan; :func:`check_fits_memory`
refuses one that does not fit, naming the stage and its bytes.
"""

from __future__ import annotations

from autopar.graph.annotate import TracedModel
from autopar.contract.plan import RECOMPUTE_MODES, Layout, Prediction
from autopar.planner.search.configs import candidate_configs, no_config_message, validate_layout
from autopar.planner.costs.tables import CostTables, cost_tables
from autopar.planner.costs.decision import Decision, InfeasibleError
from autopar.planner.strategies.megatron import megatron_placements
from autopar.contract.support import FULL_SPACE
from autopar.planner.strategies import NodeStrategies, decode_placements, node_strategies
from autopar.contract.stages import even_stage_layers
from autopar.techniques.pipeline_schedules import default_schedule, pipeline_schedule
from autopar.techniques.recompute_modes import mode_recomputing

__all__ = ["complete_hand_layout", "hand_decision", "check_fits_memory"]


def complete_hand_layout(layout: Layout) -> Layout:
    """``layout`` with the defaults a hand layout is priced with: recompute "none", ZeRO
    stage 0, schedule "1f1b" (interleaved 1F1B when v > 1), sequence parallelism off, ep
    and cp 1.
    Raises ValueError when tp, pp, dp or micro_batch_size is missing."""
    if not layout.is_complete():
        raise ValueError("evaluate needs tp, pp, dp and micro_batch_size; use autopar.plan "
                         f"to choose the rest (got {layout})")
    v = layout.virtual_stages or 1
    return Layout(tp=layout.tp, pp=layout.pp, dp=layout.dp,
                  micro_batch_size=layout.micro_batch_size,
                  zero_stage=layout.zero_stage if layout.zero_stage is not None else 0,
                  recompute=layout.recompute or "none",
                  schedule=layout.schedule or default_schedule(v).name,
                  virtual_stages=layout.virtual_stages,
                  sequence_parallel=bool(layout.sequence_parallel), dtype=layout.dtype,
                  grad_dtype=layout.grad_dtype, ep=layout.ep or 1, cp=layout.cp or 1)


def hand_decision(traced: TracedModel, cluster, layout: Layout, global_batch_size: int,
                  stage_layers: list[list[int]] | None = None,
                  recompute: list[str] | None = None
                  ) -> tuple[Decision, CostTables, NodeStrategies]:
    """The Decision of a complete hand ``layout`` (:func:`complete_hand_layout`) for
    ``traced`` on ``cluster`` with B = ``global_batch_size``: Megatron-LM's placements at
    the layout's tp and sequence parallelism, :func:`~autopar.contract.stages.even_stage_layers`,
    the layout's recompute on every layer and its ZeRO stage; with the cost tables and
    strategies that price it. ``stage_layers`` / ``recompute`` (per layer) replace the even
    split and the layout's one mode. Raises ValueError (degrees that do not fit the model,
    the cluster or the batch, a pipeline rule the layout breaks, stages that are not pp·v
    contiguous chunks of the L layers, modes not one per layer: the message says what to
    change)."""
    validate_layout(traced, cluster, layout, global_batch_size)
    why: dict[str, str] = {}
    configs = candidate_configs(traced, cluster, global_batch_size, layout, FULL_SPACE, why,
                                chunks_given=stage_layers is not None)
    if not configs:
        raise ValueError(no_config_message(cluster, global_batch_size, layout, why))
    cfg = configs[0]  # every field pinned: the one config
    strategies = node_strategies(traced, cfg.tp, cfg.sequence_parallel, cfg.ep)
    placements = megatron_placements(traced, cfg.tp, cfg.sequence_parallel, cfg.ep)
    decoded = decode_placements(traced, placements, cfg.tp, cfg.sequence_parallel, cfg.ep)
    L = traced.num_layers
    stage_layers = stage_layers or even_stage_layers(L, cfg.pp, cfg.virtual_stages)
    recompute = recompute or [layout.recompute] * L
    _check_stages(stage_layers, recompute, L, cfg.pp * cfg.virtual_stages)
    decision = Decision(config=cfg, strategy={name: k for name, (k, _) in decoded.items()},
                        stage_layers=stage_layers, recompute=list(recompute),
                        zero_stage=layout.zero_stage, objective_s=0.0, solve_time_s=0.0)
    return decision, cost_tables(traced, strategies, cluster, cfg), strategies


def _check_stages(stage_layers: list[list[int]], recompute: list[str], num_layers: int,
                  chunks: int) -> None:
    """ValueError unless ``stage_layers`` is ``chunks`` contiguous non-empty [first, last)
    chunks covering the ``num_layers`` layers and ``recompute`` names one known mode per
    layer."""
    flat = [edge for chunk in stage_layers for edge in chunk]
    ok = (len(stage_layers) == chunks and flat[:1] == [0] and flat[-1:] == [num_layers]
          and all(lo < hi for lo, hi in stage_layers)
          and all(a[1] == b[0] for a, b in zip(stage_layers, stage_layers[1:])))
    if not ok:
        raise ValueError(f"stage_layers {stage_layers} must be pp*v = {chunks} contiguous "
                         f"non-empty [first, last) chunks of the {num_layers} layers")
    if len(recompute) != num_layers or set(recompute) - set(RECOMPUTE_MODES):
        raise ValueError(f"recompute must name one of {RECOMPUTE_MODES} for each of the "
                         f"{num_layers} layers, got {recompute}")


def check_fits_memory(pred: Prediction, cluster, layout: Layout) -> None:
    """Raise :class:`~autopar.planner.costs.decision.InfeasibleError` when a pipeline stage of
    ``pred`` needs more bytes per GPU than ``cluster``'s device holds, naming the first
    such stage, its bytes by kind and what would lower them. A stage fits when its peak
    plus its memory reserve (``pred.memory_reserve_bytes_by_stage``: context, NCCL,
    temporaries, fragmentation, headroom; :mod:`cost_models.reserve`) is within the
    device's memory, as the solver requires of its own plans."""
    limit = cluster.device.memory_bytes
    reserves = pred.memory_reserve_bytes_by_stage or [{} for _ in pred.memory_bytes_by_stage]
    for i, (stage, reserve) in enumerate(zip(pred.memory_bytes_by_stage, reserves)):
        total, held_back = sum(stage.values()), sum(reserve.values())
        if total + held_back > limit:
            kinds = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in stage.items())
            raise InfeasibleError(
                f"the hand layout {_flags(layout)} does not fit: memory[stage {i}] needs "
                f"{total / 2**30:.1f} GiB per GPU ({kinds} GiB) + a reserve of "
                f"{held_back / 2**30:.1f} GiB > "
                f"{cluster.device.memory_gib:.0f} GiB of {cluster.device.name}; lower it with "
                f"{', '.join(_remedies(layout))}, or let autopar.plan choose")


def _remedies(layout: Layout) -> list[str]:
    """What would lower a complete hand layout's memory, among the knobs it has not turned."""
    most = mode_recomputing("layer")  # keeps the least
    out = [f"recompute={most.name}"] if layout.recompute != most.name else []
    record, fewer = pipeline_schedule(layout.schedule), default_schedule(layout.virtual_stages)
    p, v = max(layout.pp, 2), layout.virtual_stages or 1
    if record.in_flight(p, 0, 2 * p, v) > fewer.in_flight(p, 0, 2 * p, v):
        out += [f"schedule={fewer.name} ({record.title} keeps more micro-batches in flight)"]
    out += ["a higher zero_stage"] if layout.zero_stage < 3 else []
    out += ["a smaller micro_batch_size"] if layout.micro_batch_size > 1 else []
    return out + ["more pp or tp"]


def _flags(layout: Layout) -> str:
    """``tp=8,pp=16,dp=8,mbs=1,...``: the layout's fixed fields."""
    names = {"micro_batch_size": "mbs", "zero_stage": "zero", "virtual_stages": "v",
             "sequence_parallel": "sp"}
    return ",".join(f"{names.get(k, k)}={v}" for k, v in vars(layout).items() if v is not None)
