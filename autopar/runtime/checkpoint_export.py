"""Whole, single-device weights in and out of autopar's sharded training state.

* :func:`export_consolidated` turns a checkpoint of :mod:`autopar.runtime.checkpoint`
  (verified against its manifest first) into one ``torch.save`` file: a plain
  ``state_dict`` and the optimizer states, for one device, another framework or a hub.
* :func:`load_full_state_dict` cuts a whole state dict (e.g. a Hugging Face model's
  ``state_dict()``) into this rank's shards.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from autopar.runtime.checkpoint_files import verify_checkpoint
from autopar.runtime.checkpoint_state import META_KEY, RESERVED, full_shape, local_keys
from autopar.runtime.shard_state import dp_state

__all__ = ["export_consolidated", "load_full_state_dict"]

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

    Raises CheckpointError (naming the file) for a checkpoint that is incomplete or whose
    files differ from its manifest (every file hashed first).
    """
    verify_checkpoint(checkpoint_path)
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



def _unexpected(pm, state_dict: dict) -> list[str]:
    """Keys of ``state_dict`` that name nothing of the model: neither a parameter (under
    any tied name) nor a buffer (constants of the model's constructor, such as rotary
    ``inv_freq`` or a causal mask, which are accepted and not loaded)."""
    known = pm.model_keys.parameters | pm.model_keys.buffers | set(pm.tied_aliases)
    return sorted(k for k in state_dict if k not in known)


def load_full_state_dict(pm, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load whole, single-device weights (e.g. a Hugging Face model's ``state_dict()``)
    into ``pm``: each rank cuts its TP shard with ``ShardSpec.local`` (and its experts'
    dim-0 slice under expert parallelism, ``pm.expert_slices``) and writes it into the
    parameters (ZeRO buffers and fp32 masters, or its FSDP2 shards). Local: no collective.
    Optimizer states and steps_done are left as they are. A tied parameter may come under
    any of its names. Keys naming the model's buffers (persistent or not: rotary
    ``inv_freq``, attention masks) are accepted and not loaded: buffers are the
    constructor's constants, built by the model itself.

    strict: refuse keys that name nothing of the model (a state dict of another model,
        e.g. of a deeper one); False ignores them, as ``load_state_dict(strict=False)``.

    Raises ValueError, before anything is written: a parameter of this rank is missing or
    has another shape (naming it), or, with ``strict``, keys the model lacks (naming the
    first ones).
    """
    unexpected = _unexpected(pm, state_dict) if strict else []
    if unexpected:
        raise ValueError(f"the state dict has {len(unexpected)} key(s) the model lacks "
                         f"({unexpected[:5]}): it is of another model; pass this model's "
                         "state_dict(), or strict=False to ignore them")
    aliases: dict[str, list[str]] = {}
    for alias, canonical in pm.tied_aliases.items():
        aliases.setdefault(canonical, []).append(alias)
    params, g = dict(pm.stage_module.named_parameters()), pm.groups
    plan = []
    for key, (spec, names) in local_keys(pm).items():
        found = next((k for k in [key, *aliases.get(key, [])] if k in state_dict), None)
        if found is None:
            raise ValueError(f"the state dict has no {key!r} (nor its tied aliases "
                             f"{aliases.get(key, [])}); pass the whole model's state_dict()")
        want = full_shape(spec, params[names[0]].shape, g.tp)
        if names[0] in pm.expert_slices:  # E/ep local experts of E
            want = torch.Size([want[0] * g.ep, *want[1:]])
        if tuple(state_dict[found].shape) != tuple(want):
            raise ValueError(f"{found!r} has shape {tuple(state_dict[found].shape)} but the "
                             f"model's is {tuple(want)}; pass a state dict of this model")
        plan.append((spec, names, state_dict[found]))
    adapter = dp_state(pm.dp_optimizer)
    for spec, names, full in plan:
        value = spec.local(full.detach(), g.tp_rank, g.tp)
        for name in names:
            experts = pm.expert_slices.get(name)  # this EP rank's experts, dim 0
            adapter.write_param(params[name], value if experts is None else value[experts])
