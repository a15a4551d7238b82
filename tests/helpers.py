"""Builders shared by the tests, imported as a plain module (`from helpers import ...`;
pyproject's ``pythonpath = ["tests"]`` puts this folder on sys.path for every tier).

The end-to-end GPT (4 layers, 4 heads, h = 32, V = 64, s = 16), its batches, optimisers and
single-process reference run, and a cluster on which communication is nearly free (so the
solver shards a tiny model). Spawned gloo ranks import this module too: keep everything
module-level and picklable, and import nothing from test files.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import torch

from autopar.models import GPT, GPTConfig
from cost_models.hardware import Cluster, LinkSpec

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """A script of the repository (``benchmarks/…``, ``examples/…``: not packages) imported
    as a module named after its file, registered in sys.modules (dataclasses look their
    module up there)."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=64, block_size=16)
BATCH, SEQ, STEPS = 8, 16, 3


def fast_cluster(world: int) -> Cluster:
    """``world`` A100s on one node joined by an ideal link (communication nearly free)."""
    a100 = Cluster.dgx_a100(1)
    fast = LinkSpec(name="ideal", bandwidth_gbps=1e6, latency_s=1e-12,
                    source="test: communication nearly free, so TP pays off on a tiny model")
    return Cluster(device=a100.device, gpus_per_node=world, nodes=1, intra_node=fast,
                   inter_node=fast, name="test", dtype="fp32", attention="flash")


def seeded_gpt(config: GPTConfig = CONFIG) -> GPT:
    """The test GPT, seeded; biases random too (zero biases would leave the key bias,
    whose gradient is exactly zero, at rounding noise that no relative test can compare)."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def batches(steps: int, config: GPTConfig = CONFIG, batch: int = BATCH, seq: int = SEQ,
            seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (input, target) token batches of shape (batch, seq), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, config.vocab_size, (batch, seq), generator=g),
             torch.randint(0, config.vocab_size, (batch, seq), generator=g)) for _ in range(steps)]


def optimizer(name: str):
    """The optimiser factory of the end-to-end tests: "sgd" (lr 0.5) or AdamW (lr 1e-2)."""
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=0.5)
    return functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def reference(opt: str, config: GPTConfig = CONFIG, steps: int = STEPS, seed: int = 1234,
              max_norm: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final state of ``seeded_gpt(config)`` trained ``steps`` steps in one
    process on ``batches(steps, config, seed=seed)``, the gradient clipped to ``max_norm``
    by ``torch.nn.utils.clip_grad_norm_`` when given."""
    losses, state, _ = reference_with_norms(opt, config, steps, seed, max_norm)
    return losses, state


def train_eagerly(model, optim, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` (returning (logits, loss)) one step per (idx, targets) of ``data`` with
    ``optim`` in this process: (losses, detached copy of the final state dict)."""
    losses = []
    for idx, tgt in data:
        _, loss = model(idx, tgt)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_with_norms(opt: str, config: GPTConfig = CONFIG, steps: int = STEPS,
                         seed: int = 1234, max_norm: float | None = None):
    """:func:`reference` and the gradient's global L2 norm before clipping at every step."""
    model = seeded_gpt(config)
    optim = optimizer(opt)(model.parameters())
    losses, norms = [], []
    for idx, tgt in batches(steps, config, seed=seed):
        _, loss = model(idx, tgt)
        optim.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              max_norm if max_norm is not None else math.inf)
        optim.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b's scale floored at 1e-12)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# The technique matrix: (tp, pp, dp) shapes at world size 4 and 8 (tests/multiprocess/test_matrix.py
# runs them; tests/unit/test_matrix_space.py checks they cover the runtime's declared space).
SHAPES_4 = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
SHAPES_8 = [(2, 2, 2)]


def combinations(tp: int, pp: int, dp: int, support=None) -> list[dict]:
    """Every executable combination for one shape, as Layout keyword dicts (fp32)."""
    from autopar.contract.support import RUNTIME_SUPPORT
    from autopar.techniques.pipeline_schedules import PIPELINE_SCHEDULES

    support = RUNTIME_SUPPORT if support is None else support
    mbs = 1 if pp > 1 else 2  # pp > 1: m = BATCH / (dp * mbs) >= pp micro-batches for 1F1B
    m = BATCH // (dp * mbs)
    # (schedule, v): v = 1 for GPipe/1F1B, interleaved with each v the solver's rule allows
    schedules = [(s, v) for s in (support.schedules if pp > 1 else ("1f1b",))
                 for v in support.virtual_stages_for(s, CONFIG.n_layer, pp, m)]
    zeros = support.zero_stages_for(pp, tp, dp) if dp > 1 else (0,)
    sps = support.sequence_parallel if tp > 1 else (False,)
    return [dict(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, schedule=s, virtual_stages=v,
                 zero_stage=z, recompute=r, sequence_parallel=sp, dtype="fp32")
            for (s, v), z, r, sp in itertools.product(schedules, zeros, support.recompute, sps)
            if r not in PIPELINE_SCHEDULES[s].refused_recompute]  # what composes


def pairwise(cases: list[dict], factors: tuple[str, ...], strength: int = 2) -> list[dict]:
    """A subset of ``cases`` in which every pair of values of two ``factors`` that occurs
    together in some case occurs together in a chosen one (all-pairs coverage; each
    single value too). ``strength=1``: only each single value (every value of every
    factor in some chosen case). Greedy and deterministic: repeatedly the first case that
    covers the most pairs not yet covered (Cohen et al. 1997, the AETG system's greedy
    step)."""
    def pairs(case: dict) -> set:
        items = [(f, case[f]) for f in factors]
        if strength == 1:
            return set(items)
        return {(a, b) for i, a in enumerate(items) for b in items[i + 1:]} | set(items)

    wanted = set().union(*(pairs(c) for c in cases))
    chosen: list[dict] = []
    while wanted:
        best = max(cases, key=lambda c: len(pairs(c) & wanted))
        chosen.append(best)
        wanted -= pairs(best)
    return chosen


MATRIX_FACTORS = ("schedule", "virtual_stages", "zero_stage", "recompute", "sequence_parallel")
"""The Layout fields the technique matrix varies per (tp, pp, dp) shape."""


# Dropout under parallelism (tests/unit/test_rng.py, tests/multiprocess/test_rng_gloo.py).
RNG_CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16, dropout=0.3)


def rng_gpt(symmetric_heads: bool = False) -> GPT:
    """The dropout test GPT. symmetric_heads: the Q/K/V weights of heads 2-3 copy heads 0-1, so
    both TP ranks of tp = 2 feed identical q, k, v to their attention core."""
    torch.manual_seed(0)
    model = GPT(RNG_CONFIG)
    if symmetric_heads:
        half = RNG_CONFIG.n_embd // 2
        with torch.no_grad():
            for block in model.transformer.h:
                for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                    lin.weight[half:] = lin.weight[:half]
                    lin.bias[half:] = lin.bias[:half]
    return model


# Interleaved 1F1B (tests/unit/test_interleaved_rules.py, tests/multiprocess/test_interleaved.py).
INTERLEAVED_LAYOUT = dict(tp=1, pp=2, dp=1, micro_batch_size=1, schedule="interleaved_1f1b",
                          virtual_stages=2, recompute="none", dtype="fp32")


def interleaved_plan(world: int = 2, **layout):
    """The solver's interleaved plan of the end-to-end GPT, INTERLEAVED_LAYOUT overridden by ``layout``."""
    import autopar

    with torch.device("meta"):
        meta = GPT(CONFIG)
    return autopar.plan(meta, fast_cluster(world), global_batch_size=BATCH, seq_len=SEQ,
                        layout=autopar.Layout(**{**INTERLEAVED_LAYOUT, **layout}))


# ZeRO-3 on shapes FSDP2 must pad (tests/unit/test_fsdp_units.py, tests/multiprocess/test_fsdp.py).
ODD = GPTConfig(n_layer=2, n_head=3, n_embd=30, vocab_size=65, block_size=17)


# gpt-tiny plans for `autopar verify` (tests/unit/test_verify_units.py, tests/multiprocess/test_verify.py).
TINY_BATCH, TINY_SEQ = 8, 16


def tiny_meta_gpt():
    """gpt-tiny (2 layers, 4 heads, h = 32, V = 64, s = 16) on the meta device."""
    from autopar.models import preset

    with torch.device("meta"):
        return GPT(preset("gpt-tiny"))


def tiny_plan(tp: int, pp: int, dp: int = 1, zero_stage: int = 0,
              sequence_parallel: bool | None = None):
    """A world tp*pp*dp fp32 plan of gpt-tiny; TP plans get Megatron's placements (real
    all-reduces), with sequence parallelism as pinned or, unset, as the solver chose."""
    import dataclasses

    import autopar
    from autopar.graph.capture import trace_model
    from autopar.planner.strategies.megatron import megatron_placements

    meta, cluster = tiny_meta_gpt(), Cluster.local_cpu(processes=tp * pp * dp)
    plan = autopar.plan(meta, cluster, global_batch_size=TINY_BATCH, seq_len=TINY_SEQ,
                        model_name="gpt-tiny",
                        layout=autopar.Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage,
                                              sequence_parallel=sequence_parallel))
    if tp > 1:
        placements = megatron_placements(trace_model(meta, TINY_SEQ), tp,
                                         sequence_parallel=plan.sequence_parallel)
        plan = autopar.evaluate_plan(meta, cluster, dataclasses.replace(plan, placements=placements))
    assert plan.dtype == "fp32"
    return plan


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``autopar.cli.main(argv)`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from autopar import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def refused_load(pm, path, error: type[BaseException]) -> tuple[str | None, bool]:
    """``pm.load_checkpoint(path)`` expected to raise ``error`` (collective: every rank
    calls it): (the message, None if it loaded; whether every parameter is as it was)."""
    before = pm.full_state_dict()
    try:
        pm.load_checkpoint(path)
        message = None
    except error as exc:
        message = str(exc)
    after = pm.full_state_dict()
    return message, all(torch.equal(before[k], after[k]) for k in before)


def runtime_class(dotted: str):
    """The class ``dotted`` names (``autopar.runtime.zero.DistributedOptimizer``), or None
    when it is not an attribute of a module under ``autopar.runtime`` (a record's runner)."""
    import importlib

    module, _, name = dotted.rpartition(".")
    if not module.startswith("autopar.runtime"):
        return None
    runner = getattr(importlib.import_module(module), name, None)
    return runner if isinstance(runner, type) else None


def framework_answer_gaps(record) -> list[str]:
    """"framework: no answer for T" for each framework target T a technique record
    (``autopar.techniques``) has neither a name nor a reasoned Refusal for."""
    from autopar.techniques.answers import FRAMEWORK_TARGETS, Refusal

    return [f"framework: no answer for {target}" for target in FRAMEWORK_TARGETS
            if not (isinstance(answer := record.frameworks.get(target), str) and answer
                    or isinstance(answer, Refusal) and answer.reason)]
