"""Expert parallelism (EP), one record: everything autopar knows about splitting a
mixture-of-experts layer's E routed experts over ep ranks (Lepikhin et al. 2020, "GShard",
section 2.2; Fedus et al. 2022, "Switch Transformers", section 2.2; Megatron-Core's MoE,
"MoE Parallel Folding", Liu et al. 2025, arXiv:2504.14960, section 3).

* **the rule** (:func:`ep_problem`): ep folds over the data-parallel ranks (ep | d: each EP
  group is ep consecutive DP ranks of one (tp, pp) coordinate; Megatron-Core's EP with
  expert-TP 1 folded over DP), ep | E of every MoE layer, the layer's experts one call of a
  transformers experts module (:mod:`autopar.graph.experts`: what the runtime swaps for its
  sharded form), and ZeRO stage 0 (the autopar runtime all-reduces the expert gradients
  over their own expert-data-parallel group of d/ep ranks; ZeRO over that group is not
  built yet);
* **the groups** (:func:`expert_ranks`): DP rank j is EP rank ``j % ep`` of EP group
  ``j // ep``; the expert-data-parallel (EDP) group of a rank is the d/ep DP ranks with its
  EP rank, which hold the same experts;
* **the price** (:mod:`cost_models.moe`): per MoE layer and micro-batch, dispatch and
  combine all-to-alls in forward and again in backward over the EP group, b·s·k·h values
  each with (ep−1)/ep of them leaving the rank under balanced routing; the experts'
  parameters, gradients and optimizer states divided by ep; their gradients all-reduced
  over the EDP group instead of the DP group; per-expert GEMMs of ep times the rows;
* **the framework mapping** (:data:`FRAMEWORK_FLAGS`): Megatron-LM's
  ``--expert-model-parallel-size`` (with ``--expert-tensor-parallel-size 1``), torchtitan's
  ``parallelism.expert_parallel_degree``.

Pure Python: the planner, the runtime, the report and the frameworks import it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ep_problem", "expert_ranks", "FRAMEWORK_FLAGS", "SOURCE"]

SOURCE = ("Lepikhin et al. 2020 (GShard), section 2.2; Liu et al. 2025 (MoE Parallel "
          "Folding), section 3")

FRAMEWORK_FLAGS = {
    "megatron": "--expert-model-parallel-size",
    "torchtitan": "parallelism.expert_parallel_degree",
}
"""Per target framework, its setting of the EP degree (Megatron-LM's arguments.py;
torchtitan's ``Parallelism`` job config). autopar emits Megatron-LM's
(:mod:`autopar.frameworks.megatron_moe`, at tp = 1, with ``--expert-tensor-parallel-size 1
--moe-token-dispatcher-type alltoall``); torchtitan's is not emitted (its EP borrows FSDP
ranks and its MoE layers are its own models': :mod:`autopar.frameworks.torchtitan`)."""


def ep_problem(ep: int, dp: int, zero_stage: int | None,
               num_experts: Sequence[int], shardable: bool = True) -> str | None:
    """Why expert parallelism of degree ``ep`` does not run, or None.

    dp: the data-parallel size d (ep folds over it); zero_stage: the ZeRO stage (None:
    not chosen yet); num_experts: E of every MoE layer of the model (empty: none);
    shardable: every MoE layer's experts are one call of a transformers experts module.
    """
    if ep == 1:
        return None
    if not num_experts:
        return f"ep={ep} but the model has no mixture-of-experts layer; use ep=1"
    if not shardable:
        return (f"ep={ep}: a MoE layer's experts are ops of the graph, not one call of a "
                "transformers experts module, which is what autopar shards; use ep=1")
    if dp % ep:
        return (f"ep={ep} does not divide dp={dp}: expert parallelism folds over the "
                f"data-parallel ranks; choose ep in {[e for e in range(1, dp + 1) if dp % e == 0]}")
    bad = sorted({E for E in num_experts if E % ep})
    if bad:
        return f"ep={ep} does not divide the {bad[0]} experts of a MoE layer; choose ep | E"
    if zero_stage not in (None, 0):
        return (f"ep={ep} with zero_stage={zero_stage}: autopar all-reduces expert gradients "
                "over the expert-data-parallel group; ZeRO over that group is not built yet; "
                "use zero_stage=0")
    return None


def expert_ranks(dp_rank: int, dp: int, ep: int) -> tuple[int, list[int], list[int]]:
    """(EP rank, the DP ranks of this rank's EP group, the DP ranks of its expert-data-
    parallel group) for DP rank ``dp_rank`` of ``dp`` under EP degree ``ep`` (ep | dp)."""
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    group = dp_rank // ep
    return (dp_rank % ep, [group * ep + i for i in range(ep)],
            [j * ep + dp_rank % ep for j in range(dp // ep)])
