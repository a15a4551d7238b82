"""Checkpoints that move between plans, on ``torch.distributed.checkpoint`` (DCP).

A checkpoint saved under one plan (tp, pp, dp, ZeRO stage, schedule, world size) loads
under any other plan of the same model: everything is stored under the ORIGINAL model's
state-dict keys, in the original shapes, and DCP reshards on load (it reads, for each
tensor, the chunks that overlap what this rank asks for). The DCP state dict
(``dcp.save``/``dcp.load``, https://pytorch.org/docs/stable/distributed.checkpoint.html):

==================================  ===============================================  =========
key                                 value                                            saved by
==================================  ===============================================  =========
``transformer.h.0.attn.c_q.weight`` the parameter (fp32 master weights under bf16)   owners
``optim.<state>.<key>``             optimizer state of parameter ``key``: AdamW's    owners
                                    ``exp_avg``/``exp_avg_sq`` (the parameter's
                                    shape), ``step`` (a scalar); SGD's
                                    ``momentum_buffer``
``autopar.meta``                    pickled dict: ``steps_done``, ``layout``,        rank 0
                                    ``optimizer`` (class name), ``param_groups``
                                    (hyperparameters: lr, betas, ...),
                                    ``tied_aliases``, ``extra``
``autopar.rng.rank<r>``             pickled RNG state of rank r: the default         every rank
                                    generator and the tracker's dropout streams
==================================  ===============================================  =========

How a rank stores parameter ``key`` (its TP shard ``p``, see ``ShardSpec``):

* a plain contiguous TP split (``ShardSpec.dim`` set, no ``blocks``): a DTensor on the TP
  sub-mesh ``groups.device_mesh["tp"]`` with ``Shard(dim)``; DCP writes each TP rank's
  chunk once;
* replicated (dim None), tp = 1, or a fused-block layout (Megatron's fused QKV: rank r holds
  the r-th part of every block): the whole tensor (fused blocks are all-gathered over TP
  first), a plain tensor written by one rank.

DCP de-duplicates the chunks that several ranks hold (DP replicas, TP-replicated tensors,
the tied embedding held by the first and the last pipeline stage), so each original key is
written once.

Memory and communication. A save makes each parameter's tensors (fp32 master value,
optimizer states) whole over DP, one parameter at a time, on one DP rank: a stage's i-th
key goes to DP rank i mod d (ZeRO-1/2 flat slices: a reduce of numel elements per tensor;
ZeRO-3 shards: an all-gather; :mod:`autopar.runtime.shard_state`). The state dict DCP
then writes holds about 1/d of the stage's TP-local model states per rank: with AdamW 12
bytes (fp32 master, exp_avg, exp_avg_sq) × Ψ/(t·p·d), ZeRO-1's optimizer footprint once
more while saving (``async_save`` stages one more CPU copy). A load reads every TP-local
tensor of this rank whole (12 bytes × Ψ/(t·p) with AdamW) before cutting out its piece.
Megatron-LM's distributed optimizer (``megatron/core/optimizer/distrib_optimizer.py``,
``sharded_state_dict``) avoids the gather in its ``fully_sharded_model_space`` format:
each DP rank saves its flattened range of each parameter (a ShardedTensor with a
``flattened_range``) in model space; DCP's chunks are boxes of the original shape, which
a flat range crossing rows is not (Megatron's ``dp_zero_gather_scatter`` gathers to DP
rank 0 as well; ``dp_reshardable`` stores the flat buffer and needs the same d).

Not saved: gradients (the next step recomputes them), buffers that are not parameters
(constants of the model's constructor: attention masks, rotary tables), LR schedulers
(put their ``state_dict()`` into ``extra``).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from autopar.rewrite.tensor_parallel import ShardSpec
from autopar.runtime.full_state import whole_over_tp
from autopar.runtime.shard_state import dp_state

__all__ = ["save_checkpoint", "load_checkpoint", "export_consolidated", "load_full_state_dict",
           "checkpoint_keys", "META_KEY", "FORMAT_VERSION"]

META_KEY = "autopar.meta"
RESERVED = ("optim.", "autopar.")  # key prefixes that are not model parameters
FORMAT_VERSION = 1


def _rng_key(rank: int) -> str:
    return f"autopar.rng.rank{rank}"


def _optim_key(state: str, key: str) -> str:
    return f"optim.{state}.{key}"


def _layout(pm) -> dict:
    g = pm.groups
    return {"tp": g.tp, "pp": g.pp, "dp": g.dp, "world_size": g.world_size,
            "zero_stage": pm.dp_optimizer.zero_stage, "schedule": pm.schedule}


def _local_keys(pm) -> dict[str, tuple[ShardSpec, list[str]]]:
    """Original key -> (its ShardSpec, this rank's parameter names holding it), sorted."""
    out: dict[str, tuple[ShardSpec, list[str]]] = {}
    for name, spec in sorted(pm.shards.items()):
        if spec.key.startswith(RESERVED):
            raise ValueError(f"parameter {spec.key!r} starts with a prefix autopar checkpoints "
                             f"reserve ({RESERVED}); rename the module")
        out.setdefault(spec.key, (spec, []))[1].append(name)
    return out


def _full_shape(spec: ShardSpec, local_shape: torch.Size, tp: int) -> torch.Size:
    """The original tensor's shape from a TP-local shape."""
    shape = list(local_shape)
    if spec.dim is not None:
        shape[spec.dim] *= tp
    return torch.Size(shape)


def _is_split(spec: ShardSpec, tp: int) -> bool:
    """Stored as a TP-sharded DTensor (a plain contiguous split over tp > 1 ranks)."""
    return spec.dim is not None and tp > 1 and not spec.blocks


def _tp_dtensor(pm, spec: ShardSpec, local: torch.Tensor, shape: torch.Size) -> DTensor:
    """``local``, this TP rank's ``Shard(spec.dim)`` of a tensor of ``shape``, as a DTensor
    on the TP sub-mesh."""
    return DTensor.from_local(local.contiguous(), pm.groups.device_mesh["tp"], [Shard(spec.dim)],
                              run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _to_saved(pm, spec: ShardSpec, local: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local tensor (whole over DP) as the value DCP saves for its key."""
    g = pm.groups
    if _is_split(spec, g.tp):
        return _tp_dtensor(pm, spec, local, _full_shape(spec, local.shape, g.tp))
    return whole_over_tp(local, spec, g)  # replicated as is; fused blocks all-gathered


def _template(pm, spec: ShardSpec, md: TensorStorageMetadata,
              device: torch.device) -> torch.Tensor:
    """An empty tensor on ``device`` that DCP fills with this rank's part of a saved key."""
    g, dtype = pm.groups, md.properties.dtype
    if md.size == torch.Size([]) or not _is_split(spec, g.tp):
        return torch.empty(md.size, dtype=dtype, device=device)
    local = list(md.size)
    local[spec.dim] //= g.tp
    return _tp_dtensor(pm, spec, torch.empty(local, dtype=dtype, device=device), md.size)


def _from_loaded(pm, spec: ShardSpec, value: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor of a loaded value (``_template``'s DTensor or a whole tensor)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if value.dim() == 0:
        return value
    return spec.local(value, pm.groups.tp_rank, pm.groups.tp)


def _rng_state(pm) -> dict:
    """This rank's generator states: the default (CPU) generator, the parameters'
    accelerator generator if any, and the tracker's streams."""
    device = next(pm.stage_module.parameters()).device
    accel = torch.get_device_module(device.type).get_rng_state(device) \
        if device.type != "cpu" else None
    tracker = pm.rng_tracker
    return {"default": torch.default_generator.get_state(), "device": accel,
            "streams": tracker.get_states() if tracker is not None else {}}


def _set_rng_state(pm, state: dict) -> None:
    torch.default_generator.set_state(state["default"])
    if state["device"] is not None:
        device = next(pm.stage_module.parameters()).device
        torch.get_device_module(device.type).set_rng_state(state["device"], device)
    tracker = pm.rng_tracker
    if tracker is not None and state["streams"]:
        tracker.set_states(state["streams"])


def _state_dict(pm) -> dict[str, Any]:
    """The DCP state dict of this rank: the i-th of its stage's keys (sorted) is made whole
    over DP on DP rank i mod d, which alone holds it (collective over DP and, for fused
    blocks, TP)."""
    adapter, params = dp_state(pm.dp_optimizer), dict(pm.stage_module.named_parameters())
    sd: dict[str, Any] = {}
    for i, (key, (spec, names)) in enumerate(_local_keys(pm).items()):
        p, owner = params[names[0]], i % pm.groups.dp
        value = adapter.param(p, owner)
        states = adapter.states(p, owner)
        if value is None:  # another DP rank holds this key
            continue
        sd[key] = _to_saved(pm, spec, value)
        for state, v in states.items():
            sd[_optim_key(state, key)] = v if v.dim() == 0 else _to_saved(pm, spec, v)
    return sd


def save_checkpoint(pm, path: str | os.PathLike, *, extra: dict | None = None,
                    async_save: bool = False):
    """Save ``pm``'s training state to the DCP checkpoint directory ``path`` (see the module
    docstring for the keys): parameters (fp32 master values under bf16), optimizer states,
    ``pm.steps_done``, every rank's RNG state and the user's ``extra`` dict (e.g. the data
    position; pickled, taken from rank 0).

    Collective over the whole world: every rank calls it with the same ``path``, between
    steps. ``async_save``: the state is gathered and staged to CPU memory here, the files
    are written by a background thread (``dcp.async_save``) over a gloo process group of
    its own (made on the first async save, collectively, and kept on ``pm``); returns the
    ``concurrent.futures.Future`` of that write: call ``.result()`` before the next save
    (and before reading the checkpoint). Synchronous saves return None.

    Raises ValueError for a parameter whose key starts with ``optim.`` or ``autopar.``,
    NotImplementedError for an optimizer state that is not a tensor.
    """
    sd = _state_dict(pm)
    if pm.groups.rank == 0:
        group = pm.optimizer.param_groups[0]
        sd[META_KEY] = pickle.dumps({
            "format_version": FORMAT_VERSION, "steps_done": pm.steps_done,
            "layout": _layout(pm), "optimizer": type(pm.optimizer).__name__,
            "param_groups": {k: v for k, v in group.items() if k != "params"},
            "tied_aliases": dict(pm.tied_aliases), "extra": dict(extra or {})})
    sd[_rng_key(pm.groups.rank)] = pickle.dumps(_rng_state(pm))
    if not async_save:
        dcp.save(sd, checkpoint_id=str(path))
        return None
    if pm.checkpoint_group is None:
        pm.checkpoint_group = dist.new_group(backend="gloo")
    return dcp.async_save(sd, checkpoint_id=str(path), process_group=pm.checkpoint_group)


def _metadata(path: str | os.PathLike) -> dict:
    """DCP's per-key metadata of the checkpoint at ``path`` (its ``.metadata`` file)."""
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} holds no DCP checkpoint (no .metadata file); pass the "
                                "directory save_checkpoint wrote")
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _sizes(md: dict) -> dict[str, torch.Size | None]:
    return {k: (v.size if isinstance(v, TensorStorageMetadata) else None) for k, v in md.items()}


def checkpoint_keys(path: str | os.PathLike) -> dict[str, torch.Size | None]:
    """Every key of the checkpoint at ``path`` with its shape (None: a pickled object).
    Local (reads the ``.metadata`` file). Raises FileNotFoundError if there is none."""
    return _sizes(_metadata(path))


def _check_fits(pm, path, keys: dict, meta: dict) -> None:
    """Raise ValueError (the same on every rank) unless the checkpoint holds exactly this
    model's parameters in its shapes, and the same optimizer. Collective over the world."""
    local = {}
    params = dict(pm.stage_module.named_parameters())
    for key, (spec, names) in _local_keys(pm).items():
        local[key] = tuple(_full_shape(spec, params[names[0]].shape, pm.groups.tp))
    everyone: list = [None] * pm.groups.world_size
    dist.all_gather_object(everyone, local)
    expected = {k: v for part in everyone for k, v in part.items()}
    saved = {k: (tuple(v) if v is not None else None) for k, v in keys.items()
             if not k.startswith(RESERVED)}
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    shapes = [f"{k}: checkpoint {saved[k]} vs model {expected[k]}"
              for k in sorted(set(saved) & set(expected)) if saved[k] != expected[k]]
    problems = ([f"{len(missing)} parameter(s) missing from the checkpoint ({missing[:3]})"]
                if missing else []) + \
        ([f"{len(unexpected)} parameter(s) the model lacks ({unexpected[:3]})"]
         if unexpected else []) + ([f"other shapes ({'; '.join(shapes[:3])})"] if shapes else [])
    if problems:
        raise ValueError(f"checkpoint {path} is not of this model: {', '.join(problems)}; load "
                         "it into the model it was saved from (any plan of it works), or load "
                         "matching weights with load_full_state_dict")
    has_optim = any(k.startswith("optim.") for k in keys)
    if has_optim and meta["optimizer"] != type(pm.optimizer).__name__:
        raise ValueError(f"checkpoint {path} holds {meta['optimizer']} state but the model "
                         f"trains with {type(pm.optimizer).__name__}; parallelize with the same "
                         "optimizer, or load only the weights with load_full_state_dict")


def load_checkpoint(pm, path: str | os.PathLike) -> dict:
    """Load a checkpoint of :func:`save_checkpoint`, saved under any plan of the same model,
    into ``pm``; returns the ``extra`` dict given at save time.

    Collective over the whole world. Writes the parameters (ZeRO-1/2: the bf16 buffer
    rounded, the fp32 master slice exact; ZeRO-3: the FSDP2 shards), replaces the optimizer
    states (creating them when the optimizer has not stepped yet; names and dtypes from the
    checkpoint) and its hyperparameters (``param_groups``: lr, ...), and restores
    ``pm.steps_done``. RNG states are per rank: they are restored only when (tp, pp, dp)
    equal the saved layout; otherwise the generators keep this run's seeds (dropout masks
    then differ from an uninterrupted run; losses without dropout do not).

    Raises FileNotFoundError (no checkpoint at ``path``) and ValueError (another model:
    missing or extra parameters, other shapes, another optimizer class), on every rank
    before any state is modified.
    """
    md = _metadata(path)
    keys = _sizes(md)
    meta_sd: dict[str, Any] = {META_KEY: b""}
    dcp.load(meta_sd, checkpoint_id=str(path))
    meta = pickle.loads(meta_sd[META_KEY])
    _check_fits(pm, path, keys, meta)
    params = dict(pm.stage_module.named_parameters())
    local = _local_keys(pm)
    states_of: dict[str, list[str]] = {}
    for k in keys:
        if k.startswith("optim."):
            state, key = k[len("optim."):].split(".", 1)
            states_of.setdefault(key, []).append(state)
    sd: dict[str, Any] = {}
    for key, (spec, names) in local.items():
        device = params[names[0]].device
        sd[key] = _template(pm, spec, md[key], device)
        for state in states_of.get(key, []):
            sd[_optim_key(state, key)] = _template(pm, spec, md[_optim_key(state, key)], device)
    rng_key = _rng_key(pm.groups.rank)
    same_layout = all(meta["layout"][k] == v for k, v in _layout(pm).items()
                      if k in ("tp", "pp", "dp"))
    if same_layout and rng_key in keys:
        sd[rng_key] = b""
    dcp.load(sd, checkpoint_id=str(path))
    adapter, states = dp_state(pm.dp_optimizer), {}
    for key, (spec, names) in local.items():
        value = _from_loaded(pm, spec, sd[key])
        loaded = {s: _from_loaded(pm, spec, sd[_optim_key(s, key)]) for s in states_of.get(key, [])}
        for name in names:
            adapter.write_param(params[name], value)
            states[name] = loaded
    adapter.write_states(states, params)
    for group in pm.optimizer.param_groups:
        group.update({k: v for k, v in meta["param_groups"].items() if k in group})
    pm.steps_done = meta["steps_done"]
    if rng_key in sd:
        _set_rng_state(pm, pickle.loads(sd[rng_key]))
    return meta["extra"]


def export_consolidated(checkpoint_path: str | os.PathLike, out_file: str | os.PathLike) -> dict:
    """Write the checkpoint as one ``torch.save`` file (one process, no process group; it
    holds the whole model and optimizer state in memory) and return what it wrote::

        {"model": {key: tensor},        # a plain state_dict: load_state_dict(out["model"])
         "optimizer": {state: {key: tensor}},   # e.g. out["optimizer"]["exp_avg"][key]
         "param_groups": {...}, "steps_done": int, "extra": {...}, "layout": {...}}

    ``model`` holds every parameter under its original key in the checkpoint's dtype (fp32
    master weights under bf16), tied aliases repeated (``lm_head.weight`` and
    ``transformer.wte.weight``); RNG states (per rank) are left out. Made by
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, then regrouped.
    """
    dcp_to_torch_save(checkpoint_path, out_file)
    flat = torch.load(out_file, weights_only=False)
    meta = pickle.loads(flat.pop(META_KEY))
    model = {k: v for k, v in flat.items() if not k.startswith(RESERVED)}
    for alias, canonical in meta["tied_aliases"].items():
        if canonical in model:
            model[alias] = model[canonical]
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith("optim."):
            state, key = k[len("optim."):].split(".", 1)
            optimizer.setdefault(state, {})[key] = v
    out = {"model": model, "optimizer": optimizer, "param_groups": meta["param_groups"],
           "steps_done": meta["steps_done"], "extra": meta["extra"], "layout": meta["layout"]}
    torch.save(out, out_file)
    return out


def load_full_state_dict(pm, state_dict: dict[str, torch.Tensor]) -> None:
    """Load whole, single-device weights (e.g. a Hugging Face model's ``state_dict()``)
    into ``pm``: each rank cuts its TP shard with ``ShardSpec.local`` and writes it into the
    parameters (ZeRO buffers and fp32 masters, or its FSDP2 shards). Local: no collective.
    Optimizer states and steps_done are left as they are. Keys that are no parameter of the
    program (buffers) are ignored; a tied parameter may come under any of its names.

    Raises ValueError naming the key when a parameter of this rank is missing or has
    another shape (checked before anything is written).
    """
    aliases: dict[str, list[str]] = {}
    for alias, canonical in pm.tied_aliases.items():
        aliases.setdefault(canonical, []).append(alias)
    params, g = dict(pm.stage_module.named_parameters()), pm.groups
    plan = []
    for key, (spec, names) in _local_keys(pm).items():
        found = next((k for k in [key, *aliases.get(key, [])] if k in state_dict), None)
        if found is None:
            raise ValueError(f"the state dict has no {key!r} (nor its tied aliases "
                             f"{aliases.get(key, [])}); pass the whole model's state_dict()")
        want = _full_shape(spec, params[names[0]].shape, g.tp)
        if tuple(state_dict[found].shape) != tuple(want):
            raise ValueError(f"{found!r} has shape {tuple(state_dict[found].shape)} but the "
                             f"model's is {tuple(want)}; pass a state dict of this model")
        plan.append((spec, names, state_dict[found]))
    adapter = dp_state(pm.dp_optimizer)
    for spec, names, full in plan:
        value = spec.local(full.detach(), g.tp_rank, g.tp)
        for name in names:
            adapter.write_param(params[name], value)
