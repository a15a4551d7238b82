"""What ``autopar.verify.check`` measured: tolerances, the report, and the error it raises.

Every difference is *relative per tensor*: for the parallel value ``a`` and the
single-device reference ``b`` of one parameter (or its gradient) at one step,

    diff = max|a - b| / max(max|b|, floor · S)

where ``S`` is the largest ``max|b|`` over all parameters at that step (of the same kind:
gradients or parameters) and ``floor`` is :attr:`Tolerances.floor`. The floor keeps a
tensor that is zero in exact arithmetic (a zero-initialised bias after one step, or the
key bias, whose gradient vanishes because softmax ignores a per-row constant) from
turning rounding noise into a huge ratio. The loss difference is ``|a - b| / |b|``.

In fp32, a tensor whose own rounding is larger than the tolerance (a gradient summing
large terms to a small one; a ReLU unit one rounding away from 0) is judged against that
rounding instead: :mod:`autopar.verify.noise` measures, per tensor and step, the fp32
reference's relative difference from the same training in fp64, and the tensor passes
within ``max(tolerance, NOISE_FACTOR · noise)`` (:meth:`ParamDiff.excess`).

A difference that is not a finite number (NaN or inf on either side) counts as infinite,
never as zero: Python's ``max`` drops NaN, so every maximum here goes through
:func:`finite_or_inf`, and any non-finite loss, gradient or parameter is recorded as a
:class:`NonFinite` that fails the report by itself and is named first in the message.

Results are plain data so that a report can be printed on rank 0, sent between processes
(``to_dict`` is JSON-able) and attached to the :class:`VerificationError`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

NOISE_FACTOR = 8.0
"""How many times the fp32 reference's own rounding (against fp64) a parallel program's
difference may be: two fp32 programs summing in different orders each sit about that
noise from exact arithmetic, so they differ by up to about twice it; 8 leaves room for
the spread over steps, and a wrong program (a missing all-reduce, a wrong slice) is
orders of magnitude past it."""

__all__ = ["Tolerances", "ParamDiff", "StepLoss", "NonFinite", "VerifyReport",
           "VerificationError", "finite_or_inf", "relative_diff", "NOISE_FACTOR"]


def finite_or_inf(value: float) -> float:
    """``value``, or inf when it is NaN or infinite (a difference that is not a number
    is as bad as it gets; ``max`` over floats silently drops NaN)."""
    return value if math.isfinite(value) else math.inf


def _json_safe(value):
    """Non-finite floats as the strings "nan" / "inf" (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class NonFinite:
    """A NaN or inf at ``step``: ``what`` ("loss", "gradient", "parameter after the step",
    "loss or gradient norm"), ``side`` ("parallel program", "single device" or "both"),
    ``detail`` (the value, or the parameter key)."""

    step: int
    what: str
    side: str
    detail: str

    def sentence(self) -> str:
        """E.g. "step 0: the loss is not finite on the parallel program (nan)"."""
        return f"step {self.step}: the {self.what} is not finite on the {self.side} ({self.detail})"


@dataclass(frozen=True)
class Tolerances:
    """Largest relative differences accepted (see the module docstring for the measure).

    loss: per-step loss, |a - b| / |b|.
    grad: per-parameter gradient after each step's backward (the synchronised gradient
        the optimizer used).
    param: per-parameter value after each optimizer step.
    floor: fraction of the largest tensor (of that kind, that step) below which a
        tensor's own scale is not used as the denominator.

    Defaults (:meth:`for_dtype`): fp32 1e-5 for loss, gradients and SGD parameters;
    bf16 2e-2 (about three bf16 ulps: 8-bit mantissa, 2^-8 ≈ 4e-3, accumulated over a
    few layers). Adam amplifies rounding of near-zero gradients: with an Adam-like
    optimizer pass a looser ``param`` (the tests use 1e-3 for fp32).
    """

    loss: float = 1e-5
    grad: float = 1e-5
    param: float = 1e-5
    floor: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("loss", "grad", "param", "floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Tolerances.{name} must be a positive number, got {value!r}")

    @classmethod
    def for_dtype(cls, dtype: str) -> "Tolerances":
        """The default tolerances for a plan's ``dtype`` ("fp32" or "bf16")."""
        if dtype == "fp32":
            return cls()
        if dtype == "bf16":
            # bf16 rounds every product and sum to 8 significant bits; a gradient summed
            # over b·s tokens differs from fp32 by a few percent of its largest entry
            return cls(loss=2e-2, grad=5e-2, param=2e-2, floor=1e-2)
        raise ValueError(f"no default tolerances for dtype {dtype!r}; pass tolerances=Tolerances(...)")


@dataclass
class StepLoss:
    """One step's global mean loss: parallel program, single-device reference, relative
    diff; ``noise``: the fp32 reference's own relative difference from fp64 at this step
    (:mod:`autopar.verify.noise`), 0 unless measured."""

    step: int
    parallel: float
    reference: float
    diff: float
    noise: float = 0.0

    def excess(self, tolerance: float) -> float:
        """diff / max(tolerance, NOISE_FACTOR · noise); > 1 fails (NaN: inf)."""
        return finite_or_inf(self.diff) / max(tolerance, NOISE_FACTOR * self.noise)


@dataclass
class ParamDiff:
    """One parameter (original model key) across the steps.

    stages: pipeline stages holding it (two for a tied embedding split over stages).
    grad, param: relative difference per step (index = step).
    grad_noise, param_noise: per step, the fp32 reference's own relative difference from
        fp64 (:mod:`autopar.verify.noise`); empty unless measured.
    """

    key: str
    stages: list[int]
    grad: list[float] = field(default_factory=list)
    param: list[float] = field(default_factory=list)
    grad_noise: list[float] = field(default_factory=list)
    param_noise: list[float] = field(default_factory=list)

    def excess(self, kind: str, tolerance: float) -> tuple[float, int]:
        """(largest difference / what is allowed, its step) of kind "grad" or "param":
        allowed is ``tolerance``, or ``NOISE_FACTOR`` times the step's measured fp32
        noise when that is larger; > 1 fails."""
        values = [finite_or_inf(v) for v in getattr(self, kind)]
        noise = getattr(self, f"{kind}_noise")
        ratios = [v / max(tolerance, NOISE_FACTOR * noise[i] if i < len(noise) else 0.0)
                  for i, v in enumerate(values)]
        if not ratios:
            return 0.0, 0
        step = max(range(len(ratios)), key=ratios.__getitem__)
        return ratios[step], step

    def worst(self, kind: str) -> tuple[float, int]:
        """(largest difference, step at which it occurs) of kind "grad" or "param"."""
        values = [finite_or_inf(v) for v in getattr(self, kind)]
        if not values:
            return 0.0, 0
        step = max(range(len(values)), key=values.__getitem__)
        return values[step], step


@dataclass
class VerifyReport:
    """The comparison of ``steps`` training steps of a plan against one device.

    layout: e.g. "tp=2 pp=1 dp=1 fp32"; optimizer: its class name.
    losses: one :class:`StepLoss` per step. params: one :class:`ParamDiff` per key.
    nonfinite: every NaN/inf seen, in step order (any one fails the report).
    claims: why the plan's recorded prediction does not describe its own decisions (""
        when it does; :func:`autopar.verify.claims.claim_problem`).
    noise_error: see the field.
    """

    layout: str
    optimizer: str
    steps: int
    tolerances: Tolerances
    losses: list[StepLoss] = field(default_factory=list)
    params: dict[str, ParamDiff] = field(default_factory=dict)
    nonfinite: list[NonFinite] = field(default_factory=list)
    claims: str = ""
    noise_error: str = ""
    """why the fp64 re-run of :mod:`autopar.verify.noise` could not run (an op with no
    fp64 kernel, e.g. grouped_mm); "" when it ran or was not needed"""

    # ------------------------------------------------------------------ summaries
    @property
    def max_loss_diff(self) -> float:
        return max((finite_or_inf(s.diff) for s in self.losses), default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max((p.worst("grad")[0] for p in self.params.values()), default=0.0)

    @property
    def max_param_diff(self) -> float:
        return max((p.worst("param")[0] for p in self.params.values()), default=0.0)

    @property
    def ok(self) -> bool:
        """True when every loss, gradient and parameter is finite on both sides, the
        plan claims what its decisions give, and every difference is within tolerance."""
        return self._clean() and all(self._badness(p) <= 1 for p in self.params.values())

    def failed_by_differences_only(self) -> bool:
        """True when nothing is non-finite and the plan's claims hold, but a loss,
        gradient or parameter is past its tolerance (before any measured noise): the case
        :mod:`autopar.verify.noise` may explain."""
        t = self.tolerances
        return (not self.nonfinite and not self.claims
                and (self.max_loss_diff > t.loss or self.max_grad_diff > t.grad
                     or self.max_param_diff > t.param))

    def _clean(self) -> bool:
        """Nothing non-finite, the plan's claims hold, every loss within what is allowed."""
        return (not self.nonfinite and not self.claims
                and all(s.excess(self.tolerances.loss) <= 1 for s in self.losses))

    def _badness(self, p: ParamDiff) -> float:
        """How far past what is allowed a parameter is (> 1: failing; :meth:`ParamDiff.excess`)."""
        return max(p.excess("grad", self.tolerances.grad)[0],
                   p.excess("param", self.tolerances.param)[0])

    def worst_params(self) -> list[ParamDiff]:
        """Parameters ordered worst first (by difference / tolerance)."""
        return sorted(self.params.values(), key=lambda p: (-self._badness(p), p.key))

    def by_stage(self) -> dict[int, dict]:
        """Per pipeline stage: parameter count and the largest grad/param differences."""
        out: dict[int, dict] = {}
        for p in self.params.values():
            for s in p.stages:
                row = out.setdefault(s, {"params": 0, "max_grad_diff": 0.0, "max_param_diff": 0.0})
                row["params"] += 1
                row["max_grad_diff"] = max(row["max_grad_diff"], p.worst("grad")[0])
                row["max_param_diff"] = max(row["max_param_diff"], p.worst("param")[0])
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------- outputs
    def to_dict(self) -> dict:
        """JSON-able: summary, tolerances, per-step losses, per-stage and per-parameter diffs
        (parameters worst first)."""
        return _json_safe({
            "ok": self.ok, "layout": self.layout, "optimizer": self.optimizer,
            "nonfinite": [asdict(n) for n in self.nonfinite], "claims": self.claims, "noise_error": self.noise_error,
            "steps": self.steps, "tolerances": asdict(self.tolerances),
            "max_loss_diff": self.max_loss_diff, "max_grad_diff": self.max_grad_diff,
            "max_param_diff": self.max_param_diff,
            "losses": [asdict(s) for s in self.losses],
            "stages": {str(k): v for k, v in self.by_stage().items()},
            "params": [asdict(p) for p in self.worst_params()],
        })

    def table(self, max_params: int | None = 20) -> str:
        """Human-readable report: verdict, losses per step, stages, worst parameters first."""
        t = self.tolerances
        verdict = "OK" if self.ok else "FAILED"
        lines = [f"autopar verify: {self.layout}, {self.steps} {self.optimizer} steps: {verdict}"]
        lines += [f"  not finite: {n.sentence()}" for n in self.nonfinite[:3]]
        lines += [f"  plan: {self.claims}"] if self.claims else []
        lines += [f"  max relative diff: loss {self.max_loss_diff:.1e} (tol {t.loss:.0e}), "
                  f"grad {self.max_grad_diff:.1e} (tol {t.grad:.0e}), "
                  f"param {self.max_param_diff:.1e} (tol {t.param:.0e})", "",
                  f"{'step':>4}  {'loss parallel':>14}  {'loss single':>14}  {'rel diff':>9}"]
        lines += [f"{s.step:>4}  {s.parallel:>14.8f}  {s.reference:>14.8f}  {s.diff:>9.1e}"
                  for s in self.losses]
        lines += ["", f"{'stage':>5}  {'params':>6}  {'max grad diff':>13}  {'max param diff':>14}"]
        lines += [f"{s:>5}  {r['params']:>6}  {r['max_grad_diff']:>13.1e}  {r['max_param_diff']:>14.1e}"
                  for s, r in self.by_stage().items()]
        noisy = ["loss"] * any(NOISE_FACTOR * s.noise > t.loss for s in self.losses)
        noisy += [p.key for p in self.params.values()
                 if any(NOISE_FACTOR * n > t.grad for n in p.grad_noise)
                 or any(NOISE_FACTOR * n > t.param for n in p.param_noise)]
        if noisy:
            lines += ["", f"  judged against {NOISE_FACTOR:g}× the fp32 reference's own rounding "
                          f"(fp64 re-run, autopar.verify.noise): {', '.join(noisy[:6])}"
                          + (f" and {len(noisy) - 6} more" if len(noisy) > 6 else "")]
        params = self.worst_params()
        shown = params if max_params is None else params[:max_params]
        width = max([len(p.key) for p in shown] + [9])
        lines += ["", f"{'parameter':<{width}}  {'stage':>5}  {'grad diff (step)':>16}  "
                      f"{'param diff (step)':>17}"]
        for p in shown:
            (g, gs), (v, vs) = p.worst("grad"), p.worst("param")
            stages = ",".join(map(str, p.stages))
            lines.append(f"{p.key:<{width}}  {stages:>5}  {g:>9.1e} ({gs:>2})    {v:>9.1e} ({vs:>2})")
        if len(shown) < len(params):
            lines.append(f"... {len(params) - len(shown)} more parameters within these differences")
        return "\n".join(lines)

    def failure_message(self) -> str:
        """One paragraph naming the worst loss step and the worst parameter, step and stage."""
        t = self.tolerances
        parts = []
        if self.nonfinite:  # the first NaN/inf explains the rest
            parts.append(f"{self.nonfinite[0].sentence()} (first non-finite step; NaN or inf "
                         "is never within tolerance)")
        if self.claims:
            parts.append(self.claims)
        s = max(self.losses, key=lambda s: s.excess(t.loss), default=None)
        if s is not None and s.excess(t.loss) > 1:
            noise = (f"; the fp32 reference's own rounding against fp64 is {s.noise:.1e}"
                     if s.noise else "")
            parts.append(f"loss differs by {s.diff:.1e} relative at step {s.step} "
                         f"(parallel {s.parallel:.8f}, single device {s.reference:.8f}; "
                         f"tolerance {t.loss:.0e}{noise})")
        if self.params:
            p = self.worst_params()[0]
            what = [f"{label} differs by {getattr(p, kind)[step]:.1e} relative at step {step} "
                    f"({_allowed(p, kind, step, tol)})"
                    for label, kind, tol in (("gradient", "grad", t.grad),
                                             ("value after the optimizer step", "param", t.param))
                    for ratio, step in [p.excess(kind, tol)] if ratio > 1]
            if what:
                parts.append(f"parameter {p.key!r} (pipeline stage "
                             f"{','.join(map(str, p.stages))}): " + ", ".join(what))
        if self.noise_error:
            parts.append("the fp64 re-run that measures fp32's own rounding could not run "
                         f"({self.noise_error})")
        return (f"autopar verify failed for {self.layout}: " + "; ".join(parts)
                + ". The parallel program does not compute what the single-device model does; "
                  "see .report.table() for every parameter")


def relative_diff(full: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
              drift: dict[str, float], floor: float) -> dict[str, float]:
    """Per key of ``reference``: max|a - b| / max(max|b|, floor·S), S the largest max|b|
    (module docstring); a key's ``drift`` (the largest local-shard difference, absolute)
    counts when larger than the gathered tensors'. Raises RuntimeError when ``full`` lacks
    a key (a bug in the rewrite)."""
    scale = {k: b.abs().max().item() if b.numel() else 0.0 for k, b in reference.items()}
    floor_abs = floor * max(scale.values(), default=0.0)
    out = {}
    for key, b in reference.items():
        if key not in full:
            raise RuntimeError(f"the parallel program has no parameter {key!r} (it holds "
                               f"{sorted(full)}); this is a bug in the rewrite")
        diff = (full[key].float() - b.float()).abs().max().item() if b.numel() else 0.0
        diff = max(finite_or_inf(diff), finite_or_inf(drift.get(key, 0.0)))
        out[key] = diff / max(finite_or_inf(scale[key]), floor_abs, 1e-30)
    return out


def _allowed(p: ParamDiff, kind: str, step: int, tolerance: float) -> str:
    """What bounded ``p``'s ``kind`` difference at ``step``, in words."""
    noise = getattr(p, f"{kind}_noise")
    if step < len(noise) and NOISE_FACTOR * noise[step] > tolerance:
        return (f"allowed {NOISE_FACTOR:g}× the fp32 reference's own rounding, "
                f"{noise[step]:.1e} against fp64")
    if noise:
        return (f"tolerance {tolerance:.0e}; the fp32 reference's own rounding against fp64 "
                f"is {noise[step]:.1e}")
    return f"tolerance {tolerance:.0e}"


class VerificationError(AssertionError):
    """The parallel program's loss, gradients or parameters differ from the single-device
    model's past tolerance. An AssertionError because it is a failed check of a result
    (like a failing test), not a failure to run; raised explicitly, so ``python -O`` does
    not disable it. ``.report`` holds the full :class:`VerifyReport`.
    """

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.failure_message())
        self.report = report
