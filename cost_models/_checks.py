"""Argument checks shared by the cost models.

Every public function of ``cost_models`` validates its inputs with these helpers,
so a bad value fails early with a message that names the argument, the value and
what was expected ("group_size must be a positive int, got 0"), never a silent
zero or a ``nan`` further down.
"""

from __future__ import annotations

import math
from typing import Iterable

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation modes: keep everything, recompute only the attention
core (Korthikanti et al. 2022, "selective"), or recompute whole layers ("full")."""


def is_number(value: object) -> bool:
    """True for a finite int or float (bools are not numbers here)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def check_non_negative(name: str, value: object) -> float:
    """Return ``value`` as a float; ValueError unless it is a finite number >= 0."""
    if not is_number(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """Return ``value`` as a float; ValueError unless it is a finite number > 0."""
    if not is_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_positive_int(name: str, value: object) -> int:
    """Return ``value``; ValueError unless it is an int >= 1 (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """Return ``value``; ValueError listing ``choices`` unless it is one of them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}"
        )
    return value  # type: ignore[return-value]
