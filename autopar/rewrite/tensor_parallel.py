"""Rewrite pass 1 of :func:`autopar.rewrite.apply_plan`: tensor parallelism for one TP rank.

Reads only the plan's per-node placements. For every node, in graph order:

1. its module is replaced by this rank's shard (column Linear: output rows; row Linear:
   input columns, bias added after the reduction; vocabulary Embedding: a row range,
   shared with a tied lm_head, its padding row kept); other tensors the graph reads from
   a replaced module (Gemma's ``embed_scale``) move to the root, so the whole weight
   leaves the program;
2. each input edge whose producer placement differs from the required one gets an explicit
   collective module (:mod:`autopar.runtime.tp_modules`): ``GatherFromTPRegion`` (S -> R),
   ``ScatterToTPRegion`` (R -> S); partial outputs (row Linear, vocabulary Embedding) are
   completed where they are read: ``ReduceFromTPRegion`` (Megatron's g, P -> R) or, with
   sequence parallelism, ``ReduceScatterToTPRegion`` (ḡ, P -> S), then the row Linear's
   bias; a consumer whose strategy makes its input gradient partial (column Linear) reads
   the producer through one shared ``CopyToTPRegion`` (Megatron's f), or, when the
   producer is sharded, through ``GatherToTPRegionWithPartialGrad`` (f̄: all-gather
   forward, reduce-scatter backward, f and the gather in one);
   each runs right after the producer, or, for a tensor written in place later (MLA's
   key buffer filled by ``copy_``), after the last write before its consumer
   (:mod:`autopar.graph.aliases`): a slice taken earlier would hold the unwritten buffer;
3. shape-only and element-wise ops are left unchanged: they run on shards as they are
   (reshapes infer the head count with -1, which the strategies checked); ``x.size(d)`` of
   a tensor sharded along d is multiplied by t;
4. parameters that are replicated but used on sequence shards (LayerNorm on S1, a row
   bias added after a reduce-scatter) get partial gradients: they are listed in
   ``TPRewrite.partial_grad_params`` for the runtime to all-reduce over TP after backward
   (Megatron's ``allreduce_sequence_parallel_grads``).

``print(gm.code)`` afterwards shows the distributed program.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.graph.aliases import in_place_writes, last_write_before
from autopar.graph.normalize import resolve
from autopar.graph.ops import is_conv1d, packet
from autopar.contract.placement import ShardSpec  # re-exported: the rewrite makes them
from autopar.runtime.tp_modules import (CopyToTPRegion, GatherFromTPRegion,
                                        GatherToTPRegionWithPartialGrad, ReduceFromTPRegion,
                                        ReduceScatterToTPRegion, ScatterToTPRegion, TPOperator)
from autopar.runtime.vocab_parallel import VocabParallelEmbedding
from autopar.contract.placement import Placement
from autopar.rewrite.pipeline import CHUNK, LAYER
from autopar.rewrite.shard_modules import BiasAdd, BlockOrder, Conv1DShard
from autopar.planner.strategies import (Strategy, decode_placements, gathers_for_partial_grad,
                                        partial_grad_input, partial_grad_params)

__all__ = ["ShardSpec", "TPRewrite", "BiasAdd", "BlockOrder", "Conv1DShard",
           "apply_tensor_parallel"]

aten = torch.ops.aten


@dataclass
class TPRewrite:
    """Result of the TP pass: the rewritten graph, the origin of every local parameter and
    the replicated parameters whose gradients are partial over TP (both by ``id`` of the
    Parameter object, so later passes may move modules freely)."""

    gm: fx.GraphModule
    shards: dict[int, ShardSpec] = field(default_factory=dict)
    partial_grad_params: set[int] = field(default_factory=set)


def _owner_meta(node: fx.Node) -> dict:
    """The model chunk / layer annotations a node inserted for ``node`` inherits."""
    return {k: v for k, v in node.meta.items() if k.startswith("autopar")}


def _owner_key(node: fx.Node) -> tuple:
    """(chunk, layer) of ``node``: inserted collectives are shared within one of these."""
    return (node.meta.get(CHUNK), node.meta.get(LAYER))


class _Rewriter:
    def __init__(self, traced, placements: dict[str, str], tp: int, tp_rank: int, group,
                 sequence_parallel: bool = False, ep: int = 1):
        self.traced, self.gm = traced, traced.gm
        self.tp, self.rank, self.group = tp, tp_rank, group
        self.choice: dict[str, Strategy] = {
            name: strategy for name, (_, strategy)
            in decode_placements(traced, placements, tp, sequence_parallel, ep).items()}
        self.placement: dict[fx.Node, Placement] = {}
        self.resharded: dict[tuple[fx.Node, str], fx.Node] = {}
        self.f_nodes: dict[fx.Node, fx.Node] = {}
        self.partial_bias: dict[fx.Node, nn.Parameter | None] = {}  # P outputs -> their bias
        self.scalars: set[fx.Node] = set()  # inserted nodes that are not tensors
        self.bias_paths: dict[int, set[str]] = {}  # id(bias) -> placements it is added in
        self.shard_params: dict[tuple[int, str], nn.Parameter] = {}
        self.result = TPRewrite(self.gm)
        self.canon = {id(p): traced.tied_params.get(n, n)  # the model's own name of p
                      for n, p in self.gm.named_parameters(remove_duplicate=False)}
        self.count = 0
        self.replaced: list[str] = []  # paths of the modules replaced by their shards
        # tensors written in place after they are made (MLA's key buffer): a collective
        # reading one runs after the writes its consumer sees (autopar.graph.aliases)
        self.writes = in_place_writes(self.gm.graph)
        self.order = {node: i for i, node in enumerate(self.gm.graph.nodes)}

    def _add_module(self, prefix: str, module: nn.Module) -> str:
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.gm.add_submodule(name, module)
        return name

    def _insert_after(self, anchor: fx.Node, module: nn.Module, arg: fx.Node, owner: fx.Node,
                      prefix: str | None = None) -> fx.Node:
        """Insert ``module(arg)`` after ``anchor``, named ``<prefix>_<n>`` (default: the TP
        operator's name); it belongs to ``owner``'s model chunk and layer."""
        target = self._add_module(prefix or module.name, module)
        with self.gm.graph.inserting_after(anchor):
            new = self.gm.graph.call_module(target, (arg,))
        new.meta.update(_owner_meta(owner))
        return new

    def _reshard(self, src: fx.Node, dst: Placement, consumer: fx.Node, fused: bool = False) -> fx.Node:
        """``src`` in placement ``dst`` for ``consumer`` (shared by consumers of one layer);
        ``fused``: the gather also carries Megatron's f (reduce-scatters the partial input
        gradient, :func:`~autopar.planner.strategies.gathers_for_partial_grad`)."""
        have = self.placement[src]
        if have == dst:
            return src
        at = last_write_before(src, consumer, self.writes, self.order)  # src's value is final
        key = (src, dst, _owner_key(consumer), fused, at)
        blocks = self._blocks(src, have if have.is_sharded else dst)
        if key not in self.resharded:
            if have.is_partial:
                self.resharded[key] = self._complete_partial(src, dst, consumer, at)
            elif dst.is_replicated and have.is_sharded:
                cls = GatherToTPRegionWithPartialGrad if fused else GatherFromTPRegion
                out = self._insert_after(at, cls(self.group, have.dim), src, consumer)
                if blocks:  # the gathered chunks are rank-major: back to q|k|v order
                    out = self._insert_after(out, BlockOrder(blocks, self.tp, have.dim, False),
                                             out, consumer, "block_order")
                self.resharded[key] = out
            elif have.is_replicated and dst.is_sharded:
                arg = src
                if blocks:  # rank r's chunk must hold the r-th part of every block
                    arg = self._insert_after(at, BlockOrder(blocks, self.tp, dst.dim, True),
                                             src, consumer, "block_order")
                mod = ScatterToTPRegion(self.group, dst.dim)
                self.resharded[key] = self._insert_after(at if arg is src else arg, mod, arg,
                                                         consumer)
            else:
                raise ValueError(f"cannot reshard {src.name} from {have} to {dst}")
        return self.resharded[key]

    def _blocks(self, src: fx.Node, sharded: Placement) -> tuple[int, ...]:
        """The fused-projection blocks of ``src``'s output when sharded along their dim."""
        info = self.traced.nodes.get(src.name)
        if info is None or not sharded.is_sharded or sharded.dim != len(info.shape) - 1:
            return ()
        return tuple(info.extra.get("out_blocks", ()))

    def _complete_partial(self, src: fx.Node, dst: Placement, consumer: fx.Node,
                          at: fx.Node) -> fx.Node:
        """P -> R (all-reduce, Megatron's g) or P -> S<d> (reduce-scatter, sequence-parallel
        ḡ), run after ``at``, then the row Linear's bias if it has one."""
        mod: TPOperator = (ReduceFromTPRegion(self.group) if dst.is_replicated
                           else ReduceScatterToTPRegion(self.group, dst.dim))
        out = self._insert_after(at, mod, src, consumer)
        bias = self.partial_bias.get(src)
        if bias is None:
            return out
        paths = self.bias_paths.setdefault(id(bias), set())
        paths.add(dst.is_sharded)
        if len(paths) > 1:
            raise NotImplementedError(
                f"the bias of {src.name} would be added on a replicated and on a sharded path; "
                "its gradient could not be completed by one all-reduce. Give the consumers of "
                f"{src.name} one placement (e.g. megatron_placements(..., sequence_parallel=True))")
        start, size = 0, None
        dim = dst.dim
        ndim = len(self.traced.nodes[src.name].shape)
        if dim is not None and dim == ndim - 1:  # sharded along the bias's own dim
            size = bias.shape[0] // self.tp
            start = self.rank * size
        if dim is not None:
            self.result.partial_grad_params.add(id(bias))
        return self._insert_after(out, BiasAdd(bias, start, size), out, consumer, "row_bias")

    def _copy_to_tp(self, src: fx.Node, consumer: fx.Node) -> fx.Node:
        at = last_write_before(src, consumer, self.writes, self.order)
        key = (src, _owner_key(consumer), at)
        if key not in self.f_nodes:
            self.f_nodes[key] = self._insert_after(at, CopyToTPRegion(self.group), src, consumer)
        return self.f_nodes[key]

    def run(self) -> TPRewrite:
        for node in list(self.gm.graph.nodes):
            strat = self.choice[node.name]
            ins = self._tensor_inputs(node)
            for j, src in enumerate(ins):
                fused = gathers_for_partial_grad(strat, j, self.placement[src])
                new_src = self._reshard(src, strat.inputs[j], node, fused)
                if partial_grad_input(strat, j) and not fused:
                    new_src = self._copy_to_tp(new_src, node)
                if new_src is not src:
                    node.replace_input_with(src, new_src)
            self.placement[node] = strat.output
            if node.op == "call_module":
                self._replace_module(node, strat)
            elif strat.reads_size:
                self._scale_size(node, strat)
            elif strat.output.is_sharded and packet(node.target) is not None:
                self._local_sizes(node, strat)
        self._rehome_attrs()
        self._record_replicated()
        self.gm.graph.lint()
        self.gm.delete_all_unused_submodules()
        self.gm.recompile()
        return self.result

    def _tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Tensor inputs in original order; nodes this pass inserted are tensors."""
        info = self.traced.nodes
        return [n for n in node.all_input_nodes if n not in self.scalars
                and (n.name not in info or info[n.name].shape is not None)]

    def _local_sizes(self, node: fx.Node, strat: Strategy) -> None:
        """An aten op whose output is sharded along d reads the local size: constant target
        sizes along d of reshapes and expands, and a fused projection's block bounds of a
        slice, are divided by t (a -1 or a computed size is left as it is)."""
        op, d = packet(node.target), strat.output.dim
        args = list(node.args)
        if op in (aten.reshape, aten.view, aten.expand) and isinstance(args[1], (list, tuple)):
            sizes = list(args[1])
            if isinstance(sizes[d], int) and sizes[d] != -1:
                sizes[d] //= self.tp
            args[1] = sizes
        elif op is aten.slice and "block" in self.traced.nodes[node.name].extra:
            if args[1] % len(self.traced.nodes[node.name].shape) == d:
                start, end = self.traced.nodes[node.name].extra["block"]
                args[2:4] = [start // self.tp, end // self.tp]
        node.args = tuple(args)

    def _replace_module(self, node: fx.Node, strat: Strategy) -> None:
        mod = self.gm.get_submodule(node.target)
        blocks = tuple(self.traced.nodes[node.name].extra.get("out_blocks", ()))
        if strat.name in ("column", "row") and is_conv1d(mod):
            column = strat.name == "column"
            weight = self._param(mod.weight, 1 if column else 0, blocks if column else ())
            bias = self._param(mod.bias, 0, blocks) if column and mod.bias is not None else None
            self._set(node, Conv1DShard(weight, bias))
            if not column:
                self.partial_bias[node] = mod.bias
        elif strat.name == "column" and isinstance(mod, nn.Linear):
            self._set(node, self._linear(mod, 0, blocks))
        elif strat.name == "row" and isinstance(mod, nn.Linear):
            self._set(node, self._linear(mod, 1))
            self.partial_bias[node] = mod.bias  # added where the partial sum is completed
        elif strat.name == "vocab" and isinstance(mod, nn.Embedding):
            weight = self._param(mod.weight, 0)
            emb = VocabParallelEmbedding(weight, self.rank * weight.shape[0], mod.padding_idx)
            self._set(node, emb)
            self.partial_bias[node] = None
        elif partial_grad_params(self.traced.nodes[node.name], strat):  # e.g. LayerNorm
            self.result.partial_grad_params.update(id(p) for p in mod.parameters())

    def _scale_size(self, node: fx.Node, strat: Strategy) -> None:
        """``x.size(d)`` of x sharded along d is the local size: multiply it by t."""
        dim = strat.inputs[0].dim
        args = list(node.args[1:]) + list(node.kwargs.values())
        if len(args) != 1 or not isinstance(args[0], int):
            raise NotImplementedError(f"{node.name}: size() of a sharded tensor needs one int dim")
        ndim = len(self.traced.nodes[node.args[0].name].shape)
        if args[0] % ndim != dim:
            return
        users = list(node.users)
        with self.gm.graph.inserting_after(node):
            full = self.gm.graph.call_function(operator.mul, (node, self.tp))
        full.meta.update(_owner_meta(node))
        self.scalars.add(full)
        for user in users:
            user.replace_input_with(node, full)

    def _param(self, p: nn.Parameter, dim: int, blocks: tuple[int, ...] = ()) -> nn.Parameter:
        key = (id(p), dim)
        if key not in self.shard_params:
            spec = ShardSpec(self.canon[id(p)], dim, blocks)
            shard = nn.Parameter(spec.local(p.detach(), self.rank, self.tp).clone())
            self.shard_params[key] = shard
            self.result.shards[id(shard)] = spec
        return self.shard_params[key]

    def _linear(self, mod: nn.Linear, dim: int, blocks: tuple[int, ...] = ()) -> nn.Linear:
        """Column (dim 0: output features; ``blocks``: a fused projection's parts, each
        split) or row (dim 1: input features) shard."""
        out_f = mod.out_features // self.tp if dim == 0 else mod.out_features
        in_f = mod.in_features // self.tp if dim == 1 else mod.in_features
        with torch.device("meta"):
            new = nn.Linear(in_f, out_f, bias=mod.bias is not None and dim == 0)
        new.weight = self._param(mod.weight, dim, blocks)
        if dim == 0 and mod.bias is not None:
            new.bias = self._param(mod.bias, 0, blocks)
        return new

    def _set(self, node: fx.Node, module: nn.Module) -> None:
        name = node.target.replace(".", "_") + "_tp"
        self.gm.add_submodule(name, module)
        self.replaced.append(node.target)
        node.target = name

    def _rehome_attrs(self) -> None:
        """``get_attr`` of a replaced module's other tensors (Gemma's ``embed_scale`` buffer
        of its embedding) read them from the root instead, so the replaced module, whole
        weight included, leaves the program (otherwise the optimizer would hold a full,
        never-updated copy of the weight)."""
        for node in self.gm.graph.nodes:
            path = next((p for p in self.replaced if node.op == "get_attr"
                         and node.target.startswith(p + ".")), None)
            if path is None:
                continue
            value = resolve(self.gm, node.target)
            split = next((d for (pid, d) in self.shard_params if pid == id(value)), None)
            if split is not None:
                raise NotImplementedError(
                    f"{', '.join(u.name for u in node.users)} reads the whole {node.target}, which "
                    f"the plan splits along dim {split} for its module's call: its gradient would "
                    "miss that read. Read the parameter through its module's own call (e.g. "
                    "self.lm_head(x), not F.linear(x, self.lm_head.weight)), or pin that module "
                    "replicated")
            name = "_".join(node.target.split(".")) + "_attr"
            if isinstance(value, nn.Parameter):
                self.gm.register_parameter(name, value)
            else:
                self.gm.register_buffer(name, value, persistent=False)
            node.target = name

    def _record_replicated(self) -> None:
        for p in self.gm.parameters():
            if id(p) not in self.result.shards and id(p) in self.canon:
                self.result.shards[id(p)] = ShardSpec(self.canon[id(p)], None)


def apply_tensor_parallel(traced, placements: dict[str, str], *, tp: int, tp_rank: int,
                          group, sequence_parallel: bool = False, ep: int = 1) -> TPRewrite:
    """Rewrite ``traced.gm`` in place into TP rank ``tp_rank``'s program (see module doc).

    Raises ValueError when the placements do not belong to this graph or to this tp
    (``sequence_parallel``, ``ep``: the strategies the plan was solved with).
    """
    return _Rewriter(traced, placements, tp, tp_rank, group, sequence_parallel, ep).run()
