"""Every pair of techniques the solver can emit runs together, and equals one process.

The matrix is generated from :data:`autopar.contract.support.RUNTIME_SUPPORT` (the one
source of truth the solver's search space also reads): for each (tp, pp, dp) shape at
world size 4 (and a few at 8), the schedules (ZB-H1, ZB-V and DualPipeV without full
recompute, which they refuse; ZB-V's and DualPipeV's V at pp=2, 4 chunks of one layer, rank
0 holding the embedding and the head; interleaved 1F1B with every declared v that
:meth:`~autopar.contract.support.RuntimeSupport.virtual_stages_for` allows for the shape: pp=2 cuts the 4
layers into 4 chunks of one layer, pp=4 would need 8 layers), ZeRO stages, recompute modes
and sequence-parallel settings the runtime declares for that shape, and the optimizer. The
full product (220 trainings at world size 4) is reduced to an all-pairs covering
(``helpers.pairwise``: every two values of two factors that can run together do so in
some trained case; 70 trainings): the bugs this matrix has found were interactions of two
techniques. At world size 8 (tp, pp and dp of 2) every single value runs in some trained
combination (6 trainings). Each chosen combination trains a 4-layer GPT (dropout 0) for 3
steps on real gloo process groups:

* SGD, the gradient clipped to a global norm of CLIP_NORM (below the first two steps'
  norms, above the third's): losses, the gradient norm of every step and every gathered
  parameter equal the single-process run under ``torch.nn.utils.clip_grad_norm_`` to 1e-5
  relative (max |a - b| / max |b| per tensor);
* AdamW (unclipped): losses and norms to 1e-5, parameters to 1e-3 (the end-to-end
  tolerances);
* the step's communication, measured by the dispatch-mode CommMeter, equals the plan's
  predicted payload bytes for every kind, exactly; model-state bytes within 1%; without
  recompute, the saved activations within 5% on every rank (SAVED_TOLERANCE).

Sequence-parallel cases run Megatron's sequence-parallel placements (LayerNorm, dropout and
residual adds on sequence shards; reduce-scatter out of and all-gather into each TP
region), except under selective recompute, where they run the solver's own SP plan.

bf16 mixed precision (bf16 parameters, gradients, activations and collectives; fp32 master
weights) runs on one combination per shape against the fp32 single-process run with the
documented tolerance BF16_TOLERANCE. A second test turns dropout on and checks that every
combination of a pairwise covering of the shapes and the factors that draw random numbers
(27 trainings) is reproducible from its seed (bitwise equal losses over two runs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.models import GPT
from autopar.planner.strategies.megatron import megatron_placements
from autopar.graph.capture import trace_model
from dist_utils import run_distributed
from helpers import BATCH, CONFIG, MATRIX_FACTORS, SEQ, SHAPES_4, SHAPES_8, STEPS, combinations, pairwise
from helpers import batches as _batches, fast_cluster as _cluster, optimizer as _optimizer
from helpers import reference_with_norms as _reference, rel as _rel, seeded_gpt as _model

# bf16 against the fp32 single-process run: bf16 keeps 8 significant bits (relative
# rounding 2^-9 = 2e-3 per operation), so: losses 1e-2, SGD parameters 2e-2 relative.
# AdamW normalises each update to ~lr whatever the gradient's size, so parameters whose
# true gradient is ~0 (the key bias: softmax is invariant to it) move by ~lr on rounding
# noise; AdamW under bf16 is therefore checked on losses only.
BF16_TOLERANCE = {"loss": 1e-2, "sgd_param": 2e-2}

DROPOUT_CONFIG = dataclasses.replace(CONFIG, dropout=0.1)

# saved activations measured (the saved-tensor hooks, on the measured step) over predicted,
# without recompute: the split-backward schedules hold each micro-batch's graph until its
# weight-gradient pass (order_in_flight); within 5% on every rank, as test_parallelize's
SAVED_TOLERANCE = 0.05

# the end-to-end GPT's gradient norms under SGD are 0.80, 0.57, 0.55: steps 1 and 2 clip
CLIP_NORM = {"sgd": 0.56, "adamw": None}


def _plan_json(world: int, layout: dict, config=CONFIG) -> str:
    """The solver's plan for ``layout``; sequence-parallel cases other than selective
    recompute take Megatron's sequence-parallel placements instead (the solver, on a
    cluster where communication is nearly free, need not put LayerNorm on shards)."""
    with torch.device("meta"):
        meta = GPT(config)
    plan = autopar.plan(meta, _cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**layout))
    if layout["sequence_parallel"] and layout["recompute"] != "selective":
        placements = megatron_placements(trace_model(meta, SEQ), layout["tp"], sequence_parallel=True)
        plan = autopar.evaluate_plan(meta, _cluster(world), dataclasses.replace(plan, placements=placements))
    return plan.to_json()


def _train(plan: autopar.Plan, opt: str, model=None, seed: int = 0):
    """(program, losses, gradient norms) of STEPS steps, SGD clipped to CLIP_NORM."""
    pm = autopar.parallelize(model if model is not None else _model(), plan=plan,
                             optimizer=_optimizer(opt), max_norm=CLIP_NORM[opt])
    losses, norms = [], []
    for idx, tgt in _batches(STEPS):
        losses.append(pm.train_step(idx, tgt))
        norms.append(pm.last_step_stats()["grad_norm"])
    return pm, losses, norms


def _matrix_worker(rank: int, world: int, runs: list[tuple[str, str]]):
    """Train each (plan JSON, optimizer) of ``runs``."""
    results = []
    for text, opt in runs:
        plan = autopar.Plan.from_json(text)
        pm, losses, norms = _train(plan, opt)
        measured = pm.last_step_stats()
        state = pm.full_state_dict()  # collective: every rank calls it
        predicted = plan.predicted.stage_stats[pm.groups.pp_rank]
        pm.close()  # its process groups' threads would slow every later training
        priced = set(plan.recompute) == {"none"}
        results.append({
            "layout": str(plan.layout()),
            "opt": opt, "losses": losses, "norms": norms,
            "state": state if rank == 0 else None,
            "comm_bytes": measured["comm_bytes"], "predicted_comm": predicted["comm_bytes"],
            "states_ratio": measured["model_state_bytes"] / predicted["model_state_bytes"],
            # recompute is the hooks' blind spot (test_parallelize's docstring)
            "saved_ratio": measured["saved_activation_bytes"]
            / predicted["saved_activation_bytes"] if priced else None,
        })
    return results


def _check_matrix(per_rank: list[list[dict]], loss_tol: float, param_tol: dict[str, float]) -> None:
    refs = {opt: _reference(opt, max_norm=CLIP_NORM[opt]) for opt in ("sgd", "adamw")}
    for rank, results in enumerate(per_rank):
        for r in results:
            case = (r["layout"], r["opt"], f"rank {rank}")
            for kind, nbytes in r["comm_bytes"].items():
                assert nbytes == r["predicted_comm"][kind], (case, kind, r["comm_bytes"],
                                                             r["predicted_comm"])
            if r["opt"] == "adamw":  # the cost model prices Adam's states
                assert abs(r["states_ratio"] - 1) < 0.01, (case, r["states_ratio"])
            if r["saved_ratio"] is not None:
                assert abs(r["saved_ratio"] - 1) < SAVED_TOLERANCE, (case, r["saved_ratio"])
            assert r["losses"] == per_rank[0][results.index(r)]["losses"], case
            assert r["norms"] == per_rank[0][results.index(r)]["norms"], case
    for r in per_rank[0]:
        ref_losses, ref_state, ref_norms = refs[r["opt"]]
        case = (r["layout"], r["opt"])
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) / abs(want) < loss_tol, (case, r["losses"], ref_losses)
        for got, want in zip(r["norms"], ref_norms):  # clipping acts on this norm
            assert abs(got - want) / abs(want) < 2 * loss_tol, (case, r["norms"], ref_norms)
        tol = param_tol.get(r["opt"])
        if tol is None:
            continue
        assert set(r["state"]) == set(ref_state), case
        for key, want in ref_state.items():
            err = _rel(r["state"][key].float(), want)
            assert err < tol, (case, key, err)


@pytest.mark.parametrize("shape", SHAPES_4, ids=lambda s: "tp%d-pp%d-dp%d" % s)
def test_world4_every_pair_of_techniques_matches_single_process(shape):
    """Every pair of values of two factors (schedule, v, ZeRO stage, recompute, SP, the
    optimizer) that the runtime can run together, in at least one trained combination."""
    cases = [dict(layout, opt=opt) for layout in combinations(*shape) for opt in ("sgd", "adamw")]
    chosen = pairwise(cases, MATRIX_FACTORS + ("opt",))
    runs = [(_plan_json(4, {k: v for k, v in c.items() if k != "opt"}), c["opt"]) for c in chosen]
    per_rank = run_distributed(_matrix_worker, 4, runs, timeout_s=900)
    _check_matrix(per_rank, 1e-5, {"sgd": 1e-5, "adamw": 1e-3})


@pytest.mark.parametrize("shape", SHAPES_8, ids=lambda s: "tp%d-pp%d-dp%d" % s)
def test_world8_combinations_match_single_process(shape):
    """Every value of every factor on the three-dimensional mesh (tp, pp and dp groups all
    of size 2), in some trained combination; their pairs are trained at world size 4."""
    chosen = pairwise(combinations(*shape), MATRIX_FACTORS, strength=1)
    runs = [(_plan_json(8, layout), "sgd") for layout in chosen]
    per_rank = run_distributed(_matrix_worker, 8, runs, timeout_s=900)
    _check_matrix(per_rank, 1e-5, {"sgd": 1e-5})


def test_bf16_mixed_precision_within_documented_tolerance():
    layouts = []
    for shape in SHAPES_4:
        layout = combinations(*shape)[-1]  # the last: highest ZeRO stage, full recompute
        layouts.append(dict(layout, dtype="bf16"))
    runs = [(_plan_json(4, layout), opt) for layout in layouts for opt in ("sgd", "adamw")]
    per_rank = run_distributed(_matrix_worker, 4, runs, timeout_s=900)
    _check_matrix(per_rank, BF16_TOLERANCE["loss"], {"sgd": BF16_TOLERANCE["sgd_param"]})


def _dropout_model() -> GPT:
    torch.manual_seed(0)
    return GPT(DROPOUT_CONFIG)


def _dropout_worker(rank: int, world: int, plans: list[str]):
    """Each plan trains 2 steps with dropout 0.1 twice with seed 0; the first plan also once
    with seed 1."""
    results = []
    for k, text in enumerate(plans):
        plan = autopar.Plan.from_json(text)
        runs = []
        for seed in (0, 0, 1) if k == 0 else (0, 0):
            pm = autopar.parallelize(_dropout_model(), plan=plan, optimizer=_optimizer("sgd"),
                                     seed=seed)
            runs.append([pm.train_step(idx, tgt) for idx, tgt in _batches(2)])
            pm.close()  # 55 programs per process: their groups' threads would pile up
        results.append((str(plan.layout()), runs))
    return results


def test_world4_dropout_is_reproducible_from_the_seed():
    """Dropout on (Megatron's tracked RNG): the same seed repeats the losses bitwise on
    every rank, for every pair of values of the shape, schedule, v, recompute and SP;
    another seed changes them."""
    # ZeRO shards optimizer states and gradients and draws no random numbers: the pairs of
    # the factors that change which masks are drawn, and when, the (tp, pp, dp) shape one
    # of them
    rng_factors = ("shape",) + tuple(f for f in MATRIX_FACTORS if f != "zero_stage")
    cases = [dict(layout, shape=shape) for shape in SHAPES_4 for layout in combinations(*shape)]
    plans = [_plan_json(4, {k: v for k, v in case.items() if k != "shape"}, DROPOUT_CONFIG)
             for case in pairwise(cases, rng_factors)]
    per_rank = run_distributed(_dropout_worker, 4, plans, timeout_s=900)
    for rank, results in enumerate(per_rank):
        for k, (layout, runs) in enumerate(results):
            assert runs[0] == runs[1], (layout, rank, runs)
            assert runs[0] == per_rank[0][k][1][0], (layout, rank)  # the same on every rank
            if len(runs) == 3:
                assert all(a != b for a, b in zip(runs[0], runs[2])), (layout, rank, runs)
