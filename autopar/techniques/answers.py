"""What a technique's value is to each framework target: its name or setting there, or a
:class:`Refusal` saying why that framework does not run it. Every record (a pipeline
schedule, a ZeRO stage, a recompute mode) holds one answer per target in ``frameworks``;
the functions here read them the same way for every technique."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["FRAMEWORK_TARGETS", "Refusal", "framework_records", "record_for"]

FRAMEWORK_TARGETS = ("megatron", "torchtitan", "deepspeed")
"""The frameworks every record answers for (``autopar.targets.TARGETS``)."""


@dataclass(frozen=True)
class Refusal:
    """A framework cannot run this value of a technique; ``reason`` says why, naming what
    the framework runs instead."""

    reason: str


def framework_records(records: Iterable[Any], target: str) -> list[Any]:
    """The ``records`` framework ``target`` runs: those whose answer there is a name or
    setting, not a :class:`Refusal`. ValueError for a target not in FRAMEWORK_TARGETS."""
    if target not in FRAMEWORK_TARGETS:
        raise ValueError(f"unknown framework {target!r}; choose one of {FRAMEWORK_TARGETS}")
    return [r for r in records if isinstance(r.frameworks.get(target), str)]


def record_for(records: Iterable[Any], target: str, setting: str, technique: str) -> Any:
    """The record of ``records`` that framework ``target`` runs under ``setting`` (the
    inverse of ``frameworks``). ValueError naming the ``technique`` and the settings
    ``target`` has for the values autopar prices."""
    records = list(records)
    for record in records:
        if record.frameworks.get(target) == setting:
            return record
    settings = [r.frameworks[target] for r in framework_records(records, target)]
    raise ValueError(f"{target} {technique} {setting!r}: autopar prices {settings}")
