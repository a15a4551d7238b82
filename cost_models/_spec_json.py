"""Reading hardware specs from JSON-shaped dicts: exact keys, and numbers that may carry their
own source (``{"value": x, "source": "..."}``), folded into the spec's ``source``. Used by
:meth:`cost_models.hardware.Cluster.from_dict` for presets and user cluster files."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

NOTE_KEYS = frozenset({"description", "notes"})
"""Keys a spec dict may carry for humans only; they are accepted and not stored."""


def check_text(where: str, value: object, what: str) -> None:
    """ValueError unless ``value`` is a non-empty str (``what`` says what it names)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty str ({what}), got {value!r}")


def read_fields(where: str, d: object, names: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check ``d`` is a mapping with exactly the keys ``names`` (plus notes)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be a JSON object (dict), got {type(d).__name__}")
    unknown = sorted(set(d) - set(names) - NOTE_KEYS)
    if unknown:
        raise ValueError(
            f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; "
            f"expected {', '.join(names)}"
        )
    missing = [n for n in names if n not in d and n not in optional]
    if missing:
        raise ValueError(f"{where} is missing field(s) {', '.join(map(repr, missing))}")
    return {n: d[n] for n in names if n in d}


def unwrap(where: str, raw: object) -> tuple[Any, str | None]:
    """``x`` -> (x, None); ``{"value": x, "source": s}`` -> (x, s)."""
    if isinstance(raw, Mapping):
        fields = read_fields(where, raw, ("value", "source"))
        check_text(f"{where}.source", fields["source"], "where the number comes from")
        return fields["value"], fields["source"]
    return raw, None


def spec_from_dict(spec_cls: type, where: str, d: object) -> Any:
    """Build a DeviceSpec/LinkSpec, folding per-number sources into ``source``."""
    names = tuple(f.name for f in dataclasses.fields(spec_cls))
    optional = tuple(f.name for f in dataclasses.fields(spec_cls)
                     if f.default is not dataclasses.MISSING)
    fields = read_fields(where, d, names, optional=optional)
    kwargs: dict[str, Any] = {}
    notes = []
    for name in names:
        if name not in fields:
            continue
        if name in ("name", "source"):
            kwargs[name] = fields[name]
            continue
        kwargs[name], source = unwrap(f"{where}.{name}", fields[name])
        if source is not None:
            notes.append(f"{name}: {source}")
    if notes and isinstance(kwargs.get("source"), str):
        kwargs["source"] = f"{kwargs['source']} [{'; '.join(notes)}]"
    return spec_cls(**kwargs)
