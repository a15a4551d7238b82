"""Expert parallelism on the MoE families of transformers: each tiny config (2 layers,
h = 64, 4 experts, top-2, s = 16, random weights) planned with ep = 2 and verified at world
size 4 against one process, for three layouts (ep folded over the data-parallel ranks):
dp4·ep2, tp2·dp2·ep2 (sequence parallelism) and pp2·dp2·ep2, fp32.

Run: ``python benchmarks/moe_expert_parallel.py [family ...]`` (about 1 minute per family and
layout on 2 CPU cores); prints one row per family and layout: the plan's predicted
all-to-all bytes per step (balanced routing, the planning assumption) and verify's outcome
(the largest gradient difference over 2 SGD steps, or the typed error that stopped it).
The multiprocess tier runs Mixtral's three layouts (tests/multiprocess/test_expert_parallel.py);
this script is the oracle over every family that runs its experts as one transformers
experts module.
"""

from __future__ import annotations

import sys

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "qwen2_moe")
"""Families whose experts are one ``use_experts_implementation`` module: one with shared
experts (qwen2_moe, deepseek_v3), one with multi-head latent attention (deepseek_v3), one
with expert biases and transposed weights (gpt_oss)."""

LAYOUTS = {
    "dp4·ep2": dict(tp=1, pp=1, dp=4),
    "tp2·dp2·ep2": dict(tp=2, pp=1, dp=2, sequence_parallel=True),
    "pp2·dp2·ep2": dict(tp=1, pp=2, dp=2),
}


def ep_plan(family: str, layout: str, dtype: str = "fp32"):
    """The tiny ``family`` model's plan of ``layout`` with ep = 2, priced by ``evaluate``."""
    import autopar
    from benchmarks.hf_families import build_family, tiny_cluster
    from benchmarks.model_zoo import TINY_SEQ

    fields = dict(LAYOUTS[layout], micro_batch_size=2, dtype=dtype, ep=2)
    return autopar.evaluate(build_family(family, device="meta"), tiny_cluster(4),
                            autopar.Layout(**fields), global_batch_size=8, seq_len=TINY_SEQ,
                            model_name=family)


def _verify_rank(rank: int, world: int, family: str, plan) -> dict:
    from autopar.verify.check import verify
    from benchmarks.hf_families import build_family

    return verify(build_family(family), plan, steps=2, raise_on_failure=False).to_dict()


def verify_row(family: str, layout: str) -> str:
    """One table row: family, layout, predicted all-to-all bytes, verify's outcome."""
    from autopar.runtime.launch import launch
    from benchmarks.model_zoo import _first_line

    try:
        plan = ep_plan(family, layout)
        a2a = f"{plan.predicted.comm_bytes_by_kind['ep_all_to_all']:.0f}"
        report = launch(_verify_rank, 4, family, plan, timeout_s=600, pg_timeout_s=120)[0]
        outcome = (f"ok ({report['max_grad_diff']:.1e})" if report["ok"] else
                   f"MISMATCH ({report['max_grad_diff']:.1e})")
    except Exception as exc:  # the row records the typed error that stopped the family
        a2a, outcome = "-", f"stopped: {type(exc).__name__}: {_first_line(exc)}"
    return f"| {family} | {layout} | {a2a} | {outcome} |"


def main(argv: list[str]) -> None:
    families = argv or list(FAMILIES)
    print("| family | layout | predicted ep_all_to_all B/step | verify (max grad diff) |")
    print("| :--- | :--- | ---: | :--- |")
    for family in families:
        for layout in LAYOUTS:
            print(verify_row(family, layout), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
    main(sys.argv[1:])
