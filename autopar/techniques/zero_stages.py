"""ZeRO stages, one record each: everything autopar knows about sharding model states over
the data-parallel group (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC'20, section 5: P_os, P_os+g, P_os+g+p).

A :class:`ZeroStage` owns, for its value of ``Layout.zero_stage``:

* **the rule**: with which pipeline degree it runs (:meth:`ZeroStage.problem`; the
  runtime support, the search, plan files and the engine ask it);
* **the price**: which model states it shards (``shards_*``: the model-state bytes of
  :func:`cost_models.memory.model_state_bytes`, the precision's master copy), the
  data-parallel collective the gradients take (:attr:`ZeroStage.gradient_collective`) and
  how often per step (:meth:`ZeroStage.gradient_reductions`), whether parameters are
  all-gathered per micro-batch (``shards_parameters``): read by the cost tables, the
  communication bytes, the precision and the engine's order of gradient sums;
* **the runner**: the autopar class that executes it (``runner``);
* **the drawing**: how the report names it (``title``, the layout table's row);
* **the framework mapping**: per target framework, its setting for the stage, or a
  :class:`~autopar.techniques.answers.Refusal` saying why that framework does
  not run it.

Pure Python: the planner, the runtime, the report and the frameworks import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.techniques.answers import Refusal, framework_records, record_for

__all__ = ["ZeroStage", "ZERO_STAGE_RECORDS", "zero_stage", "framework_zero_stages",
           "zero_stage_for"]


@dataclass(frozen=True, kw_only=True)
class ZeroStage:
    """One ZeRO stage (module docstring).

    stage: the value of ``Layout.zero_stage`` (0-3). title: as the report names it.
    source: the paper and section. shards_optimizer / shards_gradients /
    shards_parameters: which model states are partitioned over the d data-parallel ranks
    (Rajbhandari et al. 2020, Fig. 1). reduces_each_micro_batch: the gradients leave each
    micro-batch (reduce-scattered as they are produced, their buffer freed) instead of once
    per step. with_pipeline: why it does not run with pp > 1, or None (the rule).
    runner: the autopar class that executes it. frameworks: target -> its setting for the
    stage, or a :class:`Refusal`.
    """

    stage: int
    title: str
    source: str
    shards_optimizer: bool
    shards_gradients: bool
    shards_parameters: bool
    reduces_each_micro_batch: bool
    with_pipeline: str | None
    runner: str
    frameworks: Mapping[str, str | Refusal]

    @property
    def gradient_collective(self) -> str:
        """The data-parallel collective of the gradients: ``all_reduce`` when every rank
        keeps the whole optimizer, else ``reduce_scatter`` (each rank its shard)."""
        return "reduce_scatter" if self.shards_optimizer else "all_reduce"

    def gradient_reductions(self, num_micro_batches: int) -> int:
        """How many times a step reduces the gradients over the data-parallel group: m when
        they leave each micro-batch, else once (gradient accumulation)."""
        return num_micro_batches if self.reduces_each_micro_batch else 1

    def problem(self, pp: int) -> str | None:
        """Why this stage does not run with ``pp`` pipeline stages, or None."""
        return self.with_pipeline if pp > 1 else None


def _not_with_pipeline(stage: int) -> str:
    """A stage whose gradients leave each micro-batch needs the engine's own micro-batch
    loop (pp = 1), as in DeepSpeed, which combines neither ZeRO-2 nor ZeRO-3 with its
    pipeline engine."""
    return (f"ZeRO-{stage} reduce-scatters gradients after every micro-batch, which runs only "
            "without pipelining (as in DeepSpeed); use zero_stage 0 or 1 with pp > 1, or pp=1")


_SOURCE = "Rajbhandari et al. 2020, ZeRO, section 5 and Fig. 1"
_MEGATRON_FSDP = Refusal(
    "Megatron-LM shards gradients and parameters only through FSDP (--use-torch-fsdp2, "
    "Megatron-FSDP), which the Megatron emitter does not write; use zero_stage 1 "
    "(--use-distributed-optimizer)")
_TORCHTITAN_OS = Refusal(
    "torchtitan replicates (DDP, data_parallel_replicate_degree) or fully shards (FSDP2, "
    "data_parallel_shard_degree); it has no optimizer-state-only sharding: use zero_stage 0 "
    "or 3")

ZERO_STAGE_RECORDS: dict[int, ZeroStage] = {r.stage: r for r in (
    ZeroStage(stage=0, title="ZeRO-0 (replicated, gradients all-reduced)", source=_SOURCE,
              shards_optimizer=False, shards_gradients=False, shards_parameters=False,
              reduces_each_micro_batch=False, with_pipeline=None,
              runner="autopar.runtime.zero.DistributedOptimizer",
              frameworks={"megatron": "DistributedDataParallel",
                          "torchtitan": "data_parallel_replicate_degree",
                          "deepspeed": "zero_optimization.stage=0"}),
    ZeroStage(stage=1, title="ZeRO-1 (optimizer states sharded)", source=_SOURCE,
              shards_optimizer=True, shards_gradients=False, shards_parameters=False,
              reduces_each_micro_batch=False, with_pipeline=None,
              runner="autopar.runtime.zero.DistributedOptimizer",
              frameworks={"megatron": "--use-distributed-optimizer",
                          "torchtitan": _TORCHTITAN_OS,
                          "deepspeed": "zero_optimization.stage=1"}),
    ZeroStage(stage=2, title="ZeRO-2 (optimizer states and gradients sharded)", source=_SOURCE,
              shards_optimizer=True, shards_gradients=True, shards_parameters=False,
              reduces_each_micro_batch=True, with_pipeline=_not_with_pipeline(2),
              runner="autopar.runtime.zero.DistributedOptimizer",
              frameworks={"megatron": _MEGATRON_FSDP, "torchtitan": _TORCHTITAN_OS,
                          "deepspeed": "zero_optimization.stage=2"}),
    ZeroStage(stage=3, title="ZeRO-3 (optimizer states, gradients and parameters sharded: "
              "FSDP2)", source=_SOURCE + "; torch.distributed.fsdp.fully_shard",
              shards_optimizer=True, shards_gradients=True, shards_parameters=True,
              reduces_each_micro_batch=True, with_pipeline=_not_with_pipeline(3),
              runner="autopar.runtime.fsdp.FullyShardedOptimizer",
              frameworks={"megatron": _MEGATRON_FSDP,
                          "torchtitan": "data_parallel_shard_degree",
                          "deepspeed": "zero_optimization.stage=3"}),
)}
"""Every ZeRO stage autopar prices, by ``Layout.zero_stage``."""


def zero_stage(stage: int) -> ZeroStage:
    """The record of ZeRO stage ``stage``; ValueError naming the stages there are."""
    if isinstance(stage, bool) or stage not in ZERO_STAGE_RECORDS:
        raise ValueError(f"zero_stage must be one of {tuple(ZERO_STAGE_RECORDS)}, got {stage!r}")
    return ZERO_STAGE_RECORDS[stage]


def framework_zero_stages(target: str) -> tuple[int, ...]:
    """The ZeRO stages ``target`` (one of FRAMEWORK_TARGETS) runs: those it does not refuse."""
    return tuple(r.stage for r in framework_records(ZERO_STAGE_RECORDS.values(), target))


def zero_stage_for(target: str, setting: str) -> ZeroStage:
    """The record ``target`` runs under its ``setting`` (the inverse of ``frameworks``);
    ValueError naming the settings it has."""
    return record_for(ZERO_STAGE_RECORDS.values(), target, setting, "ZeRO setting")
