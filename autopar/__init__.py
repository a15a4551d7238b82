"""autopar: automatic tensor/pipeline/data-parallel plans for GPT training.

Public face: :func:`plan`, :func:`evaluate`, :func:`parallelize`, :func:`dry_run`, :class:`Cluster`,
:class:`Layout`, :class:`Plan`, :mod:`report` (``report.write_report``), :func:`load_model`,
:func:`init_model` and :func:`meta_parameters`.
"""

import copy

from cost_models.hardware import Cluster

from autopar import report  # autopar.report.write_report(plan, out_dir, hand_layouts=...)
from autopar.api import evaluate, evaluate_plan, plan
from autopar.models import load_model
from autopar.contract.plan import Layout, Plan, Prediction
from autopar.contract.plan_check import PlanError
from autopar.planner.costs.decision import InfeasibleError
from autopar.planner.search.outcome import SolverTimeLimitError
from autopar.graph.capture import TraceError

__all__ = ["Cluster", "Layout", "Plan", "Prediction", "plan", "evaluate", "evaluate_plan", "parallelize",
           "dry_run", "report", "load_model", "init_model", "meta_parameters", "InfeasibleError", "TraceError", "PlanError",
           "SolverTimeLimitError"]


def init_model(model, seed=0, *, device=None, init_fn=None):
    """Initialise ``model`` (built on the meta device, or materialised) whole on ``device``
    (default CPU) by the layout-independent rule a meta model's shards follow under
    :func:`parallelize` with the same ``seed``; returns it. The recipe (each module's own
    parameters created and initialised from a generator seeded by (seed, module name),
    ``init_fn(name, module)`` or the model's own rule, meta buffers filled by that rule) and
    its errors (ValueError naming a buffer or parameter the rule leaves unset):
    :func:`autopar.runtime.materialize.init_model` (imported lazily: ``import autopar``
    loads no runtime)."""
    from autopar.runtime.materialize import init_model as materialize

    return materialize(model, seed, device=device, init_fn=init_fn)


def dry_run(model, plan, *, ranks=None, optimizer=None, seed=0):
    """Build ``plan``'s ranks at its full world size in this one process (torch's fake
    process group, fake tensors: nothing allocated, nothing sent), run one training step of
    each and compare its collective bytes, model states and saved-activation peak with the
    plan's prediction. ``ranks``: a rank, several, or None for one per pipeline stage.
    Returns a :class:`~autopar.verify.dry_run.DryRunReport` (``.ok``, ``.table()``,
    ``.to_dict()``); raises ``DryRunError`` naming the rank and the op or field that
    failed, RuntimeError inside an initialised process group
    (:func:`autopar.verify.dry_run.dry_run`, imported lazily)."""
    from autopar.verify.dry_run import dry_run as run

    return run(model, plan, ranks=ranks, optimizer=optimizer, seed=seed)


def meta_parameters():
    """A context manager that builds a model with its parameters on the meta device and its
    buffers real (as accelerate's ``init_empty_weights()``): ``with autopar.meta_parameters():
    model = Model(config)``, then :func:`plan`, :func:`parallelize` (each rank creates only
    its shards) or :func:`init_model`. Buffers the constructor computes (rotary caches, a
    causal mask) keep their values; no weight is filled
    (:func:`autopar.runtime.materialize.meta_parameters`)."""
    from autopar.runtime.materialize import meta_parameters as build

    return build()


def parallelize(model, cluster=None, plan=None, *, optimizer, global_batch_size=None,
                seq_len=None, seed=0, verify=False, timeout=None, max_norm=None,
                on_nonfinite="raise", measure_every=100, init_fn=None):
    """Build this rank's parallel training program (call inside ``torchrun``/an initialised
    process group, on every rank: gloo keeps the rank on the CPU, NCCL puts it on
    ``cuda:LOCAL_RANK``, :mod:`autopar.runtime.device`). The recipe is
    :func:`autopar.recipe.parallelize` (imported lazily: it needs
    torch.distributed).

    model: the single-device model (it is copied, not modified): materialised, or built on
        the meta device (``with torch.device("meta"): GPT(config)``), in which case each
        rank creates only its own shards, initialised by :func:`init_model`'s rule with
        ``seed``: a shard equals the same slice of ``init_model(model, seed)``, whatever
        the layout, and no rank holds more than one module's whole parameters at a time
        (:mod:`autopar.runtime.materialize`).
    cluster: used to solve when ``plan`` is None (rank 0 solves and broadcasts; then
        global_batch_size and seq_len are required).
    optimizer: parameters -> torch.optim.Optimizer, e.g. ``partial(torch.optim.AdamW, lr=3e-4)``.
    seed: dropout seed, the same on every rank; each rank seeds its default generator
        (``torch.manual_seed``) and a tensor-parallel stream from it the Megatron way
        (:func:`autopar.runtime.rng.rank_seeds`), so runs with one seed repeat exactly.
        A meta model's initialisation seed too.
        A meta model's shards are created on the rank's device (CPU under gloo).
    init_fn: ``init_fn(name, module)``, a meta model's init rule (default: the model's own,
        :func:`autopar.runtime.materialize.model_init_fn`).
    verify: first run :func:`autopar.verify.check.verify` on the agreed plan (3 SGD steps
        of a copy against one device; ``model`` is untouched) and raise its
        VerificationError on a mismatch.
    timeout: seconds (or a timedelta) for every process group the program creates (default:
        the world group's); a collective that a dead or stuck peer never completes raises
        ``autopar.runtime.health.CollectiveError`` naming the step and the collective.
    max_norm: clip the gradient to this global L2 norm, counted over every parameter however
        it is sharded: ``torch.nn.utils.clip_grad_norm_`` on one device (None: no clipping).
    on_nonfinite: when the step's loss or gradient norm is NaN/inf: "raise" (every rank
        raises ``autopar.runtime.health.NonFiniteError`` naming the step, before the
        update) or "skip" (no rank applies the update; ``last_step_stats()["skipped"]``).
    measure_every: count communication bytes and saved activations (``last_step_stats()``)
        on step 2 and every measure_every-th step after (their hooks cost about 2x a
        small model's step on CPU); 1 measures every step.
    Returns a :class:`~autopar.recipe.ParallelizedModel`;
    ``train_step(idx (B, s), targets (B, s))`` takes the same global batch on every rank
    and returns the global mean loss.

    Raises ValueError (a plan made for another model: another config or traced graph,
    :func:`~autopar.recipe.check_plan_matches`; world size != tp·pp·dp, or an
    interleaved plan breaking
    :func:`~autopar.techniques.pipeline_schedules.interleaving_problem`, e.g. m % pp != 0: before any
    collective; a bad timeout, max_norm or on_nonfinite; a meta buffer the init rule does
    not set: before any collective; a parameter it leaves unset: on every rank),
    PlanError (a ValueError: a plan feature the runtime cannot run, named by its field, the
    same error and message as a plan file's), RuntimeError (no process
    group, an accelerator backend on a machine without one, or ranks disagree on the plan),
    ``autopar.verify.VerificationError`` (verify=True and the program is wrong).
    """
    from autopar import recipe as runtime

    if verify:
        from autopar.runtime.materialize import Initializer, on_meta
        from autopar.verify.check import verify as verify_plan

        if on_meta(model):  # the buffer rule's ValueError before agreed_plan's collectives
            Initializer.of(copy.deepcopy(model), seed, device="cpu", init_fn=init_fn)
        plan = runtime.agreed_plan(model, cluster, plan, global_batch_size=global_batch_size,
                                   seq_len=seq_len)
        verify_plan(model, plan, seed=seed, init_fn=init_fn)  # on copies, model untouched
    return runtime.parallelize(model, cluster, plan, optimizer=optimizer,
                               global_batch_size=global_batch_size, seq_len=seq_len, seed=seed,
                               timeout=timeout, max_norm=max_norm, on_nonfinite=on_nonfinite,
                               measure_every=measure_every, init_fn=init_fn)
