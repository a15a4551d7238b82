"""What expert parallelism changes in the price of one MoE layer's experts call.

A node of a transformers experts module (:mod:`autopar.graph.experts`, ``extra["inner"]``)
under expert parallelism of degree ep (:mod:`autopar.techniques.expert_parallel`):

* its grouped GEMMs run E/ep experts on ep times the rows each (the tokens of the ep ranks
  of the EP group routed to this rank's experts; balanced routing, the planning
  assumption, :data:`cost_models.moe.BALANCED_ROUTING`): the same FLOPs per rank, larger
  GEMMs; when the EP group spans TP (:func:`autopar.techniques.expert_parallel.
  experts_token_parallel`) a rank routes its TP rank's 1/t of the tokens, so its rows,
  its all-to-alls, the activations it keeps and the memory traffic of its sorts and
  gathers are 1/t of the layer's;
* dispatch and combine all-to-alls in forward and the two again in backward
  (:func:`cost_models.moe.moe_all_to_alls_per_layer`), each sending
  :func:`cost_models.moe.moe_dispatch_bytes` of the rank's b·s·k/t routed rows of h
  values, priced by :func:`cost_models.moe.moe_all_to_all_time_s` over the EP group (ep
  consecutive ranks, ``ranks_per_node_in_group`` of them in a node); before the dispatch
  the runtime exchanges the rows per expert, (E − E/ep) int64 counts
  (:class:`autopar.runtime.expert_parallel.ExpertParallelExperts`), counted in the bytes;
* it holds 1/ep of the experts' parameters, whose gradients the runtime all-reduces over
  the expert-data-parallel group (t·d/ep ranks) instead of the DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_models.hardware import Cluster
from cost_models.moe import MOE_FORWARD_ALL_TO_ALLS, moe_all_to_all_time_s, moe_dispatch_bytes

__all__ = ["ExpertParallelPrice", "expert_parallel_price", "COUNT_BYTES"]

COUNT_BYTES = 8
"""Bytes of one per-expert row count exchanged before a dispatch (int64)."""


@dataclass(frozen=True)
class ExpertParallelPrice:
    """The EP part of one experts node's cost for one micro-batch on one GPU.

    info: the node's annotation with the GEMMs of this rank (E/ep experts, ep times the rows);
    all_to_all_s: seconds of ONE dispatch (or combine) all-to-all; fwd_bytes / bwd_bytes:
    bytes this rank sends to other EP ranks in forward (dispatch, combine and the counts
    exchange) and in backward (the two all-to-alls reversed)."""

    info: object
    all_to_all_s: float
    fwd_bytes: float
    bwd_bytes: float

    def applied(self, cost, ep: int):
        """``cost`` (the node's :class:`~autopar.planner.costs.node_cost.StrategyCost` at
        this rank's GEMMs) with the all-to-alls: dispatch and combine in forward (again in
        full recompute), both reversed in backward; 1/ep of the experts' parameters, all
        of them reduced over the expert-data-parallel group."""
        a2a = MOE_FORWARD_ALL_TO_ALLS * self.all_to_all_s
        params = cost.param_numel / ep
        return replace(cost, fwd_s=cost.fwd_s + a2a, bwd_s=cost.bwd_s + a2a,
                       rec_s=cost.rec_s + a2a, param_numel=params, a2a_s=2.0 * a2a,
                       a2a_fwd_bytes=self.fwd_bytes, a2a_bwd_bytes=self.bwd_bytes,
                       expert_param_numel=params)


def ranks_per_node_in_group(cluster: Cluster, size: int, stride: int) -> int:
    """Ranks of a group of ``size`` ranks ``stride`` apart (Megatron's rank order) that
    share a node, as :func:`cost_models.comm.all_to_all_time_s` needs it (the same count on
    every node, dividing ``size``): gcd(size, gpus_per_node // stride), all of them when the
    group fits in a node's aligned block, fewer (so more traffic priced between nodes) when
    the group straddles nodes unevenly (6 ranks of stride 2 over 8-GPU nodes: 2); 1 when
    the stride exceeds a node."""
    if stride > cluster.gpus_per_node:
        return 1
    return math.gcd(size, cluster.gpus_per_node // stride)


def expert_parallel_price(info, b: int, cluster: Cluster, ep: int, act_bytes: int,
                          token_share: int = 1) -> ExpertParallelPrice:
    """:class:`ExpertParallelPrice` of experts node ``info`` (``extra["experts"]``: E, k, h,
    T·k rows per sequence; ``extra["inner"]``: elements its other ops save and move) for
    ``b`` sequences per micro-batch and EP degree ``ep`` >= 2 over consecutive ranks, the
    rank holding 1/``token_share`` of the tokens (t when its experts call runs on its TP
    rank's rows, 1 when whole). Raises ValueError when ep does not divide E."""
    shape = info.extra["experts"]
    E, k, h, rows = shape["num_experts"], shape["top_k"], shape["hidden_size"], shape["rows"]
    if E % ep:
        raise ValueError(f"ep={ep} does not divide the {E} experts of {info.name}")
    rows = rows / token_share
    per_expert = math.ceil(rows * ep / E)
    gemms = tuple((g // ep, per_expert, n, kk) for g, _, n, kk in info.extra["gemms"])
    saved, moved, ops = info.extra["inner"]
    view = replace(info, extra={**info.extra, "gemms": gemms,
                                "inner": (saved / token_share, moved / token_share, ops)})
    tokens = b * rows / k
    r = ranks_per_node_in_group(cluster, ep, 1)
    a2a = moe_all_to_all_time_s(tokens, k, h, act_bytes, ep, r, cluster.intra_node,
                                cluster.inter_node)
    sent = moe_dispatch_bytes(tokens, k, h, act_bytes, ep)
    counts = (E - E // ep) * COUNT_BYTES
    return ExpertParallelPrice(info=view, all_to_all_s=a2a,
                               fwd_bytes=MOE_FORWARD_ALL_TO_ALLS * sent + counts,
                               bwd_bytes=MOE_FORWARD_ALL_TO_ALLS * sent)
