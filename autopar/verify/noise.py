"""How much of a difference is fp32's own: the reference re-run in fp64.

Two fp32 programs that compute the same function in a different order (a matmul summed in
two halves under tensor parallelism, then all-reduced) differ by rounding. For most tensors
that is far below ``Tolerances.grad`` (1e-5 relative), but not for all:

* a gradient that is a sum of large terms cancelling to a small one (Differential
  Transformer's ``lambda_q1``, Doge's per-head ``A``) carries rounding relative to its
  terms, not to itself;
* a kink (ReLU) turns a rounding difference in a pre-activation near 0 into a unit that is
  on in one program and off in the other.

So when an fp32 report fails only by loss, gradient or parameter differences, :func:`fp32_noise`
trains the single-device model again from the same initial state on the same batches in
fp64 and measures, per tensor and step, how far the fp32 reference itself is from it
(the relative measure of :mod:`autopar.verify.result`). A tensor passes when its
difference is within ``max(tolerance, NOISE_FACTOR · that noise)``
(:meth:`~autopar.verify.result.ParamDiff.excess`; the loss alike): the parallel program is then as close
to the reference as the reference is to exact arithmetic, up to the factor. A real error
(a missing all-reduce, a wrong slice) is orders of magnitude past both. The fp64 run is
local, deterministic and the same on every rank; it costs one more single-device training
run, paid only by a report that would otherwise fail. Experts that run a grouped matmul
run their per-expert loop in fp64 (:func:`_fp64`).
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from autopar.graph.export import causal_lm_logits
from autopar.runtime.engine import token_cross_entropy
from autopar.verify.result import relative_diff

__all__ = ["fp32_noise", "reference_step"]

Batch = tuple[torch.Tensor, torch.Tensor]


def reference_step(model: nn.Module, optim: torch.optim.Optimizer,
                    batch: Batch, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One single-device training step of ``model`` on ``batch`` ((idx, targets), each
    (B, s) int64): the runtime's per-token cross-entropy of ``model(idx)``'s logits,
    backward, ``optim.step()``, from torch's default RNG seeded with ``seed`` (a training
    forward's random ops: a router's jitter or sampling). Returns (loss, gradients by key,
    zeros where None)."""
    idx, targets = batch
    torch.manual_seed(seed)
    optim.zero_grad(set_to_none=True)
    logits = causal_lm_logits(model, idx)  # called as capture calls it (graph.export)
    loss = token_cross_entropy(logits, targets)  # (b, s, V), (b, s) -> scalar
    loss.backward()
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for k, p in model.named_parameters()}
    optim.step()
    return float(loss.item()), grads


def fp32_noise(initial: nn.Module, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
               batches: Sequence[Batch], floor: float,
               seed: int = 0) -> list[tuple[float, dict[str, float], dict[str, float]]]:
    """Per step, (loss noise, gradient noise by key, parameter noise by key): the relative
    difference between
    the fp32 single-device reference and the same training in fp64, both from ``initial``
    (the reference model before its first step, fp32; not modified) with ``optimizer`` on
    ``batches`` (each (idx, targets) of shape (B, s)). Both runs take
    :func:`reference_step`, verify's own reference step, step k from RNG seed ``seed + k``
    as verify's."""
    m32, m64 = copy.deepcopy(initial), _fp64(initial)
    o32, o64 = optimizer(m32.parameters()), optimizer(m64.parameters())
    noise = []
    for step, batch in enumerate(batches):
        l32, g32 = reference_step(m32, o32, batch, seed + step)
        l64, g64 = reference_step(m64, o64, batch, seed + step)
        p32 = {k: p.detach() for k, p in m32.named_parameters()}
        p64 = {k: p.detach() for k, p in m64.named_parameters()}
        noise.append((abs(l32 - l64) / max(abs(l64), 1e-30), relative_diff(g32, g64, {}, floor),
                      relative_diff(p32, p64, {}, floor)))
    return noise


def _fp64(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``. A Hugging Face MoE whose experts run a grouped matmul
    (``torch._grouped_mm``: fp32/bf16/fp16 only) runs them in its "eager" per-expert loop
    instead, the same function in every dtype (``set_experts_implementation``), so that
    the exact reference exists for it too."""
    m64 = copy.deepcopy(model).double()
    config = getattr(m64, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager") and \
            hasattr(m64, "set_experts_implementation"):
        m64.set_experts_implementation("eager")
    return m64
