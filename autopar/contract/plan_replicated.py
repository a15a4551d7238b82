"""The compute ops tensor parallelism leaves whole on every TP rank, as the plan records
them (:attr:`autopar.contract.plan.Plan.replicated_ops`; re-exported by :mod:`autopar.contract.plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplicatedOp", "ReplicatedOps", "format_share"]


@dataclass(frozen=True)
class ReplicatedOp:
    """One compute op that every tensor-parallel rank runs whole (on the whole tensor).

    node: the traced node's name (a key of ``Plan.placements``).
    op: what it calls: a module class ("LayerNorm"), an op or function ("cumsum", "le").
    kind: its node kind (:class:`~autopar.graph.annotate.NodeInfo`; "other": an op autopar
        has no rule for, whose FLOPs count one per output element).
    section: "pre" (before the first transformer layer) | "layer" | "post".
    layer: the transformer layer index (None outside the layers).
    flops: forward FLOPs per sequence. share: flops / the model's forward FLOPs.
    per_sequence: False for work done once per micro-batch whatever its size (a causal
        mask, position ids).
    reason: why it is replicated ("no sharding rule for this op", "chosen by the solver" ...).
    """

    node: str
    op: str
    kind: str
    section: str
    layer: int | None
    flops: float
    share: float
    per_sequence: bool = True
    reason: str = ""


@dataclass(frozen=True)
class ReplicatedOps:
    """The compute ops (forward FLOPs > 0) that tensor parallelism leaves whole on every
    TP rank. Replication is always correct: each rank runs the op on the whole tensor (its
    work is not divided by t), after an all-gather where its input arrives sharded.

    tp: the TP size t the strategies were enumerated at: the plan's, or 2 for a plan with
        tp = 1 (the list then says what TP could not split).
    model_flops: forward FLOPs per sequence of the whole graph (the shares' denominator).
    no_strategy: ops whose only strategy at t is replication (no sharding rule for the op,
        LayerNorm without sequence parallelism, or shapes its rule cannot split at t), in
        graph order.
    chosen: ops that had a sharded strategy and that the plan replicated (empty at tp = 1).
    """

    tp: int
    model_flops: float
    no_strategy: list[ReplicatedOp] = field(default_factory=list)
    chosen: list[ReplicatedOp] = field(default_factory=list)

    @staticmethod
    def by_op(ops: list[ReplicatedOp]) -> list[tuple[str, int, float]]:
        """(op, count, total share) per op name, the largest share first."""
        groups: dict[str, list[float]] = {}
        for r in ops:
            groups.setdefault(r.op, []).append(r.share)
        rows = [(name, len(shares), sum(shares)) for name, shares in groups.items()]
        return sorted(rows, key=lambda row: (-row[2], -row[1], row[0]))

    def line(self, shown: int = 6) -> str:
        """``replicated (no TP strategy at t=2): 6 ops (1 before the first layer), 0.17% of
        FLOPs: LayerNorm (5), add (1)``: the :attr:`no_strategy` ops by op name."""
        ops = self.no_strategy
        groups = self.by_op(ops)
        names = ", ".join(f"{name} ({count})" for name, count, _ in groups[:shown])
        more = f", {len(groups) - shown} more" if len(groups) > shown else ""
        pre = sum(r.section == "pre" for r in ops)
        where = f" ({pre} before the first layer)" if pre else ""
        return (f"replicated (no TP strategy at t={self.tp}): {len(ops)} ops{where}, "
                f"{format_share(sum(r.share for r in ops))} of FLOPs: {names}{more}")

    @classmethod
    def from_dict(cls, data: dict) -> "ReplicatedOps":
        ops = {k: [ReplicatedOp(**r) for r in data.get(k, [])] for k in ("no_strategy", "chosen")}
        return cls(tp=data["tp"], model_flops=data["model_flops"], **ops)


def format_share(share: float) -> str:
    """A share of FLOPs as a percentage with the digits a small one needs: ``12.3%``,
    ``0.17%``, ``<0.01%``, ``0%``."""
    if share <= 0:
        return "0%"
    if share < 1e-4:
        return "<0.01%"
    return f"{share:.1%}" if share >= 0.01 else f"{share:.2%}"
