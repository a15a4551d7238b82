"""Mixture-of-experts (MoE) layers under expert parallelism: token bytes, FLOPs, expert
states and dispatch buffers, per MoE layer and micro-batch.

A router sends each token to k of E expert MLPs; expert parallelism over e ranks places
E/e experts on each rank and moves the routed token copies with an all-to-all before the
experts (dispatch) and another after them (combine) (Lepikhin et al. 2020, "GShard",
section 2; Fedus et al. 2021, "Switch Transformers", section 2.2 and Figure 3; Megatron-Core
``MoEAlltoAllTokenDispatcher``). So the price is in token bytes, not weights.

Symbols (DESIGN.md): T tokens (what one rank routes per micro-batch: b*s, less where sequence
or context parallelism splits the sequence, unless a docstring says otherwise),
h hidden size, k experts per token (top-k), E experts per MoE layer, F one expert's FFN
width, e = ``ep`` expert-parallel size, f the routing imbalance (max over mean load).
Bytes are bytes, FLOPs count a multiply-add as 2.

Routing is data-dependent; the planner plans for balanced routing, f = 1
(:data:`BALANCED_ROUTING`), with f a parameter of every function it touches, and measures
against the routing a step actually had (DESIGN.md, "Mixture of experts").
"""

from __future__ import annotations

from ._checks import check_non_negative, check_positive, check_positive_int, is_number
from .comm import all_to_all_time_s
from .hardware import LinkSpec
from .memory import ADAM_OPTIMIZER_BYTES_PER_PARAM, model_state_bytes

BALANCED_ROUTING = 1.0
"""The default routing imbalance f: every expert (and every rank) gets T*k/E token copies.
Not a measured number but the planning assumption DESIGN.md states; no published figure of
the max/mean expert load of a dropless run was found to cite. Pass a larger f to price
skew, e.g. :data:`SWITCH_CAPACITY_FACTOR`."""

SWITCH_CAPACITY_FACTOR = 1.25
"""The larger of the capacity factors (1.0, 1.25) that Fedus et al. 2021 (Switch
Transformers, section 2.2 and Table 1) found to work well: an expert takes at most
capacity factor * T*k/E tokens and drops the rest, so a token-dropping run with this factor
has f <= 1.25 (Lepikhin et al. 2020, GShard, the same cap; Megatron-Core
``--moe-expert-capacity-factor``). Dropless runs (Megatron-Core's default, DeepSeek-V3)
have no such bound."""

MOE_FORWARD_ALL_TO_ALLS = 2
"""All-to-alls of one MoE layer's forward per micro-batch: dispatch and combine."""


def _check_imbalance(imbalance: object) -> float:
    if not is_number(imbalance) or imbalance < 1:
        raise ValueError(f"imbalance must be a number >= 1 (max over mean expert load; 1.0 is "
                         f"balanced routing), got {imbalance!r}")
    return float(imbalance)


def _check_experts(num_experts: object, ep: object) -> tuple[int, int]:
    e_total = check_positive_int("num_experts", num_experts)
    e = check_positive_int("ep", ep)
    if e_total % e:
        raise ValueError(f"ep={e} does not divide num_experts={e_total}: each rank holds "
                         f"num_experts/ep whole experts; choose ep among the divisors of "
                         f"{e_total}")
    return e_total, e


def moe_all_to_alls_per_layer(forward_recomputed: bool = False) -> int:
    """All-to-alls one MoE layer runs per micro-batch in a training step: dispatch and
    combine in forward (:data:`MOE_FORWARD_ALL_TO_ALLS`), and in backward the reverse of
    each (the gradient of an all-to-all is the all-to-all with send and receive splits
    swapped: Megatron-Core ``tensor_parallel.all_to_all``, torch's
    ``all_to_all_single_autograd``), 4 in all; when backward recomputes the layer's forward
    (``forward_recomputed``: a recompute mode that recomputes the whole layer, as the
    mode's record says; Megatron-Core recomputes the whole layer) the forward's two run
    again, 6."""
    return 2 * MOE_FORWARD_ALL_TO_ALLS + (MOE_FORWARD_ALL_TO_ALLS if forward_recomputed else 0)


def moe_dispatch_bytes(tokens: float, top_k: int, hidden: float, dtype_bytes: float, ep: int,
                       imbalance: float = BALANCED_ROUTING) -> float:
    """Bytes one rank sends in ONE all-to-all (dispatch or combine) of one MoE layer and
    micro-batch: ``T*k*h*dtype_bytes * (e-1)/e * f``.

    The rank holds T*k routed token copies of h elements; under balanced routing (e-1)/e of
    them go to experts on other ranks (GShard section 2; Megatron-Core's all-to-all token
    dispatcher), and the combine returns as many. With imbalance f the busiest rank
    receives f times the mean, and the all-to-all ends when it has, so f scales the bytes
    that set its time. ``dtype_bytes`` is 2 in bf16 (DeepSeek-V3 dispatches in FP8, 1 byte,
    and combines in bf16: report section 3.3). ValueError on negative tokens, non-positive
    sizes or f < 1.
    """
    t = check_non_negative("tokens", tokens)
    k = check_positive_int("top_k", top_k)
    h = check_positive("hidden", hidden)
    nbytes = check_positive("dtype_bytes", dtype_bytes)
    e = check_positive_int("ep", ep)
    return t * k * h * nbytes * (e - 1) / e * _check_imbalance(imbalance)


def moe_all_to_all_time_s(tokens: float, top_k: int, hidden: float, dtype_bytes: float,
                          ep: int, ranks_per_node_in_group: int, intra: LinkSpec,
                          inter: LinkSpec, imbalance: float = BALANCED_ROUTING) -> float:
    """Seconds of ONE dispatch (or combine) all-to-all of one MoE layer and micro-batch over
    the e = ``ep`` ranks of an expert-parallel group, r = ``ranks_per_node_in_group`` per
    node: :func:`cost_models.comm.all_to_all_time_s` of the rank's whole buffer
    ``T*k*h*dtype_bytes*f``, of which it sends :func:`moe_dispatch_bytes`. Multiply by
    :func:`moe_all_to_alls_per_layer` for a layer's step."""
    check_non_negative("tokens", tokens)
    check_positive_int("ep", ep)
    buffer = (tokens * check_positive_int("top_k", top_k) * check_positive("hidden", hidden)
              * check_positive("dtype_bytes", dtype_bytes) * _check_imbalance(imbalance))
    return all_to_all_time_s(buffer, ep, ranks_per_node_in_group, intra, inter)


def tokens_per_expert(tokens: float, top_k: int, num_experts: int,
                      imbalance: float = BALANCED_ROUTING) -> float:
    """Token copies the busiest expert computes per micro-batch: ``T*k/E * f`` (GShard's
    and Switch's expert capacity with capacity factor f, Fedus et al. 2021 section 2.2).

    Here T is every token routed to the expert: under expert parallelism an expert serves
    the tokens of all e ranks of its group, so pass T = e * (tokens per rank).

    Pricing one expert's GEMMs: with m = ``math.ceil`` of this, its forward is
    ``gemm_time_s(m, F, h)`` for each of the gate and up projections (``2F`` once when they
    are fused) and ``gemm_time_s(m, h, F)`` for the down projection; the E/e experts of a
    rank run as one grouped GEMM, ``gemm_time_s(m, n, k, device, batch=E/e)``, whose tile
    and wave quantisation (:func:`cost_models.compute.gemm_time_s`) is what makes small m
    slow. Backward: the two gradient GEMMs of each, the same shapes permuted.
    ValueError on negative tokens, non-positive sizes, k > E or f < 1.
    """
    t = check_non_negative("tokens", tokens)
    k = check_positive_int("top_k", top_k)
    e_total = check_positive_int("num_experts", num_experts)
    if k > e_total:
        raise ValueError(f"top_k={k} exceeds num_experts={e_total}: a token picks k distinct "
                         f"experts")
    return t * k / e_total * _check_imbalance(imbalance)


def moe_expert_flops(tokens: float, top_k: int, hidden: float, expert_ffn: float,
                     gated: bool = True) -> float:
    """Forward FLOPs of the experts of one MoE layer over T tokens: ``2*T*k*h*F*m`` with
    m = 3 matrices of h x F for a gated (SwiGLU) expert (gate, up, down: Shazeer 2020,
    "GLU Variants Improve Transformer"; Mixtral, DeepSeek-V3) and m = 2 otherwise (up,
    down). Each token copy passes one expert; backward is twice this (an input- and a
    weight-gradient GEMM per forward GEMM). Routing imbalance does not change the total,
    only which rank does it.
    """
    t = check_non_negative("tokens", tokens)
    k = check_positive_int("top_k", top_k)
    h = check_positive("hidden", hidden)
    f = check_positive("expert_ffn", expert_ffn)
    if not isinstance(gated, bool):
        raise ValueError(f"gated must be a bool, got {gated!r}")
    return 2.0 * t * k * h * f * (3 if gated else 2)


def moe_router_flops(tokens: float, hidden: float, num_experts: int) -> float:
    """Forward FLOPs of the router's linear layer (h -> E logits) over T tokens:
    ``2*T*h*E`` (the gating network of GShard, Lepikhin et al. 2020, section 2; its
    softmax and top-k are element-wise, not counted)."""
    t = check_non_negative("tokens", tokens)
    return 2.0 * t * check_positive("hidden", hidden) * check_positive_int("num_experts",
                                                                           num_experts)


def expert_params(hidden: float, expert_ffn: float, gated: bool = True) -> float:
    """Parameters of one expert: ``3*h*F`` gated (SwiGLU: gate, up, down), ``2*h*F`` not;
    no biases (Mixtral, DeepSeek-V3). Mixtral 8x22B: 3 * 6144 * 16384 = 301,989,888."""
    h, f = check_positive("hidden", hidden), check_positive("expert_ffn", expert_ffn)
    if not isinstance(gated, bool):
        raise ValueError(f"gated must be a bool, got {gated!r}")
    return (3 if gated else 2) * h * f


def expert_param_count_per_rank(num_experts: int, ep: int, params_per_expert: float,
                                expert_tp: int = 1) -> float:
    """Expert parameters of one MoE layer held by one rank: ``E/e * P / etp``: expert
    parallelism places E/e whole experts per rank, expert tensor parallelism splits each
    like a dense MLP (Liu et al. 2025, "MoE Parallel Folding", arXiv:2504.14960;
    Megatron-Core ``--expert-tensor-parallel-size``). ValueError unless e divides E."""
    e_total, e = _check_experts(num_experts, ep)
    p = check_non_negative("params_per_expert", params_per_expert)
    return e_total // e * p / check_positive_int("expert_tp", expert_tp)


def expert_data_parallel_size(world_size: int, ep: int, expert_tp: int = 1, pp: int = 1) -> int:
    """Ranks that hold the same experts, over which their gradients are reduced and ZeRO
    shards their states: EDP = world / (etp * e * p) ("MoE Parallel Folding", Liu et al.
    2025, arXiv:2504.14960: the expert layers' own etp x ep x edp x pp grid
    folded over the attention's tp x cp x dp x pp; Megatron-Core ``parallel_state``'s
    expert-data-parallel group). ValueError unless etp*e*p divides the world."""
    n = check_positive_int("world_size", world_size)
    grid = (check_positive_int("expert_tp", expert_tp) * check_positive_int("ep", ep)
            * check_positive_int("pp", pp))
    if n % grid:
        raise ValueError(f"expert_tp*ep*pp = {grid} does not divide world_size={n}: the "
                         f"expert-data-parallel size world/(etp*ep*pp) must be whole")
    return n // grid


def expert_model_state_bytes(num_experts: int, ep: int, params_per_expert: float,
                             zero_stage: int, edp: int, expert_tp: int = 1,
                             param_bytes: float = 2, grad_bytes: float = 2,
                             optimizer_bytes: float = ADAM_OPTIMIZER_BYTES_PER_PARAM) -> float:
    """Bytes of expert parameters + gradients + optimizer states of one MoE layer on one
    rank: :func:`cost_models.memory.model_state_bytes` (ZeRO, Rajbhandari et al. 2020) of
    :func:`expert_param_count_per_rank`, sharded over the expert-data-parallel group of
    ``edp`` ranks (:func:`expert_data_parallel_size`), not over the dense layers' d.
    E.g. ZeRO-1: ``(P + G) * Psi_e + K * Psi_e / edp`` with Psi_e = E/e * P_expert / etp."""
    psi = expert_param_count_per_rank(num_experts, ep, params_per_expert, expert_tp)
    return model_state_bytes(psi, zero_stage, check_positive_int("edp", edp), param_bytes,
                             grad_bytes, optimizer_bytes)


def moe_dispatch_buffer_bytes(tokens: float, top_k: int, hidden: float, dtype_bytes: float,
                              imbalance: float = BALANCED_ROUTING) -> float:
    """Bytes of the token buffers one MoE layer holds around its all-to-all, per rank and
    micro-batch in flight: ``T*k*h*dtype_bytes * (1 + f)``.

    Megatron-Core's all-to-all dispatcher permutes the rank's T*k routed copies into one
    send buffer (T*k*h elements) and receives the experts' input into another (T*k*h*f at
    the busiest rank); the combine runs the same two sizes backwards (expert output in,
    T*k*h out, before the weighted un-permute to T*h). For the memory reserve: both exist
    at once during each all-to-all; which of them autograd also keeps for backward is an
    activation, counted with the layer's activations, not here. ValueError as
    :func:`moe_dispatch_bytes`.
    """
    t = check_non_negative("tokens", tokens)
    k = check_positive_int("top_k", top_k)
    copies = t * k * check_positive("hidden", hidden) * check_positive("dtype_bytes",
                                                                         dtype_bytes)
    return copies * (1.0 + _check_imbalance(imbalance))
