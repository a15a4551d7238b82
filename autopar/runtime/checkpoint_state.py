"""How a rank's training state maps to the keys of an autopar checkpoint (see
:mod:`autopar.runtime.checkpoint` for the keys): the state dict a save hands DCP, the
templates a load asks DCP to fill, and the RNG states. Collectives over TP and DP where a
tensor is made whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.contract.placement import ShardSpec
from autopar.runtime.checkpoint_files import CheckpointError
from autopar.runtime.full_state import whole_over_tp
from autopar.runtime.shard_state import dp_state

META_KEY = "autopar.meta"
RESERVED = ("optim.", "autopar.")  # key prefixes that are not model parameters


def rng_key(rank: int) -> str:
    return f"autopar.rng.rank{rank}"


def optim_key(state: str, key: str) -> str:
    return f"optim.{state}.{key}"


def layout_of(pm) -> dict:
    g = pm.groups
    return {"tp": g.tp, "pp": g.pp, "dp": g.dp, "ep": g.ep, "world_size": g.world_size,
            "zero_stage": pm.dp_optimizer.zero_stage, "schedule": pm.schedule}


def local_keys(pm) -> dict[str, tuple[ShardSpec, list[str]]]:
    """Original key -> (its ShardSpec, this rank's parameter names holding it), sorted."""
    out: dict[str, tuple[ShardSpec, list[str]]] = {}
    for name, spec in sorted(pm.shards.items()):
        if spec.key.startswith(RESERVED):
            raise ValueError(f"parameter {spec.key!r} starts with a prefix autopar checkpoints "
                             f"reserve ({RESERVED}); rename the module")
        out.setdefault(spec.key, (spec, []))[1].append(name)
    return out


def full_shape(spec: ShardSpec, local_shape: torch.Size, tp: int, ep: int = 1) -> torch.Size:
    """The original tensor's shape from a TP-local shape, or from an EP rank's experts
    (``ep`` > 1: E/ep of them on dim 0)."""
    shape = list(local_shape)
    if ep > 1:
        shape[0] *= ep
    elif spec.dim is not None:
        shape[spec.dim] *= tp
    return torch.Size(shape)


def expert_degree(pm, names: list[str]) -> int:
    """ep when the parameters ``names`` (one key's) are an EP rank's experts, else 1."""
    return pm.groups.ep if names[0] in pm.expert_slices else 1


def is_split(spec: ShardSpec, tp: int) -> bool:
    """Stored as a TP-sharded DTensor (a plain contiguous split over tp > 1 ranks)."""
    return spec.dim is not None and tp > 1 and not spec.blocks


def tp_dtensor(pm, spec: ShardSpec, local: torch.Tensor, shape: torch.Size) -> DTensor:
    """``local``, this TP rank's ``Shard(spec.dim)`` of a tensor of ``shape``, as a DTensor
    on the TP sub-mesh."""
    return DTensor.from_local(local.contiguous(), pm.groups.device_mesh["tp"], [Shard(spec.dim)],
                              run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def expert_dtensor(pm, local: torch.Tensor, shape: torch.Size) -> DTensor:
    """``local``, this EP rank's experts (dim 0: E/ep of the E in ``shape``), as a DTensor
    on a mesh of the EP group with ``Shard(0)``: DCP writes each EP rank's experts once (the
    expert-data-parallel replicas hold the same chunk) and reshards them on load to any ep."""
    mesh = DeviceMesh.from_group(pm.groups.ep_group, local.device.type)
    return DTensor.from_local(local.contiguous(), mesh, [Shard(0)], run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def to_saved(pm, spec: ShardSpec, local: torch.Tensor, ep: int = 1) -> torch.Tensor:
    """This rank's TP-local tensor (whole over DP) as the value DCP saves for its key;
    ``ep`` > 1: the key's experts, this EP rank's E/ep of them (:func:`expert_dtensor`)."""
    g = pm.groups
    if ep > 1:
        return expert_dtensor(pm, local, full_shape(spec, local.shape, g.tp, ep))
    if is_split(spec, g.tp):
        return tp_dtensor(pm, spec, local, full_shape(spec, local.shape, g.tp))
    return whole_over_tp(local, spec, g)  # replicated as is; fused blocks all-gathered


def template(pm, spec: ShardSpec, md: TensorStorageMetadata,
              device: torch.device, ep: int = 1) -> torch.Tensor:
    """An empty tensor on ``device`` that DCP fills with this rank's part of a saved key
    (``ep`` > 1: this EP rank's experts of it)."""
    g, dtype = pm.groups, md.properties.dtype
    if ep > 1 and md.size != torch.Size([]):
        local = [md.size[0] // ep, *md.size[1:]]
        return expert_dtensor(pm, torch.empty(local, dtype=dtype, device=device), md.size)
    if md.size == torch.Size([]) or not is_split(spec, g.tp):
        return torch.empty(md.size, dtype=dtype, device=device)
    local = list(md.size)
    local[spec.dim] //= g.tp
    return tp_dtensor(pm, spec, torch.empty(local, dtype=dtype, device=device), md.size)


def from_loaded(pm, spec: ShardSpec, value: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor of a loaded value (``template``'s DTensor or a whole tensor)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if value.dim() == 0:
        return value
    return spec.local(value, pm.groups.tp_rank, pm.groups.tp)


def rng_state(pm) -> dict:
    """This rank's generator states: the default (CPU) generator, the parameters'
    accelerator generator if any, and the tracker's streams."""
    device = next(pm.stage_module.parameters()).device
    accel = torch.get_device_module(device.type).get_rng_state(device) \
        if device.type != "cpu" else None
    tracker = pm.rng_tracker
    return {"default": torch.default_generator.get_state(), "device": accel,
            "streams": tracker.get_states() if tracker is not None else {}}


def set_rng_state(pm, state: dict) -> None:
    torch.default_generator.set_state(state["default"])
    if state["device"] is not None:
        device = next(pm.stage_module.parameters()).device
        torch.get_device_module(device.type).set_rng_state(state["device"], device)
    tracker = pm.rng_tracker
    if tracker is not None and state["streams"]:
        tracker.set_states(state["streams"])


def rank_state_dict(pm) -> dict[str, Any]:
    """The DCP state dict of this rank: the i-th of its stage's keys (sorted) is made whole
    over DP on DP rank i mod d, which alone holds it (collective over DP and, for fused
    blocks, TP); an expert key is saved by every rank, its E/ep experts (ZeRO-0, the one
    stage that runs at ep > 1: no collective)."""
    adapter, params = dp_state(pm.dp_optimizer), dict(pm.stage_module.named_parameters())
    sd: dict[str, Any] = {}
    for i, (key, (spec, names)) in enumerate(local_keys(pm).items()):
        ep = expert_degree(pm, names)
        p, owner = params[names[0]], pm.groups.dp_rank if ep > 1 else i % pm.groups.dp
        value = adapter.param(p, owner)
        states = adapter.states(p, owner)
        if value is None:  # another DP rank holds this key
            continue
        sd[key] = to_saved(pm, spec, value, ep)
        for state, v in states.items():
            sd[optim_key(state, key)] = v if v.dim() == 0 else to_saved(pm, spec, v, ep)
    return sd


def dcp_metadata(path: Path) -> dict:
    """DCP's per-key metadata of the checkpoint at ``path`` (its ``.metadata`` file)."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} holds no DCP checkpoint (no .metadata file); pass the "
                              "directory save_checkpoint wrote")
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def key_sizes(md: dict) -> dict[str, torch.Size | None]:
    """Each key of DCP metadata ``md`` with its tensor shape (None: a pickled object)."""
    return {k: (v.size if isinstance(v, TensorStorageMetadata) else None) for k, v in md.items()}


def checkpoint_keys(path: str | os.PathLike) -> dict[str, torch.Size | None]:
    """Every key of the checkpoint at ``path`` with its shape (None: a pickled object).
    Local (reads the ``.metadata`` file). Raises CheckpointError if there is none."""
    return key_sizes(dcp_metadata(Path(path)))


def check_fits(pm, path, keys: dict, meta: dict) -> None:
    """Raise ValueError (the same on every rank) unless the checkpoint holds exactly this
    model's parameters in its shapes, and the same optimizer. Collective over the world."""
    local = {}
    params = dict(pm.stage_module.named_parameters())
    for key, (spec, names) in local_keys(pm).items():
        local[key] = tuple(full_shape(spec, params[names[0]].shape, pm.groups.tp,
                                      expert_degree(pm, names)))
    everyone: list = [None] * pm.groups.world_size
    dist.all_gather_object(everyone, local, group=pm.groups.checkpoint_group)
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
