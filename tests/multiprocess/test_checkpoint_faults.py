"""A checkpoint is whole or absent: crashes inside a save, and damaged files on load.

Each crash case saves a complete checkpoint ("previous") to ``ckpt/NAME`` (AdamW, one
step), then a second launch trains on and saves over the same ``ckpt/NAME`` while one rank
kills itself (SIGKILL) or stops (SIGSTOP) inside DCP's write phase, right after writing its
own files and before the write results are gathered: the hook wraps
``autopar.runtime.checkpoint._writer``, the storage writer of our save path. Then:

* the surviving ranks end with a CollectiveError naming the save, within the timeout given
  to ``parallelize`` plus a few seconds (a stopped peer is only seen by the timeout);
* ``ckpt/NAME`` is exactly the previous checkpoint: its consolidated export equals that of
  a copy taken before the crash, every tensor (parameters, optimizer states) and the step;
  and a fresh program loads it to exactly the previous parameters.

The cases cover world sizes 2 and 4 (the coordinator, rank 0, killed at 4), a world-size
change (saved at 2, crashed at 4) and a stopped rank at 2, and an expert-parallel save (the
tiny Mixtral under dp4·ep2, an EP rank killed: the experts' Shard(0) chunks). Damaged copies of a complete
checkpoint (a shard deleted, truncated, a byte flipped, ``.metadata`` or the manifest
missing) each raise a CheckpointError naming the file, locally and on every rank of a
load, before anything is modified; ``load_latest_checkpoint`` skips a damaged newest
checkpoint and says why.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import autopar
from autopar.models import GPT
from autopar.runtime import checkpoint
from autopar.runtime.checkpoint_export import export_consolidated
from autopar.runtime.checkpoint_files import MANIFEST, CheckpointError, verify_checkpoint
from autopar.runtime.health import CollectiveError
from dist_utils import run_distributed, run_survivors
from helpers import BATCH, CONFIG, SEQ, batches, fast_cluster, refused_load, seeded_gpt

TIMEOUT_S = 5.0  # parallelize(timeout=): the checkpoint group's timeout
SLACK_S = 15.0  # process teardown and a loaded two-core machine
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
LAYOUTS = {2: dict(tp=2, pp=1, dp=1, zero_stage=0), 4: dict(tp=2, pp=1, dp=2, zero_stage=1)}
# name: (world of the previous save, world of the crashing save, fault, rank hit)
CRASHES = {"kill-w2": (2, 2, "kill", 1), "kill-w4-rank0": (4, 4, "kill", 0),
           "kill-w2-to-w4": (2, 4, "kill", 3), "stop-w2": (2, 2, "stop", 1)}


def _plan_json(world: int) -> str:
    with torch.device("meta"):
        meta = GPT(CONFIG)
    layout = autopar.Layout(**LAYOUTS[world], micro_batch_size=2, recompute="none",
                            dtype="fp32")
    return autopar.plan(meta, fast_cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=layout).to_json()


def _parallel(plan_json: str, seed: int = 0):
    torch.manual_seed(seed)
    model = seeded_gpt() if seed == 0 else GPT(CONFIG)
    return autopar.parallelize(model, plan=autopar.Plan.from_json(plan_json), optimizer=ADAMW,
                               timeout=TIMEOUT_S)


def _save_worker(rank: int, world: int, plan_json: str, paths: list[str]) -> dict:
    """One step, then a complete checkpoint at each of ``paths``; the state saved."""
    pm = _parallel(plan_json)
    pm.train_step(*batches(1)[0])
    for path in paths:
        pm.save_checkpoint(path, extra={"step": 1})
    return pm.full_state_dict()


class _FaultyWriter(FileSystemWriter):
    """Writes this rank's files, then kills (SIGKILL) or stops (SIGSTOP) the process: the
    write phase is over on this rank, the others wait for its write results."""

    fault = "kill"

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL if self.fault == "kill" else signal.SIGSTOP)
        return written


def _crash_worker(rank: int, world: int, plan_json: str, path: str, fault: str,
                  victim: int) -> tuple:
    """Two steps of another model, then a save over ``path`` during which rank ``victim``
    dies or stops; the others report (seconds in the save, exception type, message)."""
    pm = _parallel(plan_json, seed=1)
    for idx, tgt in batches(2):
        pm.train_step(idx, tgt)
    return _faulty_save(pm, path, fault if rank == victim else None)


def _faulty_save(pm, path: str, fault: str | None) -> tuple:
    """Save step 2 over ``path``, this rank killed or stopped inside the write when
    ``fault``; (seconds in the save, exception type or None, message)."""
    if fault is not None:
        checkpoint._writer = type("Faulty", (_FaultyWriter,), {"fault": fault})
    start = time.monotonic()
    try:
        pm.save_checkpoint(path, extra={"step": 2})
        return time.monotonic() - start, None, "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return time.monotonic() - start, type(exc).__name__, str(exc)


def _load_worker(rank: int, world: int, plan_json: str, paths: list[str], damaged: str,
                 directory: str) -> dict:
    """A fresh program (another seed) loads each of ``paths``; a ``damaged`` checkpoint is
    refused on every rank with the parameters untouched; the newest complete checkpoint
    of ``directory`` is found past a damaged newer one."""
    out = {}
    for path in paths:
        pm = _parallel(plan_json, seed=2)
        out[path] = {"extra": pm.load_checkpoint(path), "state": pm.full_state_dict(),
                     "steps": pm.steps_done}
    pm = _parallel(plan_json, seed=2)
    out["damaged"], out["untouched"] = refused_load(pm, damaged, CheckpointError)
    latest = pm.load_latest_checkpoint(directory)
    out["latest"] = (str(latest.path), latest.extra, [(str(p), why) for p, why in latest.skipped])
    return out


def _damage(src: Path, dst: Path, how: str) -> str:
    """A copy of checkpoint ``src`` at ``dst`` damaged ``how``; returns the file damaged."""
    shutil.copytree(src, dst)
    shard = sorted(p.name for p in dst.iterdir() if p.suffix == ".distcp")[-1]
    if how == "deleted":
        (dst / shard).unlink()
    elif how == "truncated":
        os.truncate(dst / shard, (dst / shard).stat().st_size // 2)
    elif how == "flipped":
        data = bytearray((dst / shard).read_bytes())
        data[len(data) // 2] ^= 0x01
        (dst / shard).write_bytes(bytes(data))
    elif how == "metadata":
        (dst / ".metadata").unlink()
        return ".metadata"
    elif how == "manifest":
        (dst / MANIFEST).unlink()
        return MANIFEST
    return shard


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("crash")
    plans = {w: _plan_json(w) for w in (2, 4)}
    saved = {}
    for world in (2, 4):
        names = [n for n, (w, *_) in CRASHES.items() if w == world]
        paths = [str(tmp / n) for n in names] + ([str(tmp / "good")] if world == 2 else [])
        state = run_distributed(_save_worker, world, plans[world], paths, timeout_s=300)[0]
        saved.update({n: state for n in names})
    for name in CRASHES:  # the previous checkpoints as they were
        shutil.copytree(tmp / name, tmp / f"{name}.copy")
    survivors = {}
    for name, (_, world, fault, victim) in CRASHES.items():
        survivors[name] = run_survivors(_crash_worker, world, plans[world], str(tmp / name),
                                        fault, victim, expected=world - 1)
    (tmp / "dir").mkdir()
    shutil.copytree(tmp / "good", tmp / "dir" / "step_1")
    _damage(tmp / "good", tmp / "dir" / "step_2", "truncated")  # same manifest step: by name
    _damage(tmp / "good", tmp / "flipped", "flipped")
    loaded = run_distributed(_load_worker, 2, plans[2], [str(tmp / n) for n in CRASHES],
                             str(tmp / "flipped"), str(tmp / "dir"), timeout_s=300)
    return {"tmp": tmp, "saved": saved, "survivors": survivors, "loaded": loaded}


@pytest.mark.parametrize("name", list(CRASHES))
def test_the_survivors_of_a_crashed_save_end_within_the_timeout(runs, name):
    world, victim = CRASHES[name][1], CRASHES[name][3]
    reports = runs["survivors"][name]
    assert sorted(reports) == sorted(set(range(world)) - {victim}), reports
    for rank, (elapsed, kind, message) in reports.items():
        assert kind == CollectiveError.__name__, (rank, kind, message)
        assert message.startswith("saving checkpoint ") and "step 2 on rank" in message, message
        assert elapsed < TIMEOUT_S + SLACK_S, (rank, elapsed, message)


@pytest.mark.parametrize("name", list(CRASHES))
def test_a_crashed_save_leaves_exactly_the_previous_checkpoint(runs, name, tmp_path):
    tmp = runs["tmp"]
    got = export_consolidated(tmp / name, tmp_path / "got.pt")
    want = export_consolidated(tmp / f"{name}.copy", tmp_path / "want.pt")
    assert got["steps_done"] == want["steps_done"] == 1 and got["extra"] == {"step": 1}
    tensors = [(got["model"], want["model"])] + \
        [(got["optimizer"][s], want["optimizer"][s]) for s in want["optimizer"]]
    assert set(got["optimizer"]) == set(want["optimizer"]) == {"exp_avg", "exp_avg_sq", "step"}
    for have, expect in tensors:
        assert set(have) == set(expect)
        for key, value in expect.items():
            assert torch.equal(have[key], value), (name, key)
    for rank_out in runs["loaded"]:
        loaded = rank_out[str(tmp / name)]
        assert loaded["extra"] == {"step": 1} and loaded["steps"] == 1
        for key, value in runs["saved"][name].items():
            assert torch.equal(loaded["state"][key], value), (name, key)


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped", "metadata", "manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(runs, how, tmp_path):
    damaged = tmp_path / "ckpt"
    file = _damage(runs["tmp"] / "good", damaged, how)
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(damaged)
    assert file in str(err.value), str(err.value)
    with pytest.raises(CheckpointError, match=file.replace(".", r"\.")):
        export_consolidated(damaged, tmp_path / "out.pt")


def test_a_damaged_checkpoint_is_refused_on_every_rank_before_loading(runs):
    for rank_out in runs["loaded"]:
        message = rank_out["damaged"]
        assert message is not None and "SHA-256" in message and ".distcp" in message, message
        assert rank_out["untouched"]


def test_load_latest_checkpoint_skips_a_damaged_newest_and_says_why(runs):
    directory = runs["tmp"] / "dir"
    for rank_out in runs["loaded"]:
        path, extra, skipped = rank_out["latest"]
        assert path == str(directory / "step_1") and extra == {"step": 1}, rank_out["latest"]
        assert [p for p, _ in skipped] == [str(directory / "step_2")], skipped
        assert "bytes, the manifest" in skipped[0][1], skipped


# -- expert parallelism: the experts are saved as Shard(0) DTensors over the EP group -------
EP_LAYOUT = dict(tp=1, pp=1, dp=4, ep=2, micro_batch_size=2, dtype="fp32")


def _ep_plan_json() -> str:
    from benchmarks.hf_families import build_family, tiny_cluster
    from benchmarks.model_zoo import TINY_SEQ

    return autopar.evaluate(build_family("mixtral", device="meta"), tiny_cluster(4),
                            autopar.Layout(**EP_LAYOUT), global_batch_size=8,
                            seq_len=TINY_SEQ, model_name="mixtral").to_json()


def _ep_program(plan_json: str, seed: int):
    from benchmarks.hf_families import build_family

    return autopar.parallelize(build_family("mixtral", seed=seed),
                               plan=autopar.Plan.from_json(plan_json), optimizer=ADAMW,
                               timeout=TIMEOUT_S)


def _ep_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from benchmarks.model_zoo import TINY_SEQ

    idx = torch.randint(0, 128, (8, TINY_SEQ), generator=torch.Generator().manual_seed(step))
    return idx, torch.roll(idx, -1, dims=1)


def _ep_save_worker(rank: int, world: int, plan_json: str, path: str) -> dict:
    pm = _ep_program(plan_json, seed=0)
    pm.train_step(*_ep_batch(0))
    pm.save_checkpoint(path, extra={"step": 1})
    return pm.full_state_dict()


def _ep_crash_worker(rank: int, world: int, plan_json: str, path: str, victim: int) -> tuple:
    pm = _ep_program(plan_json, seed=1)
    for step in (1, 2):
        pm.train_step(*_ep_batch(step))
    return _faulty_save(pm, path, "kill" if rank == victim else None)


def _ep_load_worker(rank: int, world: int, plan_json: str, path: str) -> dict:
    pm = _ep_program(plan_json, seed=2)
    return {"extra": pm.load_checkpoint(path), "state": pm.full_state_dict()}


def test_a_rank_killed_while_writing_an_expert_parallel_checkpoint(tmp_path):
    """dp4·ep2 (each EP rank writes its own experts' chunk): EP rank 1 of the first EP
    group killed after writing its files; the others fail naming the save within the
    timeout, and the checkpoint is exactly the previous one, experts included."""
    pytest.importorskip("transformers")
    plan_json, path = _ep_plan_json(), tmp_path / "ep"
    saved = run_distributed(_ep_save_worker, 4, plan_json, str(path), timeout_s=300)[0]
    shutil.copytree(path, tmp_path / "ep.copy")
    reports = run_survivors(_ep_crash_worker, 4, plan_json, str(path), 1, expected=3)
    assert sorted(reports) == [0, 2, 3], reports
    for rank, (elapsed, kind, message) in reports.items():
        assert kind == CollectiveError.__name__, (rank, kind, message)
        assert message.startswith("saving checkpoint ") and "step 2 on rank" in message, message
        assert elapsed < TIMEOUT_S + SLACK_S, (rank, elapsed, message)
    got = export_consolidated(path, tmp_path / "got.pt")
    want = export_consolidated(tmp_path / "ep.copy", tmp_path / "want.pt")
    assert got["extra"] == want["extra"] == {"step": 1}
    experts = [k for k in want["model"] if ".experts." in k]
    assert experts and all(want["model"][k].shape[0] == 4 for k in experts)  # all E experts
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    loaded = run_distributed(_ep_load_worker, 4, plan_json, str(path), timeout_s=300)
    for rank_out in loaded:
        assert rank_out["extra"] == {"step": 1}
        for key, value in saved.items():
            assert torch.equal(rank_out["state"][key], value), key
