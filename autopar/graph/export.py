"""Capture any causal LM with ``torch.export`` (non-strict): the front end for user models.

``fx.symbolic_trace`` stops at what real model files contain (a Python ``assert`` on a
traced size, ``**kwargs`` signatures, ``ModelOutput`` returns, cache objects); non-strict
``torch.export`` runs the Python code with fake tensors instead, so it sees through all of
them and gives an aten-level fx graph. :func:`export_logits` turns that graph into the
form the rest of autopar reads:

* the parameters and buffers are ``get_attr`` nodes of the user's model under their own
  FQNs (``transformer.h.0.attn.c_attn.weight``), the same tensor objects (tied weights
  stay tied: identity, not name);
* the main op of a known leaf module becomes a ``call_module`` of that module again
  (``aten.linear`` of an ``nn.Linear``, ``aten.addmm`` of GPT-2's ``Conv1D``,
  ``aten.embedding``, ``aten.layer_norm``, ``aten.dropout`` of an ``nn.Dropout``), named by
  its module path (``transformer_h_0_attn_c_attn``), so tensor parallelism shards modules
  as it does for a symbolically traced model; a subclass with its own forward (Gemma's
  scaled embedding, OPT's offset positions) is called as its base class, since its
  extra ops stay in the graph (:func:`~autopar.graph.normalize.lift_modules`);
* ``aten.scaled_dot_product_attention`` and free ``aten.dropout`` become the
  ``torch.nn.functional`` calls the dropout and recompute passes know;
* ``split`` / ``chunk`` + ``getitem`` become one ``aten.slice`` per piece (single-output
  nodes; a fused QKV projection then reads as three slices of one Linear's output);
* ``aten.view`` becomes ``aten.reshape`` and ``aten.contiguous`` is dropped: export
  records a ``.contiguous()`` only where the device's fake kernel made it a copy, so
  without this the meta-device graph (planning) and the CPU/GPU graph (the runtime)
  would differ; a reshape copies where a view would need contiguous memory;
* ``_assert_tensor_metadata`` / ``_assert_scalar`` checks are dropped;
* the graph takes the token ids ``idx`` (b, s) and returns the logits (b, s, V) only: the
  model is called as ``model(idx, targets)`` when its forward has a ``targets`` / ``labels``
  argument (so nanoGPT-style models return logits for every position), with
  ``use_cache=False`` when it has that argument, and its own loss is dropped.

The batch dimension is exported dynamic, so the graph runs at any micro-batch size. The
expert loops of the MoE families whose shapes depend on the routing run in their static
grouped form while captured (:mod:`autopar.graph.expert_loops`). A deep
stack of identical layers is exported as three and the rest written by copying the last
(:mod:`autopar.graph.repeat`): the same graph, in seconds instead of half a minute for 80
layers.
"""

from __future__ import annotations

import inspect
import operator
import traceback

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # public, not _private

from autopar.graph.expert_loops import static_experts
from autopar.graph.normalize import lift_modules, renamed, resolve, split_to_slices
from autopar.graph.functions import keep_functions, restore_calls
from autopar.graph.no_grad import inline_region
from autopar.graph.repeat import EXPORTED_LAYERS, cut_stack, layer_stack, repeat_last_layer

__all__ = ["export_logits", "causal_lm_call", "causal_lm_logits", "user_frame", "user_frames",
           "TARGET_ARGS"]

aten = torch.ops.aten

TARGET_ARGS = ("targets", "labels")
"""Names of a forward's training-target argument (nanoGPT; Hugging Face)."""

_DROPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
            aten.sym_constrain_range_for_size.default}


def causal_lm_call(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None
                   ) -> tuple[tuple, dict]:
    """The (args, kwargs) autopar calls ``model`` with for token ids ``idx`` (b, s): the
    targets go to a ``targets`` / ``labels`` argument when the forward has one (a distinct
    tensor, zeros when not given), and ``use_cache=False`` when it takes ``use_cache``."""
    params = inspect.signature(model.forward).parameters
    kwargs = {}
    for name in TARGET_ARGS:
        if name in params:
            kwargs[name] = torch.zeros_like(idx) if targets is None else targets
            break
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (idx,), kwargs


def _pick_logits(out):
    """The logits in a model's output: ``.logits`` / ``["logits"]``, else the first element
    of a tuple, else the output itself."""
    if isinstance(out, dict) or hasattr(out, "logits"):
        return out["logits"] if isinstance(out, dict) else out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def causal_lm_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """``model``'s logits (b, s, V) for ``idx`` (b, s), called as :func:`export_logits`
    captures it: the single-device reference of ``verify``."""
    args, kwargs = causal_lm_call(model, idx)
    return _pick_logits(model(*args, **kwargs))


def _logits_leaf(spec) -> int:
    """Index, among the flattened output leaves described by pytree ``spec``, of the logits
    (the rule of :func:`_pick_logits`)."""
    children = spec.children()
    context = spec.context
    if not children:
        return 0
    if isinstance(context, (list, tuple)) and "logits" in context:
        k = list(context).index("logits")
    else:
        k = 0
    return sum(c.num_leaves for c in children[:k]) + _logits_leaf(children[k])


def user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and autopar's capture: where the
    user's code failed, as ``file:line in function: `code` ``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/autopar/graph/" not in f.filename]
    if not frames:
        return "<unknown location>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"


def export_logits(model: nn.Module, seq_len: int, trace_error: type[Exception], *,
                  repeat_layers: bool = True) -> fx.GraphModule:
    """``model(idx)`` -> logits as an fx GraphModule over ``model``'s own modules and
    parameters (see the module docstring); ``idx`` (b, s=seq_len) int64 with b dynamic.

    A stack of interchangeable layers is exported cut to its first layers and the rest
    repeated (:mod:`autopar.graph.repeat`: the same graph as a full export, in a fraction of
    the time); ``repeat_layers=False``, or a check of that module failing, exports it whole.

    Raises:
        trace_error: torch.export could not capture the model; the message names the
            user's file and line and export's own diagnosis.
    """
    stack = layer_stack(model) if repeat_layers else None
    if stack is not None:
        path, layers, lead = stack
        try:
            with cut_stack(model, path, lead + EXPORTED_LAYERS):
                ep = _export(model, seq_len)
        except Exception:  # the cut model does not export: the whole one decides below
            ep = None
        gm = _to_module_graph(model, ep, (path, len(layers), lead)) if ep is not None else None
        if gm is not None:
            return gm
    try:
        ep = _export(model, seq_len)
    except Exception as exc:  # export raises many types; all mean "cannot capture"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise trace_error(
            f"torch.export could not capture {type(model).__name__}.forward(idx) for seq_len="
            f"{seq_len}: {type(exc).__name__}: {first}\n  at {user_frame(exc)}\n"
            "  fix: make forward(idx) a static graph for a fixed seq_len (no data-dependent "
            "Python branches on tensor values; torch._check for size assumptions)") from exc
    return _to_module_graph(model, ep)


def _export(model: nn.Module, seq_len: int):
    """Non-strict ``torch.export`` of ``model(idx, ...)`` (:func:`causal_lm_call`) with a
    dynamic batch dimension; export's own exception when it fails."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    idx = torch.zeros(2, seq_len, dtype=torch.long, device=device)  # b = 2: not specialised
    args, kwargs = causal_lm_call(model, idx, torch.zeros_like(idx))
    # Dim.DYNAMIC, not Dim("batch"): a named Dim refuses every guard sympy cannot prove for
    # all batch sizes, even one that holds for all of them (Llama 4's MoE guards
    # 16·b·min(64, 1024·b) == 1024·b); DYNAMIC keeps such guards as export's runtime checks
    # and still refuses a model that specialises the batch size.
    batch = Dim.DYNAMIC
    names = list(inspect.signature(model.forward).parameters)
    dynamic = {names[0]: {0: batch}}
    dynamic.update({k: ({0: batch} if isinstance(v, torch.Tensor) else None)
                    for k, v in kwargs.items()})
    config = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None) if "use_cache" not in kwargs else None
    if cache:  # a forward without use_cache that reads the config's (GraniteMoE): a cache
        config.use_cache = False  # object in the output stops export
    try:
        with keep_functions() as calls, static_experts(model):
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
        restore_calls(ep.graph_module.graph, calls)  # the model's own autograd Functions
        return ep
    finally:
        if cache:
            config.use_cache = cache


def _to_module_graph(model: nn.Module, ep, repeat: tuple[str, int, int] | None = None
                     ) -> fx.GraphModule | None:
    """The module-level graph of export ``ep`` (the module docstring's normalisations).
    ``repeat`` (stack path, layer count, leading layers that differ): ``ep`` is of the cut
    stack, whose last layer is repeated up to the count (:func:`~autopar.graph.repeat.repeat_last_layer`); None when
    its checks fail."""
    _check_static_shapes(ep)
    sig = ep.graph_signature
    state = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    constants = getattr(sig, "inputs_to_lifted_tensor_constants", {})
    src = ep.graph_module
    graph = fx.Graph()
    root: dict[str, object] = {}
    env: dict[fx.Node, fx.Node] = {}
    targets: set[fx.Node] = set()
    user_inputs = [n for n in src.graph.nodes if n.op == "placeholder"
                   and n.name not in state and n.name not in constants]
    for node in src.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in state:
            fqn = state[node.name]
            root[fqn] = resolve(model, fqn)
            env[node] = graph.get_attr(fqn)
        elif node.name in constants:
            fqn = "_autopar_const_" + node.name
            root[fqn] = ep.constants[constants[node.name]]
            env[node] = graph.get_attr(fqn)
        elif node is user_inputs[0]:
            env[node] = graph.placeholder("idx")
        else:
            env[node] = None  # targets / flags: must be unused once the loss is dropped
            targets.add(node)
        if env[node] is not None:
            env[node].meta.update(node.meta)
    out_node = next(n for n in src.graph.nodes if n.op == "output")
    logits = out_node.args[0][_logits_leaf(ep.call_spec.out_spec)]
    idx = env[user_inputs[0]]
    batch = graph.call_function(aten.sym_size.int, (idx, 0))  # read once, before any layer
    batch.meta["val"] = user_inputs[0].meta["val"].shape[0]
    for node in src.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is aten.sym_size.int and _is_batch(node, user_inputs[0]):
            # export reads the batch size where a layer first needs it and every later
            # layer reuses that read; one read before the layers keeps them identical
            env[node] = batch
            continue
        if node.target is aten.sym_size.int and node.args[0] in targets:
            # the targets have the token ids' shape: read the batch size from the ids
            env[node] = graph.call_function(aten.sym_size.int, (env[user_inputs[0]],) + node.args[1:])
            env[node].meta.update(node.meta)
            continue
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            env[node] = inline_region(graph, getattr(src, node.args[1].target),
                                [env[a] for a in node.args[2:]], node.meta,
                                no_grad=not node.args[0])
            continue
        if node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        if node.op == "get_attr":  # other higher-order op bodies
            root[node.target] = getattr(src, node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[logits])
    _drop_checks(graph)
    graph.eliminate_dead_code()
    _hoist_sizes(graph, batch)
    for node in graph.nodes:
        if node.op == "placeholder" and node.target != "idx" and node.users:
            raise ValueError("the logits depend on the targets argument; autopar needs "
                             "forward(idx) logits that do not read the targets")
    _place_attrs(graph)
    if repeat is not None:
        graph = repeat_last_layer(graph, root, model, *repeat)
        if graph is None:
            return None
    gm = fx.GraphModule(root, graph)
    lift_modules(gm, model)
    split_to_slices(gm)
    gm.graph.eliminate_dead_code()
    gm.graph = renamed(gm.graph)  # the setter recompiles
    gm.graph.lint()
    return gm


def _hoist_sizes(graph: fx.Graph, batch: fx.Node) -> None:
    """Move integer arithmetic on the batch size (``b * heads``), which export computes where
    a layer first needs it and every later layer reuses, to just after ``batch``: before
    the layers, so that each layer holds the same op sequence."""
    anchor, hoisted = batch, {batch}
    for node in list(graph.nodes):
        if (node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)
                and node.all_input_nodes and set(node.all_input_nodes) <= hoisted):
            anchor.append(node)
            anchor = node
            hoisted.add(node)
            node.meta.pop("nn_module_stack", None)  # no longer in the layer that first read it


def _is_batch(node: fx.Node, idx: fx.Node) -> bool:
    """Whether ``node`` (a ``sym_size``) is the batch size: the symbol of idx's dim 0."""
    val, batch = node.meta.get("val"), idx.meta["val"].shape[0]
    return isinstance(val, torch.SymInt) and isinstance(batch, torch.SymInt) \
        and val.node.expr == batch.node.expr


def _check_static_shapes(ep) -> None:
    """Refuse a graph whose shapes depend on the data (a size read from a tensor's values:
    JetMoE's ``split`` by the tokens routed to each expert): autopar prices and shards
    static shapes. Raises ValueError naming the first such op and its source line."""
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            raise ValueError(
                f"forward computes a tensor whose shape depends on the data ({node.target}, "
                f"shape {tuple(val.shape)}, at {_user_line(node.meta.get('stack_trace') or '')}"
                "): autopar plans and shards static shapes; fix: route with fixed-size "
                "tensors (a capacity per expert, or the grouped/batched experts kernels)")


def user_frames(stack_trace: str) -> list[tuple[str, str]]:
    """The frames of an fx node's ``stack_trace`` outside torch and autopar, innermost
    last, each ("File ..., line N, in f", "code"); every frame when none is outside."""
    lines = stack_trace.strip().splitlines()
    frames = [(lines[i].strip(), lines[i + 1].strip() if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].strip().startswith("File ")]
    return [f for f in frames if "/torch/" not in f[0] and "/autopar/" not in f[0]] or frames


def _user_line(stack_trace: str) -> str:
    """The innermost user frame of an fx ``stack_trace`` as "file:line: `code`"."""
    frames = user_frames(stack_trace)
    return f"{frames[-1][0]}: `{frames[-1][1]}`" if frames else "<unknown location>"


def _place_attrs(graph: fx.Graph) -> None:
    """Move each ``get_attr`` just before its first user, in that user's module (so a
    parameter read inside layer i belongs to layer i, and to its pipeline chunk)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.users]:
        first = min(node.users, key=order.__getitem__)
        first.prepend(node)
        if "nn_module_stack" in first.meta:
            node.meta["nn_module_stack"] = dict(first.meta["nn_module_stack"])


def _drop_checks(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            graph.erase_node(node)


