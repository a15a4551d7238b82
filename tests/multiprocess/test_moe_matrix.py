"""The technique matrix of expert parallelism: every pair of techniques the runtime runs with
ep > 1, on the tiny Mixtral, equals one process.

The tiny Mixtral of the model zoo (2 layers, h = 64, 4 experts, top-2, s = 16, fp32; global
batch 8, micro-batches of 2 sequences) at world size 4. The factors and their values, from
:data:`autopar.contract.support.RUNTIME_SUPPORT` (what the runtime executes, the space the
solver searches):

* the mesh (tp, pp, dp) in (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1), varied as two
  factors, tp and pp (dp = 4 / (tp·pp));
* ep: every divisor > 1 of tp·dp that divides the E = 4 experts (EP groups are consecutive
  ranks of a stage, TP innermost: at tp2·dp2·ep4 the whole stage);
* sequence parallelism (tp > 1 only), the recompute mode, the pipeline schedule (pp = 2;
  "1f1b" at pp = 1);
* ZeRO-0 only: the runtime runs no other stage at ep > 1 (``expert_zero_stages``).

A combination that a rule of autopar refuses is dropped: each schedule's record's pipeline
rule (:func:`~autopar.contract.support.pipeline_problem`: interleaved 1F1B, ZB-V and
DualPipeV cut 2 layers into 2·pp = 4 chunks, which is refused) and its refused recompute
modes (ZB-H1's split backward with full recompute). The 42 that remain are reduced to an
all-pairs covering (``helpers.pairwise``: every two values of two factors that run together
do so in some trained combination): 10 trainings, the fewest any such covering has (CP-SAT,
solved once: the 8 (schedule, recompute) pairs need 8, and ep = 4 exists only at pp = 1,
where the one schedule is 1F1B). Each chosen combination is priced by ``autopar.evaluate``
as :func:`test_expert_parallel.mixtral_plan` does (it must accept it) and
``autopar.verify`` trains 2 SGD steps of the program and of one process on the same
batches, comparing the losses, every gradient (the experts gathered over EP) and every
parameter after each step, within verify's fp32 tolerances. All ten train in one launch
(about 210 s on 2 cores; the file about 230 s). A combination in :data:`KNOWN_BUGS` is
expected to fail (strict xfail). A second test checks that ``autopar.evaluate`` refuses one
dropped combination of each rule with that rule's message, so the covering's rules are
autopar's own.
"""

from __future__ import annotations

import itertools

import pytest

from helpers import pairwise

pytest.importorskip("transformers")
from dist_utils import run_distributed  # noqa: E402
from test_expert_parallel import BATCH, _verify_rank, check_reports, mixtral_plan  # noqa: E402

from autopar.contract.support import RUNTIME_SUPPORT, divisors  # noqa: E402
from autopar.techniques.pipeline_schedules import PIPELINE_SCHEDULES  # noqa: E402

SHAPES = [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)]  # (tp, pp, dp) at world size 4
LAYERS, EXPERTS, MBS = 2, 4, 2  # the tiny Mixtral's; micro-batches of 2 sequences
FACTORS = ("tp", "pp", "ep", "sequence_parallel", "recompute", "schedule")
"""The Layout fields the covering varies (dp follows from tp and pp)."""

KNOWN_BUGS: dict[str, str] = {}
"""Case id -> why that combination does not verify (marked xfail, strict)."""


def refusal(case: dict) -> str | None:
    """The rule of autopar that refuses ``case``, in its own words, or None: the
    schedule's pipeline rule for the tiny Mixtral's 2 layers (v = 2 for a schedule of
    several chunks per rank, the one v the runtime declares above 1) and the recompute
    modes the schedule refuses."""
    record = PIPELINE_SCHEDULES[case["schedule"]]
    m = BATCH // (case["dp"] * MBS)
    problem = record.problem(case["pp"], m, 2 if record.interleaved else 1, LAYERS)
    return problem or record.refused_recompute.get(case["recompute"])


def candidates() -> list[dict]:
    """Every combination of the factors' values the runtime declares (refused ones
    included), as Layout keyword dicts."""
    out = []
    for tp, pp, dp in SHAPES:
        eps = [e for e in divisors(tp * dp) if e > 1 and EXPERTS % e == 0]
        schedules = RUNTIME_SUPPORT.schedules if pp > 1 else ("1f1b",)
        sps = RUNTIME_SUPPORT.sequence_parallel if tp > 1 else (False,)
        zeros = [z for z in RUNTIME_SUPPORT.expert_zero_stages
                 if z in RUNTIME_SUPPORT.zero_stages_for(pp, tp, dp)]
        for ep, s, r, sp, z in itertools.product(eps, schedules, RUNTIME_SUPPORT.recompute,
                                                 sps, zeros):
            out.append(dict(tp=tp, pp=pp, dp=dp, ep=ep, schedule=s, recompute=r,
                            sequence_parallel=sp, zero_stage=z, micro_batch_size=MBS,
                            dtype="fp32"))
    return out


def case_id(case: dict) -> str:
    sp = "-sp" if case["sequence_parallel"] else ""
    return "tp{tp}-pp{pp}-dp{dp}-ep{ep}-{schedule}-{recompute}".format(**case) + sp


CHOSEN = pairwise([c for c in candidates() if refusal(c) is None], FACTORS)


def _matrix_rank(rank: int, world: int, plans: list) -> list:
    """Each plan's verify report (its dict), or the error a rank raised on it, in order."""
    out = []
    for plan in plans:
        try:
            out.append(_verify_rank(rank, world, plan, False))
        except Exception as exc:  # noqa: BLE001 - reported per combination
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.fixture(scope="module")
def matrix_reports() -> dict[str, list]:
    """Case id -> every rank's verify report (or error) of that chosen combination: all
    of them in one launch (a launch's ranks import transformers, ~18 s on 2 cores)."""
    plans = []
    for case in CHOSEN:
        plan = mixtral_plan(**case)  # autopar.evaluate accepts every chosen combination
        assert (plan.schedule, plan.recompute, plan.sequence_parallel) == (
            case["schedule"], [case["recompute"]] * LAYERS, case["sequence_parallel"])
        plans.append(plan)
    per_rank = run_distributed(_matrix_rank, 4, plans, timeout_s=600)
    return {case_id(c): [results[i] for results in per_rank] for i, c in enumerate(CHOSEN)}


@pytest.mark.parametrize("case", [
    pytest.param(c, id=case_id(c), marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[
        case_id(c)])] if case_id(c) in KNOWN_BUGS else []) for c in CHOSEN])
def test_every_pair_of_techniques_with_ep_matches_one_process(case, matrix_reports):
    reports = matrix_reports[case_id(case)]
    errors = [r for r in reports if isinstance(r, str)]
    assert not errors, errors[0]
    report = check_reports(reports, case_id(case))
    assert report["ok"], report


def test_dropped_combinations_are_refused_by_autopar_rules():
    """One dropped combination per rule: ``autopar.evaluate`` refuses it, naming that rule
    (not some other error)."""
    refused: dict[str, dict] = {}
    for case in candidates():
        rule = refusal(case)
        if rule is not None:
            refused.setdefault(rule, case)
    assert len(refused) == 4, list(refused)  # interleaved 1F1B, ZB-V, DualPipeV; ZB-H1+full
    for rule, case in refused.items():
        with pytest.raises(ValueError) as exc:
            mixtral_plan(**case)
        assert rule in str(exc.value), (case_id(case), str(exc.value))
