"""``autopar dryrun PLAN.json``: build ranks of a saved plan at its full size on this CPU
and compare what one step does with the plan's prediction (:mod:`autopar.verify.dry_run`).

The model is rebuilt from the plan's model name (or ``--model``) on the meta device, so a
175B plan costs no memory for weights; each rank runs in this process on a fake process
group with fake tensors. The flags are :mod:`autopar.cli.parser`'s.

Exit codes (those of :mod:`autopar.cli.commands`, plus one): 0 every rank agrees with
the prediction · 7 a rank cannot be built or stepped at the plan's size, or disagrees with
the prediction (:data:`EXIT_DRY_RUN_FAILED`; the message names the rank and the op or the
figure) · 2 bad input (missing plan file, a model the plan was not made for) · 1 internal
error.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["run_dry_run", "EXIT_DRY_RUN_FAILED"]

EXIT_OK, EXIT_DRY_RUN_FAILED = 0, 7  # 5 is verify's, 6 the solver's time limit


def _ranks(text: str | None, plan) -> list[int] | None:
    """``--rank`` as a list: "3" or "0,517,1023"; None (every rank class) when absent."""
    if text is None:
        return None
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rank takes ranks separated by commas (e.g. 0,517), got {text!r}") \
            from None
    bad = [r for r in ranks if not 0 <= r < plan.num_gpus]
    if not ranks or bad:
        raise ValueError(f"--rank {text!r}: every rank must be in [0, {plan.num_gpus}) for this "
                         "plan's world")
    return ranks


def run_dry_run(args: argparse.Namespace) -> int:
    """``autopar dryrun``: read the plan, build the model on meta, dry-run the ranks, print
    the table (or JSON); the exit code. Raises ValueError for bad input (exit 2)."""
    import autopar
    from autopar.contract.plan_check import read_plan
    from autopar.verify.dry_run import DryRunError, dry_run

    plan = read_plan(args.plan_file, executable=True)
    ranks = _ranks(args.rank, plan)
    model, _ = autopar.load_model(args.model or plan.model)
    try:
        report = dry_run(model, plan, ranks=ranks)
    except DryRunError as exc:
        print(f"autopar dryrun: FAILED: {exc}", file=sys.stderr)
        return EXIT_DRY_RUN_FAILED
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return EXIT_OK if report.ok else EXIT_DRY_RUN_FAILED
