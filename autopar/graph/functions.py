"""Custom ``torch.autograd.Function`` calls kept whole through ``torch.export``.

Non-strict export traces a Function's ``forward`` op by op and drops its ``backward``: the
captured program would differentiate the forward's ops, not the model's own gradient rule
(PhiMoE's router, whose sparsemixer gives the top-k choice a straight-through gradient;
Bloom's GELU with its hand-written derivative; RecurrentGemma's square root with a clipped
one). So while autopar exports a model, :func:`keep_functions` routes every
``Function.apply`` through one opaque op, ``autopar::function_call`` (a
``torch.library.custom_op`` whose fake kernel runs the Function's ``forward`` on fake
tensors for the shapes), and :func:`restore_calls` then puts back, in the captured graph, a
call of the Function itself (:class:`FunctionCall`): forward and backward are the model's.
Such a node is priced as an op without a formula (one FLOP per output element), kept whole
on every TP rank ("replicate").

Only tensor arguments become the op's inputs; the others (ints, flags, None) are baked into
the call as the model passed them, which export would also do.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.fx as fx

__all__ = ["FunctionCall", "keep_functions", "restore_calls"]

# the Function calls met during the export under way, by key (their position in the trace)
_ACTIVE: contextvars.ContextVar["list[FunctionCall] | None"] = contextvars.ContextVar(
    "autopar_function_calls", default=None)


class _Ctx:
    """A stand-in for the autograd context while the fake kernel runs ``forward``: what
    ``forward`` records for ``backward`` is not needed for shapes."""

    def __init__(self) -> None:
        self.needs_input_grad = ()

    def __getattr__(self, name):  # save_for_backward, mark_non_differentiable, ...
        return lambda *args, **kwargs: None


@torch.library.custom_op("autopar::function_call", mutates_args=())
def _function_call(inputs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    raise RuntimeError("autopar::function_call runs only while autopar exports a model")


@_function_call.register_fake
def _(inputs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    call = _ACTIVE.get()[key]
    out = call.cls.forward(_Ctx(), *call.arguments(inputs))
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"{call.cls.__qualname__}.forward returns a non-tensor; autopar keeps "
                        "custom autograd Functions whose outputs are tensors")
    call.single = single
    return [o.clone() for o in outs]  # a custom op's outputs alias none of its inputs


class FunctionCall:
    """``cls.apply`` on the model's arguments with the graph's tensors put in: the callable
    target of a captured Function's node; returns its outputs as a list."""

    def __init__(self, cls: type, template: tuple, key: int) -> None:
        self.cls, self.template, self.single = cls, template, True
        self.__name__ = f"apply_{cls.__name__}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__
        self.key = key

    def arguments(self, tensors) -> list:
        it = iter(tensors)
        return [next(it) if a is _TENSOR else a for a in self.template]

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.cls.apply(*self.arguments(tensors))
        return [out] if isinstance(out, torch.Tensor) else list(out)

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}.apply"


_TENSOR = object()


@contextlib.contextmanager
def keep_functions():
    """While active, ``torch.autograd.Function.apply`` of any Function on tensors the
    exporter traces records one ``autopar::function_call`` op (module docstring)."""
    original = torch.autograd.Function.__dict__["apply"]
    calls: list[FunctionCall] = []

    def apply(cls, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or not torch.compiler.is_exporting():
            return original.__func__(cls, *args, **kwargs)
        if kwargs:  # traced through, its backward would be lost: say so instead
            raise TypeError(f"{cls.__qualname__}.apply is called with keyword arguments "
                            f"({', '.join(kwargs)}); autopar keeps a custom autograd Function "
                            "whole only when called positionally: pass them by position")
        call = FunctionCall(cls, tuple(_TENSOR if isinstance(a, torch.Tensor) else a
                                       for a in args), len(calls))
        calls.append(call)
        outs = torch.ops.autopar.function_call(tensors, call.key)
        return outs[0] if call.single else tuple(outs)

    token = _ACTIVE.set(calls)
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield calls
    finally:
        torch.autograd.Function.apply = original
        _ACTIVE.reset(token)


def restore_calls(graph: fx.Graph, calls: list[FunctionCall]) -> None:
    """Each ``autopar::function_call`` node of ``graph`` becomes a call of its
    :class:`FunctionCall` (the same inputs and list output)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.autopar.function_call.default:
            inputs, key = node.args
            node.target = calls[key]
            node.args = (inputs,)
