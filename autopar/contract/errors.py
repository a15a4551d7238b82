"""The one error type of the plan doors: a plan that cannot be read or run as it is."""

from __future__ import annotations

__all__ = ["PlanError", "REPLAN"]

REPLAN = "re-plan with `autopar plan ... -o FILE` (or `autopar evaluate`)"
"""The fix a plan error names when nothing narrower applies."""


class PlanError(ValueError):
    """A plan that cannot be read or run as it is: the message names the source (a file,
    or "plan" for one in memory), the field, what is wrong and the fix. A ValueError, so
    the CLI exits with 2. Raised by every door a plan passes: plan files
    (:func:`autopar.contract.plan_check.check_plan`), :func:`autopar.parallelize` and
    :func:`autopar.contract.support.check_executable`."""

    def __init__(self, source: str, field: str, problem: str, fix: str = REPLAN) -> None:
        super().__init__(f"{source}: plan field {field!r} {problem}; {fix}")
        self.source, self.field = source, field
