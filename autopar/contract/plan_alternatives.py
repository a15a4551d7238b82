"""The configurations a search visited besides the one it chose: :class:`Alternative`, one
per config, as the search records it and ``Plan.alternatives`` lists it (the report's "Best
alternatives the search priced")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["Alternative"]


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """One config the search visited, and what became of it.

    layout: the config's fields as saved (tp, pp, dp, micro_batch_size, num_micro_batches,
        schedule, virtual_stages, dtype, attention, sequence_parallel, grad_dtype; ep and cp
        when above 1; a search's own records hold dp = c·d, a plan's d).
    feasible: True when priced (it fits), False when proven not to fit (by CP-SAT or a
        memory lower bound), None when not priced (a step-time lower bound no better than
        the best, or cut off by it).
    step_time_s: its predicted step time in seconds; None unless priced.
    reason: why it lost, or why it was not priced ("" for a priced runner-up of the
        search's own order; "slower"; "slower (not proven optimal: ...)"; the bound).
    tflops_per_gpu: its predicted model TFLOP/s per GPU; None unless priced.
    peak_memory_bytes: its predicted peak bytes per GPU; None unless priced.
    min_memory_bytes: the memory lower bound (bytes per GPU) that pruned it, else None.
    """

    layout: dict
    feasible: bool | None
    step_time_s: float | None = None
    reason: str = ""
    tflops_per_gpu: float | None = None
    peak_memory_bytes: float | None = None
    min_memory_bytes: float | None = None

    def __post_init__(self) -> None:  # ep = 1 and cp = 1 are left out, as in plans
        if self.layout.get("ep") == 1 or self.layout.get("cp") == 1:
            object.__setattr__(self, "layout", {k: v for k, v in self.layout.items()
                                                if k not in ("ep", "cp") or v != 1})

    @property
    def priced(self) -> bool:
        """True when the search priced a plan of this config (a positive step time)."""
        return self.feasible is True and bool(self.step_time_s and self.step_time_s > 0)

    def to_dict(self) -> dict:
        """As a plan file saves it: ``layout``, ``feasible``, ``step_time_s`` and ``reason``
        always, the numbers only when known."""
        return {k: v for k, v in asdict(self).items()
                if v is not None or k in ("feasible", "step_time_s")}

    @classmethod
    def from_dict(cls, data: dict) -> Alternative:
        """:meth:`to_dict` data read back (a plan file's entry, checked by
        :mod:`autopar.contract.plan_check`); a missing ``feasible`` reads as True (plans
        saved before autopar recorded it listed priced configs only)."""
        names = {f.name for f in fields(cls)}
        return cls(**{"feasible": True, **{k: v for k, v in data.items() if k in names}})
