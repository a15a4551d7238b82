"""``autopar.verify.check``: run a plan's program and the single-device model side by side.

On every rank of an initialised process group (world size tp·pp·dp), :func:`verify`

1. checks that the plan was made for this model (traced node names, model config):
   ValueError before any collective;
2. copies the model with dropout switched off (:func:`disable_dropout`): the traced graph
   bakes dropout probabilities in, so ``eval()`` cannot turn them off afterwards, and
   two programs drawing different dropout masks could never agree;
3. builds the parallel program with :func:`autopar.recipe.parallelize` from
   one copy, and keeps another as the single-device reference with the same optimizer
   (default SGD). A model on the meta device is initialised with ``seed``: the program's
   shards by the runtime, the reference whole on the CPU by
   :func:`~autopar.runtime.materialize.init_model` (the same rule);
4. runs ``steps`` training steps of both on the same seeded batches (B = the plan's
   global batch, s = its seq_len, token ids below the model's vocabulary size). After
   each step it compares the global mean loss, every parameter's gradient (the
   synchronised one the optimizer used, gathered by :func:`full_gradients`) and every
   parameter's value after the step (``full_state_dict``);
5. also compares every rank's *local* shard with the matching slice of the reference, so
   a replica that drifted on one TP or DP rank is caught even though the gathered
   tensors come from TP rank 0 / DP rank 0 (an expert-parallel rank's experts with the
   reference's slice of them, ``pm.expert_slices``; gathered over EP for the whole);
6. fails on any NaN/inf: a loss, gradient or parameter that is not finite on either side
   is recorded (:class:`~autopar.verify.result.NonFinite`, the first one named in the
   message) and never counts as a zero difference; a step the runtime refuses for a
   non-finite loss or gradient norm (``NonFiniteError``, on every rank alike) ends the run
   there;
7. checks first that the plan claims what its decisions give
   (:func:`autopar.verify.claims.claim_problem`: the recorded prediction against a
   re-pricing of its exact tp/pp/dp, placements, stages and recompute), so an edited plan
   (tp=2 over placements made for tp=1) fails instead of verifying a program that is not
   the one the plan describes;
8. when an fp32 report fails by loss, gradient or parameter differences alone, measures how far
   the fp32 reference itself is from the same training in fp64
   (:func:`autopar.verify.noise.fp32_noise`): a tensor within a fixed multiple of that
   rounding noise passes (cancelling sums, ReLU kinks);
9. returns a :class:`~autopar.verify.result.VerifyReport` (identical on every rank), or
   raises :class:`~autopar.verify.result.VerificationError` on every rank past tolerance.

The relative measure and the default tolerances are documented in
:mod:`autopar.verify.result`. The reference loss is the runtime's own per-token
cross-entropy of ``model(idx)``'s logits (``runtime.engine.token_cross_entropy``), so
both sides compute the same function. Meant for small models: every rank holds the
reference model and the gathered full tensors.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.contract.plan import Plan
from autopar.runtime.compat import DropoutBase
from autopar.runtime.health import NonFiniteError
from autopar import recipe as runtime_parallelize  # looked up at call time
from autopar.runtime.fsdp import full_tensor
from autopar.runtime.full_state import gather_full
from autopar.runtime.materialize import InitFn, init_model, on_meta
from autopar.verify.claims import claim_problem
from autopar.verify.noise import fp32_noise, reference_step
from autopar.verify.result import (NonFinite, ParamDiff, StepLoss, Tolerances, VerificationError,
                                   VerifyReport, finite_or_inf, relative_diff)

__all__ = ["verify", "full_gradients", "disable_dropout", "default_batches", "first_nonfinite",
           "Tolerances", "VerifyReport", "VerificationError"]

Batch = tuple[torch.Tensor, torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
DEFAULT_SGD_LR = 0.1


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability in ``model`` to 0, in place; returns what was changed.

    Covers ``nn.Dropout``-family modules (``p``) and float attributes whose name contains
    "dropout" (e.g. the ``dropout`` passed to ``scaled_dot_product_attention``, Hugging
    Face's ``attention_dropout``). Call it on a copy: it changes the model.
    """
    changed = []
    for mod_name, module in model.named_modules():
        if isinstance(module, DropoutBase) and module.p > 0:
            module.p = 0.0
            changed.append(f"{mod_name}.p")
        for attr, value in list(vars(module).items()):
            if "dropout" in attr and isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed.append(f"{mod_name}.{attr}")
    return changed


def vocab_size(model: nn.Module) -> int:
    """V: ``model.config.vocab_size``, else the largest ``nn.Embedding``'s row count."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not sizes:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__} (no "
                         "config.vocab_size, no nn.Embedding); pass batches=...")
    return max(sizes)


def default_batches(model: nn.Module, plan: Plan, steps: int, seed: int = 0) -> list[Batch]:
    """``steps`` random (idx, targets) pairs, each (B, s) int64 in [0, V), from ``seed``
    (a private generator: the global RNG is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    shape, v = (plan.global_batch_size, plan.seq_len), vocab_size(model)
    return [(torch.randint(0, v, shape, generator=gen), torch.randint(0, v, shape, generator=gen))
            for _ in range(steps)]


# ------------------------------------------------------------------ gathering
def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def full_gradients(pm) -> dict[str, torch.Tensor]:
    """Unsharded gradients of a :class:`~autopar.recipe.ParallelizedModel` under the
    original model's keys, on every rank (CPU), like ``full_state_dict`` for parameters.

    Read after ``train_step``: each ``.grad`` then holds that step's synchronised gradient
    (tied embedding summed over stages, averaged over DP). A parameter without a gradient
    gives zeros. Collective over the whole world: every rank must call it.
    Under ZeRO-1/2 each rank keeps only its slice of the averaged gradient; the slices are
    all-gathered over DP first (``DistributedOptimizer.synchronize_gradients``); ZeRO-3
    gradients are DTensors, made whole over DP by ``runtime.fsdp.full_tensor``.
    """
    pm.dp_optimizer.synchronize_gradients()
    return gather_full(pm, _grad_or_zeros)


def _stages_of(pm) -> dict[str, list[int]]:
    """Original key -> pipeline stages holding it (every rank contributes its stage)."""
    mine = {spec.key: pm.groups.pp_rank for spec in pm.shards.values()}
    gathered: list = [None] * pm.groups.world_size
    dist.all_gather_object(gathered, mine)
    stages: dict[str, set[int]] = {}
    for part in gathered:
        for key, stage in part.items():
            stages.setdefault(key, set()).add(stage)
    for alias, canonical in pm.tied_aliases.items():
        both = stages.get(alias, set()) | stages.get(canonical, set())
        stages[alias] = stages[canonical] = both
    return {k: sorted(v) for k, v in stages.items()}


def _local_drift(pm, reference: dict[str, torch.Tensor],
                 pick: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, float]:
    """max|local shard - matching reference slice| per key, maximised over all ranks."""
    g = pm.groups
    params = dict(pm.stage_module.named_parameters())
    mine: dict[str, float] = {}
    for name, spec in pm.shards.items():
        key = spec.key if spec.key in reference else pm.tied_aliases.get(spec.key, spec.key)
        ref = reference[key]
        ref = spec.local(ref, g.tp_rank, g.tp)
        if name in pm.expert_slices:  # this EP rank's experts (dim 0)
            ref = ref[pm.expert_slices[name]]
        local = full_tensor(pick(params[name]).detach())  # ZeRO-3: whole over DP
        diff = (local.cpu().float() - ref.float()).abs().max().item() if ref.numel() else 0.0
        mine[key] = max(mine.get(key, 0.0), finite_or_inf(diff))
    gathered: list = [None] * g.world_size
    dist.all_gather_object(gathered, mine)
    drift: dict[str, float] = {}
    for part in gathered:
        for key, value in part.items():
            drift[key] = max(drift.get(key, 0.0), value)
    return drift


def first_nonfinite(step: int, what: str, parallel: dict[str, torch.Tensor],
                    reference: dict[str, torch.Tensor]) -> NonFinite | None:
    """The first key (reference order) whose tensor holds NaN/inf on either side, as a
    :class:`~autopar.verify.result.NonFinite`, or None."""
    for key, b in reference.items():
        bad_a = key in parallel and not bool(torch.isfinite(parallel[key]).all())
        bad_b = not bool(torch.isfinite(b).all())
        if bad_a or bad_b:
            side = "both sides" if bad_a and bad_b else (
                "parallel program" if bad_a else "single device")
            return NonFinite(step, what, side, f"parameter {key!r}")
    return None


def _loss_nonfinite(step: int, loss: float, ref_loss: float) -> NonFinite | None:
    bad = [name for name, v in (("parallel program", loss), ("single device", ref_loss))
           if not math.isfinite(v)]
    if not bad:
        return None
    side = "both sides" if len(bad) == 2 else bad[0]
    return NonFinite(step, "loss", side, f"parallel {loss}, single device {ref_loss}")


# ------------------------------------------------------------------ the check
def _check_inputs(model: nn.Module, plan: Plan, steps: int, batches) -> None:
    """Everything that can be checked before any collective (ValueError); the plan against
    the model is checked by the runtime's ``parallelize``, also before any collective
    (:func:`~autopar.recipe.check_plan_matches`)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if batches is not None and len(batches) < steps:
        raise ValueError(f"{len(batches)} batches given for {steps} steps")


def _compare_step(pm, base: nn.Module, ref_optim, batch: Batch, step: int, rng_seed: int,
                  loss: float, report: VerifyReport) -> None:
    """One reference step on ``batch`` from RNG seed ``rng_seed`` (the program's step's);
    the step's loss, gradients and parameters compared into ``report`` (NaN/inf recorded
    as :class:`NonFinite`, never as a zero difference)."""
    ref_loss, ref_grads = reference_step(base, ref_optim, batch, rng_seed)
    loss_diff = finite_or_inf(abs(loss - ref_loss) / max(abs(ref_loss), 1e-30))
    report.losses.append(StepLoss(step, loss, ref_loss, loss_diff))
    full_grads = full_gradients(pm)
    ref_params = {k: p.detach() for k, p in base.named_parameters()}
    full_params = pm.full_state_dict()
    found = [_loss_nonfinite(step, loss, ref_loss),
             first_nonfinite(step, "gradient", full_grads, ref_grads),
             first_nonfinite(step, "parameter after the step", full_params, ref_params)]
    report.nonfinite += [n for n in found if n is not None]
    tol = report.tolerances
    grads = relative_diff(full_grads, ref_grads, _local_drift(pm, ref_grads, _grad_or_zeros), tol.floor)
    params = relative_diff(full_params, ref_params, _local_drift(pm, ref_params, lambda p: p),
                       tol.floor)
    for key, diff in report.params.items():
        diff.grad.append(grads[key])
        diff.param.append(params[key])


def verify(model: nn.Module, plan: Plan, *, steps: int = 3,
           optimizer: OptimizerFactory | None = None, seed: int = 0,
           batches: Sequence[Batch] | None = None, tolerances: Tolerances | None = None,
           raise_on_failure: bool = True, init_fn: InitFn | None = None) -> VerifyReport:
    """Train ``steps`` steps of ``plan``'s parallel program and of ``model`` on one device on
    the same batches, and compare loss, gradients and parameters (module docstring).

    Call on every rank of an initialised process group of tp·pp·dp ranks; ``model`` must
    be the same model on every rank (it is copied, never modified): materialised, or on
    the meta device, then initialised from ``seed`` (by ``init_fn``, default the model's
    rule) on both sides; the reference needs the whole model on this process's CPU.
    optimizer: parameters -> Optimizer, the same for both sides; default SGD, lr 0.1
        (Adam amplifies rounding of near-zero gradients; loosen ``tolerances.param``).
    seed / batches: the seeded random batches of :func:`default_batches`, or your own
        ``steps`` pairs (idx, targets) of shape (B, s) int64; ``seed`` also initialises a
        meta model, and seeds torch's default RNG with ``seed + step`` before each side's
        step, so that random ops of a training forward (a router's jitter or sampling,
        replicated over TP) draw alike on both sides.
    tolerances: default :meth:`Tolerances.for_dtype` of ``plan.dtype``.
    Returns the :class:`VerifyReport` (the same on every rank).

    Raises ValueError (bad steps/batches, plan made for another model, a meta buffer the
    init rule does not set; before any collective), the errors of :func:`autopar.parallelize`, and
    :class:`VerificationError` on every rank past tolerance when ``raise_on_failure``.
    """
    _check_inputs(model, plan, steps, batches)
    tolerances = tolerances or Tolerances.for_dtype(plan.dtype)
    optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=DEFAULT_SGD_LR))
    if batches is None:
        batches = default_batches(model, plan, steps, seed)
    batches = list(batches)[:steps]
    base = copy.deepcopy(model)
    disable_dropout(base)
    base.train()
    pm = runtime_parallelize.parallelize(copy.deepcopy(base), plan=plan, optimizer=optimizer,
                                         seed=seed, init_fn=init_fn)
    if on_meta(base):  # the same rule and seed as the program's shards, whole on the CPU
        init_model(base, seed, init_fn=init_fn)
    initial = copy.deepcopy(base) if plan.dtype == "fp32" else None  # for fp32_noise
    ref_optim = optimizer(base.parameters())
    stages = _stages_of(pm)
    ep = f" ep={plan.ep}" if plan.ep > 1 else ""
    layout = f"tp={plan.tp} pp={plan.pp} dp={plan.dp}{ep} {plan.dtype}"
    report = VerifyReport(layout=layout, optimizer=type(ref_optim).__name__, steps=steps,
                          tolerances=tolerances)
    for key, _ in base.named_parameters():
        report.params[key] = ParamDiff(key=key, stages=stages.get(key, []))
    report.claims = claim_problem(model, plan)  # local and deterministic: the same on every rank
    for step, (idx, targets) in enumerate(batches):
        try:
            torch.manual_seed(seed + step)  # as the reference step (reference_step)
            loss = pm.train_step(idx, targets)
        except NonFiniteError as exc:  # raised on every rank alike, before the update
            report.nonfinite.append(NonFinite(step, "loss or gradient norm",
                                              "parallel program", str(exc)))
            break
        _compare_step(pm, base, ref_optim, (idx, targets), step, seed + step, loss, report)
    if initial is not None and report.failed_by_differences_only():
        try:
            noise = fp32_noise(initial, optimizer, batches[:len(report.losses)], tolerances.floor,
                               seed)
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # an op without fp64
            report.noise_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            noise = []  # local and deterministic: every rank alike
        for step_loss, (loss_noise, grad_noise, param_noise) in zip(report.losses, noise):
            step_loss.noise = loss_noise
            for key, diff in report.params.items():
                diff.grad_noise.append(grad_noise[key])
                diff.param_noise.append(param_noise[key])
    if raise_on_failure and not report.ok:
        raise VerificationError(report)
    return report
