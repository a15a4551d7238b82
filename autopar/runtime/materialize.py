"""Shard-only initialisation: give a model built on the meta device its values, whole
(:func:`init_model`) or as one rank's shards (:mod:`autopar.runtime.shard_init`, called by
``autopar.parallelize``), such that the values do not depend on the layout.

The rule, one :class:`Initializer` for both paths, so that a rank's shard of a parameter
equals the same slice of the single-device model initialised with the same seed:

1. **Ownership.** A parameter belongs to the module of its first qualified name in
   ``model.named_parameters(remove_duplicate=False)`` (a tied ``lm_head.weight`` belongs to
   ``transformer.wte``): the key the TP rewrite records in ``ShardSpec.key``.
2. **One module at a time.** A module's own parameters are created whole on ``device``
   (in the model's dtype, filled with NaN) while every other parameter stays on meta, and
   the model's init rule ``init_fn(name, module)`` runs under the CPU (and ``device``'s)
   generator seeded with :func:`module_seed` ``(seed, name)``: a SHA-256 of both, so
   neither Python's hash randomisation nor the order modules are visited in changes a
   value. A floating parameter still holding NaN afterwards was not written by the rule;
   it takes the module's own ``reset_parameters()`` (run the same way: litgpt's
   ``_init_weights`` leaves LayerNorm to its constructor), and one that neither writes is a
   ValueError naming it.
3. **Slicing.** ``parallelize`` keeps ``ShardSpec.local(whole, tp_rank, tp)`` of each local
   parameter (ZeRO-3: then FSDP2's dim-0 chunk of the DP rank), cast to the local
   parameter's dtype, and drops the whole: besides its shards a rank holds at most one
   module's whole parameters at a time.

The init rule (:func:`model_init_fn`): ``init_fn`` when given; else the model's
``init_module(name, module)`` (autopar's GPT: :func:`autopar.models.gpt2_init`); else the
model's ``_init_weights(module)`` (Hugging Face), run on the module and then on each of its
ancestors, nearest first, because ``model.apply`` runs it children first and a parent may
re-initialise a child's weight (GPT-2's scaled ``c_proj`` from ``GPT2MLP``); what it writes
into other modules' parameters is a no-op on meta; else ``module.reset_parameters()``.
A rule outside those hooks (nanoGPT's scaled ``c_proj`` loop in ``__init__``) is not seen:
pass ``init_fn`` (``functools.partial(gpt2_init, n_layer=L)`` for nanoGPT).

**Buffers** are state the model derives, not learns (a causal mask, rotary ``inv_freq``),
and small. A real buffer (created on a device, e.g. ``torch.ones(s, s, device="cpu")``
even under ``with torch.device("meta")``, or any buffer of a model built under
:func:`meta_parameters` or accelerate's ``init_empty_weights()``) is used as it is, moved to
``device``. A meta buffer is computed on its module the way the model's stack computes it,
trying in order: the same rule (Hugging Face's ``_init_weights`` recomputes the rotary
``inv_freq`` and ``original_inv_freq``), the module's ``reset_parameters()`` (litgpt's
``GPT`` recomputes its rotary ``cos``/``sin`` there), its ``init_weights(buffer_device)``
(torchtitan's models recompute ``freqs_cis`` there after ``to_empty``) or
``init_weights()``: every buffer, whole, on every rank, before any collective
(:meth:`Initializer.of`). Each runs twice, over the buffer filled with 0 and with 1, with
the parameters on meta (what it writes into them is a no-op); a buffer none of them sets
the same both times is a ValueError naming it and the fix.

Values depend on the seed, the module's name, the shapes and dtypes and the device type
(CPU and CUDA generators draw different numbers from one seed); not on tp, pp, dp or ZeRO.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

__all__ = ["InitFn", "Initializer", "init_model", "meta_parameters", "model_init_fn",
           "module_seed", "on_meta", "replace_tensors"]

InitFn = Callable[[str, nn.Module], None]
"""``init_fn(qualified module name, module)``: initialise the module's own parameters (and
meta buffers) in place, drawing from the default generator."""


def module_seed(seed: int, name: str) -> int:
    """The 63-bit seed of module ``name`` (qualified, "" for the root): the first 8 bytes of
    SHA-256 of ``f"{seed}/{name}"``, the same in every process and Python version."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real, as
    accelerate's ``init_empty_weights()`` does: ``with autopar.meta_parameters(): model =
    Model(config)``. A buffer the model computes in its constructor (rotary caches, a
    causal mask) is computed on the default device; each parameter is moved to meta as it is
    registered, before the module initialises it, so no weight is ever filled (a parameter
    is created empty for a moment, one at a time). Patches ``nn.Module.register_parameter``
    for the duration of the block, process-wide: build no other model in another thread
    meanwhile."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (it needs initialising)."""
    return any(p.is_meta for p in model.parameters())


@contextlib.contextmanager
def _seeded(seed: int, name: str, device: torch.device) -> Iterator[None]:
    """The default generator(s) seeded for module ``name``, restored afterwards; no grad."""
    if device.type == "cpu":
        devices: list = []
    else:
        index = device.index if device.index is not None else \
            torch.get_device_module(device.type).current_device()
        devices = [index]
    with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
        if device.type == "cpu":
            torch.default_generator.manual_seed(module_seed(seed, name))
        else:  # seeds the CPU and every device of the kind; the forked one is restored
            torch.manual_seed(module_seed(seed, name))
        yield


def _reset_parameters(name: str, module: nn.Module) -> None:
    """``module.reset_parameters()`` when the module has one (torch's own modules do)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _with_ancestors(model: nn.Module, init_weights: Callable[[nn.Module], None],
                    name: str, module: nn.Module) -> None:
    """Hugging Face's ``_init_weights`` as ``model.apply`` runs it for ``module``'s
    parameters: the module first, then every ancestor, nearest first."""
    init_weights(module)
    parts = name.split(".") if name else []
    for k in range(len(parts) - 1, -1, -1):
        init_weights(model.get_submodule(".".join(parts[:k])))


def model_init_fn(model: nn.Module) -> InitFn:
    """``model``'s init rule (module docstring): its ``init_module``, else its
    ``_init_weights`` replayed over ancestors, else each module's ``reset_parameters``."""
    own = getattr(model, "init_module", None)
    if callable(own):
        return own
    hf = getattr(model, "_init_weights", None)
    if callable(hf):
        return functools.partial(_with_ancestors, model, hf)
    return _reset_parameters


def _buffer_hooks(module: nn.Module, device: torch.device) -> list[tuple[str, InitFn]]:
    """The hooks of ``module`` that other stacks compute buffers in, in the order tried
    after the init rule: ``reset_parameters()`` (litgpt's ``GPT`` recomputes its rotary
    ``cos``/``sin`` there; torch's modules), then ``init_weights(buffer_device=device)``
    (torchtitan's models recompute ``freqs_cis`` there after ``to_empty``) or
    ``init_weights()``. Parameters are on meta while they run, so what they write into
    parameters is a no-op."""
    hooks: list[tuple[str, InitFn]] = []
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        hooks.append(("reset_parameters()", lambda _name, m: m.reset_parameters()))
    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights):
        try:
            takes_device = "buffer_device" in inspect.signature(init_weights).parameters
        except (TypeError, ValueError):
            takes_device = False
        hooks.append(("init_weights()", (lambda _name, m: m.init_weights(buffer_device=device))
                      if takes_device else (lambda _name, m: m.init_weights())))
    return hooks


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@contextlib.contextmanager
def _installed(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s own parameters/buffers ``tensors`` (by attribute name) swapped in, then
    the originals put back."""
    saved = {n: getattr(module, n) for n in tensors}
    try:
        for n, t in tensors.items():
            setattr(module, n, t)
        yield
    finally:
        for n, t in saved.items():
            setattr(module, n, t)


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _unset_buffer(key: str, module: nn.Module, tried: list[str]) -> ValueError:
    return ValueError(
        f"buffer {key!r} of {type(module).__name__} is on the meta device and nothing autopar "
        f"runs sets it ({', '.join(tried)}; it must be computable, not left empty); create it "
        "on a real device "
        "in the model (e.g. torch.tril(torch.ones(s, s, device='cpu')), which stays real under "
        "`with torch.device('meta')`, or build the model under autopar.meta_parameters()), "
        "or set it in init_fn(name, module), the model's init_module or _init_weights, or "
        "the module's reset_parameters() or init_weights(buffer_device)")


def _unset_param(key: str, module: nn.Module) -> ValueError:
    return ValueError(
        f"parameter {key!r} of {type(module).__name__} was not written by the init rule; give "
        "the module a reset_parameters(), the model an init_module(name, module) or "
        "_init_weights(module) that covers it, or pass init_fn (autopar.runtime.materialize)")


@dataclass(frozen=True, eq=False)
class Initializer:
    """The layout-independent initialisation of one model (module docstring).

    model: the source model (meta parameters; it is modified only while a rule runs);
    seed: the init seed; device: where values are created; init_fn: the rule;
    buffers: every buffer's whole value on ``device`` by its first qualified name;
    names: ``id`` of each parameter -> its first qualified name (ownership, rule 1).
    Build with :meth:`of`.
    """

    model: nn.Module
    seed: int
    device: torch.device
    init_fn: InitFn
    buffers: dict[str, torch.Tensor]
    names: dict[int, str]

    @classmethod
    def of(cls, model: nn.Module, seed: int = 0, *, device: torch.device | str | None = None,
           init_fn: InitFn | None = None) -> Initializer:
        """Put ``model``'s parameters on meta (their values are never read, and a rule's
        writes to other modules' parameters must draw nothing) and run the buffer pass
        (local: call it before any collective). Raises ValueError naming a meta buffer
        the rule does not set, and how to fix it."""
        replace_tensors(model, {id(p): nn.Parameter(torch.empty_like(p, device="meta"),
                                             requires_grad=p.requires_grad)
                         for p in model.parameters() if not p.is_meta}, {})
        names: dict[int, str] = {}
        for key, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), key)
        init = cls(model, seed, _device(device), init_fn or model_init_fn(model), {}, names)
        seen: set[int] = set()
        for name, module in model.named_modules():
            meta = {}
            for bname, b in module.named_buffers(recurse=False):
                if id(b) not in seen:
                    seen.add(id(b))
                    if b.is_meta:
                        meta[bname] = b
                    else:
                        init.buffers[_join(name, bname)] = b.detach().to(init.device)
            if meta:
                init.buffers.update(init._rule_buffers(name, module, meta))
        return init

    def _run(self, name: str, module: nn.Module, tensors: dict[str, torch.Tensor],
             rule: InitFn | None = None) -> dict:
        """``rule`` (default the init rule) on ``module`` with ``tensors`` installed; what
        it holds afterwards."""
        with _installed(module, tensors):
            with _seeded(self.seed, name, self.device):
                (rule or self.init_fn)(name, module)
            return {n: getattr(module, n).detach() for n in tensors}

    def _rule_buffers(self, name: str, module: nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        """The meta buffers ``meta`` of ``module`` as the init rule computes them, then, for
        those it leaves unset, as the module's own hooks do (:func:`_buffer_hooks`). Raises
        ValueError naming the first buffer none of them sets."""
        out: dict[str, torch.Tensor] = {}
        rules = [("the init rule", self.init_fn), *_buffer_hooks(module, self.device)]
        for _, rule in rules:
            unset = {n: b for n, b in meta.items() if _join(name, n) not in out}
            if not unset:
                break
            try:
                runs = [self._run(name, module, {n: torch.full(b.shape, fill, dtype=b.dtype,
                                                               device=self.device)
                                                 for n, b in unset.items()}, rule)
                        for fill in (0, 1)]
            except Exception:  # a stack's hook that cannot run on a meta model sets nothing
                if rule is self.init_fn:
                    raise
                continue
            for n in unset:  # set: the same value whatever the buffer held before
                a, b = runs[0][n], runs[1][n]
                if not a.is_meta and a.shape == unset[n].shape and torch.equal(a, b):
                    out[_join(name, n)] = a
        missing = [n for n in meta if _join(name, n) not in out]
        if missing:
            raise _unset_buffer(_join(name, missing[0]), module, [k for k, _ in rules])
        return out

    def owner(self, key: str) -> str:
        """The module that owns parameter ``key`` (a first qualified name)."""
        return key.rsplit(".", 1)[0] if "." in key else ""

    def module_params(self, name: str) -> dict[str, torch.Tensor]:
        """Whole values, on ``device``, of the parameters module ``name`` owns, by
        qualified name (rule 2); a parameter the rule leaves unset takes the value of the
        module's own ``reset_parameters()``. Raises ValueError for one neither sets."""
        module = self.model.get_submodule(name)
        owned = {n: p for n, p in module.named_parameters(recurse=False, remove_duplicate=False)
                 if self.names[id(p)] == _join(name, n)}
        if not owned:
            return {}
        scratch: dict[str, torch.Tensor] = {
            n: nn.Parameter(torch.full(p.shape, float("nan") if p.is_floating_point() else 0,
                                       dtype=p.dtype, device=self.device),
                            requires_grad=p.requires_grad) for n, p in owned.items()}
        for n, b in module.named_buffers(recurse=False):
            if b.is_meta and _join(name, n) in self.buffers:
                scratch[n] = self.buffers[_join(name, n)].clone()
        got = self._run(name, module, scratch)
        unset = [n for n in owned if got[n].is_floating_point() and bool(got[n].isnan().any())]
        if unset and callable(getattr(module, "reset_parameters", None)):
            # the module's own initialisation for what the rule leaves (litgpt's
            # _init_weights skips LayerNorm, whose constructor initialises it)
            again = self._run(name, module, scratch, lambda _name, m: m.reset_parameters())
            got.update({n: again[n] for n in unset})
        for n in owned:
            if got[n].is_floating_point() and bool(got[n].isnan().any()):
                raise _unset_param(_join(name, n), module)
        return {_join(name, n): got[n] for n in owned}


def replace_tensors(root: nn.Module, params: dict[int, nn.Parameter],
                    buffers: dict[int, torch.Tensor]) -> None:
    """Replace, wherever ``root``'s modules hold them, the parameters and buffers whose
    ``id`` is a key (a tied parameter stays one object)."""
    for module in root.modules():
        for n, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) in params:
                setattr(module, n, params[id(p)])
        for n, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if id(b) in buffers:
                setattr(module, n, buffers[id(b)])


def init_model(model: nn.Module, seed: int = 0, *, device: torch.device | str | None = None,
               init_fn: InitFn | None = None) -> nn.Module:
    """Initialise every parameter and meta buffer of ``model`` by the layout-independent
    rule (module docstring), whole, on ``device`` (default CPU); returns ``model``.

    The single-device reference of a meta model parallelized with the same seed: each
    rank's shards equal the slices of this model's parameters. Parameters and buffers are
    replaced by new tensors (tied ones stay tied), so build the optimizer afterwards. A
    model already materialised is re-initialised, as its meta twin would be. Needs the whole model's bytes on
    ``device``. Raises ValueError naming a meta buffer or a parameter the rule leaves unset.
    """
    init = Initializer.of(model, seed, device=device, init_fn=init_fn)
    values: dict[str, torch.Tensor] = {}
    for name, _ in model.named_modules():
        values.update(init.module_params(name))
    params = {id(p): nn.Parameter(values[init.names[id(p)]], requires_grad=p.requires_grad)
              for p in model.parameters()}
    first: dict[int, str] = {}
    for key, b in model.named_buffers(remove_duplicate=False):
        first.setdefault(id(b), key)
    replace_tensors(model, params, {i: init.buffers[k] for i, k in first.items()})
    return model
