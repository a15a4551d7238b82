"""``autopar.dry_run``: build any rank's program at the plan's full size on one CPU, and
check it against the plan before a cluster is booked.

For each rank asked for, in this process and one rank at a time:

1. the plan is checked against the model locally (:func:`autopar.recipe.checked_trace`);
2. the process becomes rank R of a world of the plan's size on torch's "fake" process group
   (every collective returns at once, moving nothing) and builds the plan's process groups
   there as :func:`autopar.parallelize` does (tp/pp/dp/cp/ep peers, DeviceMesh);
3. under ``FakeTensorMode`` (tensors with shapes and dtypes, no storage), the rank's
   program is built exactly as :func:`autopar.parallelize` builds it (rewrite, shards,
   ZeRO-0/1 buffers, optimizer) and runs two whole training steps: every micro-batch
   through the plan's schedule, the gradient reductions and the optimizer step; the second
   is measured (the first also carries torch.distributed.pipelining's one-time warm-up vote
   between neighbouring stages, as on a cluster);
4. what the step measured (:meth:`~autopar.recipe.ParallelizedModel.last_step_stats`: the
   payload bytes of every collective by kind, the model states held, the peak of the
   activations saved for backward, counted on the live fake storages) is compared with
   the plan's prediction for the rank's stage (``Plan.predicted.stage_stats``): bytes and
   model states exactly, saved activations within :data:`ACTIVATION_TOLERANCE`.

Ranks that run the same program up to their position in the tp, cp and dp groups are
alike: :func:`rank_classes` keeps one rank per pipeline rank (the first of its tp/cp/dp
block), so a plan's dry run builds at most p programs. A plan that cannot be built at its
size (a stage without layers, a dimension TP cannot split) fails here on one CPU with the
rank and the op named (:class:`DryRunError`), not on the cluster.

Left out (refused by name): expert parallelism (the routing's all-to-all splits are data,
which fake tensors do not hold) and ZeRO-3 (FSDP2's sharded parameters do not materialise
on fake tensors yet). The loss and the gradient norm have no values (read as 0).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.contract.plan import Plan
from autopar import recipe
from autopar.runtime.compat import FakeTensorMode, TorchDispatchMode, init_fake_process_group
from autopar.runtime.materialize import Initializer, on_meta
from autopar.runtime.mesh import ParallelGroups
from autopar.techniques.pipeline_schedules import pipeline_schedule
from autopar.techniques.zero_stages import zero_stage

__all__ = ["dry_run", "dry_run_rank", "rank_classes", "place", "RankCheck", "DryRunReport", "DryRunError",
           "ACTIVATION_TOLERANCE"]

ACTIVATION_TOLERANCE = 0.05  # issue 36: the saved-activation peak within 5% of the prediction


class DryRunError(RuntimeError):
    """A rank's program could not be built or stepped at the plan's size: the message
    names the rank, its place (stage, tp/cp/dp ranks) and the error of the op that failed."""


@dataclass(frozen=True)
class RankCheck:
    """One rank's dry run against its stage's prediction.

    rank: the global rank; stage, tp_rank, cp_rank, dp_rank: its coordinates.
    layers: the transformer layers its model chunks hold (global indices, in order).
    peers: axis ("tp", "cp", "dp", "pp", "ep") -> the global ranks of its group.
    measured, predicted: ``comm_bytes`` (kind -> payload bytes of one step),
        ``model_state_bytes`` and ``saved_activation_bytes`` (bytes).
    wall_s: seconds the build and the step took on this machine.
    """

    rank: int
    stage: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    layers: tuple[int, ...]
    peers: dict[str, list[int]]
    measured: dict
    predicted: dict
    wall_s: float

    @property
    def activation_error(self) -> float:
        """(measured - predicted) / predicted saved-activation peak (0 when both are 0)."""
        want, got = self.predicted["saved_activation_bytes"], self.measured["saved_activation_bytes"]
        return (got - want) / want if want else float(got != 0)

    def comm_problems(self) -> list[str]:
        """The collective kinds whose bytes differ from the prediction, one line each."""
        want, got = self.predicted["comm_bytes"], self.measured["comm_bytes"]
        return [f"{kind}: measured {int(got.get(kind, 0)):,} B, predicted "
                f"{int(want.get(kind, 0)):,} B" for kind in sorted(set(want) | set(got))
                if int(want.get(kind, 0)) != int(got.get(kind, 0))]

    def problems(self) -> list[str]:
        """What disagrees with the prediction, one line each (empty: the rank agrees)."""
        out = self.comm_problems()
        want, got = self.predicted["model_state_bytes"], self.measured["model_state_bytes"]
        if int(want) != int(got):
            out.append(f"model states: measured {int(got):,} B, predicted {int(want):,} B")
        if abs(self.activation_error) > ACTIVATION_TOLERANCE:
            out.append(f"saved activations: measured {self.measured['saved_activation_bytes']:,}"
                       f" B, predicted {int(self.predicted['saved_activation_bytes']):,} B "
                       f"({self.activation_error:+.1%}, tolerance {ACTIVATION_TOLERANCE:.0%})")
        return out


@dataclass(frozen=True)
class DryRunReport:
    """The dry runs of a plan's rank classes: ``checks`` (one :class:`RankCheck` per rank
    run), ``ok`` when every one agrees with the prediction."""

    plan: Plan
    checks: list[RankCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not c.problems() for c in self.checks)

    def table(self) -> str:
        """The checks as a text table: per rank, its place, layers and groups, and each
        measured figure beside the predicted one (MiB), then every disagreement."""
        mib = 2 ** 20
        rows = [f"dry run of tp={self.plan.tp} cp={self.plan.cp} pp={self.plan.pp} "
                f"dp={self.plan.dp} on {self.plan.num_gpus} ranks (fake process group, "
                "fake tensors; the second of two steps measured)",
                f"{'rank':>6} {'stage':>5} {'layers':>9} {'comm bytes':>11} "
                f"{'model states MiB':>21} {'saved activations MiB':>30} {'wall s':>7}"]
        for c in self.checks:
            layers = f"{c.layers[0]}-{c.layers[-1]}" if c.layers else "none"
            comm = "DIFFER" if c.comm_problems() else "equal"
            states = (f"{c.measured['model_state_bytes'] / mib:,.1f} / "
                      f"{c.predicted['model_state_bytes'] / mib:,.1f}")
            acts = (f"{c.measured['saved_activation_bytes'] / mib:,.1f} / "
                    f"{c.predicted['saved_activation_bytes'] / mib:,.1f} "
                    f"({c.activation_error:+.1%})")
            rows.append(f"{c.rank:>6} {c.stage:>5} {layers:>9} {comm:>11} {states:>21} "
                        f"{acts:>30} {c.wall_s:>7.1f}")
        rows.append("(measured / predicted; groups: " + "; ".join(
            f"rank {c.rank} " + " ".join(f"{axis} {_span(r)}" for axis, r in c.peers.items())
            for c in self.checks) + ")")
        rows += [f"rank {c.rank}: {p}" for c in self.checks for p in c.problems()]
        rows.append("ok: every rank agrees with the plan" if self.ok else
                    "FAILED: a rank disagrees with the plan's prediction")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """Plain data for ``--json``: ok, and per rank its place, figures and problems."""
        return {"ok": self.ok, "ranks": [
            {"rank": c.rank, "stage": c.stage, "tp_rank": c.tp_rank, "cp_rank": c.cp_rank,
             "dp_rank": c.dp_rank, "layers": list(c.layers), "peers": c.peers,
             "measured": c.measured, "predicted": c.predicted, "wall_s": c.wall_s,
             "problems": c.problems()} for c in self.checks]}


def _span(ranks: list[int]) -> str:
    """A group's ranks, short: ``[0..7]`` for a run of consecutive ranks or a stride."""
    if len(ranks) <= 3:
        return str(ranks)
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]}..{ranks[-1]}" + (f" step {step}]" if step != 1 else "]")
    return f"[{ranks[0]}, {ranks[1]}, ... {ranks[-1]}]"


def rank_classes(plan: Plan) -> list[int]:
    """One rank per class of alike ranks: for every pipeline rank, its first rank (tp, cp
    and dp rank 0), in stage order. Ranks of one stage differ only by which shard of each
    tensor they hold, so they build the same program."""
    block = plan.tp * plan.cp * plan.dp
    return [stage * block for stage in range(plan.pp)]


class _ShapesOnly(Initializer):
    """The runtime's initialiser with the values left out: each module's whole parameters
    as empty tensors of their shapes and dtypes (fake ones under the dry run's mode); the
    buffers as :class:`~autopar.runtime.materialize.Initializer` sets them."""

    def module_params(self, name: str) -> dict[str, torch.Tensor]:
        module = self.model.get_submodule(name)
        out = {}
        for n, p in module.named_parameters(recurse=False, remove_duplicate=False):
            key = f"{name}.{n}" if name else n
            if self.names[id(p)] == key:
                out[key] = torch.empty(p.shape, dtype=p.dtype, device=self.device)
        return out


class _OpWatch(TorchDispatchMode):
    """The dry run's dispatch mode, above the fake tensors: keeps the last op dispatched
    (``last``, to name the op a failure happened in), and answers a read of a fake tensor's
    value as a Python number (``.item()``, which fake tensors cannot answer) with 1 (1.0 for
    a float). The reads on the dry run's path are torch.distributed.pipelining's warm-up
    vote, where 1 means a stage with static shapes, as every autopar stage is
    (``input_args``/``output_args``), and the optimizer's step count (Adam's bias
    correction, which a 0 would divide by)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = None  # the OpOverload (named only when a failure asks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.last = func
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def place(plan: Plan, rank: int) -> dict[str, int]:
    """``rank``'s coordinates in ``plan``'s world (Megatron's order: tp fastest, then cp,
    dp, pp; :class:`~autopar.runtime.mesh.ParallelGroups`): stage, tp_rank, cp_rank, dp_rank."""
    axis = (rank // plan.tp) % (plan.cp * plan.dp)  # the c·d data-parallel axis
    return {"stage": rank // (plan.tp * plan.cp * plan.dp), "tp_rank": rank % plan.tp,
            "cp_rank": axis % plan.cp, "dp_rank": axis // plan.cp}


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception with a message along ``exc``'s chain (torch's pipelining
    re-raises a stage's error as a RuntimeError whose message is the stage's inputs)."""
    found, seen = exc, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if str(exc).strip():
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def _local_agree(build: Callable[[], None], groups: ParallelGroups) -> None:
    """The dry run's agreement: this rank's build step alone (no other rank exists)."""
    build()


def _peers(groups: ParallelGroups) -> dict[str, list[int]]:
    axes = {"tp": groups.tp_group, "pp": groups.pp_group, "dp": groups.dp_group,
            "cp": groups.cp_group, "ep": groups.ep_group if groups.ep > 1 else None}
    return {axis: dist.get_process_group_ranks(g) for axis, g in axes.items() if g is not None}


def _layers(plan: Plan, stage: int) -> tuple[int, ...]:
    chunks = pipeline_schedule(plan.schedule).rank_chunks(plan.pp, len(plan.stage_layers), stage)
    return tuple(layer for c in chunks for layer in range(*plan.stage_layers[c]))


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def dry_run_rank(model: nn.Module, plan: Plan, rank: int, *,
                 optimizer: Callable | None = None, seed: int = 0) -> RankCheck:
    """Build rank ``rank``'s program for ``plan`` on a fake world of ``plan``'s size and run
    one training step on fake tensors (module docstring); returns its :class:`RankCheck`.

    model: the single-device model, best on the meta device (nothing is allocated).
    optimizer: a factory over the rank's parameters (default AdamW, whose two fp32 states
        per parameter the plan prices).

    Raises:
        RuntimeError: torch.distributed is already initialised in this process (the dry
            run makes its own fake world; run it outside ``torchrun``).
        ValueError: rank outside [0, world size), expert parallelism or ZeRO-3 (not
            dry-run yet).
        DryRunError: the plan does not fit the model (``parallelize``'s local checks: the
            message names the field or node), or the program could not be built or
            stepped (the message names the rank's place and the last op dispatched).
    """
    world = plan.tp * plan.cp * plan.pp * plan.dp
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is outside the plan's world of {world} ranks")
    if plan.ep > 1:
        raise ValueError("dry_run does not run expert parallelism yet (ep > 1): the routing's "
                         "all-to-all splits are data that fake tensors do not hold")
    if zero_stage(plan.zero_stage).shards_parameters:
        raise ValueError(f"dry_run does not run zero_stage={plan.zero_stage} yet: FSDP2's "
                         "sharded parameters do not materialise on fake tensors; dry-run the "
                         "plan with zero_stage 1 (the same collectives' bytes but the "
                         "parameters' all-gathers, the same activations)")
    if dist.is_initialized():
        raise RuntimeError("dry_run makes its own fake process group, but torch.distributed "
                           "is already initialised in this process; call it outside torchrun "
                           "(or after dist.destroy_process_group())")
    start = time.perf_counter()
    at = place(plan, rank)
    where = (f"rank {rank} (stage {at['stage']}, tp rank {at['tp_rank']}, cp rank "
             f"{at['cp_rank']}, dp rank {at['dp_rank']})")
    try:  # the plan against the model, as parallelize checks it on every rank
        traced = recipe.checked_trace(model, plan)
        device = torch.device("cpu")
        init = _ShapesOnly.of(copy.deepcopy(model), seed, device=device) \
            if on_meta(model) else None
    except ValueError as exc:
        raise DryRunError(f"{where}: {exc}") from exc
    init_fake_process_group(rank, world)
    groups, watch = None, _OpWatch()
    try:
        groups = recipe.plan_groups(plan, device, None)
        with FakeTensorMode(allow_non_fake_inputs=True), watch:
            pm = recipe.build_program(traced, plan, groups, optimizer or _default_optimizer,
                                      seed=seed, init=init, agree=_local_agree)
            idx = torch.zeros(plan.global_batch_size, plan.seq_len, dtype=torch.long)
            for _ in range(2):  # the second is measured: the first warms the pipeline's
                pm.train_step(idx, idx)  # p2p up (a vote its ranks send once)
        stats = pm.last_step_stats()
        peers = _peers(groups)
    except Exception as exc:  # noqa: BLE001 - re-raised with the rank's place and op named
        op = f" in {watch.last}" if watch.last else ""
        cause = _root_cause(exc)
        raise DryRunError(f"{where}{op}: {type(cause).__name__}: {cause}") from exc
    finally:
        if groups is not None:
            groups.destroy()
        dist.destroy_process_group()
    predicted = plan.predicted.stage_stats[at["stage"]] if plan.predicted else {}
    kinds = ("comm_bytes", "model_state_bytes", "saved_activation_bytes")
    return RankCheck(rank=rank, **at, layers=_layers(plan, at["stage"]), peers=peers,
                     measured={k: stats[k] for k in kinds},
                     predicted={k: predicted.get(k, 0) for k in kinds},
                     wall_s=time.perf_counter() - start)


def dry_run(model: nn.Module, plan: Plan, *, ranks: int | Iterable[int] | None = None,
            optimizer: Callable | None = None, seed: int = 0) -> DryRunReport:
    """Dry runs of ``plan``'s ranks (default: :func:`rank_classes`, one per stage) on one
    CPU: :func:`dry_run_rank` for each, in order. Raises what it raises."""
    chosen = rank_classes(plan) if ranks is None else [ranks] if isinstance(ranks, int) \
        else list(ranks)
    return DryRunReport(plan, [dry_run_rank(model, plan, r, optimizer=optimizer, seed=seed)
                               for r in chosen])
