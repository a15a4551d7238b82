"""Step 1 of the flow: model -> fx graph annotated with shapes, FLOPs and bytes.

``trace_model`` runs ``torch.fx.symbolic_trace`` (leaf ``nn`` modules such as Linear and
LayerNorm stay ``call_module`` nodes, which is what a Megatron-style rewrite wants), then
propagates shapes on the ``meta`` device, so a 175B model is planned without allocating
its weights. Everything is traced for ONE sequence (b = 1): FLOPs and activation bytes of
a transformer are linear in b, so the cost adapter scales them by the micro-batch size.

Node annotations (``NodeInfo``) and the layer grouping live in :mod:`autopar.graph.annotate`.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from autopar.graph.annotate import TracedModel, annotate, layer_of_nodes
from autopar.graph.experts import collapse_experts
from autopar.graph.export import export_logits, user_frame
from autopar.graph.layer_groups import group_layers
from autopar.graph.moe import check_router_losses
from autopar.graph.shared_reads import hoist_shared_reads

__all__ = ["TraceError", "trace_model", "symbolic_trace_logits", "check_causal_lm",
           "check_parameters_read", "meta_buffers",
           "cast_floating", "COMPUTE_DTYPES", "place_meta_devices"]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # Plan.dtype -> torch


class TraceError(Exception):
    """The model cannot be captured as an fx graph; the message names the code and a fix."""


def symbolic_trace_logits(model: torch.nn.Module) -> fx.GraphModule:
    """fx-trace ``model(idx)`` and return a GraphModule whose output is the logits.

    The model is called as ``model(idx)`` (a ``targets`` argument, if any, is fixed to
    None). If it returns a tuple, the first element is taken as the logits (b, s, V).

    Raises:
        TraceError: naming the file, line and code fx could not trace, and how to fix it.
    """
    import inspect

    params = inspect.signature(model.forward).parameters
    concrete = {name: None for name in list(params)[1:]
                if params[name].default is None}
    try:
        tracer = _GradModeTracer()
        tracer.record_stack_traces = True  # each node's source line, for messages
        with torch.enable_grad():  # a no_grad region of forward then shows as one
            graph = tracer.trace(model, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # fx raises TraceError, TypeError, AssertionError, ...
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__}: {type(exc).__name__}: {exc}\n"
            f"  at {user_frame(exc)}\n"
            "  fix: remove data-dependent Python control flow and Python `assert` on tensor "
            "values or sizes (use torch.where / torch._assert), or make the offending "
            "sub-module a leaf, so that forward(idx) is a static graph"
        ) from exc
    if _no_grad_reads_parameters(gm):  # export keeps the region, and says where it is
        raise TraceError(f"{type(model).__name__}.forward runs ops on its parameters under "
                         "torch.no_grad(), which torch.fx does not record")
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    result = out.args[0]
    if isinstance(result, (tuple, list)):
        out.args = (result[0],)
    # drop the specialised `targets` placeholder and its assert
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op == "placeholder" and not node.users and node is not _first_placeholder(graph):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


class _GradModeTracer(fx.Tracer):
    """An fx tracer that marks each node created while gradients are off
    (``node.meta["no_grad"]``): fx records ops, not the grad mode they ran under."""

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():
            node.meta["no_grad"] = True
        return node


def _no_grad_reads_parameters(gm: fx.GraphModule) -> bool:
    """Whether a node traced under ``torch.no_grad()`` reads a parameter or a value
    computed from one (a rotary table of buffers under no_grad does not)."""
    depends: set[fx.Node] = set()
    for node in gm.graph.nodes:
        reads = ((node.op == "get_attr" and isinstance(_attr(gm, node.target), nn.Parameter))
                 or (node.op == "call_module"
                     and any(True for _ in gm.get_submodule(node.target).parameters()))
                 or any(a in depends for a in node.all_input_nodes))
        if reads and node.meta.get("no_grad"):
            return True
        if reads:
            depends.add(node)
    return False


def _attr(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def _first_placeholder(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "placeholder")


def trace_model(model: torch.nn.Module, seq_len: int, *, name: str = "model",
                dtype: str | None = None) -> TracedModel:
    """Capture ``model`` for one sequence of ``seq_len`` tokens and annotate every node.

    Two front ends, one result: ``torch.fx.symbolic_trace`` when it captures the whole
    model and its output is the logits (a module-level graph, e.g. autopar's own GPT);
    otherwise non-strict ``torch.export`` (:mod:`autopar.graph.export`: nanoGPT as written,
    Hugging Face models). The model may live on any device; shapes are propagated on a
    ``meta`` copy (models already on ``meta`` are not copied; a model with meta parameters
    and real buffers is captured as a copy with meta buffers, :func:`meta_buffers`). Returns a
    :class:`~autopar.graph.annotate.TracedModel` with ``gm`` (the logits graph over the
    ORIGINAL modules and parameters, for rewriting) and per-node ``NodeInfo`` for one
    sequence (b = 1).

    dtype: the plan's compute dtype (``"fp32"`` | ``"bf16"``, :data:`COMPUTE_DTYPES`): a
        model whose floating parameters hold another dtype is traced as a copy cast to it,
        because a captured graph's casts depend on it (Hugging Face's RMSNorm computes in
        fp32 and casts back to the input's dtype), so the plan's node names are those of
        the program the runtime traces. None: the model as it is.

    Raises:
        TraceError: neither front end captures the model (export's diagnosis and the
            user's file:line are named), or shape propagation fails.
        ValueError: the model is not a causal LM with a layer stack (:func:`check_causal_lm`),
            or adds a router loss autopar would drop (:func:`~autopar.graph.moe.check_router_losses`).
    """
    check_router_losses(model)
    want = COMPUTE_DTYPES[dtype] if dtype is not None else None
    recast = want is not None and any(p.is_floating_point() and p.dtype != want
                                      for p in model.parameters())
    mixed = any(p.is_meta for p in model.parameters()) and \
        not all(b.is_meta for b in model.buffers())
    if recast or mixed:  # one copy for both
        model = copy.deepcopy(model)
        if recast:
            cast_floating(model, want)
        if mixed:
            meta_buffers(model)
    try:
        gm = symbolic_trace_logits(model)
    except TraceError:
        gm = None
    if gm is not None:
        try:
            return _annotated(model, gm, seq_len, name)
        except (ValueError, TraceError):  # traced, but not to (b, s, V) logits, or to a
            pass  # graph whose shapes do not propagate (a branch fx baked): export decides
    return _annotated(model, export_logits(model, seq_len, TraceError), seq_len, name)


def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its floating-point parameters and buffers cast to ``dtype`` (in place:
    parameters keep their identity, tied ones stay tied; returned). Unlike
    ``Module.to(dtype)``, a complex buffer stays complex (torchtitan's rotary ``freqs_cis``:
    ``to`` would drop its imaginary part)."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point() and b.dtype != dtype:
                setattr(module, name, b.to(dtype))
    return model


def meta_buffers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every buffer moved to the meta device (in place; returned). A model
    built with meta parameters and real buffers (``autopar.meta_parameters()``,
    accelerate's ``init_empty_weights()``) is captured so: its operations would otherwise
    mix meta and real tensors, and capture reads only shapes (the buffers' values are kept
    by :mod:`autopar.runtime.materialize`)."""
    for module in model.modules():
        for name, b in list(module.named_buffers(recurse=False)):
            if not b.is_meta:
                setattr(module, name, torch.empty_like(b, device="meta"))
    return model


def _annotated(model: torch.nn.Module, gm: fx.GraphModule, seq_len: int, name: str) -> TracedModel:
    """Shape-propagate ``gm`` for idx (1, seq_len) on the meta device, annotate, check
    (shared reads hoisted first: :func:`~autopar.graph.shared_reads.hoist_shared_reads`)."""
    hoist_shared_reads(gm)
    meta_gm = gm if _all_meta(gm) else _meta_copy(gm)
    pair = _shapes_at(meta_gm, 2, seq_len)  # which dims grow with the batch (below)
    idx = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        RepeatedLayerShapeProp(meta_gm).propagate(idx)
    except Exception as exc:
        raise TraceError(
            f"shape propagation of {type(model).__name__} on the meta device failed for "
            f"seq_len={seq_len}: {type(exc).__name__}: {exc}\n  fix: check that seq_len fits the "
            "model (e.g. block_size) and that forward(idx) uses no CPU-only operations"
        ) from exc
    # copy the shape annotations onto the graph that references the real modules
    for node, meta_node in zip(gm.graph.nodes, meta_gm.graph.nodes):
        if "tensor_meta" in meta_node.meta:
            node.meta["tensor_meta"] = meta_node.meta["tensor_meta"]
    traced = annotate(gm, seq_len=seq_len, name=name, model=model)
    collapsed = collapse_experts(gm, model, traced.nodes)  # each experts module: one call
    if collapsed:
        traced = annotate(gm, seq_len=seq_len, name=name, model=model)
        pair.update({new: pair.get(old) for new, old in collapsed.items()})
    for info in traced.nodes.values():
        two = pair.get(info.name)
        if info.shape is not None and two is not None and len(two) == len(info.shape):
            info.extra["batch_dims"] = tuple(d for d, (a, b) in enumerate(zip(info.shape, two))
                                             if a != b)
    traced = group_layers(traced)  # layers that differ: planned as groups of identical ones
    check_causal_lm(traced, type(model).__name__)
    check_parameters_read(traced, model)
    return traced


def _shapes_at(meta_gm: fx.GraphModule, batch: int, seq_len: int) -> dict[str, tuple]:
    """Node name -> output shape for ``batch`` sequences ({} when the graph does not run at
    that batch). Shapes are annotated at b = 1, where a view that folds the batch into the
    sequence (``x.reshape(1, -1, h)``) looks like the identity; comparing with b = 2 says
    which dims hold the batch (``NodeInfo.extra["batch_dims"]``), so that a rule can ask
    whether a sharding passes at every batch size
    (:func:`~autopar.planner.strategies.batch_safe_view_map`)."""
    try:
        RepeatedLayerShapeProp(meta_gm).propagate(
            torch.zeros(batch, seq_len, dtype=torch.long, device="meta"))
    except Exception:  # a graph fixed to one sequence: no batch dims known
        shapes = {}
    else:
        shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in meta_gm.graph.nodes
                  if hasattr(n.meta.get("tensor_meta"), "shape")}
    for n in meta_gm.graph.nodes:  # the b = 1 propagation annotates afresh
        n.meta.pop("tensor_meta", None)
    return shapes


def check_parameters_read(traced: TracedModel, model: torch.nn.Module) -> None:
    """Raise ValueError naming the parameters ``forward(idx)`` never reads at the traced
    seq_len: the parallel program holds what the graph reads, so they would be dropped from
    training, the optimizer and checkpoints (DeepSeek-V4's compressor position bias at a
    sequence shorter than its compression window)."""
    read = {p for info in traced.nodes.values() for p in info.params}
    read |= set(traced.tied_params)
    unread = [name for name, _ in model.named_parameters() if name not in read]
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise ValueError(
            f"{type(model).__name__}.forward(idx) never reads {len(unread)} of its parameters "
            f"at seq_len={traced.seq_len} ({shown}): autopar's program holds only what the "
            "forward reads, so they would leave training and its checkpoints; fix: plan at "
            "the sequence length the model trains at, or remove the parameters")


def check_causal_lm(traced: TracedModel, model_name: str) -> None:
    """Raise ValueError unless ``traced`` is what autopar parallelizes: a causal language
    model whose ``forward(idx (b, s))`` returns logits (b, s, V) (alone, or first in a
    tuple) through a stack of repeated transformer layers (module paths ``P.<i>.…``, e.g.
    ``transformer.h.0``, ``model.layers.0``). The message names what is missing."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    source = out.args[0]
    shape = traced.nodes[source.name].shape if isinstance(source, fx.Node) else None
    if shape is None or len(shape) != 3 or shape[1] != traced.seq_len:
        raise ValueError(
            f"{model_name} is not a causal language model autopar can plan: forward(idx) must "
            f"return logits of shape (b, s, V) (alone or first in a tuple); for idx of shape "
            f"(1, {traced.seq_len}) it returned {tuple(shape) if shape else 'no tensor'}")
    if not traced.layers:
        raise ValueError(
            f"{model_name} has no stack of transformer layers autopar can find: it looks for a "
            "module list whose children hold the layers (module paths like transformer.h.0 or "
            "model.layers.0, at least one of them); put the layers in an nn.ModuleList")


def _meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` on the meta device, device constants baked in by export included."""
    meta_gm = copy.deepcopy(gm).to("meta")
    meta = torch.device("meta")
    for node in meta_gm.graph.nodes:
        node.args = tuple(meta if isinstance(a, torch.device) else a for a in node.args)
        node.kwargs = {k: meta if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
    meta_gm.recompile()
    return meta_gm


def place_meta_devices(gm: fx.GraphModule, device: torch.device) -> bool:
    """Replace the ``meta`` device constants in ``gm``'s node arguments by ``device`` and
    recompile when there were any (returns whether): a model captured on the meta device
    has export's device of the capture baked in (``arange(..., device=meta)`` for
    positions), which the materialised program must create on its own device instead."""
    found = False

    def place(a):
        nonlocal found
        if isinstance(a, torch.device) and a.type == "meta":
            found = True
            return device
        return a
    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, place)
        node.kwargs = fx.node.map_aggregate(node.kwargs, place)
    if found:
        gm.recompile()
    return found


def _all_meta(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return all(t.is_meta for t in tensors)


class RepeatedLayerShapeProp(ShapeProp):
    """``torch.fx``'s ShapeProp that runs each op of a repeated transformer layer once.

    Shape propagation costs one fake-tensor dispatch per op (about 5 s for GPT-3's 96
    layers on two cores), yet layer k is layer k - 1's code on the same shapes. A node of
    layer k >= 1 whose counterpart in layer k - 1 (the same position in the layer, the same
    op and target, or a module of the same class) saw arguments of equal metadata (shape,
    dtype, stride; constants equal) takes that counterpart's output and ``tensor_meta``
    instead of running: the same result, since a meta op's output depends only on that
    metadata. Every other node runs as in ShapeProp, so a layer that differs (another
    length, another op) is propagated op by op.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.previous: dict[fx.Node, fx.Node] = {}
        by_layer: dict[int, list[fx.Node]] = {}
        for node, layer in zip(gm.graph.nodes, layer_of_nodes(gm)):
            if layer is not None:
                by_layer.setdefault(layer, []).append(node)
        modules = dict(gm.named_modules())
        for k in sorted(by_layer)[1:]:
            before = by_layer.get(k - 1, [])
            if len(before) != len(by_layer[k]):
                continue
            for node, twin in zip(by_layer[k], before):
                same = node.op == twin.op and (
                    _module_shape(modules.get(node.target)) == _module_shape(modules.get(twin.target))
                    if node.op == "call_module" else node.target == twin.target)
                if same:
                    self.previous[node] = twin
        self.twinned = set(self.previous.values())
        self.outputs: dict[fx.Node, object] = {}  # a twinned node's output, until its twin ran

    def run_node(self, n: fx.Node):
        twin = self.previous.get(n)
        if twin is not None and twin in self.outputs and "tensor_meta" in twin.meta:
            def meta(a):  # a tensor by its metadata; a size or other value by itself
                return fx.node.map_arg(a, lambda x: (x.meta["tensor_meta"], x.meta.get("type"))
                                       if "tensor_meta" in x.meta else _plain(self.env.get(x)))
            if meta(n.args) == meta(twin.args) and meta(n.kwargs) == meta(twin.kwargs):
                n.meta["tensor_meta"] = twin.meta["tensor_meta"]
                n.meta["type"] = twin.meta.get("type")
                result = self.outputs.pop(twin)
                self.outputs[n] = result
                return result
        result = super().run_node(n)
        if n in self.twinned:  # the interpreter frees env entries after their last use
            self.outputs[n] = result
        return result


def _plain(value) -> object:
    """``value`` where equality means the same value (an int, a size, a tuple of them), its
    identity otherwise (Gemma 4's global layers read sizes 512, its sliding ones 256)."""
    if isinstance(value, (int, float, bool, str, type(None), torch.SymInt, torch.Size)):
        return ("value", value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, bool, type(None))) for v in value):
        return ("value", tuple(value))
    return ("object", id(value))


def _module_shape(module: nn.Module | None) -> tuple:
    """What a module's output shape may depend on besides its inputs: its class, settings
    (``extra_repr``) and the shapes of its own parameters and buffers (Gemma 4's global
    layers project to 512-wide heads where its sliding ones project to 256)."""
    if module is None:
        return (None,)
    tensors = [(n, tuple(t.shape)) for n, t in (*module.named_parameters(recurse=False),
                                                 *module.named_buffers(recurse=False))]
    return type(module), module.extra_repr(), tuple(tensors)
