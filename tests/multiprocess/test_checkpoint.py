"""Checkpoints move between plans (autopar.runtime.checkpoint, on torch.distributed.checkpoint).

Each pair (A, B): plan A trains the 4-layer test GPT (fp32, dropout 0) for 6 steps and
saves a checkpoint after step 3 (the save must not disturb it); plan B, a fresh
ParallelizedModel in the same launch or in a launch of another world size, loads the
checkpoint and trains steps 4-6. B's losses and final parameters equal A's uninterrupted
run with test_matrix's tolerances (SGD 1e-5 relative; AdamW losses 1e-5, parameters 1e-3).
Together the pairs change tp, pp, dp, the ZeRO stage (0-3), the schedule (GPipe, 1F1B,
interleaved 1F1B) and the world size (4 -> 2, 4 -> 4, 2 -> 2). Also: same-plan resumes
with dropout on and in bf16 are bitwise equal (RNG streams and fp32 master weights
restored); nanoGPT's fused QKV reshards; a consolidated export equals
``full_state_dict()``; ``load_full_state_dict`` of a single-device model then training
equals training that model; a checkpoint of another model is refused, before anything is
modified.

Two launches (world 4, then world 2) run every case, to keep the wall time small.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch

import autopar
from autopar.models import GPT
from autopar.runtime.checkpoint_export import export_consolidated
from autopar.runtime.checkpoint_files import CheckpointWarning
from dist_utils import run_distributed
from examples.nanogpt_model import GPT as NanoGPT, GPTConfig as NanoConfig
from helpers import (BATCH, CONFIG, SEQ, batches, fast_cluster, refused_load, rel, seeded_gpt,
                     train_eagerly)

OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)}
LOSS_TOL = 1e-5
PARAM_TOL = {"sgd": 1e-5, "adamw": 1e-3}
CONFIGS = {"gpt": CONFIG, "dropout": dataclasses.replace(CONFIG, dropout=0.1),
           "smaller": dataclasses.replace(CONFIG, n_layer=2),
           "nanogpt": NanoConfig(block_size=SEQ, vocab_size=64, n_layer=2, n_head=4, n_embd=32)}


def _layout(tp, pp, dp, zero=0, schedule="1f1b", v=None, dtype="fp32", sp=False) -> dict:
    """A pinned fp32 layout; m = 2 micro-batches of B / (2 d) rows (dp 4: m = 1, 2 rows)."""
    rows = BATCH // dp
    return dict(tp=tp, pp=pp, dp=dp, zero_stage=zero, schedule=schedule, virtual_stages=v,
                micro_batch_size=rows // 2 if rows >= 4 else rows,
                recompute="selective" if sp else "none", sequence_parallel=sp, dtype=dtype)


# name, optimizer, (world, layout) of A, (world, layout) of B
PAIRS = [
    ("tp2dp2z1-to-pp2dp2gpipe", "sgd", 4, _layout(2, 1, 2, 1), 4, _layout(1, 2, 2, 0, "gpipe")),
    ("tp2pp2interleaved-to-dp2z3", "sgd", 4, _layout(2, 2, 1, 0, "interleaved_1f1b", 2),
     2, _layout(1, 1, 2, 3)),
    ("dp4z3-to-tp2", "adamw", 4, _layout(1, 1, 4, 3), 2, _layout(2, 1, 1)),
    ("dp2z2-to-pp2interleaved", "sgd", 2, _layout(1, 1, 2, 2),
     2, _layout(1, 2, 1, 0, "interleaved_1f1b", 2)),
    ("pp2zbv-to-dp2z1", "adamw", 2, _layout(1, 2, 1, 0, "zb_v", 2), 2, _layout(1, 1, 2, 1)),
    ("tp2-to-dp2z2", "adamw", 2, _layout(2, 1, 1), 2, _layout(1, 1, 2, 2)),
]
ASYNC_SAVED = "pp2zbv-to-dp2z1"  # AdamW, saved with dcp.async_save while training goes on
SAME_PLAN = [("dropout", "adamw", _layout(2, 1, 1), "dropout"),  # RNG streams restored
             ("bf16", "adamw", _layout(1, 1, 2, 1, dtype="bf16"), "gpt")]  # fp32 masters


def _build(config: str) -> torch.nn.Module:
    """The test GPT (autopar.models) or nanoGPT, whose fused c_attn (q|k|v) TP splits in
    blocks, of CONFIGS[config]."""
    return (NanoGPT if config == "nanogpt" else GPT)(CONFIGS[config])


def _plan_json(world: int, layout: dict, config: str = "gpt") -> str:
    with torch.device("meta"):
        meta = _build(config)
    return autopar.plan(meta, fast_cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**layout)).to_json()


def _model(config: str, seed: int) -> torch.nn.Module:
    if config == "gpt" and seed == 0:
        return seeded_gpt()
    torch.manual_seed(seed)
    return _build(config)


def _data(config: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(6, CONFIGS[config])


def _parallel(plan_json: str, opt: str, config: str = "gpt", seed: int = 0):
    return autopar.parallelize(_model(config, seed), plan=autopar.Plan.from_json(plan_json),
                               optimizer=OPTIMIZERS[opt])


def _run_a(plan_json: str, opt: str, path: str, config: str, async_save: bool) -> dict:
    """6 steps, a checkpoint after step 3: losses, state at the save and at the end."""
    pm, data = _parallel(plan_json, opt, config), _data(config)
    losses = [pm.train_step(*data[i]) for i in range(3)]
    future = pm.save_checkpoint(path, extra={"step": 3}, async_save=async_save)
    saved_state = pm.full_state_dict()
    losses += [pm.train_step(*data[i]) for i in range(3, 6)]  # while an async save writes
    if future is not None:
        future.result()
    return {"losses": losses, "saved_state": saved_state, "state": pm.full_state_dict()}


def _run_b(plan_json: str, opt: str, path: str, config: str, async_save: bool) -> dict:
    """A fresh model (another seed) loads the checkpoint and trains the remaining steps."""
    pm, data = _parallel(plan_json, opt, config, seed=1), _data(config)
    extra = pm.load_checkpoint(path)
    steps_at_load = pm.steps_done
    losses = [pm.train_step(*data[i]) for i in range(extra["step"], 6)]
    return {"losses": losses, "state": pm.full_state_dict(), "extra": extra,
            "steps": (steps_at_load, pm.steps_done)}


def _losses(out: dict) -> dict:
    return {k: v["losses"] for k, v in out.items() if isinstance(v, dict) and "losses" in v}


def _jobs_worker(rank: int, world: int, jobs: list, tmp: str) -> dict:
    """Run ("A" | "B", name, optimizer, plan, config, async) jobs in order; rank 0 returns
    everything, the others their losses (checked equal)."""
    out = {}
    for kind, name, opt, plan, config, async_save in jobs:
        run = _run_a if kind == "A" else _run_b
        out[kind, name] = run(plan, opt, f"{tmp}/{name}", config, async_save)
    return out if rank == 0 else _losses(out)


def _reference(opt: str, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """seeded_gpt trained ``steps`` steps in this process."""
    model = seeded_gpt()
    return train_eagerly(model, OPTIMIZERS[opt](model.parameters()), batches(steps))


def _strict_loads(plan: str) -> dict:
    """A deeper model's whole state dict: refused by default (naming the extra layer's
    keys), accepted with strict=False."""
    deeper = GPT(dataclasses.replace(CONFIG, n_layer=5)).state_dict()
    pm = _parallel(plan, "adamw", seed=1)
    try:
        pm.load_full_state_dict(deeper)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    pm.load_full_state_dict(deeper, strict=False)
    return {"refused": refused, "lenient": pm.full_state_dict()}


def _warned_loads(plan: str, path: str) -> list[str]:
    """The CheckpointWarnings of loading the checkpoint at ``path`` (saved under tp2·dp2
    with SGD lr 0.1) into ``plan`` (tp2) with SGD lr 0.05 (rank 0 warns)."""
    pm = autopar.parallelize(_model("gpt", 1), plan=autopar.Plan.from_json(plan),
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.load_checkpoint(path)
    return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def _world2_worker(rank: int, world: int, jobs: list, full_plans: list, small_plan: str,
                   refused_path: str, tmp: str) -> dict:
    """``jobs``, then single-device weights into ``full_plans`` and a smaller model refusing
    the checkpoint at ``refused_path``."""
    out = _jobs_worker(0, world, jobs, tmp)
    for k, plan in enumerate(full_plans):  # single-device weights into a plan, then train
        pm = _parallel(plan, "adamw", seed=1)
        pm.load_full_state_dict(seeded_gpt().state_dict())
        losses = [pm.train_step(idx, tgt) for idx, tgt in batches(3)]
        out["full", k] = {"losses": losses, "state": pm.full_state_dict()}
    out["strict"] = _strict_loads(full_plans[0])
    out["warned"] = _warned_loads(full_plans[0], refused_path)
    pm = _parallel(small_plan, "sgd", "smaller")  # another model refuses the checkpoint
    out["refused"], out["untouched"] = refused_load(pm, refused_path, ValueError)
    return out if rank == 0 else _losses(out)


# nanoGPT's fused c_attn under TP (with sequence parallelism and selective recompute, as
# benchmarks/model_zoo.py runs it), to and from ZeRO-1/2 over dp = 2. SGD with momentum:
# nanoGPT's biases start at zero, so the key bias's gradient is rounding noise, which AdamW
# would amplify to ~lr per step (see test_matrix).
FUSED_PAIRS = [("nanogpt-tp2-to-dp2z1", "sgd", _layout(2, 1, 1, sp=True), _layout(1, 1, 2, 1)),
               ("nanogpt-dp2z2-to-tp2", "sgd", _layout(1, 1, 2, 2), _layout(2, 1, 1, sp=True))]


def _jobs(world: int) -> list[tuple]:
    """The launch of ``world`` ranks: A of the pairs starting there, B of those ending
    there (4 -> 2: A in the first launch, B in the second), the same-plan pairs at 2."""
    jobs = []
    for name, opt, world_a, a, world_b, b in PAIRS:
        if world_a == world:
            jobs.append(("A", name, opt, _plan_json(world_a, a), "gpt", name == ASYNC_SAVED))
        if world_b == world:
            jobs.append(("B", name, opt, _plan_json(world_b, b), "gpt", False))
    if world == 2:
        cases = [(n, o, lay, lay, c) for n, o, lay, c in SAME_PLAN] + \
            [(n, o, a, b, "nanogpt") for n, o, a, b in FUSED_PAIRS]
        for name, opt, a, b, config in cases:
            jobs += [("A", name, opt, _plan_json(2, a, config), config, False),
                     ("B", name, opt, _plan_json(2, b, config), config, False)]
    return jobs


def _close(got: dict, want: dict, opt: str, case) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) / abs(b) < LOSS_TOL, (case, got["losses"], want["losses"])
    assert set(got["state"]) == set(want["state"]), case
    for key, value in want["state"].items():
        err = rel(got["state"][key], value)
        assert err < PARAM_TOL[opt], (case, key, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case's results (rank 0), keyed ("A" | "B", name), "full", "refused", ..."""
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    per_rank4 = run_distributed(_jobs_worker, 4, _jobs(4), tmp, timeout_s=600)
    full_plans = [_plan_json(2, _layout(2, 1, 1)), _plan_json(2, _layout(1, 1, 2, 3))]
    small = _plan_json(2, _layout(1, 1, 2, 1), "smaller")
    per_rank2 = run_distributed(_world2_worker, 2, _jobs(2), full_plans, small,
                                f"{tmp}/{PAIRS[0][0]}", tmp, timeout_s=600)
    for per_rank in (per_rank4, per_rank2):  # the same losses on every rank
        for rank, losses in enumerate(per_rank[1:], 1):
            assert losses == _losses(per_rank[0]), rank
    return {**per_rank4[0], **per_rank2[0], "tmp": tmp}


def _resumed(runs: dict, name: str, opt: str) -> None:
    a, b = runs["A", name], runs["B", name]
    assert b["extra"] == {"step": 3} and b["steps"] == (3, 6), b["steps"]
    _close(b, {"losses": a["losses"][3:], "state": a["state"]}, opt, name)


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] for p in PAIRS])
def test_checkpoint_of_plan_a_resumes_under_plan_b(runs, pair):
    _resumed(runs, pair[0], pair[1])


@pytest.mark.parametrize("name", [p[0] for p in SAME_PLAN])
def test_same_plan_resume_with_dropout_or_bf16_is_bitwise_equal(runs, name):
    """Dropout: the RNG streams are restored; bf16: the fp32 master weights are saved, not
    the bf16 parameters."""
    a, b = runs["A", name], runs["B", name]
    assert b["losses"] == a["losses"][3:]
    assert all(torch.equal(b["state"][k], v) for k, v in a["state"].items())


@pytest.mark.parametrize("pair", FUSED_PAIRS, ids=[p[0] for p in FUSED_PAIRS])
def test_fused_qkv_reshards_exactly(runs, pair):
    """nanoGPT's fused c_attn: each TP rank holds its part of q, k and v (saved whole)."""
    _resumed(runs, pair[0], pair[1])


def test_consolidated_export_equals_full_state_dict(runs, tmp_path):
    out = export_consolidated(f"{runs['tmp']}/{ASYNC_SAVED}", tmp_path / "model.pt")
    want = runs["A", ASYNC_SAVED]["saved_state"]
    assert set(out["model"]) == set(want)
    assert all(torch.equal(out["model"][k], v) for k, v in want.items())
    assert set(out["optimizer"]) == {"exp_avg", "exp_avg_sq", "step"}
    assert out["steps_done"] == 3 and out["extra"] == {"step": 3}
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    model = GPT(CONFIG)
    model.load_state_dict(loaded["model"])  # a plain state_dict


def test_load_full_state_dict_then_train_equals_single_device(runs):
    ref_losses, ref_state = _reference("adamw")
    for k in range(2):
        _close(runs["full", k], {"losses": ref_losses, "state": ref_state}, "adamw", k)


def test_a_checkpoint_of_another_model_is_refused_before_loading(runs):
    message = runs["refused"]
    assert message is not None and "is not of this model" in message, message
    assert "the model lacks" in message and "transformer.h.2" in message, message
    assert runs["untouched"]


def test_load_full_state_dict_refuses_another_models_keys_unless_not_strict(runs):
    message = runs["strict"]["refused"]
    assert message is not None and "key(s) the model lacks" in message, message
    assert "transformer.h.4." in message and "strict=False" in message, message
    assert len(runs["strict"]["lenient"]) > 0


def test_loading_under_another_layout_or_learning_rate_says_so(runs):
    warned = runs["warned"]
    assert len(warned) == 2, warned
    assert any("RNG states" in w and "tp/pp/dp/ep [2, 1, 2, 1]" in w and "[2, 1, 1, 1]" in w
               for w in warned), warned
    assert any("lr 0.05 -> 0.1" in w for w in warned), warned
