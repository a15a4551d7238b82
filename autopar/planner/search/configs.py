"""The configs a search enumerates: mesh shapes (t, p, d), micro-batch sizes, schedules
and virtual stages consistent with a layout's pins, the model, the cluster and what the
runtime executes (:func:`candidate_configs`), each rule that removes one recorded so that
an empty space is explained, not reported as "nothing fits".
"""

from __future__ import annotations

from dataclasses import asdict

from autopar.contract import support as support_rules
from autopar.graph.annotate import TracedModel
from autopar.graph.context_parallel import trace_cp
from autopar.graph.moe import moe_blocks
from autopar.contract.plan import Layout
from autopar.planner.costs.tables import Config
from autopar.contract.support import RUNTIME_SUPPORT, RuntimeSupport, divisors, pipeline_problem
from autopar.techniques.pipeline_schedules import (PIPELINE_SCHEDULES, default_schedule,
                                                   pipeline_schedule)
from autopar.techniques.expert_parallel import ep_problem
from autopar.techniques.zero_stages import zero_stage

__all__ = ["candidate_configs", "validate_layout", "no_config_message", "MAX_MICRO_BATCH_SIZE"]

MAX_MICRO_BATCH_SIZE = 8


def _heads(traced: TracedModel) -> int | None:
    """Attention heads a of the traced model (dim 1 of its attention's output), None if it
    has no attention node."""
    for n in traced.layers[0] if traced.layers else []:
        info = traced.nodes[n]
        if info.kind == "sdpa":
            return info.shape[1]
    return None


def _kv_heads(traced: TracedModel) -> int | None:
    """Key/value heads of the traced model's attention (grouped-query attention: fewer than
    the query heads; None without attention): the Linear that produces the keys, found by
    walking back from the attention's key input (through any repeat of the kv heads),
    over the head size, at most the query heads (a fused QKV Linear holds all three)."""
    graph = {n.name: n for n in traced.gm.graph.nodes}
    for name in traced.layers[0] if traced.layers else []:
        info = traced.nodes[name]
        if info.kind != "sdpa":
            continue
        node = graph[name]
        ins = [a for a in node.all_input_nodes if a.name in traced.nodes]
        head_dim = traced.nodes[ins[0].name].shape[-1]
        key, seen = ins[1], 0
        while traced.nodes[key.name].kind != "linear" and seen < 32:
            parents = [a for a in key.all_input_nodes if a.name in traced.nodes]
            if not parents:
                return info.shape[1]
            key, seen = parents[0], seen + 1
        if traced.nodes[key.name].kind != "linear":
            return info.shape[1]
        out = traced.gm.get_submodule(key.target).out_features
        return min(info.shape[1], out // head_dim)
    return None


def validate_layout(traced: TracedModel, cluster, layout: Layout, global_batch_size: int) -> None:
    """:func:`autopar.contract.support.validate_layout` for ``traced`` on ``cluster`` (ValueError
    saying what to change)."""
    support_rules.validate_layout(layout, num_gpus=cluster.num_gpus,
                                  gpus_per_node=cluster.gpus_per_node, heads=_heads(traced),
                                  num_layers=traced.num_layers,
                                  global_batch_size=global_batch_size)


def candidate_configs(traced: TracedModel, cluster, global_batch_size: int, layout: Layout,
                      support: RuntimeSupport = RUNTIME_SUPPORT,
                      why: dict[str, str] | None = None,
                      chunks_given: bool = False) -> list[Config]:
    """All (tp, pp, dp, mbs, schedule, v, sequence_parallel) consistent with ``layout`` and
    the runtime. Sequence parallelism is the layout's, or both (without, then with) when
    the layout leaves it unset, a search (``support`` given) and tp > 1.

    Schedules: the layout's, else 1F1B and (when the runtime executes it) interleaved 1F1B.
    Interleaved configs take each v >= 2 the runtime declares (or the layout's v); every
    other schedule gets v = 1; a (schedule, p, m, v) is kept when
    :func:`~autopar.contract.support.pipeline_problem` accepts it (1F1B: m >= p; interleaved:
    pp > 1, L % (pp·v) == 0, m % pp == 0), and a pinned ZeRO stage only with the pipeline
    sizes the runtime runs it with. ``support``
    :data:`~autopar.contract.support.FULL_SPACE` (evaluating a hand layout): the layout's
    schedule and v, checked by the same rule. ``why``: filled with the first
    reason each rule rejected a config for (the error when none is left). ``chunks_given``:
    the caller cuts the layers into chunks itself (a hand layout's ``stage_layers``, e.g.
    Megatron's uneven first and last stages), so the rule's L % (pp·v) is not applied.
    A trace at s/c (context parallelism, :func:`~autopar.graph.context_parallel.trace_cp`)
    gets configs of cp = c and dp = c·d (``layout.dp`` and ``global_batch_size`` are then
    c·d and c·B: :func:`~autopar.graph.context_parallel.folded_layout`).
    """
    n, heads, L = cluster.num_gpus, _heads(traced), traced.num_layers
    blocks, cp = moe_blocks(traced), trace_cp(traced)
    # Megatron's pattern splits whole key/value heads (megatron-core: num_query_groups % tp)
    kv = _kv_heads(traced) if support.placements == "megatron" else None
    why = {} if why is None else why
    schedules = [layout.schedule] if layout.schedule else _searched_schedules(layout, support)
    out = []
    for tp in divisors(n):
        if tp > cluster.gpus_per_node or (heads and heads % tp) or layout.tp not in (None, tp):
            continue
        if kv and kv % tp:
            why.setdefault("kv", f"{support.name} splits whole key/value heads over TP: "
                                 f"{kv} kv heads do not divide over tp={tp}")
            continue
        if support.max_tp is not None and tp > support.max_tp:
            continue
        # a target whose experts under TP run on sequence shards (Megatron-LM's expert-TP
        # 1) runs as priced only with the EP group spanning TP (ep > 1) under SP
        tokens_only = tp > 1 and blocks and not support.moe_tp and not support.as_written
        for pp in divisors(n // tp):
            dp = n // (tp * pp)  # c·d under context parallelism (autopar.graph.context_parallel)
            if pp > L or layout.pp not in (None, pp) or layout.dp not in (None, dp):
                continue
            if dp % cp:
                why.setdefault("cp", f"cp={cp} does not divide the {dp} ranks left by tp={tp} "
                                     f"pp={pp} (N = tp·cp·pp·dp)")
                continue
            zeros = support.zero_stages_for(pp, tp, dp)
            if layout.zero_stage is not None and \
                    layout.zero_stage not in zeros:
                problem = zero_stage(layout.zero_stage).problem(pp)
                why.setdefault("zero", f"zero_stage={layout.zero_stage} with pp={pp}: {problem}"
                               if problem else
                               f"zero_stage=0 with tp or pp > 1: {support.name} runs plain "
                               "data parallelism only without TP and PP")
                continue
            if zeros == ():
                why.setdefault("mesh", f"{support.name} runs no ZeRO stage at tp={tp} pp={pp} "
                                       f"dp={dp} (plain DP only without TP and PP, ZeRO-3 only "
                                       "without PP)")
                continue
            if global_batch_size % dp:
                why.setdefault("dp", f"global_batch_size={global_batch_size} is not divisible "
                                     f"by dp={dp}")
                continue
            for ep in _expert_degrees(blocks, layout, support, tp, dp, zeros, why,
                                      traced.seq_len):
                if tokens_only and ep == 1:
                    why.setdefault("moe_tp", f"{support.name} runs a mixture-of-experts model "
                                             "at tp > 1 as autopar prices it only with ep > 1 "
                                             "and sequence parallelism (its experts on "
                                             "sequence shards); use tp=1 or ep > 1")
                    continue
                out += [c for c in _micro_configs(traced, cluster, layout, support, schedules,
                                                  why, tp, pp, dp, global_batch_size // dp, ep,
                                                  None if chunks_given else L)
                        if c.sequence_parallel or not tokens_only]
    return out


def _expert_degrees(blocks, layout: Layout, support, tp: int, dp: int,
                    zeros: tuple[int, ...], why: dict, seq_len: int | None = None) -> list[int]:
    """The EP degrees to try at tensor- and data-parallel sizes ``tp``, ``dp`` (ep folds
    over the tp·dp ranks of a stage): the layout's, else 1 and, where
    ``support`` runs expert parallelism, every ep > 1 that :func:`~autopar.techniques.
    expert_parallel.ep_problem` allows for the MoE ``blocks`` with a ZeRO stage in ``zeros``."""
    experts = [b.num_experts for b in blocks]
    shardable = all(b.experts_module for b in blocks)
    wanted = [layout.ep] if layout.ep is not None else \
        [1] + [e for e in divisors(tp * dp) if e > 1 and support.expert_parallel and blocks]
    out = []
    for ep in wanted:
        zero = layout.zero_stage if layout.zero_stage is not None else next(
            (z for z in zeros if z in support.expert_zero_stages), zeros[0] if zeros else None)
        problem = ep_problem(ep, dp, zero, experts, shardable, tp, support.expert_zero_stages,
                             seq_len)
        if ep > 1 and not support.expert_parallel:
            problem = f"the {support.name} runtime does not run expert parallelism; use ep=1"
        if problem:
            why.setdefault("ep", problem)
            continue
        out.append(ep)
    return out


def _micro_configs(traced, cluster, layout: Layout, support, schedules, why: dict,
                   tp: int, pp: int, dp: int, per_replica: int, ep: int = 1,
                   num_layers: int | None = -1) -> list[Config]:
    """The configs of one mesh shape (tp, pp, dp) and EP degree: micro-batch sizes,
    schedules and v; ``num_layers`` the L of the pipeline rule (None: chunks cut by the
    caller, no L rule; -1: the model's)."""
    out, L = [], traced.num_layers if num_layers == -1 else num_layers
    # sequence parallelism: the layout's; free (without, then with) when it is unset, the
    # search and tp > 1; a hand layout (the full space) is priced as written
    sequence_parallel = ((False,) if tp == 1 else (bool(layout.sequence_parallel),)
                         if layout.sequence_parallel is not None or support.as_written
                         else tuple(sp for sp in (False, True) if sp in support.sequence_parallel))
    dtype = layout.dtype or cluster.dtype
    if support.dtype_for(dtype, tp, pp, dp) != dtype:
        if layout.dtype is not None:  # pinned bf16 the target would run in fp32
            why.setdefault("dtype", f"{support.name} trains bf16 with tp or pp > 1 only under "
                                    "FSDP (dp > 1); it would run fp32 at "
                                    f"tp={tp} pp={pp} dp={dp}")
            return out
        dtype = support.dtype_for(dtype, tp, pp, dp)
    # gradients: the layout's, else the first the target runs (fp32 under fp32 training)
    grad_dtype = None if dtype == "fp32" else (layout.grad_dtype or support.default_grad_dtype)
    # attention: the kernel the target runs in this dtype (the cluster's when it can)
    attention = support.attention_for(cluster.attention, dtype)
    for mbs in divisors(per_replica):
        if layout.micro_batch_size not in (None, mbs) or (
                layout.micro_batch_size is None and mbs > MAX_MICRO_BATCH_SIZE):
            continue
        m = per_replica // mbs
        for sched in schedules:
            if sched not in support.schedules:
                continue
            refused = pipeline_schedule(sched).refused_recompute.get(layout.recompute)
            if refused:
                why.setdefault(f"recompute {sched}", f"recompute={layout.recompute!r} with "
                                                     f"schedule {sched!r}: {refused}")
                continue
            vs = _virtual_stages(sched, layout, support, L, pp, m)
            if not vs:  # the rule with the smallest v it could take says why
                problem = pipeline_problem(sched, pp, m, L, max(2, layout.virtual_stages or 2))
                why.setdefault(f"pipeline {sched} pp={pp}", f"at pp={pp}, m={m}: "
                               f"{problem or 'no virtual_stages the runtime executes fits'}")
            for v in vs:
                problem = pipeline_problem(sched, pp, m, L, v)
                if problem:
                    why.setdefault(f"pipeline {sched} pp={pp}", f"at pp={pp}, m={m}: {problem}")
                    continue
                out += [Config(tp, pp, dp, mbs, m, sched, v, dtype, attention, sp,
                               grad_dtype, ep, trace_cp(traced)) for sp in sequence_parallel]
    if layout.micro_batch_size is not None and per_replica % layout.micro_batch_size:
        why.setdefault("mbs", f"micro_batch_size={layout.micro_batch_size} does not divide "
                              f"the {per_replica} sequences of a replica at dp={dp} (choose "
                              f"micro_batch_size in {divisors(per_replica)})")
    return out


def _searched_schedules(layout: Layout, support: RuntimeSupport) -> list[str]:
    """The schedules a layout without one is searched over: the default (1F1B; interleaved
    when it pins v > 1) and, in a search whose runtime runs them, the interleaved and the
    split-backward (zero-bubble) ones."""
    default = default_schedule(layout.virtual_stages)
    if default.interleaved or support.as_written:
        return [default.name]
    return [default.name] + [s.name for s in PIPELINE_SCHEDULES.values()
                             if (s.interleaved or s.split_backward) and s.name != default.name
                             and s.name in support.schedules]


def _virtual_stages(schedule: str, layout: Layout, support: RuntimeSupport, L: int,
                    pp: int, m: int) -> tuple[int, ...]:
    """The v to try for one (schedule, pp, m): see :func:`candidate_configs`."""
    if not pipeline_schedule(schedule).interleaved:
        return (1,) if (layout.virtual_stages or 1) == 1 else ()
    if layout.virtual_stages is not None or support.as_written:
        return (layout.virtual_stages or 2,)
    return support.virtual_stages_for(schedule, L, pp, m)


def no_config_message(cluster, global_batch_size: int, layout: Layout,
                      why: dict[str, str]) -> str:
    """Why no config is left, for a ValueError: the rules that removed them (``why``, as
    filled by :func:`candidate_configs`), else the pins."""
    pins = ", ".join(f"{k}={v}" for k, v in asdict(layout).items() if v is not None) or "none"
    reasons = "; ".join(list(why.values())[:4]) or (
        "no (tp, pp, dp) divides the GPUs with the tp, pp and dp pinned")
    return (f"no (tp, pp, dp, micro_batch_size, schedule) of {cluster.num_gpus} GPUs fits "
            f"global_batch_size={global_batch_size} with the pins ({pins}): {reasons}; "
            "change or drop the pins, or the batch size")
