"""The rank's device: the one module of the runtime that knows about accelerators.

Everything else in :mod:`autopar.runtime` takes a ``torch.device`` from here (through
``ParallelGroups.device``) and never calls ``torch.cuda``: meshes are built on
``device.type``, the stage's parameters, inputs, losses and pipeline buffers live on it,
FSDP2 and ``torch.distributed.pipelining`` follow the parameters, and the RNG tracker swaps
the device's generator next to the CPU's.

The rule (as torchrun and torchtitan use it): a process group whose backend is gloo alone
keeps the rank on the CPU; any other backend (NCCL, or a "cpu:gloo,cuda:nccl" pair) puts the
rank on accelerator ``LOCAL_RANK`` (torchrun's environment variable; the global rank modulo
the device count when it is unset), through the device-generic ``torch.accelerator`` API.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["rank_device", "default_generators", "peak_memory_bytes", "reset_peak_memory",
           "synchronize"]


def rank_device(backend: str | None = None) -> torch.device:
    """The device this rank computes on, from the process group's backend (default: the
    initialised group's), made current for the accelerator API.

    Raises:
        RuntimeError: the backend needs an accelerator (e.g. "nccl") but torch sees none
            (no ``torch.accelerator.current_accelerator()``, or a CUDA build on a host
            without GPUs: no device): initialise the process group with backend="gloo" on a
            machine without GPUs.
    """
    backend = (backend or dist.get_backend()).lower()
    if backend == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    # a CUDA build of torch on a host without GPUs names "cuda" but counts 0 devices
    count = torch.accelerator.device_count() if accelerator is not None else 0
    if count == 0:
        raise RuntimeError(f"the process group's backend {backend!r} computes on an "
                           "accelerator, but torch sees none on this machine; initialise the "
                           "process group with backend='gloo' to train on CPUs")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % count))
    if not 0 <= index < count:
        raise RuntimeError(f"LOCAL_RANK={index} but this machine has {count} "
                           f"{accelerator.type} devices; launch at most {count} processes per node")
    torch.accelerator.set_device_index(index)
    return torch.device(accelerator.type, index)


def default_generators(device: torch.device) -> tuple[torch.Generator, ...]:
    """The generators an op on ``device`` draws from: the CPU's, plus the accelerator's
    (``torch.get_device_module(type).default_generators[index]``, e.g. CUDA's)."""
    device = torch.device(device)
    if device.type == "cpu":
        return (torch.default_generator,)
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:
        module = None
    generators = getattr(module, "default_generators", None)
    if generators is None:
        raise ValueError(f"the {device.type} device module has no default generators to fork; "
                         "dropout under tensor parallelism needs them")
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return (torch.default_generator, generators[index])


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes the caching allocator handed out on ``device`` since the last
    :func:`reset_peak_memory` (``torch.accelerator.max_memory_allocated``); None on the
    CPU, which keeps no such counter."""
    if torch.device(device).type == "cpu":
        return None
    return torch.accelerator.max_memory_allocated(device)


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peak counter of :func:`peak_memory_bytes` (no-op on the CPU)."""
    if torch.device(device).type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (for wall-clock timing; no-op on the CPU)."""
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize(device)
