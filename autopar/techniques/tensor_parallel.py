"""Tensor parallelism with and without sequence parallelism, one record each: everything
autopar knows about how a TP group of t ranks holds the activations between its
column- and row-parallel regions (Shoeybi et al. 2019, "Megatron-LM", section 3: the f
and g operators; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2: sequence parallelism, the g-bar and f-bar operators).

The value is ``Layout.sequence_parallel`` / ``Plan.sequence_parallel`` at tp > 1 (tp = 1
runs neither: nothing is split). A :class:`TensorParallelMode` owns:

* **the rule**: which tensor-parallel sizes it runs with (:meth:`TensorParallelMode.problem`;
  pins, plan files and the runtime ask it);
* **the price**: whether LayerNorm, dropout and the residual run on sequence shards
  (``shards_sequence``: the strategies offer LayerNorm on s/t rows and the P -> S
  transition, and the closed form of a layer's kept activations
  (:func:`cost_models.memory.transformer_layer_activation_bytes`, Korthikanti et al. 2022 Table 2)
  divides its LayerNorm/dropout part by t), and the collectives a TP region ends and
  starts with (``region_collectives``: one all-reduce, or a reduce-scatter and an
  all-gather of the same bytes);
* **the runner**: the :mod:`autopar.runtime.tp_modules` class that completes a row-parallel
  region's partial output (``runner``), placed by the rewrite
  (:mod:`autopar.rewrite.tensor_parallel`);
* **the drawing**: how the report names it (``title``);
* **the framework mapping**: per target, its setting or a
  :class:`~autopar.techniques.answers.Refusal`.

Pure Python: the planner, the runtime, the report and the frameworks import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.techniques.answers import Refusal, framework_records, record_for

__all__ = ["TensorParallelMode", "TENSOR_PARALLEL_RECORDS", "tensor_parallel_mode",
           "framework_sequence_parallel", "framework_max_tp", "sequence_parallel_for"]


@dataclass(frozen=True, kw_only=True)
class TensorParallelMode:
    """One way of running tensor parallelism (module docstring).

    sequence_parallel: the value of ``Layout.sequence_parallel``. title: as the report
    names it (after "tensor parallel t"). source: the paper and section. min_tp: the
    smallest TP size it runs with (the rule: sequence shards need t > 1).
    shards_sequence: LayerNorm, dropout and the residual run on sequence shards of s/t
    tokens per rank. region_collectives: (at a row-parallel region's end, at a
    column-parallel region's start) in the forward: ("all_reduce", None) (Megatron's g,
    its f an identity) or ("reduce_scatter", "all_gather") (g-bar, f-bar). runner: the
    :mod:`autopar.runtime.tp_modules` class that completes a partial output. frameworks:
    target -> its setting, or a :class:`Refusal`.
    """

    sequence_parallel: bool
    title: str
    source: str
    min_tp: int
    shards_sequence: bool
    region_collectives: tuple[str, str | None]
    runner: str
    frameworks: Mapping[str, str | Refusal]

    @property
    def name(self) -> str:
        """The value as :func:`~autopar.techniques.answers.record_for` matches it."""
        return "tp+sp" if self.sequence_parallel else "tp"

    def problem(self, tp: int) -> str | None:
        """Why this mode does not run with a TP group of ``tp`` ranks, or None."""
        if tp < self.min_tp:
            return (f"sequence_parallel={self.sequence_parallel} splits activations over the "
                    f"TP group but tp={tp} is pinned; pin tp >= {self.min_tp} or drop "
                    "sequence_parallel")
        return None


_SHOEYBI = "Shoeybi et al. 2019, Megatron-LM, section 3 (f and g)"
_KORTHIKANTI = "Korthikanti et al. 2022, section 4.2.2 and Table 2"
_DEEPSPEED_TP = Refusal(
    "the DeepSpeed emitter writes no tensor parallelism (DeepSpeed's AutoTP shards "
    "differently: no vocabulary-parallel embedding, no pipeline with it); use tp=1")

TENSOR_PARALLEL_RECORDS: dict[bool, TensorParallelMode] = {r.sequence_parallel: r for r in (
    TensorParallelMode(
        sequence_parallel=False, title="", source=_SHOEYBI, min_tp=1, shards_sequence=False,
        region_collectives=("all_reduce", None),
        runner="autopar.runtime.tp_modules.ReduceFromTPRegion",
        frameworks={"megatron": "--tensor-model-parallel-size",
                    "torchtitan": Refusal(
                        "torchtitan's tensor-parallel plan always runs norms on sequence "
                        "shards (SequenceParallel); use sequence_parallel=True"),
                    "deepspeed": _DEEPSPEED_TP}),
    TensorParallelMode(
        sequence_parallel=True, title=" + sequence parallel", source=_KORTHIKANTI, min_tp=2,
        shards_sequence=True, region_collectives=("reduce_scatter", "all_gather"),
        runner="autopar.runtime.tp_modules.ReduceScatterToTPRegion",
        frameworks={"megatron": "--sequence-parallel",
                    "torchtitan": "tensor_parallel_degree",
                    "deepspeed": _DEEPSPEED_TP}),
)}
"""Every tensor-parallel mode autopar prices, by ``Layout.sequence_parallel``."""


def tensor_parallel_mode(sequence_parallel: bool) -> TensorParallelMode:
    """The record of ``sequence_parallel``; ValueError naming the values there are."""
    if not isinstance(sequence_parallel, bool) or sequence_parallel not in TENSOR_PARALLEL_RECORDS:
        raise ValueError(f"sequence_parallel must be one of {tuple(TENSOR_PARALLEL_RECORDS)}, "
                         f"got {sequence_parallel!r}")
    return TENSOR_PARALLEL_RECORDS[sequence_parallel]


def framework_sequence_parallel(target: str) -> tuple[bool, ...]:
    """The ``sequence_parallel`` values ``target`` runs at tp > 1 (those it does not
    refuse), or (False,) where it refuses tensor parallelism altogether (it runs tp = 1,
    which splits nothing)."""
    return tuple(r.sequence_parallel for r in framework_records(
        TENSOR_PARALLEL_RECORDS.values(), target)) or (False,)


def framework_max_tp(target: str) -> int | None:
    """1 where ``target`` refuses every tensor-parallel mode, else None (no limit)."""
    return None if framework_records(TENSOR_PARALLEL_RECORDS.values(), target) else 1


def sequence_parallel_for(target: str, setting: str) -> TensorParallelMode:
    """The record ``target`` runs under its ``setting`` (the inverse of ``frameworks``);
    ValueError naming the settings it has."""
    return record_for(TENSOR_PARALLEL_RECORDS.values(), target, setting,
                      "tensor-parallel setting")
