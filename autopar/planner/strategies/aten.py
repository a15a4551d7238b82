"""Tensor-parallel strategies of the aten ops of an exported graph (:mod:`autopar.graph.ops`).

Each rule says which shardings an op passes through unchanged, which is what lets the
solver rediscover Megatron's pattern on any model: a column-split Linear's output
(b, s, n/t) flows through views to whole heads (b, nh/t, s, hd), through rotary
embeddings (slices and cats along the head dim, products with replicated cos/sin),
through SwiGLU's ``silu(gate) * up`` and RMSNorm's per-token ops, into a row-split
Linear. The rules:

* element-wise ops (broadcasting): the output sharded along d needs each input sharded
  along its aligned dim, or replicated where it broadcasts (size 1 / missing) — the
  gradient of a broadcast input is then a partial sum (Megatron's f completes it);
* views: a dim that is the outermost of a group of equal products (the rewriter divides
  a constant target size by t); transposes and permutes move the dim; unsqueeze shifts
  it; expand passes it (or expands a broadcast dim straight to its local size);
* reductions and softmax: dims they do not reduce; cat: dims it does not join; slices:
  dims they do not cut, and each block of a fused projection (``extra["block"]``, set by
  annotation: q/k/v of a fused QKV Linear, gate/up of a fused MLP);
* batched matmul (eager attention): the batch dims.

Anything else keeps the one "replicate" strategy of the caller.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.graph.annotate import NodeInfo
from autopar.graph.ops import packet
from autopar.contract.placement import REPLICATE, Placement, Shard
from autopar.planner.strategies.nodes import Strategy, batch_safe_view_map

__all__ = ["aten_strategies"]


def _sharded(inputs: tuple[Placement, ...], out: Placement, tp: int, divisor: int,
             partial: tuple[bool, ...] | None = None) -> Strategy:
    return Strategy("sharded", inputs, out, divisor, 1,
                    partial if partial is not None else (False,) * len(inputs))


def _elementwise(shape, in_shapes, tp: int) -> list[Strategy]:
    out = []
    n = len(shape)
    for d in range(n):
        if shape[d] % tp or shape[d] == 1:
            continue
        places, partial = [], []
        for s in in_shapes:
            aligned = d - (n - len(s))
            if aligned < 0 or s[aligned] == 1:
                places.append(REPLICATE)       # broadcast along d: its gradient is partial
                partial.append(True)
            elif s[aligned] == shape[d]:
                places.append(Shard(aligned))
                partial.append(False)
            else:
                break
        else:
            out.append(_sharded(tuple(places), Shard(d), tp, tp, tuple(partial)))
    return out


def _moved(in_shape, mapping: dict[int, int], tp: int, out_shape) -> list[Strategy]:
    """One strategy per (input dim -> output dim) of ``mapping`` that t divides."""
    return [_sharded((Shard(i),), Shard(o), tp, 1) for i, o in mapping.items()
            if in_shape[i] % tp == 0 and out_shape[o] % tp == 0 and in_shape[i] > 1]


def aten_strategies(node: fx.Node, info: NodeInfo, nodes: dict[str, NodeInfo],
                    ins: list[fx.Node], tp: int) -> list[Strategy]:
    """The non-replicated strategies of aten node ``node`` at TP size ``tp`` > 1 (see the
    module docstring); ``ins``: its tensor inputs."""
    op, kind, shape = packet(node.target), info.kind, info.shape
    if shape is None or not ins:
        return []
    in_shapes = [nodes[n.name].shape for n in ins]
    x = in_shapes[0]
    args = node.args
    if kind in ("elementwise", "add", "gelu", "contiguous"):
        return _elementwise(shape, in_shapes, tp)
    if len(ins) != 1 and kind not in ("cat", "matmul"):
        return []
    if kind == "view":  # at every batch size, not only the b = 1 of the annotation
        return _moved(x, batch_safe_view_map(nodes[ins[0].name], info), tp, shape)
    if kind == "transpose":
        if op.__name__ == "t":
            perm = [1, 0][:len(shape)]
        elif op.__name__ == "permute":
            perm = [p % len(shape) for p in args[1]]
        else:
            a, b = (d % len(shape) for d in args[1:3])
            perm = list(range(len(shape)))
            perm[a], perm[b] = perm[b], perm[a]
        return _moved(x, {perm[o]: o for o in range(len(shape))}, tp, shape)
    if kind == "unsqueeze":
        dim = args[1] % len(shape)
        return _moved(x, {i: (i if i < dim else i + 1) for i in range(len(x))}, tp, shape)
    if kind == "expand":
        lead = len(shape) - len(x)
        out = _moved(x, {i: i + lead for i in range(len(x)) if x[i] == shape[i + lead]}, tp, shape)
        out += [_sharded((REPLICATE,), Shard(i + lead), tp, 1, (True,)) for i in range(len(x))
                if x[i] == 1 and shape[i + lead] > 1 and shape[i + lead] % tp == 0
                and isinstance(args[1][i + lead], int)]
        return out
    if kind in ("reduce", "softmax"):
        if kind == "softmax":
            reduced, keep = {args[1] % len(x)}, True
        else:
            dims = args[1] if len(args) > 1 else None
            if dims is None:
                return []
            dims = [dims] if isinstance(dims, int) else list(dims)
            reduced = {d % len(x) for d in dims}
            keep = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
        mapping = {i: (i if keep else i - sum(r < i for r in reduced))
                   for i in range(len(x)) if i not in reduced}
        return [_sharded((Shard(i),), Shard(o), tp, tp) for i, o in mapping.items()
                if x[i] % tp == 0 and x[i] > 1]
    if kind == "slice":
        dim = args[1] % len(x) if len(args) > 1 else 0
        whole = shape[dim] == x[dim]
        out = _moved(x, {i: i for i in range(len(x)) if i != dim or whole}, tp, shape)
        block = info.extra.get("block")
        if block is not None and not whole:  # one block of a fused projection's output
            out.append(_sharded((Shard(dim),), Shard(dim), tp, 1))
        return out
    if kind == "cat":
        dim = (args[1] if len(args) > 1 else 0) % len(shape)
        same = all(len(s) == len(shape) for s in in_shapes)
        return [_sharded(tuple(Shard(d) for _ in ins), Shard(d), tp, 1)
                for d in range(len(shape)) if same and d != dim and shape[d] % tp == 0
                and shape[d] > 1 and all(s[d] == shape[d] for s in in_shapes)]
    if kind == "matmul" and len(ins) == 2:
        a, b = in_shapes
        n = len(shape)
        out = []
        for d in range(n - 2):
            da, db = d - (n - len(a)), d - (n - len(b))
            pa = Shard(da) if da >= 0 and a[da] == shape[d] else REPLICATE
            pb = Shard(db) if db >= 0 and b[db] == shape[d] else REPLICATE
            if shape[d] % tp == 0 and shape[d] > 1 and (pa.is_sharded or pb.is_sharded):
                out.append(_sharded((pa, pb), Shard(d), tp, tp,
                                    (pa.is_replicated, pb.is_replicated)))
        return out
    return []
