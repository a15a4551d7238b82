"""Checkpoints that move between plans, on ``torch.distributed.checkpoint`` (DCP), whole or
absent (:mod:`autopar.runtime.checkpoint_files`: staged, a manifest of SHA-256 digests
written last, renamed into place; checked against it on load).

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
* an experts module's parameter under expert parallelism (ep > 1: this rank's E/ep experts,
  :mod:`autopar.runtime.expert_parallel`): a DTensor on a mesh of the EP group with
  ``Shard(0)``; DCP writes each EP rank's experts once and a load under another ep (or
  ep = 1) reads the experts it holds there;
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
rank 0 as well; ``dp_reshardable`` stores the flat buffer and needs the same d). The
manifest reads every written file once more (SHA-256, each rank 1/N of the files) on a
save, and again on a load, before DCP reads them.

Not saved: gradients (the next step recomputes them), buffers that are not parameters
(constants of the model's constructor: attention masks, rotary tables), LR schedulers
(put their ``state_dict()`` into ``extra``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from autopar.runtime.checkpoint_files import (CheckpointError, CheckpointWarning, commit,
                                              latest_checkpoint, on_rank0, resolve_checkpoint,
                                              staging_dir, verify_checkpoint, write_manifest)
from autopar.runtime.checkpoint_state import (META_KEY, check_fits, checkpoint_keys,
                                              dcp_metadata, expert_degree, from_loaded,
                                              key_sizes, layout_of,
                                              local_keys, optim_key, rank_state_dict, rng_key,
                                              rng_state, set_rng_state, template)
from autopar.runtime.health import CollectiveError, as_collective_error
from autopar.runtime.shard_state import dp_state

__all__ = ["save_checkpoint", "load_checkpoint", "load_latest_checkpoint", "LoadedCheckpoint",
           "checkpoint_keys", "CheckpointError", "CheckpointWarning", "META_KEY",
           "FORMAT_VERSION"]

FORMAT_VERSION = 2  # 2: staged saves committed with a manifest (checkpoint_files)


def _writer(path: Path) -> FileSystemWriter:
    """The DCP storage writer of a save's staging directory ``path`` (the fault-injection
    tests wrap it to kill or stop a rank inside the write phase)."""
    return FileSystemWriter(path)


def _peer_failure(exc: BaseException) -> BaseException:
    """``exc``, or for DCP's CheckpointException (a BaseException carrying each failed
    rank's exception) the first rank's exception, a communication failure first."""
    if not isinstance(exc, CheckpointException):
        return exc
    failures = [e for e, _ in exc.failures.values()]
    comm = [e for e in failures if as_collective_error(e, None, 0, None) is not None]
    return (comm or failures or [exc])[0]


@contextlib.contextmanager
def _named_failures(pm, what: str, path, step: int):
    """Re-raise what a save or load raised (DCP's CheckpointException, a BaseException,
    included) as CollectiveError (a peer died, or did not reach a collective within the
    groups' timeout) or CheckpointError (a file could not be read or written), naming
    ``what`` (e.g. "saving checkpoint"), ``path``, the rank and the step. Our own typed
    errors, ValueError and NotImplementedError pass unchanged."""
    try:
        yield
    except (CheckpointError, CollectiveError, ValueError, NotImplementedError):
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised, typed
        cause = _peer_failure(exc)
        axes = {pm.groups.checkpoint_group.group_name: "checkpoint", **pm.groups.axis_names()}
        comm = as_collective_error(cause, None, step, pm.groups.timeout, axes)
        if comm is not None:
            raise CollectiveError(f"{what} {path}: {comm}") from exc
        file = getattr(cause, "filename", None)
        raise CheckpointError(f"{what} {path} failed on rank {pm.groups.rank} at step {step}"
                              + (f" in file {file}" if file else "")
                              + f": {type(cause).__name__}: {cause}") from exc


def _wait_for_pending_save(pm) -> None:
    """Finish an asynchronous save still writing (its collectives share the checkpoint
    group: the next save or load must not interleave with them)."""
    future, pm.pending_save = pm.pending_save, None
    if future is not None:
        future.result()


def _then(first: Future, then: Callable[[], None]) -> Future:
    """A Future done when ``first`` is and ``then()`` has run after it (not run when
    ``first`` failed; either exception is the returned Future's)."""
    out: Future = Future()

    def finish(done: Future) -> None:
        try:
            done.result()
            then()
            out.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's .result()
            out.set_exception(exc)
    first.add_done_callback(finish)
    return out


def _meta(pm, extra: dict | None) -> bytes:
    group = pm.optimizer.param_groups[0]
    return pickle.dumps({
        "format_version": FORMAT_VERSION, "steps_done": pm.steps_done,
        "layout": layout_of(pm), "optimizer": type(pm.optimizer).__name__,
        "param_groups": {k: v for k, v in group.items() if k != "params"},
        "tied_aliases": dict(pm.tied_aliases), "extra": dict(extra or {})})


def save_checkpoint(pm, path: str | os.PathLike, *, extra: dict | None = None,
                    async_save: bool = False) -> Future | None:
    """Save ``pm``'s training state to the checkpoint directory ``path`` (see the module
    docstring for the keys): parameters (fp32 master values under bf16), optimizer states,
    ``pm.steps_done``, every rank's RNG state and the user's ``extra`` dict (e.g. the data
    position; pickled, taken from rank 0).

    Whole or absent (:mod:`autopar.runtime.checkpoint_files`): the files are written into a
    staging directory beside ``path``, a manifest of their sizes and SHA-256 digests is
    written last, and the directory is renamed into place; a crash at any moment leaves the
    checkpoint that was at ``path`` (if any) intact and loadable, never a mix.

    Collective over the whole world (``pm.groups.checkpoint_group``, with the timeout given
    to ``parallelize``): every rank calls it with the same ``path``, between steps.
    ``async_save``: the state is gathered and staged to CPU memory here, the files are
    written, hashed and committed by a background thread (``dcp.async_save``); returns the
    ``concurrent.futures.Future`` of that work (the next save or load waits for it; call
    ``.result()`` before reading the checkpoint yourself). Synchronous saves return None.

    Raises:
        ValueError: a parameter whose key starts with ``optim.`` or ``autopar.``.
        NotImplementedError: an optimizer state that is not a tensor.
        CollectiveError: a peer died or did not reach a collective within the timeout
            (naming the path, the step, the rank and the collective).
        CheckpointError: a file could not be written (naming it).
    """
    _wait_for_pending_save(pm)
    target, step, group = Path(path), pm.steps_done, pm.groups.checkpoint_group
    with _named_failures(pm, "saving checkpoint", target, step):
        staging = staging_dir(target, group)
        sd = rank_state_dict(pm)
        if pm.groups.rank == 0:
            sd[META_KEY] = _meta(pm, extra)
        sd[rng_key(pm.groups.rank)] = pickle.dumps(rng_state(pm))

        def finish() -> None:
            with _named_failures(pm, "saving checkpoint", target, step):
                write_manifest(staging, step, group)
                commit(staging, target, group)
        if not async_save:
            dcp.save(sd, storage_writer=_writer(staging), process_group=group)
            finish()
            return None
        written = dcp.async_save(sd, storage_writer=_writer(staging), process_group=group)
    pm.pending_save = _then(written, finish)
    return pm.pending_save


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements, ...
        return repr(a) != repr(b)


def _warn_on_load(pm, path: Path, meta: dict, rng_restored: bool) -> None:
    """The documented, intended behaviours a user may not expect, said once (rank 0)."""
    if pm.groups.rank != 0:
        return
    if not rng_restored:
        saved, here = ([layout.get(k, 1) for k in ("tp", "pp", "dp", "ep")]
                       for layout in (meta["layout"], layout_of(pm)))
        warnings.warn(f"{path} was saved under tp/pp/dp/ep {saved}, this program runs {here}: the "
                      "RNG states are per rank, so they are not restored and dropout masks "
                      "restart from this run's seed (losses differ from an uninterrupted run "
                      "only through dropout)", CheckpointWarning, stacklevel=3)
    group = pm.optimizer.param_groups[0]
    changed = [f"{k} {group[k]!r} -> {v!r}" for k, v in meta["param_groups"].items()
               if k in group and _differs(group[k], v)]
    if changed:
        warnings.warn(f"{path} sets the optimizer's hyperparameters it was saved with "
                      f"({', '.join(changed)}), replacing those of the optimizer given to "
                      "parallelize (the checkpoint carries the schedule's state); set "
                      "pm.optimizer.param_groups after load_checkpoint to override",
                      CheckpointWarning, stacklevel=3)


def load_checkpoint(pm, path: str | os.PathLike) -> dict:
    """Load a checkpoint of :func:`save_checkpoint`, saved under any plan of the same model,
    into ``pm``; returns the ``extra`` dict given at save time.

    Collective over the whole world (``pm.groups.checkpoint_group``, with the timeout given
    to ``parallelize``). First every file is checked against the manifest (existence and
    size on every rank, SHA-256 split over the ranks); then writes the parameters (ZeRO-1/2:
    the bf16 buffer rounded, the fp32 master slice exact; ZeRO-3: the FSDP2 shards),
    replaces the optimizer states (creating them when the optimizer has not stepped yet;
    names and dtypes from the checkpoint) and its hyperparameters (``param_groups``: lr,
    ...; a :class:`CheckpointWarning` names those that differ from the optimizer given to
    ``parallelize``), and restores ``pm.steps_done``. RNG states are per rank: they are
    restored only when (tp, pp, dp, ep) equal the saved layout; otherwise the generators keep
    this run's seeds (a CheckpointWarning says so: dropout masks then differ from an
    uninterrupted run; losses without dropout do not). A ``path`` that an interrupted save
    left missing loads the previous checkpoint that save had set aside (with a warning).

    Raises, on every rank alike and before any state is modified:
        CheckpointError: no checkpoint at ``path``, an incomplete one (no manifest), or a
            file missing, truncated or changed (naming the file).
        ValueError: another model (missing or extra parameters, other shapes, another
            optimizer class).
        CollectiveError: a peer died or did not reach a collective within the timeout.
    """
    _wait_for_pending_save(pm)
    group = pm.groups.checkpoint_group
    with _named_failures(pm, "loading checkpoint", path, pm.steps_done):
        found = Path(on_rank0(lambda: str(resolve_checkpoint(path)), group, f"reading {path}"))
        verify_checkpoint(found, group)
        return _load_verified(pm, found, group)


def _load_verified(pm, path: Path, group) -> dict:
    md = dcp_metadata(path)
    keys = key_sizes(md)
    meta_sd: dict[str, Any] = {META_KEY: b""}
    dcp.load(meta_sd, checkpoint_id=str(path), process_group=group)
    meta = pickle.loads(meta_sd[META_KEY])
    check_fits(pm, path, keys, meta)
    params = dict(pm.stage_module.named_parameters())
    local = local_keys(pm)
    states_of: dict[str, list[str]] = {}
    for k in keys:
        if k.startswith("optim."):
            state, key = k[len("optim."):].split(".", 1)
            states_of.setdefault(key, []).append(state)
    sd: dict[str, Any] = {}
    for key, (spec, names) in local.items():
        device, ep = params[names[0]].device, expert_degree(pm, names)
        sd[key] = template(pm, spec, md[key], device, ep)
        for state in states_of.get(key, []):
            sd[optim_key(state, key)] = template(pm, spec, md[optim_key(state, key)], device, ep)
    rank_rng = rng_key(pm.groups.rank)
    same_layout = all(meta["layout"].get(k, 1) == v for k, v in layout_of(pm).items()
                      if k in ("tp", "pp", "dp", "ep"))
    if same_layout and rank_rng in keys:
        sd[rank_rng] = b""
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    _warn_on_load(pm, path, meta, rank_rng in sd)
    adapter, states = dp_state(pm.dp_optimizer), {}
    for key, (spec, names) in local.items():
        value = from_loaded(pm, spec, sd[key])
        loaded = {s: from_loaded(pm, spec, sd[optim_key(s, key)]) for s in states_of.get(key, [])}
        for name in names:
            adapter.write_param(params[name], value)
            states[name] = loaded
    adapter.write_states(states, params)
    for group_ in pm.optimizer.param_groups:
        group_.update({k: v for k, v in meta["param_groups"].items() if k in group_})
    pm.steps_done = meta["steps_done"]
    if rank_rng in sd:
        set_rng_state(pm, pickle.loads(sd[rank_rng]))
    return meta["extra"]


@dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What :func:`load_latest_checkpoint` loaded.

    Attributes:
        path: the checkpoint loaded (None: there was none to load).
        extra: its ``extra`` dict (None when nothing was loaded).
        skipped: (checkpoint, why) of each newer checkpoint that could not be loaded,
            newest first: incomplete (a save that did not finish) or damaged.
    """

    path: Path | None
    extra: dict | None
    skipped: tuple[tuple[Path, str], ...]


def load_latest_checkpoint(pm, directory: str | os.PathLike) -> LoadedCheckpoint:
    """Load the newest complete, undamaged checkpoint among the subdirectories of
    ``directory`` (as :func:`autopar.runtime.checkpoint_files.latest_checkpoint` orders
    them, by the step in their manifests) and say which newer ones it skipped and why. A
    ``directory`` that does not exist holds none. Collective over the whole world (rank 0
    lists the directory).

    Raises what :func:`load_checkpoint` raises but CheckpointError (that checkpoint is
    skipped and the next older one tried): ValueError for another model stops the search.
    """
    directory = Path(directory)
    group = pm.groups.checkpoint_group
    listed = on_rank0(lambda: [str(p) for p in latest_checkpoint(directory).candidates]
                      if directory.is_dir() else [], group, f"listing {directory}")
    skipped = []
    for candidate in map(Path, listed):
        try:
            extra = load_checkpoint(pm, candidate)
        except CheckpointError as exc:
            skipped.append((candidate, str(exc)))
            continue
        return LoadedCheckpoint(path=candidate, extra=extra, skipped=tuple(skipped))
    return LoadedCheckpoint(path=None, extra=None, skipped=tuple(skipped))
