r"""Pipeline schedules, one record each: everything autopar knows about a schedule.

A :class:`PipelineSchedule` owns, for its value of ``Layout.schedule``:

* **the rule**: which (p stages, m micro-batches, v chunks per rank, L layers) it runs
  (:meth:`PipelineSchedule.problem`; the solver, the search, plan files and the runtime
  all ask it);
* **the price**: the activations each stage holds at peak (``in_flight``, a formula of
  :mod:`cost_models.memory`) and the step time of m micro-batches
  (:func:`cost_models.pipeline.pipeline_step_time_s`), with the weight gradients W run in
  the fill and drain when it splits the backward (``split_backward``);
* **the runner**: the ``torch.distributed.pipelining`` schedule class that executes it
  (``runner``), and whether that class takes all of a rank's chunks (``interleaved``);
* **the drawing**: the order in which pipeline rank i runs its forward and backward blocks
  (``order``), from which the report simulates the timeline;
* **the framework mapping**: per target framework, its name for the schedule, or a
  :class:`Refusal` saying why that framework cannot run it.

Adding a schedule is adding a record to :data:`PIPELINE_SCHEDULES`
(``docs/adding-a-technique.md``): ``tests/unit/test_technique_records.py`` fails when a
record lacks any of the five. The orders are
:mod:`autopar.techniques.pipeline_orders`'.

Pure Python over :mod:`cost_models`: the report, the planner and the runtime import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
from dataclasses import dataclass

from cost_models.memory import (all_forwards_in_flight, interleaved_in_flight,
                                one_forward_one_backward_in_flight)
from cost_models.pipeline import pipeline_step_time_s, simulate_orders

from autopar.techniques.answers import FRAMEWORK_TARGETS, Refusal, framework_records, record_for
from autopar.techniques.pipeline_orders import (Order, dualpipe_v_order, gpipe_order,
                                                interleaved_order, one_f_one_b_order,
                                                order_in_flight, zb_h1_order, zb_v_order)

__all__ = ["PipelineSchedule", "Refusal", "PIPELINE_SCHEDULES", "SCHEDULES",
           "DEFAULT_SCHEDULE", "FRAMEWORK_TARGETS", "pipeline_schedule", "default_schedule",
           "framework_schedules", "schedule_for", "interleaved_names", "interleaving_problem",
           "PLACEMENTS"]

PLACEMENTS = ("loop", "v")
"""Where a schedule's p·v model chunks run (:meth:`PipelineSchedule.chunk_rank`)."""


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """One pipeline schedule (module docstring).

    name: the value of ``Layout.schedule`` and ``--schedule``. title: as papers write it.
    source: the paper and section its rule, price and order come from. interleaved: it
    runs v >= 2 model chunks per rank (``virtual_stages``), its runner taking all of a
    rank's chunks; else v = 1. rule: extra reason (p, m, v, L) cannot run, beyond the
    v rule (L None: chunks already cut). in_flight: (p, stage, m, v) -> whole-stage
    micro-batches of activations the stage holds at peak. order: (p, m, rank, v) -> the
    rank's blocks. runner: the ``torch.distributed.pipelining`` class. frameworks: target
    -> its name for the schedule, or a :class:`Refusal`. split_backward: runs each
    backward as B then W (Qi et al. 2024), W filling the bubble: priced with the stages'
    weight-gradient seconds, drawn with "W" blocks. refused_recompute: recompute mode ->
    why this schedule does not run with it (what composes with what). placement: which
    pipeline rank runs which model chunk, one of :data:`PLACEMENTS`
    (:meth:`chunk_rank`); ``order`` numbers a rank's chunks in the ascending order of
    :meth:`rank_chunks`.
    """

    name: str
    title: str
    source: str
    interleaved: bool
    rule: Callable[[int, int, int, int | None], str | None]
    in_flight: Callable[[int, int, int, int], float]
    order: Callable[[int, int, int, int], Order]
    runner: str
    frameworks: Mapping[str, str | Refusal]
    split_backward: bool = False
    refused_recompute: Mapping[str, str] = dataclasses.field(default_factory=dict)
    placement: str = "loop"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"schedule {self.name!r}: placement {self.placement!r} is not one "
                             f"of {PLACEMENTS}")

    def chunk_rank(self, chunk: int, pp: int, num_chunks: int) -> int:
        """The pipeline rank that runs model chunk ``chunk`` of ``num_chunks`` (p·v):
        "loop", chunk c on rank c % p (Megatron-LM's round-robin; v = 1: chunk i on rank
        i); "v", chunk c < p on rank c and chunk c >= p on rank 2p - 1 - c (Qi et al. 2024,
        section 6: rank 0 holds the first and the last chunk)."""
        if self.placement == "v" and chunk >= pp:
            return num_chunks - 1 - chunk
        return chunk % pp

    def head_rank(self, pp: int, virtual_stages: int = 1) -> int:
        """The pipeline rank of the last model chunk (the head and the loss): p - 1, or 0
        under the V placement, where the first rank holds both ends of the model."""
        return self.chunk_rank(pp * virtual_stages - 1, pp, pp * virtual_stages)

    def head_in_flight(self, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> int:
        """Micro-batches whose loss tensors (the cross-entropy's saved fp32 softmax) the head
        rank holds at once: the most forwards of the last chunk whose "B" or "BW" has not
        run (GPipe: m; others 1). A split backward frees them at B."""
        return _order_peaks(self.name, pp, num_micro_batches, virtual_stages)[1]

    def head_weight_inputs_in_flight(self, pp: int, num_micro_batches: int,
                                     virtual_stages: int = 1) -> int:
        """Micro-batches whose head-section tensors other than the loss's (the final norm's
        and the output layer's inputs) the head rank holds at once: as
        :meth:`head_in_flight`, but a split backward holds them to the chunk's "W" (torch
        keeps them for the weight gradients: ZB-H1 defers the head's W by up to p - 1
        micro-batches; measured with ``benchmarks/split_backward_memory.py``)."""
        return _order_peaks(self.name, pp, num_micro_batches, virtual_stages)[2]

    def rank_chunks(self, pp: int, num_chunks: int, rank: int) -> list[int]:
        """The model chunks pipeline rank ``rank`` runs, ascending (its local order: chunk
        j of the rank's list is its j-th ``PipelineStage``)."""
        return [c for c in range(num_chunks) if self.chunk_rank(c, pp, num_chunks) == rank]

    def problem(self, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                num_layers: int | None = None) -> str | None:
        """Why this schedule cannot run p = ``pp`` stages over m = ``num_micro_batches``
        micro-batches with v = ``virtual_stages`` chunks per rank of an L = ``num_layers``
        layer model, or None (``num_layers`` None skips the layer-count rule)."""
        v = virtual_stages
        if not self.interleaved and v != 1:
            return (f"virtual_stages={v} needs schedule {interleaved_names()}, got "
                    f"{self.name!r}; use virtual_stages=1")
        return self.rule(pp, num_micro_batches, v, num_layers)

    def recompute_modes(self, modes: tuple[str, ...]) -> tuple[str, ...]:
        """The recompute ``modes`` this schedule runs with (those it does not refuse)."""
        return tuple(m for m in modes if m not in self.refused_recompute)

    def step_time_s(self, stage_times_s: list[float], num_micro_batches: int,
                    virtual_stages: int = 1, p2p_time_s: float = 0.0,
                    weight_grad_s: list[float] | None = None,
                    forward_s: list[float] | None = None) -> float:
        """Seconds of one pipelined step. Closed form
        (:func:`cost_models.pipeline.pipeline_step_time_s`: GPipe and 1F1B run the same
        work in the same dependency order and share it, interleaving shortens the fill and
        drain v times, a split backward runs the stages' weight gradients
        ``weight_grad_s`` (seconds per micro-batch, part of ``stage_times_s``) in them);
        a V placement has none (Qi et al. 2024, section 6: zero bubble only when F = B =
        W), so its price is the makespan of its own order
        (:func:`cost_models.pipeline.simulate_orders`), which needs the stages' forward
        seconds ``forward_s`` (part of ``stage_times_s``). ValueError when a
        split-backward schedule gets no ``weight_grad_s`` or a V one no ``forward_s``."""
        if self.split_backward and weight_grad_s is None:
            raise ValueError(f"schedule {self.name!r} splits the backward: pass weight_grad_s")
        if self.placement == "loop":
            return pipeline_step_time_s(stage_times_s, num_micro_batches, virtual_stages,
                                        p2p_time_s,
                                        weight_grad_s if self.split_backward else None)
        if forward_s is None:
            raise ValueError(f"schedule {self.name!r} is priced by its order: pass forward_s")
        p, m, v = len(stage_times_s), num_micro_batches, virtual_stages
        chunks = [self.rank_chunks(p, p * v, i) for i in range(p)]
        blocks = simulate_orders([self.order(p, m, i, v) for i in range(p)],
                                 lambda i, c: chunks[i][c], forward_s,
                                 [t - f for t, f in zip(stage_times_s, forward_s)],
                                 recompute_s=[0.0] * p, weight_grad_s=weight_grad_s,
                                 p2p_time_s=p2p_time_s, virtual_stages=v)
        return max((b[4] + b[6] for rank in blocks for b in rank), default=0.0)

    def framework_name(self, target: str) -> str:
        """``target``'s name for this schedule. Raises ValueError with the record's reason
        when ``target`` cannot run it, or when the record does not answer for ``target``."""
        answer = self.frameworks.get(target)
        if answer is None:
            raise ValueError(f"pipeline schedule {self.name!r} has no answer for framework "
                             f"{target!r} (one of {sorted(self.frameworks)})")
        if isinstance(answer, Refusal):
            raise ValueError(f"{target} cannot run pipeline schedule {self.name!r}: "
                             f"{answer.reason}")
        return answer


@functools.lru_cache(maxsize=4096)
def _order_peaks(name: str, pp: int, m: int, v: int) -> tuple[tuple[float, ...], int, int]:
    """(each rank's :func:`order_in_flight`, :meth:`PipelineSchedule.head_in_flight`,
    :meth:`PipelineSchedule.head_weight_inputs_in_flight`) of schedule ``name``'s orders
    (kept: the search and the oracle ask per rank and plan)."""
    record = pipeline_schedule(name)
    orders = [record.order(pp, m, i, v) for i in range(pp)]
    head = record.head_rank(pp, v)
    chunk = record.rank_chunks(pp, pp * v, head).index(pp * v - 1)
    head_blocks = [b for b in orders[head] if b[2] == chunk]
    return (tuple(order_in_flight(order, v) for order in orders),
            round(order_in_flight([b for b in head_blocks if b[0] != "W"], 1)),  # to B
            round(order_in_flight(head_blocks, 1)))  # to W (B when the backward is whole)


def _no_rule(pp: int, m: int, v: int, num_layers: int | None) -> None:
    return None


def _one_f_one_b_rule(pp: int, m: int, v: int, num_layers: int | None) -> str | None:
    if pp > 1 and m < pp:
        return (f"1F1B needs at least as many micro-batches as stages: m={m} < p={pp}; raise "
                f"num_micro_batches to {pp} or use schedule='gpipe'")
    return None


def _zb_h1_rule(pp: int, m: int, v: int, num_layers: int | None) -> str | None:
    """p > 1, 1F1B's m >= p, and torch's round rule: m a multiple of its rounds
    max(1, m // p)."""
    if pp < 2:
        return f"ZB-H1 needs pp > 1 (one stage has no bubble to fill), got pp={pp}; use 1f1b"
    problem = _one_f_one_b_rule(pp, m, v, num_layers)
    if problem:
        return problem.replace("1F1B", "ZB-H1", 1)
    rounds = max(1, m // pp)
    if m % rounds:
        return (f"ZB-H1 runs m micro-batches in max(1, m // p) rounds of equal size: m={m}, "
                f"p={pp}; choose m a multiple of p or schedule='1f1b'")
    return None


def _zb_v_rule(pp: int, m: int, v: int, num_layers: int | None) -> str | None:
    """p > 1, exactly 2 chunks per rank (torch's ZBV), 2p equal chunks of the layers."""
    if pp < 2:
        return f"ZB-V needs pp > 1 (one stage has no bubble to fill), got pp={pp}; use 1f1b"
    if v != 2:
        return (f"ZB-V runs exactly 2 model chunks per rank (a V), got virtual_stages={v}; "
                "use virtual_stages=2")
    if num_layers is not None and num_layers % (2 * pp):
        return (f"ZB-V cuts the {num_layers} layers into 2*pp = {2 * pp} equal chunks, but "
                f"{num_layers} is not divisible by {2 * pp}; choose pp with 2*pp dividing the "
                "layer count or schedule='zb_h1'")
    return None


def _dualpipe_v_rule(pp: int, m: int, v: int, num_layers: int | None) -> str | None:
    """ZB-V's rules (p > 1, the V of 2 chunks, 2p equal chunks) and torch's m >= 2p."""
    problem = _zb_v_rule(pp, m, v, num_layers)
    if problem:
        return problem.replace("ZB-V", "DualPipeV").replace("schedule='zb_h1'", "schedule='zb_v'")
    if m < 2 * pp:
        return (f"DualPipeV needs at least as many micro-batches as its 2*pp = {2 * pp} chunks, "
                f"got m={m}; raise num_micro_batches to {2 * pp} or use schedule='zb_v'")
    return None


def interleaving_problem(num_layers: int | None, pp: int, virtual_stages: int,
                         num_micro_batches: int) -> str | None:
    """Why interleaved 1F1B with v = ``virtual_stages`` chunks per rank cannot run, or None.

    The rules (Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``; Narayanan et al.
    2021, section 2.2.2): p > 1 (with one rank the chunks would not interleave), v >= 2
    (v = 1 is plain 1F1B), L divisible by p·v (p·v equal chunks of L/(p·v) layers; chunk c
    runs on pipeline rank c % p), m divisible by p (the schedule runs rounds of p
    micro-batches).
    """
    L, p, v, m = num_layers, pp, virtual_stages, num_micro_batches
    if p < 2:
        return f"interleaved 1F1B needs pp > 1, got pp={p}; use schedule='1f1b'"
    if v < 2:
        return (f"interleaved 1F1B needs virtual_stages >= 2, got v={v} (v=1 is plain "
                "1F1B: use schedule='1f1b')")
    if L is not None and L % (p * v):
        ok = [k for k in range(2, L // p + 1) if L % (p * k) == 0]
        return (f"interleaved 1F1B cuts the {L} layers into pp*v = {p}*{v} equal chunks, but "
                f"{L} is not divisible by {p * v}; choose virtual_stages in {ok or '(none)'} "
                "or schedule='1f1b'")
    if m % p:
        return (f"interleaved 1F1B needs num_micro_batches divisible by pp: m={m}, pp={p}; "
                f"choose m in multiples of {p} (global batch = dp * micro_batch_size * m) or "
                "schedule='1f1b'")
    return None


_SPLIT_BACKWARD_RECOMPUTES = (
    "torch's split backward (torch.distributed.pipelining) recomputes a fully checkpointed "
    "layer in the input-gradient pass and again for each group of weights in the "
    "weight-gradient pass: more recompute time and tensor-parallel traffic than a plan "
    "prices; use recompute 'selective' or 'none', or schedule='1f1b'")
_MEGATRON_1F1B_ONLY = Refusal("Megatron-LM's pipeline runs 1F1B, interleaved with "
                              "--num-layers-per-virtual-pipeline-stage; it has no GPipe")
_MEGATRON_NO_ZERO_BUBBLE = Refusal("Megatron-LM's pipeline runs 1F1B and interleaved 1F1B; "
                                   "it has no zero-bubble schedule")
_DEEPSPEED_1F1B_ONLY = Refusal("DeepSpeed's PipelineEngine runs its TrainSchedule (1F1B) only")

PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (
    PipelineSchedule(
        name="gpipe", title="GPipe", source="Huang et al. 2019; Narayanan et al. 2021 §2.2",
        interleaved=False, rule=_no_rule,
        in_flight=lambda p, i, m, v: all_forwards_in_flight(p, i, m),
        order=gpipe_order, runner="ScheduleGPipe",
        frameworks={"megatron": _MEGATRON_1F1B_ONLY, "torchtitan": "GPipe",
                    "deepspeed": _DEEPSPEED_1F1B_ONLY}),
    PipelineSchedule(
        name="1f1b", title="1F1B", source="PipeDream-flush, Narayanan et al. 2021 §2.2.1",
        interleaved=False, rule=_one_f_one_b_rule,
        in_flight=lambda p, i, m, v: one_forward_one_backward_in_flight(p, i, m),
        order=one_f_one_b_order, runner="Schedule1F1B",
        frameworks={"megatron": "1F1B", "torchtitan": "1F1B", "deepspeed": "TrainSchedule"}),
    PipelineSchedule(
        name="interleaved_1f1b", title="interleaved 1F1B",
        source="Narayanan et al. 2021 §2.2.2", interleaved=True,
        rule=lambda p, m, v, L: interleaving_problem(L, p, v, m),
        in_flight=interleaved_in_flight, order=interleaved_order,
        runner="ScheduleInterleaved1F1B",
        frameworks={"megatron": "interleaved 1F1B (--num-layers-per-virtual-pipeline-stage)",
                    "torchtitan": "Interleaved1F1B",
                    "deepspeed": Refusal("DeepSpeed's PipelineEngine runs one model chunk "
                                         "per stage (TrainSchedule, 1F1B)")}),
    PipelineSchedule(
        name="zb_h1", title="ZB-H1", source="Qi et al. 2024, ICLR, section 3.1",
        interleaved=False, split_backward=True, rule=_zb_h1_rule,
        in_flight=lambda p, i, m, v: _order_peaks("zb_h1", p, m, v)[0][i],
        order=zb_h1_order, runner="ScheduleInterleavedZeroBubble",
        refused_recompute={"full": _SPLIT_BACKWARD_RECOMPUTES},
        frameworks={"megatron": _MEGATRON_NO_ZERO_BUBBLE,
                    "torchtitan": Refusal(
                        "torchtitan builds at least 2 stages per rank for a multi-stage "
                        "schedule such as InterleavedZeroBubble (pipeline_module_split); "
                        "ZB-H1 is one stage per rank"),
                    "deepspeed": _DEEPSPEED_1F1B_ONLY}),
    PipelineSchedule(
        name="zb_v", title="ZB-V", source="Qi et al. 2024, ICLR, section 6",
        interleaved=True, split_backward=True, placement="v", rule=_zb_v_rule,
        in_flight=lambda p, i, m, v: _order_peaks("zb_v", p, m, v)[0][i],
        order=zb_v_order, runner="ScheduleZBVZeroBubble",
        refused_recompute={"full": _SPLIT_BACKWARD_RECOMPUTES},
        frameworks={"megatron": _MEGATRON_NO_ZERO_BUBBLE,
                    "torchtitan": "ZBVZeroBubble",
                    "deepspeed": _DEEPSPEED_1F1B_ONLY}),
    PipelineSchedule(
        name="dualpipe_v", title="DualPipeV",
        source="DeepSeek-AI 2024, DeepSeek-V3 technical report, section 3.2.1",
        interleaved=True, split_backward=True, placement="v", rule=_dualpipe_v_rule,
        in_flight=lambda p, i, m, v: _order_peaks("dualpipe_v", p, m, v)[0][i],
        order=dualpipe_v_order, runner="ScheduleDualPipeV",
        refused_recompute={"full": _SPLIT_BACKWARD_RECOMPUTES},
        frameworks={"megatron": Refusal("Megatron-LM's pipeline runs 1F1B and interleaved "
                                        "1F1B; it has no DualPipe"),
                    "torchtitan": "DualPipeV",
                    "deepspeed": _DEEPSPEED_1F1B_ONLY}),
)}
"""Schedule name -> its record, in the order the CLI and errors list them."""

SCHEDULES: tuple[str, ...] = tuple(PIPELINE_SCHEDULES)
"""The values of ``Layout.schedule``."""

DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a layout that names none and has v = 1 (Megatron-LM's default)."""


def interleaved_names() -> str:
    """The interleaved schedules' names for a message: "'interleaved_1f1b'" (joined by
    " or " when there are more)."""
    return " or ".join(repr(s.name) for s in PIPELINE_SCHEDULES.values() if s.interleaved)


def pipeline_schedule(name: str) -> PipelineSchedule:
    """The record of schedule ``name``. Raises ValueError naming the schedules there are."""
    try:
        return PIPELINE_SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"pipeline schedule {name!r} is not one of {SCHEDULES}") from None


def framework_schedules(target: str) -> tuple[str, ...]:
    """The schedules framework ``target`` runs: those whose record names it there."""
    return tuple(s.name for s in framework_records(PIPELINE_SCHEDULES.values(), target))


def schedule_for(target: str, framework_name: str) -> PipelineSchedule:
    """The record framework ``target`` calls ``framework_name``. Raises ValueError naming the
    names ``target`` has for the schedules autopar prices."""
    return record_for(PIPELINE_SCHEDULES.values(), target, framework_name, "pipeline schedule")


def default_schedule(virtual_stages: int | None) -> PipelineSchedule:
    """The schedule a layout with v = ``virtual_stages`` and no schedule runs: 1F1B, or the
    first interleaved schedule when v > 1."""
    if (virtual_stages or 1) > 1:
        return next(s for s in PIPELINE_SCHEDULES.values() if s.interleaved)
    return PIPELINE_SCHEDULES[DEFAULT_SCHEDULE]
