"""Rewrite pass 1: tensor parallelism on the fx graph, for one TP rank.

Reads only the plan's per-node placements. For every node, in graph order:

1. its module is replaced by this rank's shard (column Linear: output rows; row Linear:
   input columns, bias added after the reduction; vocabulary Embedding: a row range,
   shared with a tied lm_head);
2. each input edge whose producer placement differs from the required one gets an explicit
   collective module: ``TPAllGather`` (S -> R), ``TPScatter`` (R -> S); partial outputs (row
   Linear, vocabulary Embedding) are completed right after the node by ``TPAllReduce``
   (Megatron's g); a consumer whose strategy makes its input gradient partial (column
   Linear) reads the producer through one shared ``TPCopy`` (Megatron's f);
3. shape-only and element-wise ops are left unchanged: they run on shards as they are
   (reshapes infer the head count with -1, which the strategies checked).

``print(gm.code)`` afterwards shows the distributed program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..runtime.collectives import TPAllGather, TPAllReduce, TPCopy, TPScatter, VocabParallelEmbedding
from ..strategies import Strategy, node_strategies, strategy_key

__all__ = ["ShardSpec", "TPRewrite", "BiasAdd", "apply_tensor_parallel"]


@dataclass(frozen=True)
class ShardSpec:
    """Where a local parameter comes from: ``key`` in the original state dict, split along
    ``dim`` into ``tp`` equal parts (dim None: replicated)."""

    key: str
    dim: int | None = None


@dataclass
class TPRewrite:
    """Result of the TP pass: the rewritten graph and the origin of every local parameter
    (by ``id`` of the Parameter object, so later passes may move modules freely)."""

    gm: fx.GraphModule
    shards: dict[int, ShardSpec] = field(default_factory=dict)


class BiasAdd(nn.Module):
    """``x + bias``: a row-parallel Linear's bias, added once after the all-reduce
    (adding it on every rank before the reduction would count it t times)."""

    def __init__(self, bias: nn.Parameter) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def _owner_meta(node: fx.Node) -> dict:
    """The pipeline stage / layer annotations a node inserted for ``node`` inherits."""
    return {k: v for k, v in node.meta.items() if k.startswith("autopar")}


def _owner_key(node: fx.Node) -> tuple:
    return (node.meta.get("autopar_stage"), node.meta.get("autopar_layer"))


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> nn.Parameter:
    size = t.shape[dim] // tp
    return nn.Parameter(t.detach().narrow(dim, rank * size, size).clone())


class _Rewriter:
    def __init__(self, traced, placements: dict[str, str], tp: int, tp_rank: int, group, counter):
        self.traced, self.gm = traced, traced.gm
        self.tp, self.rank, self.group, self.counter = tp, tp_rank, group, counter
        strategies = node_strategies(traced, tp)
        missing = [n.name for n in self.gm.graph.nodes if n.name not in placements]
        if missing:
            raise ValueError(f"plan has no placement for nodes {missing[:5]}: it was made for a "
                             "different model; re-plan for this model")
        self.choice: dict[str, Strategy] = {}
        for node in self.gm.graph.nodes:
            by_key = {strategy_key(s): s for s in strategies[node.name]}
            if placements[node.name] not in by_key:
                raise ValueError(f"placement {placements[node.name]!r} of node {node.name} is "
                                 f"not valid at tp={tp}; valid: {sorted(by_key)}")
            self.choice[node.name] = by_key[placements[node.name]]
        self.placement: dict[fx.Node, str] = {}
        self.resharded: dict[tuple[fx.Node, str], fx.Node] = {}
        self.f_nodes: dict[fx.Node, fx.Node] = {}
        self.shard_params: dict[tuple[int, str], nn.Parameter] = {}
        self.result = TPRewrite(self.gm)
        self.canon = {id(p): n for n, p in self.gm.named_parameters()}
        self.count = 0

    def _add_module(self, prefix: str, module: nn.Module) -> str:
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.gm.add_submodule(name, module)
        return name

    def _insert_after(self, anchor: fx.Node, prefix: str, module: nn.Module, arg: fx.Node,
                      owner: fx.Node) -> fx.Node:
        """Insert ``module(arg)`` after ``anchor``; it belongs to ``owner``'s stage/layer."""
        target = self._add_module(prefix, module)
        with self.gm.graph.inserting_after(anchor):
            new = self.gm.graph.call_module(target, (arg,))
        new.meta.update(_owner_meta(owner))
        return new

    def _reshard(self, src: fx.Node, dst: str, consumer: fx.Node) -> fx.Node:
        """``src`` in placement ``dst`` for ``consumer`` (shared by consumers of one layer)."""
        have = self.placement[src]
        if have == dst:
            return src
        key = (src, dst, _owner_key(consumer))
        if key not in self.resharded:
            if dst == "R" and have.startswith("S"):
                mod = TPAllGather(self.group, int(have[1:]), self.counter)
                self.resharded[key] = self._insert_after(src, "tp_all_gather", mod, src, consumer)
            elif have == "R" and dst.startswith("S"):
                mod = TPScatter(self.group, int(dst[1:]), self.counter)
                self.resharded[key] = self._insert_after(src, "tp_scatter", mod, src, consumer)
            else:
                raise ValueError(f"cannot reshard {src.name} from {have} to {dst}")
        return self.resharded[key]

    def _copy_to_tp(self, src: fx.Node, consumer: fx.Node) -> fx.Node:
        key = (src, _owner_key(consumer))
        if key not in self.f_nodes:
            self.f_nodes[key] = self._insert_after(
                src, "tp_f_copy", TPCopy(self.group, self.counter), src, consumer)
        return self.f_nodes[key]

    def run(self) -> TPRewrite:
        for node in list(self.gm.graph.nodes):
            strat = self.choice[node.name]
            ins = self._tensor_inputs(node)
            for j, src in enumerate(ins):
                new_src = self._reshard(src, strat.inputs[j], node)
                if strat.partial_grad_inputs and strat.partial_grad_inputs[j]:
                    new_src = self._copy_to_tp(new_src, node)
                if new_src is not src:
                    node.replace_input_with(src, new_src)
            self.placement[node] = strat.output
            if node.op == "call_module":
                self._replace_module(node, strat)
        self._record_replicated()
        self.gm.graph.lint()
        self.gm.delete_all_unused_submodules()
        self.gm.recompile()
        return self.result

    def _tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Tensor inputs in original order; nodes this pass inserted are tensors."""
        info = self.traced.nodes
        return [n for n in node.all_input_nodes if n.name not in info or info[n.name].shape is not None]

    def _replace_module(self, node: fx.Node, strat: Strategy) -> None:
        mod = self.gm.get_submodule(node.target)
        if strat.name == "column" and isinstance(mod, nn.Linear):
            self._set(node, self._linear(mod, 0))
        elif strat.name == "row" and isinstance(mod, nn.Linear):
            self._set(node, self._linear(mod, 1))
            self._complete_partial(node, mod.bias)
        elif strat.name == "vocab" and isinstance(mod, nn.Embedding):
            weight = self._param(mod.weight, 0)
            emb = VocabParallelEmbedding(weight, self.rank * weight.shape[0])
            self._set(node, emb)
            self._complete_partial(node, None)

    def _param(self, p: nn.Parameter, dim: int) -> nn.Parameter:
        key = (id(p), dim)
        if key not in self.shard_params:
            shard = _shard(p, dim, self.rank, self.tp)
            self.shard_params[key] = shard
            self.result.shards[id(shard)] = ShardSpec(self.canon[id(p)], dim)
        return self.shard_params[key]

    def _linear(self, mod: nn.Linear, dim: int) -> nn.Linear:
        """Column (dim 0: output features) or row (dim 1: input features) shard."""
        out_f = mod.out_features // self.tp if dim == 0 else mod.out_features
        in_f = mod.in_features // self.tp if dim == 1 else mod.in_features
        with torch.device("meta"):
            new = nn.Linear(in_f, out_f, bias=mod.bias is not None and dim == 0)
        new.weight = self._param(mod.weight, dim)
        if dim == 0 and mod.bias is not None:
            new.bias = self._param(mod.bias, 0)
        return new

    def _set(self, node: fx.Node, module: nn.Module) -> None:
        name = node.target.replace(".", "_") + "_tp"
        self.gm.add_submodule(name, module)
        node.target = name

    def _complete_partial(self, node: fx.Node, bias: nn.Parameter | None) -> None:
        """P -> R right after the node (Megatron's g), then the replicated bias if any."""
        users = list(node.users)
        reduced = self._insert_after(node, "tp_g_all_reduce", TPAllReduce(self.group, self.counter),
                                     node, node)
        out = reduced
        if bias is not None:
            out = self._insert_after(reduced, "row_bias", BiasAdd(bias), reduced, node)
        for user in users:
            user.replace_input_with(node, out)
        self.placement[node] = "R"
        self.placement[reduced] = "R"
        self.placement[out] = "R"

    def _record_replicated(self) -> None:
        for p in self.gm.parameters():
            if id(p) not in self.result.shards and id(p) in self.canon:
                self.result.shards[id(p)] = ShardSpec(self.canon[id(p)], None)


def apply_tensor_parallel(traced, placements: dict[str, str], *, tp: int, tp_rank: int,
                          group, counter=None) -> TPRewrite:
    """Rewrite ``traced.gm`` in place into TP rank ``tp_rank``'s program (see module doc).

    Raises ValueError when the placements do not belong to this graph or to this tp.
    """
    return _Rewriter(traced, placements, tp, tp_rank, group, counter).run()
