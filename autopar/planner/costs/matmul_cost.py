"""Seconds of a graph node's matrix multiplications at their shapes, for the cost tables.

Annotation records each matmul node's forward GEMMs as ``(batch, m, n, k)`` for one
sequence (:func:`autopar.graph.ops.gemm_shapes`); this module applies the micro-batch and
the tensor-parallel split to those shapes and prices the forward GEMMs and the two
backward GEMMs of each with :func:`cost_models.compute.gemm_time_s` (tile and wave
quantisation on a GPU profile, plain FLOPs on a CPU one).
"""

from __future__ import annotations

from cost_models import compute
from cost_models.hardware import DeviceSpec

from autopar.graph.annotate import NodeInfo
from autopar.planner.strategies import Strategy

__all__ = ["gemm_times_s", "CAUSAL_SKIP_FRACTION"]


CAUSAL_SKIP_FRACTION = 0.5
"""Share of the score tiles a fused causal attention kernel computes: those on and below
the diagonal, counted as half, as FlashAttention-2's own benchmark counts causal FLOPs
(Dao-AILab/flash-attention ``benchmarks/benchmark_flash_attention.py``, ``flops``:
``4·b·s²·a·hd // (2 if causal else 1)``)."""


def gemm_times_s(info: NodeInfo, strat: Strategy, b: int, dev: DeviceSpec,
                 attention: str = "math") -> tuple[float, float, float]:
    """(forward, backward, weight gradient) seconds of node ``info``'s GEMMs
    (``extra["gemms"]``, annotation) for ``b`` sequences on one rank under ``strat``: a
    column split divides n by t, a row split k, a split of heads (attention, batched
    matmul) the batch, a folded matmul m.
    Backward of C = A·B runs dA = dC·Bᵀ (m x k, depth n) and dB = Aᵀ·dC (k x n, depth m),
    each at its own shape (:func:`cost_models.compute.gemm_time_s`); for a linear node dB is
    the weight gradient (W of Qi et al. 2024, part of the backward), for attention and
    batched matmuls, which hold no weights, it is 0. A node without shapes is priced by its
    FLOPs, backward twice the forward (a linear's W half of it); so is fused attention on a
    device with a measured ``attention_tflops`` (:func:`cost_models.compute.attention_time_s`).

    ``attention`` is the kernel of an "sdpa" node (:attr:`autopar.planner.costs.tables.Config.
    attention`): "math" runs Q·Kᵀ and P·V over every score, masked or not; "flash" (a fused
    kernel, FlashAttention-2, Dao 2023, Algorithm 1 and 2) computes only the tiles on and
    below the diagonal of a causal node (:data:`CAUSAL_SKIP_FRACTION`, ``extra
    ["causal_skip"]``) and recomputes Q·Kᵀ in backward (five GEMMs where the math kernel runs
    four: 2.5 times the forward FLOPs, as the same benchmark counts them). Under context
    parallelism the math kernel runs ``extra["cp_score_fraction"]`` of the local × whole
    scores (:mod:`autopar.graph.context_parallel`)."""
    div, gemms = strat.compute_divisor, info.extra.get("gemms")
    if info.kind == "sdpa":  # a fused kernel with its own measured rate (a CPU process)
        head = min(min(g[1:]) for g in gemms) if gemms else 0  # min(s, hd)
        fwd = compute.attention_time_s(info.flops * b / div, dev, head)
        if fwd is not None:
            return fwd, 2.0 * fwd, 0.0
    weights = info.kind == "linear" or info.extra.get("gemm_weights", False)
    if not gemms:
        fwd = compute.matmul_time_s(info.flops * b / div, dev)
        return fwd, 2.0 * fwd, fwd if weights else 0.0
    flash = info.kind == "sdpa" and attention == "flash"
    fwd = bwd = wgrad = 0.0
    for i, (batch, m, n, k) in enumerate(gemms):
        if info.extra.get("gemm_folded"):
            m *= b
        else:
            batch *= b
        if div > 1:
            if strat.name == "column":
                n = -(-n // div)
            elif strat.name == "row":
                k = -(-k // div)
            elif batch % div == 0:
                batch //= div
            else:
                m = -(-m // div)
        gemm = compute.gemm_time_s(m, n, k, dev, batch)
        if flash and i == 0:  # Q·Kᵀ again
            bwd += gemm
        fwd += gemm
        d_weight = compute.gemm_time_s(k, n, m, dev, batch)
        bwd += compute.gemm_time_s(m, k, n, dev, batch) + d_weight
        wgrad += d_weight if weights else 0.0
    if flash and info.extra.get("causal_skip"):
        fwd, bwd = fwd * CAUSAL_SKIP_FRACTION, bwd * CAUSAL_SKIP_FRACTION
    elif info.kind == "sdpa" and not flash:  # context parallelism: each chunk's keys only
        share = info.extra.get("cp_score_fraction", 1.0)
        fwd, bwd = fwd * share, bwd * share
    return fwd, bwd, wgrad
