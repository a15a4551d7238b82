"""Compute time on one device (roofline) and the model FLOPs of a GPT step.

Roofline (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual
performance model"): an operation is bound either by arithmetic or by memory
traffic, so its time is the larger of ``flops / sustained FLOP/s`` and
``bytes / memory bandwidth``.  Tensor-core GEMMs sustain a fraction of the
datasheet peak; that fraction is ``DeviceSpec.matmul_efficiency``, one number per
hardware profile.
"""

from __future__ import annotations

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


def memory_bound_time_s(nbytes: float, device: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` through device memory: ``nbytes / (memory_bandwidth_gbps * 1e9)``."""
    nbytes = check_non_negative("nbytes", nbytes)
    device = _check_device(device)
    return nbytes / (device.memory_bandwidth_gbps * 1e9)


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
    factor = 96.0 if recompute == "full" else 72.0
    return factor * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
