"""Compute time on one device (roofline) and the model FLOPs of a GPT step.

Roofline (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual
performance model"): an operation is bound either by arithmetic or by memory
traffic, so its time is the larger of ``flops / sustained FLOP/s`` and
``bytes / memory bandwidth``.  Tensor-core GEMMs sustain a fraction of the
datasheet peak; that fraction is ``DeviceSpec.matmul_efficiency``, one number per
hardware profile.  On a GPU profile (``DeviceSpec.sm_count`` set) a GEMM's time also
depends on its shape (m, n, k): :func:`gemm_time_s` prices the tile and wave
quantisation of the kernel that runs it, so utilisation grows with the matrix sizes.
"""

from __future__ import annotations

import math
import statistics

from ._checks import RECOMPUTE_MODES, check_choice, check_non_negative, check_positive
from .hardware import DeviceSpec


def _check_device(device: object) -> DeviceSpec:
    if not isinstance(device, DeviceSpec):
        raise ValueError(f"device must be a DeviceSpec, got {type(device).__name__}")
    return device


def matmul_time_s(flops: float, device: DeviceSpec) -> float:
    """Seconds for ``flops`` FLOPs of GEMM work: ``flops / (peak_flops * matmul_efficiency)``."""
    flops = check_non_negative("flops", flops)
    device = _check_device(device)
    return flops / (device.peak_flops * device.matmul_efficiency)


def _check_dims(m: object, n: object, k: object, batch: object) -> tuple[int, int, int, int]:
    dims = []
    for name, value in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"GEMM {name} must be an int >= 0, got {value!r}")
        dims.append(value)
    return dims[0], dims[1], dims[2], dims[3]


def _tile_work(m: int, n: int, k: int, batch: int, device: DeviceSpec) -> float:
    """Multiply-adds the SMs spend on ``batch`` GEMMs (m, n, k), tiles and waves included
    (see :func:`gemm_time_s`): ``waves * sm_count * Tm * Tn * ceil(k/Tk) * Tk``, in the
    better of the tile's two orientations."""
    tile_m, tile_n, tile_k = device.gemm_tile
    depth = math.ceil(k / tile_k) * tile_k
    best = math.inf
    for tm, tn in ((tile_m, tile_n), (tile_n, tile_m)):
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / device.sm_count)
        best = min(best, waves * device.sm_count * tm * tn * depth)
    return best


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> float:
    """Useful fraction of the tile work of ``batch`` GEMMs C (m x n) = A (m x k) B (k x n):
    ``batch*m*n*k`` over the multiply-adds the SMs spend (:func:`gemm_time_s`), in (0, 1];
    1.0 on a device without a tile model (``sm_count`` None) or for an empty GEMM."""
    m, n, k, batch = _check_dims(m, n, k, batch)
    device = _check_device(device)
    if device.sm_count is None or 0 in (m, n, k, batch):
        return 1.0
    return batch * m * n * k / _tile_work(m, n, k, batch, device)


def gemm_time_s(m: int, n: int, k: int, device: DeviceSpec, batch: int = 1) -> float:
    """Seconds of ``batch`` independent GEMMs C (m x n) = A (m x k) B (k x n), 2*batch*m*n*k FLOPs.

    A GPU computes C in output tiles of Tm x Tn (``device.gemm_tile``), one thread block
    per tile, each stepping through k in slices of Tk; the blocks run in *waves* of
    ``sm_count``, one per SM (NVIDIA, "Matrix Multiplication Background User's Guide",
    DU-09799-001, sections 2.1 and 3). Two losses follow from the shape alone:

    * tile quantisation (section 3.1): a partial tile costs a whole one, so the work is
      ``ceil(m/Tm) * ceil(n/Tn)`` tiles of ``Tm * Tn * ceil(k/Tk) * Tk`` multiply-adds;
    * wave quantisation (section 3.2): ``T = batch * tiles`` blocks take ``ceil(T / sm_count)``
      waves, the last one partly idle (e.g. 288 tiles on 108 SMs: 3 waves, 89% busy).

    Each SM runs its tile at ``peak_flops * matmul_efficiency / sm_count`` (the one fitted
    constant of the profile is the in-tile rate), so

        time = waves * 2 * Tm * Tn * ceil(k/Tk) * Tk / (peak_flops * matmul_efficiency / sm_count)

    in whichever orientation of the tile (Tm x Tn or Tn x Tm) is faster, as cuBLAS picks
    its 256x128 or 128x256 kernel. GEMMs much narrower than a tile (a 64-wide head) are
    priced as the padded tile: an upper bound, since the library may pick a narrower kernel.
    On a device without a tile model (``sm_count`` None, a CPU) this is
    ``matmul_time_s(2*batch*m*n*k)`` at Hockney's half-performance rate of the smallest
    dimension, :func:`half_performance_factor` (``device.gemm_half_dim``). ValueError on
    negative or non-int dimensions.
    """
    m, n, k, batch = _check_dims(m, n, k, batch)
    device = _check_device(device)
    flops = 2.0 * batch * m * n * k
    if device.sm_count is None or flops == 0:
        return matmul_time_s(flops, device) * half_performance_factor(
            min(m, n, k), device.gemm_half_dim)
    return 2.0 * _tile_work(m, n, k, batch, device) / (device.peak_flops * device.matmul_efficiency)


def half_performance_factor(dim: float, half_dim: float) -> float:
    """Time over the asymptotic-rate time of an operation whose smallest dimension is
    ``dim`` elements: ``1 + half_dim/dim``, Hockney's r = r∞·n/(n + n½) (Hockney &
    Jesshope, "Parallel Computers 2", 1988, §1.3.3); 1 when ``half_dim`` is 0."""
    return 1.0 + half_dim / dim if half_dim and dim > 0 else 1.0


def fit_half_performance(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(r∞, n½) of Hockney's model r = r∞·d/(d + n½) (:func:`half_performance_factor`)
    fitted to measured ``points`` (d, rate): 1/r = 1/r∞ + (n½/r∞)/d is linear in 1/d,
    fitted by least squares. With one distinct d, or a fit whose rate does not grow with d
    (noise), n½ = 0 and r∞ the harmonic mean of the rates. ValueError on a non-positive
    d or rate."""
    for d, r in points:
        check_positive("d", d)
        check_positive("rate", r)
    xs, ys = [1.0 / d for d, _ in points], [1.0 / r for _, r in points]
    if len(set(xs)) < 2:
        return len(ys) / sum(ys), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0 or intercept <= 0:
        return len(ys) / sum(ys), 0.0
    return 1.0 / intercept, slope / intercept


def attention_time_s(flops: float, device: DeviceSpec, min_dim: float = 0.0) -> float | None:
    """Seconds of ``flops`` FLOPs of fused attention (Q·Kᵀ and P·V, counted in full) at the
    device's measured ``attention_tflops``, slowed for heads whose smaller of s and hd is
    ``min_dim`` by :func:`half_performance_factor` (``device.attention_half_dim``; 0: not
    known, no shape effect); None when the device has no such rate (its attention GEMMs
    are priced by :func:`gemm_time_s`)."""
    flops = check_non_negative("flops", flops)
    device = _check_device(device)
    if device.attention_tflops is None:
        return None
    factor = half_performance_factor(min_dim, device.attention_half_dim)
    return flops / (device.attention_tflops * 1e12) * factor


def memory_bound_time_s(nbytes: float, device: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` through device memory: ``nbytes / (memory_bandwidth_gbps * 1e9)``."""
    nbytes = check_non_negative("nbytes", nbytes)
    device = _check_device(device)
    return nbytes / (device.memory_bandwidth_gbps * 1e9)


def elementwise_time_s(nbytes: float, transcendentals: float, device: DeviceSpec) -> float:
    """Seconds of an element-wise op moving ``nbytes`` that evaluates ``transcendentals``
    functions (erf, exp): the larger of its memory time and its compute time at the
    device's ``transcendental_gelems_per_s`` (memory time alone when that is None)."""
    device = _check_device(device)
    rate = device.transcendental_gelems_per_s
    count = check_non_negative("transcendentals", transcendentals)
    return max(memory_bound_time_s(nbytes, device), count / (rate * 1e9) if rate else 0.0)


def dispatched_time_s(device_s: float, dispatches: float, device: DeviceSpec) -> float:
    """Seconds of ``device_s`` of device work that the host issues in ``dispatches`` op
    dispatches of ``device.op_overhead_s`` each: their sum where one process does both
    (a CPU rank), the larger where the device runs what the host queued asynchronously
    (``device.async_dispatch``, a GPU: short kernels wait on their launch, long ones
    hide it; measured on an H200 host, 22 µs per fx node in fp32:
    ``benchmarks/gpu_check.py``)."""
    device = _check_device(device)
    host_s = check_non_negative("dispatches", dispatches) * device.op_overhead_s
    device_s = check_non_negative("device_s", device_s)
    return max(device_s, host_s) if device.async_dispatch else device_s + host_s


def op_time_s(flops: float, bytes_moved: float, device: DeviceSpec) -> float:
    """Roofline time of one operation, seconds: the larger of its compute and memory times."""
    return max(matmul_time_s(flops, device), memory_bound_time_s(bytes_moved, device))


def gpt_model_flops(
    global_batch_size: float,
    seq_len: float,
    num_layers: float,
    hidden_size: float,
    vocab_size: float,
    recompute: str = "none",
) -> float:
    """FLOPs of one training step of a GPT model (forward + backward [+ recompute]).

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM"), equation (3), with B the global batch, s the
    sequence length, L layers, h hidden size, V vocabulary:

        F = c * B * s * L * h^2 * (1 + s / (6h) + V / (16 L h))

    c = 96 with full recomputation (forward counted twice: 4 forward-equivalents of
    24*B*s*L*h^2 each) and c = 72 without (``"none"``, and ``"selective"``, whose
    recomputed attention core is not counted: Korthikanti et al. 2022 count model
    FLOPs this way).  Multiply-adds count as 2 FLOPs.  Dividing by (step time *
    num GPUs * peak) gives MFU for ``"none"``/``"selective"`` and HFU for ``"full"``.
    """
    b = check_positive("global_batch_size", global_batch_size)
    s = check_positive("seq_len", seq_len)
    layers = check_positive("num_layers", num_layers)
    h = check_positive("hidden_size", hidden_size)
    v = check_positive("vocab_size", vocab_size)
    check_choice("recompute", recompute, RECOMPUTE_MODES)
    factor = {"none": 72.0, "selective": 72.0, "full": 96.0}[recompute]  # c, per the above
    return factor * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
