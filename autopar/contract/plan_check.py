"""The one validator of a saved :class:`~autopar.contract.plan.Plan`, used by every reader.

``Plan.from_json`` / ``Plan.from_dict`` (hence ``autopar report``, ``autopar verify``,
``evaluate_plan`` and ``parallelize``) read a plan through :func:`plan_from_dict`, which
checks it field by field before a Plan exists:

* schema: a JSON object, an autopar ``version`` this code reads (3: older plans were
  planned without the memory reserve and are refused with a PlanError saying so), every
  field present with its type (ints are ints, not bools or floats; numbers finite), no
  unknown field;
* the layout's own arithmetic (:func:`check_plan`): positive degrees, B = d·b·m,
  ``stage_layers`` holding pp·v chunks [first, last) that cover the L layers once in
  order, one recompute mode per layer, the pipeline rule of
  :func:`autopar.contract.support.pipeline_problem` (1F1B m ≥ p, interleaving's divisibility), sequence
  parallelism only with tp > 1, every placement a strategy key.

Readers that execute a plan add ``executable=True`` (ZeRO stage, schedule, v, recompute,
sequence parallelism and dtype inside :data:`autopar.contract.support.RUNTIME_SUPPORT`) and the world
size. What needs the model (its traced node names and placements at the plan's tp, its
layer count, seq_len within its maximum positions, its config) is
:func:`autopar.planner.plan_fit.check_plan_fits_model`. Every failure is a
:class:`PlanError` (a ValueError: exit code 2) naming the file, the field and the fix.

Imports no torch and no planner: the report renders a saved plan with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from pathlib import Path

from autopar.contract.errors import REPLAN, PlanError
from autopar.contract.placement import parse_strategy_key
from autopar.contract.plan_alternatives import Alternative
from autopar.contract.plan import (ATTENTION_KERNELS, DTYPES, GRAD_DTYPES, PLAN_VERSION, RECOMPUTE_MODES, SCHEDULES,
                          SOLVER_STATUSES, ZERO_STAGES, Plan, Prediction, ReplicatedOp, ReplicatedOps,
                          SolverStatus)
from autopar.contract.support import (RUNTIME_SUPPORT, RuntimeSupport, check_executable,
                                     pipeline_problem)
from autopar.techniques.context_parallel import cp_problem
from autopar.techniques.pipeline_schedules import pipeline_schedule
from cost_models.hardware import Cluster

__all__ = ["PlanError", "plan_from_dict", "plan_from_json", "read_plan", "check_plan", "PHASES"]

PHASES = ("forward", "backward", "recompute", "p2p")
"""The keys of each ``Prediction.stage_phase_s`` entry (seconds per micro-batch); a plan
whose schedule splits the backward also has "weight_grad" (:data:`SPLIT_PHASES`)."""
SPLIT_PHASES = PHASES + ("weight_grad",)

VERSION_NOTE = ("version 3 prices the memory reserve: plans of version 2 may not fit a real "
                "GPU and carry no reserve or margin, so they are not read")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _kind(value) -> str:
    return type(value).__name__


def _expect(src: str, name: str, value, ok: bool, want: str) -> None:
    if not ok:
        raise PlanError(src, name, f"must be {want}, got {_kind(value)} {value!r:.80}")


def _number_map(src: str, name: str, value) -> None:
    _expect(src, name, value, isinstance(value, dict), "an object of numbers")
    for k, v in value.items():
        _expect(src, f"{name}.{k}", v, _is_number(v) and v >= 0, "a finite number >= 0")


def _number_list(src: str, name: str, value, length: int | None = None) -> None:
    _expect(src, name, value, isinstance(value, list), "a list of numbers")
    if length is not None and len(value) != length:
        raise PlanError(src, name, f"has {len(value)} entries, one per pipeline stage "
                                   f"expected ({length})")
    for i, v in enumerate(value):
        _expect(src, f"{name}[{i}]", v, _is_number(v) and v >= 0, "a finite number >= 0")


def _check_prediction(src: str, data, pp: int, schedule: str) -> Prediction:
    """``predicted``: every field of :class:`Prediction`, numbers finite and >= 0."""
    _expect(src, "predicted", data, isinstance(data, dict), "an object (a Prediction)")
    _check_keys(src, "predicted", data, Prediction)
    for name in ("step_time_s", "tflops_per_gpu", "mfu", "hfu", "peak_memory_bytes"):
        v = data[name]
        _expect(src, f"predicted.{name}", v, _is_number(v) and v >= 0, "a finite number >= 0")
    for name in ("time_s_by_kind", "comm_bytes_by_kind"):
        _number_map(src, f"predicted.{name}", data[name])
    stages = data["memory_bytes_by_stage"]
    _expect(src, "predicted.memory_bytes_by_stage", stages,
            isinstance(stages, list) and len(stages) == pp, f"a list of {pp} objects")
    for i, stage in enumerate(stages):
        _number_map(src, f"predicted.memory_bytes_by_stage[{i}]", stage)
    _number_list(src, "predicted.stage_time_s", data["stage_time_s"], pp)
    for name in ("memory_reserve_bytes_by_stage", "memory_margin_bytes"):  # version 3
        if name not in data:
            raise PlanError(src, f"predicted.{name}", "is missing (a version 3 Prediction "
                            "carries the memory reserve and margin)")
    reserve = data["memory_reserve_bytes_by_stage"]
    _expect(src, "predicted.memory_reserve_bytes_by_stage", reserve,
            isinstance(reserve, list) and len(reserve) in (0, pp), f"a list of {pp} objects")
    for i, stage in enumerate(reserve):
        _number_map(src, f"predicted.memory_reserve_bytes_by_stage[{i}]", stage)
    margin = data["memory_margin_bytes"]
    _expect(src, "predicted.memory_margin_bytes", margin, _is_number(margin),
            "a finite number (bytes; negative when the plan does not fit)")
    stats = data.get("stage_stats", [])
    _expect(src, "predicted.stage_stats", stats,
            isinstance(stats, list) and all(isinstance(s, dict) for s in stats)
            and len(stats) in (0, pp), f"a list of {pp} objects")
    phases = data.get("stage_phase_s", [])  # absent in plans saved before it existed
    _expect(src, "predicted.stage_phase_s", phases,
            isinstance(phases, list) and len(phases) in (0, pp), f"a list of {pp} objects")
    split = schedule in SCHEDULES and pipeline_schedule(schedule).split_backward
    keys = SPLIT_PHASES if split else PHASES
    for i, stage in enumerate(phases):
        _number_map(src, f"predicted.stage_phase_s[{i}]", stage)
        missing = sorted(set(keys) - set(stage))
        if missing:
            raise PlanError(src, f"predicted.stage_phase_s[{i}]", f"lacks {missing[0]!r} "
                            f"(seconds by phase: {', '.join(keys)})")
    return Prediction(**data)


def _check_keys(src: str, where: str, data: dict, cls) -> None:
    """Every required field of dataclass ``cls`` present in ``data``, no unknown one."""
    known = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise PlanError(src, f"{where}.{missing[0]}" if where else missing[0],
                        f"is missing (a {cls.__name__} needs {', '.join(missing)})")
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(src, f"{where}.{unknown[0]}" if where else unknown[0],
                        f"is not a field of a version {PLAN_VERSION} {cls.__name__} (fields: "
                        f"{', '.join(sorted(known))})")


def _check_solver(src: str, data) -> SolverStatus:
    _expect(src, "solver", data, isinstance(data, dict), "an object (a SolverStatus)")
    _check_keys(src, "solver", data, SolverStatus)
    status = data.get("status", "OPTIMAL")
    _expect(src, "solver.status", status, status in SOLVER_STATUSES, f"one of {SOLVER_STATUSES}")
    for name in ("time_limit_s", "gap"):
        v = data.get(name, 0.0)
        _expect(src, f"solver.{name}", v, _is_number(v) and v >= 0, "a finite number >= 0")
    for name in ("configs", "stopped"):
        v = data.get(name, 0)
        _expect(src, f"solver.{name}", v, _is_int(v) and v >= 0, "an int >= 0")
    return SolverStatus(**data)


REPLICATED_OP_TYPES = {"node": str, "op": str, "kind": str, "section": str, "reason": str,
                       "per_sequence": bool}


def _check_replicated(src: str, data) -> ReplicatedOps:
    """``replicated_ops``: tp, model_flops and two lists of ReplicatedOp records."""
    where = "replicated_ops"
    _expect(src, where, data, isinstance(data, dict), "an object or null")
    _expect(src, f"{where}.tp", data.get("tp"), _is_int(data.get("tp")), "an int")
    _expect(src, f"{where}.model_flops", data.get("model_flops"),
            _is_number(data.get("model_flops")), "a number")
    for group in ("no_strategy", "chosen"):
        ops = data.get(group, [])
        _expect(src, f"{where}.{group}", ops, isinstance(ops, list), "a list")
        for i, op in enumerate(ops):
            name = f"{where}.{group}[{i}]"
            _expect(src, name, op, isinstance(op, dict), "an object (a ReplicatedOp)")
            _check_keys(src, name, op, ReplicatedOp)
            for key, kind in REPLICATED_OP_TYPES.items():
                if key in op:
                    _expect(src, f"{name}.{key}", op[key], isinstance(op[key], kind),
                            kind.__name__)
            for key in ("flops", "share"):
                _expect(src, f"{name}.{key}", op[key], _is_number(op[key]), "a number")
            _expect(src, f"{name}.layer", op["layer"], op["layer"] is None or _is_int(op["layer"]),
                    "an int or null")
    unknown = sorted(set(data) - {"tp", "model_flops", "no_strategy", "chosen"})
    if unknown:
        raise PlanError(src, f"{where}.{unknown[0]}", "is not a field of ReplicatedOps")
    return ReplicatedOps.from_dict(data)


def _check_fields(src: str, data: dict) -> None:
    """Types of the top-level fields (before any arithmetic on them)."""
    for name in ("global_batch_size", "seq_len", "tp", "pp", "dp", "micro_batch_size",
                 "num_micro_batches", "virtual_stages", "ep", "cp"):
        if name in data:
            _expect(src, name, data[name], _is_int(data[name]) and data[name] >= 1,
                    "a positive int")
    checks = [("model", str, "a string"), ("model_config", dict, "an object"),
              ("cluster", dict, "an object (Cluster.to_dict())"),
              ("placements", dict, "an object of node -> strategy key"),
              ("alternatives", list, "a list"), ("binding", list, "a list of strings"),
              ("sequence_parallel", bool, "true or false")]
    for name, kind, want in checks:
        if name in data:
            _expect(src, name, data[name], isinstance(data[name], kind), want)
    choices = [("schedule", SCHEDULES), ("dtype", DTYPES), ("zero_stage", ZERO_STAGES)]
    if data.get("grad_dtype") is not None:
        choices.append(("grad_dtype", GRAD_DTYPES))
    if data.get("attention") is not None:
        choices.append(("attention", ATTENTION_KERNELS))
    for name, allowed in choices:
        if name in data:
            v = data[name]
            _expect(src, name, v, not isinstance(v, bool) and isinstance(v, (int, str))
                    and v in allowed, f"one of {allowed}")
    rec = data["recompute"]
    _expect(src, "recompute", rec, isinstance(rec, list)
            and all(isinstance(m, str) and m in RECOMPUTE_MODES for m in rec),
            f"a list with one of {RECOMPUTE_MODES} per layer")
    for i, alt in enumerate(data.get("alternatives", [])):
        _expect(src, f"alternatives[{i}]", alt, isinstance(alt, dict)
                and isinstance(alt.get("layout"), dict), "an object with a layout object")
        step = alt.get("step_time_s")
        _expect(src, f"alternatives[{i}].step_time_s", step, step is None or _is_number(step),
                "a number or null")
        feasible = alt.get("feasible", True)
        _expect(src, f"alternatives[{i}].feasible", feasible,
                feasible is None or isinstance(feasible, bool), "true, false or null")
        for key in ("tflops_per_gpu", "peak_memory_bytes", "min_memory_bytes"):
            v = alt.get(key)
            _expect(src, f"alternatives[{i}].{key}", v, v is None or _is_number(v),
                    "a number or null")
        _expect(src, f"alternatives[{i}].reason", alt.get("reason", ""),
                isinstance(alt.get("reason", ""), str), "a string")
    _expect(src, "binding", data.get("binding", []),
            all(isinstance(b, str) for b in data.get("binding", [])), "a list of strings")


def plan_from_dict(data, source: str = "plan") -> Plan:
    """The :class:`Plan` of ``data`` (``Plan.to_dict()`` output), after the schema and the
    layout arithmetic are checked (module docstring). ``source`` names the file in messages.
    Raises :class:`PlanError`."""
    src = source
    if not isinstance(data, dict):
        raise PlanError(src, "(top level)", f"must be a JSON object (a saved plan), got "
                                            f"{_kind(data)}", "save one with `autopar plan -o FILE`")
    if "version" not in data:
        keys = ", ".join(map(repr, sorted(data)[:6])) or "none"
        raise PlanError(src, "version", f"is missing: this is not an autopar plan (its keys: "
                                        f"{keys})", "save one with `autopar plan -o FILE`")
    if data["version"] != PLAN_VERSION:
        raise PlanError(src, "version", f"is {data['version']!r}, but this autopar reads version "
                                        f"{PLAN_VERSION} ({VERSION_NOTE})", REPLAN)
    _check_keys(src, "", data, Plan)
    _check_fields(src, data)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["placements"].items()):
        raise PlanError(src, "placements", "must map node names to strategy keys (strings)")
    kwargs = dict(data)
    kwargs["predicted"] = _check_prediction(src, data["predicted"], data["pp"],
                                            data.get("schedule"))
    kwargs["solver"] = _check_solver(src, data.get("solver", {}))
    kwargs["alternatives"] = [Alternative.from_dict(a) for a in data.get("alternatives", [])]
    if data.get("replicated_ops") is not None:
        kwargs["replicated_ops"] = _check_replicated(src, data["replicated_ops"])
    try:
        Cluster.from_dict(data["cluster"])
    except (ValueError, TypeError) as exc:
        raise PlanError(src, "cluster", f"is not a cluster description ({exc})") from None
    plan = Plan(**kwargs)
    check_plan(plan, source=src)
    return plan


def plan_from_json(text: str, source: str = "plan") -> Plan:
    """:func:`plan_from_dict` of JSON ``text``; a JSON syntax error names ``source``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(source, "(top level)", f"is not JSON ({exc})",
                        "save a plan with `autopar plan ... -o FILE`") from None
    return plan_from_dict(data, source)


def read_plan(path, *, world_size: int | None = None, executable: bool = False) -> Plan:
    """The plan saved in the file ``path``, validated (:func:`plan_from_dict`, then
    :func:`check_plan` with ``world_size`` / ``executable``). Raises :class:`PlanError`
    (a missing or unreadable file, bad JSON, an invalid plan), naming the file."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(str(path), "(file)", "does not exist or is not a file",
                        "pass the path of a plan saved with `autopar plan -o FILE`")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(str(path), "(file)", f"cannot be read ({exc})",
                        "pass a plan saved with `autopar plan -o FILE`") from None
    plan = plan_from_json(text, str(path))
    if world_size is not None or executable:
        check_plan(plan, source=str(path), world_size=world_size, executable=executable)
    return plan


def check_plan(plan: Plan, *, source: str = "plan", world_size: int | None = None,
               executable: bool = False, support: RuntimeSupport = RUNTIME_SUPPORT) -> None:
    """Check a Plan's own arithmetic (module docstring); with ``executable`` also that
    the runtime executes every feature (``support``), with ``world_size`` that t·p·d equals
    it. Raises :class:`PlanError` naming the first field that fails and the fix."""
    src, L = source, len(plan.recompute)
    if plan.global_batch_size != plan.dp * plan.micro_batch_size * plan.num_micro_batches:
        raise PlanError(src, "global_batch_size", f"is {plan.global_batch_size} but dp * "
                        f"micro_batch_size * num_micro_batches = {plan.dp} * "
                        f"{plan.micro_batch_size} * {plan.num_micro_batches} = "
                        f"{plan.dp * plan.micro_batch_size * plan.num_micro_batches} (B = d·b·m)")
    _check_stages(plan, src, L)
    problem = pipeline_problem(plan.schedule, plan.pp, plan.num_micro_batches, L,
                               plan.virtual_stages)
    if problem:
        raise PlanError(src, "schedule", f"breaks the pipeline rule: {problem}")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError(src, "sequence_parallel", "is true with tp=1 (sequence parallelism "
                        "splits over the TP group)", "set it to false, or re-plan with --tp")
    folded = plan.tp * plan.cp * plan.dp
    if folded % plan.ep:
        raise PlanError(src, "ep", f"is {plan.ep}, which does not divide tp·cp·dp={folded} "
                        "(expert parallelism folds over the tensor-, context- and "
                        "data-parallel ranks of a stage)", "re-plan with --ep")
    problem = cp_problem(plan.cp, plan.seq_len)
    if problem:
        raise PlanError(src, "cp", f"is {plan.cp}: {problem}", "re-plan with --cp")
    _check_placements(plan, src)
    if world_size is not None and plan.num_gpus != world_size:
        raise PlanError(src, "tp/cp/pp/dp", f"need tp*cp*pp*dp = "
                        f"{plan.tp}*{plan.cp}*{plan.pp}*{plan.dp} = "
                        f"{plan.num_gpus} processes but the world size is {world_size}",
                        f"launch {plan.num_gpus} processes or pass a plan for {world_size}")
    if executable:
        check_executable(plan, support, source=src)


def _check_stages(plan: Plan, src: str, L: int) -> None:
    """pp·v chunks [first, last), contiguous from 0 to L = len(recompute)."""
    chunks, stages = plan.pp * plan.virtual_stages, plan.stage_layers
    ok = isinstance(stages, list) and all(
        isinstance(c, list) and len(c) == 2 and all(_is_int(x) for x in c) for c in stages)
    _expect(src, "stage_layers", stages, ok, "a list of [first, last) integer pairs")
    if len(stages) != chunks:
        raise PlanError(src, "stage_layers", f"has {len(stages)} chunks but pp*virtual_stages "
                        f"= {plan.pp}*{plan.virtual_stages} = {chunks}")
    if L < 1:
        raise PlanError(src, "recompute", "is empty: it holds one mode per layer")
    start = 0
    for c, (lo, hi) in enumerate(stages):
        if lo != start or hi <= lo:
            raise PlanError(src, f"stage_layers[{c}]", f"is [{lo}, {hi}) but must start at layer "
                            f"{start} and hold at least one layer (the chunks cover every "
                            "layer once, in order)")
        start = hi
    if start != L:
        raise PlanError(src, "recompute", f"has {L} entries but stage_layers covers {start} "
                        "layers (one recompute mode per layer)")


def _check_placements(plan: Plan, src: str) -> None:
    """Every placement parses as a strategy key (whether it exists for the model's node at
    tp is :mod:`autopar.planner.plan_fit`'s check)."""
    for node, key in plan.placements.items():
        try:
            parse_strategy_key(key)
        except ValueError as exc:
            raise PlanError(src, f"placements[{node!r}]", f"is not a strategy key ({exc})") \
                from None

