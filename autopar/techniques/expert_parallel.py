"""Expert parallelism (EP), one record: everything autopar knows about splitting a
mixture-of-experts layer's E routed experts over ep ranks (Lepikhin et al. 2020, "GShard",
section 2.2; Fedus et al. 2022, "Switch Transformers", section 2.2; Megatron-Core's MoE,
"MoE Parallel Folding", Liu et al. 2025, arXiv:2504.14960, section 3).

* **the rule** (:func:`ep_problem`): ep folds over the t·d tensor- and data-parallel ranks
  of a pipeline stage (ep | t·d: each EP group is ep consecutive ranks of the stage in
  Megatron's order, TP innermost; Megatron-Core's "MoE Parallel Folding" with expert-TP 1),
  and under TP (t > 1) every experts call runs on its TP rank's share of the tokens
  (:func:`experts_token_parallel`: the tokens of the micro-batch are split over the TP
  ranks as sequence parallelism splits them, Megatron-Core's MoE layer under expert-TP 1),
  so no two ranks of an EP group route the same token; ep | E of every MoE layer, the layer's experts one call of a
  transformers experts module (:mod:`autopar.graph.experts`: what the runtime swaps for its
  sharded form), and ZeRO stage 0 (the autopar runtime all-reduces the expert gradients
  over their own expert-data-parallel group of t·d/ep ranks; ZeRO over that group is not
  built yet);
* **the groups** (:func:`expert_ranks`): the stage rank j = tp_rank + t·dp_rank is EP rank
  ``j % ep`` of EP group ``j // ep``; the expert-data-parallel (EDP) group of a rank is the
  t·d/ep ranks of its stage with its EP rank, which hold the same experts (their TP ranks
  saw different tokens, their DP ranks different sequences: the experts' gradients are
  summed over the group and divided by d);
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

__all__ = ["ep_problem", "expert_ranks", "experts_token_parallel", "expert_data_parallel_size",
           "FRAMEWORK_FLAGS", "SOURCE"]

SOURCE = ("Lepikhin et al. 2020 (GShard), section 2.2; Liu et al. 2025 (MoE Parallel "
          "Folding), section 3")

FRAMEWORK_FLAGS = {
    "megatron": "--expert-model-parallel-size",
    "torchtitan": "parallelism.expert_parallel_degree",
}
"""Per target framework, its setting of the EP degree (Megatron-LM's arguments.py;
torchtitan's ``Parallelism`` job config). autopar emits Megatron-LM's
(:mod:`autopar.frameworks.megatron_moe`, at tp = 1 or, with sequence parallelism, at tp > 1,
with ``--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall``); torchtitan's is not emitted (its EP borrows FSDP
ranks and its MoE layers are its own models': :mod:`autopar.frameworks.torchtitan`)."""


def experts_token_parallel(tp: int, ep: int) -> bool:
    """Do the experts calls run on their TP rank's share of the tokens (True), or whole on
    every TP rank for all the tokens (False)? Under expert parallelism with TP (ep > 1,
    t > 1): an EP group spans TP ranks, which must not route the same tokens. At ep = 1
    the experts stay whole per TP rank (their gradients then need no reduction over TP)."""
    return tp > 1 and ep > 1


def expert_data_parallel_size(tp: int, dp: int, ep: int) -> int:
    """Ranks of a pipeline stage holding the same experts (the EDP group): t·d/ep when the
    EP group spans TP (:func:`experts_token_parallel`), d at ep = 1 (the DP group; the TP
    ranks then compute the same expert gradients)."""
    return tp * dp // ep if ep > 1 else dp


def ep_problem(ep: int, dp: int, zero_stage: int | None,
               num_experts: Sequence[int], shardable: bool = True, tp: int = 1,
               zero_stages: Sequence[int] = (0,), seq_len: int | None = None) -> str | None:
    """Why expert parallelism of degree ``ep`` does not run, or None.

    dp, tp: the data- and tensor-parallel sizes d and t (ep folds over the t·d ranks of a
    stage); zero_stage: the ZeRO stage (None: not chosen yet); num_experts: E of every MoE
    layer of the model (empty: none); shardable: every MoE layer's experts are one call of
    a transformers experts module; zero_stages: the stages the runner runs at ep > 1 (the
    autopar runtime: ZeRO-0; :attr:`autopar.contract.support.RuntimeSupport.
    expert_zero_stages`); seq_len: the sequence length s (under TP the experts run on each
    TP rank's s/t tokens; None: not checked).
    """
    if ep == 1:
        return None
    if not num_experts:
        return f"ep={ep} but the model has no mixture-of-experts layer; use ep=1"
    if not shardable:
        return (f"ep={ep}: a MoE layer's experts are ops of the graph, not one call of a "
                "transformers experts module, which is what autopar shards; use ep=1")
    ranks = tp * dp
    if ranks % ep:
        return (f"ep={ep} does not divide tp·dp={ranks}: expert parallelism folds over the "
                "tensor- and data-parallel ranks of a stage; choose ep in "
                f"{[e for e in range(1, ranks + 1) if ranks % e == 0]}")
    if experts_token_parallel(tp, ep) and seq_len is not None and seq_len % tp:
        return (f"ep={ep} at tp={tp}: the experts run on each TP rank's share of a sequence's "
                f"{seq_len} tokens, which tp does not divide; choose tp | seq_len or ep=1")
    bad = sorted({E for E in num_experts if E % ep})
    if bad:
        return f"ep={ep} does not divide the {bad[0]} experts of a MoE layer; choose ep | E"
    if zero_stage is not None and zero_stage not in zero_stages:
        return (f"ep={ep} with zero_stage={zero_stage}: the runner shards no expert states "
                "over the expert-data-parallel group at this stage (the autopar runtime "
                "all-reduces expert gradients over it, ZeRO-0); use zero_stage in "
                f"{list(zero_stages)}")
    return None


def expert_ranks(stage_rank: int, ranks: int, ep: int) -> tuple[int, list[int], list[int]]:
    """(EP rank, the stage ranks of this rank's EP group, the stage ranks of its expert-
    data-parallel group) for stage rank ``stage_rank`` = tp_rank + t·dp_rank of the
    ``ranks`` = t·d ranks of a pipeline stage under EP degree ``ep`` (ep | t·d; at t = 1
    the stage rank is the DP rank)."""
    if ep < 1 or ranks % ep:
        raise ValueError(f"ep={ep} must divide the {ranks} tensor- and data-parallel ranks")
    group = stage_rank // ep
    return (stage_rank % ep, [group * ep + i for i in range(ep)],
            [j * ep + stage_rank % ep for j in range(ranks // ep)])
