"""Tracked random-number streams for dropout under tensor parallelism (Megatron-style).

Dropout draws a random mask. Under tensor parallelism the t ranks of a TP group hold
either the *same* tensor (replicated, placement R) or *different slices* of one
tensor (sharded, placement S<d>), and the masks must follow suit:

* replicated tensor: every rank must draw the same mask, or the replicas diverge
  (the residual stream would no longer be one tensor);
* sharded tensor (the attention core on whole heads, or sequence-parallel regions):
  each rank must draw a different mask, or every shard repeats the same pattern and
  the full tensor's mask is not i.i.d.

Megatron-LM solves this with two random streams (Shoeybi et al. 2019, "Megatron-LM",
section 3; Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.2.2
for the sequence-parallel dropouts): the *default* stream, seeded the same on every
rank of a TP group, and a *tensor-parallel* stream seeded per TP rank, which the
dropouts on sharded tensors use by swapping it into the default generator for the
duration of the op. This module is our version of Megatron-LM's
``megatron/core/tensor_parallel/random.py`` (``CudaRNGStatesTracker``,
``model_parallel_cuda_manual_seed``) and ``megatron/training/initialize.py``
(``_set_random_seed``), for CPU and CUDA and without module-level state: the tracker
is an object made per parallelized program and handed to whoever forks it.

Seeds of one rank (:func:`rank_seeds`), from a user seed ``seed``::

    default stream          seed + 100·pp_rank                 (same on TP and DP ranks)
    tensor-parallel stream  seed + 100·pp_rank + 2718 + tp_rank (differs per TP rank)

Pipeline stages differ so that their (different) layers do not reuse masks. DP
replicas share both seeds, as in Megatron without ``--data-parallel-random-init``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from autopar.runtime.compat import real_tensors
from autopar.runtime.device import default_generators

__all__ = ["TENSOR_PARALLEL", "RNGStatesTracker", "RankSeeds", "rank_seeds", "seed_rank"]

TENSOR_PARALLEL = "tensor-parallel"
"""Name of the per-TP-rank stream (Megatron: ``model-parallel-rng``)."""

_TP_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed from the default seed
_PP_STRIDE = 100  # Megatron's per-pipeline-stage seed stride

States = dict[str, tuple[torch.Tensor, ...]]


class RNGStatesTracker:
    """Named random streams that can be swapped into the default generator(s).

    Each stream is a saved generator state (one per generator: the CPU's, and on CUDA
    also the device's). :meth:`fork` makes a stream current for the ops inside it and
    stores its advanced state on exit, so a stream continues where it stopped while the
    default stream is left untouched. Megatron-LM: ``CudaRNGStatesTracker``.

    device: where the forked ops run ("cpu", or an accelerator such as "cuda:i" to also swap
        that device's generator, :func:`autopar.runtime.device.default_generators`).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        default_generators(self.device)  # validate early
        self._states: States = {}
        self._seeds: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"RNGStatesTracker(device={self.device}, seeds={self._seeds})"

    @property
    def seeds(self) -> dict[str, int]:
        """Stream name -> the seed it was added with."""
        return dict(self._seeds)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (the default generators are not
        touched). Raises ValueError if the name or the seed is already taken."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream; "
                             "two streams with one seed would draw the same masks")
        self._states[name] = tuple(torch.Generator(device=g.device).manual_seed(seed).get_state()
                                   for g in default_generators(self.device))
        self._seeds[name] = seed

    def get_states(self) -> States:
        """A copy of every stream's state (name -> generator states)."""
        with real_tensors():  # a dry run's fake mode: states stay real tensors
            return {name: tuple(s.clone() for s in states) for name, states in self._states.items()}

    def set_states(self, states: States) -> None:
        """Replace the streams' states (e.g. with what :meth:`get_states` returned earlier)."""
        unknown = set(states) - set(self._states)
        if unknown:
            raise ValueError(f"unknown RNG streams {sorted(unknown)}; known: {sorted(self._states)}")
        with real_tensors():
            for name, value in states.items():
                self._states[name] = tuple(s.clone() for s in value)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Run the block with stream ``name`` as the default generator(s); on exit save the
        stream's advanced state and put the default state back (also on an exception)."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; known: {sorted(self._states)}")
        generators = default_generators(self.device)
        with real_tensors():  # a dry run's fake mode: generator states stay real tensors
            outside = [g.get_state() for g in generators]
            for g, state in zip(generators, self._states[name]):
                g.set_state(state)
        try:
            yield
        finally:
            with real_tensors():
                self._states[name] = tuple(g.get_state() for g in generators)
                for g, state in zip(generators, outside):
                    g.set_state(state)


@dataclass(frozen=True)
class RankSeeds:
    """The seeds of one rank's random streams.

    default: seed of the default generator (same on every TP and DP rank of a stage).
    tensor_parallel: seed of the tensor-parallel stream (different on every TP rank).
    """

    default: int
    tensor_parallel: int


def rank_seeds(seed: int, *, tp_rank: int, pp_rank: int) -> RankSeeds:
    """Megatron-LM's seeds for a rank (``_set_random_seed`` adds 100·pp_rank,
    ``model_parallel_cuda_manual_seed`` adds 2718 + tp_rank for the TP stream)."""
    default = seed + _PP_STRIDE * pp_rank
    return RankSeeds(default=default, tensor_parallel=default + _TP_OFFSET + tp_rank)


def seed_rank(seed: int, *, tp_rank: int, pp_rank: int,
              device: torch.device | str = "cpu") -> RNGStatesTracker:
    """Seed this process's default generator(s) with the rank's default seed
    (``torch.manual_seed``: CPU and every CUDA device, as Megatron's ``_set_random_seed``
    does) and return a tracker holding the rank's ``"tensor-parallel"`` stream.

    Call once per parallelized program, before its first forward.
    """
    seeds = rank_seeds(seed, tp_rank=tp_rank, pp_rank=pp_rank)
    torch.manual_seed(seeds.default)
    tracker = RNGStatesTracker(device)
    tracker.add(TENSOR_PARALLEL, seeds.tensor_parallel)
    return tracker
