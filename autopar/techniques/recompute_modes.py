"""Activation recompute modes, one record each: everything autopar knows about recomputing
a transformer layer's activations in its backward instead of keeping them (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sections 4-5).

A :class:`RecomputeMode` owns, for its value of ``Layout.recompute`` and of each entry of
``Plan.recompute`` (one per layer):

* **the rule**: which pipeline schedules refuse it is the schedule record's
  (``refused_recompute``); the mode itself runs on any layer;
* **the price**: what the backward recomputes (``recomputes``: nothing, the attention core
  or the whole layer), hence the bytes a layer keeps (:meth:`RecomputeMode.kept`) and the
  forward work it redoes (:meth:`RecomputeMode.recomputed`): read by predict, the CP-SAT
  model, the bounds, the exhaustive oracle and the closed forms;
* **the runner**: the pass of :mod:`autopar.rewrite.recompute` that applies it to a layer
  (``runner``: ``torch.utils.checkpoint`` around the layer or its attention core);
* **the drawing**: how the report names it (``title``);
* **the framework mapping**: per target framework, its value of that framework's
  recompute setting, or a :class:`~autopar.techniques.answers.Refusal`.

Pure Python: the planner, the rewrite, the report and the frameworks import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.techniques.answers import Refusal, framework_records, record_for

__all__ = ["RecomputeMode", "RECOMPUTE_MODE_RECORDS", "RECOMPUTED", "recompute_mode",
           "mode_recomputing", "recompute_mode_for", "recomputed_by",
           "framework_recompute_modes"]

RECOMPUTED = ("nothing", "attention_core", "layer")
"""What a mode's backward recomputes (:attr:`RecomputeMode.recomputes`)."""


@dataclass(frozen=True, kw_only=True)
class RecomputeMode:
    """One recompute mode (module docstring).

    name: the value of ``Layout.recompute``. title: as the report names it. source: the
    paper and section. recomputes: one of :data:`RECOMPUTED`. runner: the name of the
    per-layer pass in :mod:`autopar.rewrite.recompute`. frameworks: target -> its value of
    the framework's recompute setting (Megatron-LM ``--recompute-granularity``,
    torchtitan ``activation_checkpoint.mode``, DeepSpeed
    ``activation_checkpoint_interval``), or a :class:`Refusal`.
    """

    name: str
    title: str
    source: str
    recomputes: str
    runner: str
    frameworks: Mapping[str, str | Refusal]

    def __post_init__(self) -> None:
        if self.recomputes not in RECOMPUTED:
            raise ValueError(f"recompute mode {self.name!r}: recomputes {self.recomputes!r} "
                             f"is not one of {RECOMPUTED}")

    @property
    def recomputes_layer(self) -> bool:
        """The backward reruns the whole layer's forward from its checkpointed input."""
        return self.recomputes == "layer"

    def kept(self, layer: float, core: float, layer_input: float) -> float:
        """What a layer keeps for its backward, per micro-batch: every saved tensor
        (``layer``), all but the attention core's (``core``: its softmax, mask and
        dropout, 5as²b in Korthikanti et al. Table 2), or the layer's input alone
        (``layer_input``). Units: those of the arguments (bytes, or an expression)."""
        return {"nothing": layer, "attention_core": layer - core,
                "layer": layer_input}[self.recomputes]

    def recomputed(self, layer: float, core: float) -> float:
        """The forward work the backward redoes: none, the attention core's (``core``) or
        the layer's (``layer``). Units: those of the arguments (seconds, FLOPs)."""
        return {"nothing": 0 * layer, "attention_core": core, "layer": layer}[self.recomputes]


_SOURCE = "Korthikanti et al. 2022, sections 4-5 and Table 2"

RECOMPUTE_MODE_RECORDS: dict[str, RecomputeMode] = {r.name: r for r in (
    RecomputeMode(name="none", title="none (every activation kept)", source=_SOURCE,
                  recomputes="nothing", runner="keep_layer",
                  frameworks={"megatron": "none", "torchtitan": "none", "deepspeed": "0"}),
    RecomputeMode(name="selective", title="selective (the attention core recomputed)",
                  source=_SOURCE + "; Megatron-LM --recompute-granularity selective",
                  recomputes="attention_core", runner="checkpoint_attention_core",
                  frameworks={
                      "megatron": "selective",
                      "torchtitan": Refusal(
                          "torchtitan's selective activation checkpointing is op-level or "
                          "every k-th layer (selective_ac_option), which autopar does not "
                          "price; use none or full"),
                      "deepspeed": Refusal(
                          "DeepSpeed checkpoints whole layers (activation_checkpoint_"
                          "interval); it has no attention-core recompute: use none or full")}),
    RecomputeMode(name="full", title="full (the whole layer recomputed)",
                  source=_SOURCE + "; Chen et al. 2016, gradient checkpointing",
                  recomputes="layer", runner="checkpoint_layer",
                  frameworks={"megatron": "full", "torchtitan": "full", "deepspeed": "1"}),
)}
"""Every recompute mode autopar prices, by name."""


def recompute_mode(name: str) -> RecomputeMode:
    """The record of recompute mode ``name``; ValueError naming the modes there are."""
    if not isinstance(name, str) or name not in RECOMPUTE_MODE_RECORDS:
        raise ValueError(f"recompute must be one of {tuple(RECOMPUTE_MODE_RECORDS)}, got "
                         f"{name!r}")
    return RECOMPUTE_MODE_RECORDS[name]


def mode_recomputing(recomputes: str) -> RecomputeMode:
    """The mode whose backward recomputes ``recomputes`` (one of :data:`RECOMPUTED`)."""
    for record in RECOMPUTE_MODE_RECORDS.values():
        if record.recomputes == recomputes:
            return record
    raise ValueError(f"no recompute mode recomputes {recomputes!r}; one of {RECOMPUTED}")


def recompute_mode_for(target: str, setting: str,
                       setting_name: str = "recompute setting") -> RecomputeMode:
    """The mode ``target`` runs under its recompute ``setting`` (the inverse of
    ``frameworks``); ValueError, naming the framework's key ``setting_name``, with the
    refusal's reason for a mode it refuses, or naming the settings it has."""
    refused = RECOMPUTE_MODE_RECORDS.get(setting)
    if refused is not None and isinstance(refused.frameworks.get(target), Refusal):
        raise ValueError(f"{target} {setting_name} {setting!r}: "
                         f"{refused.frameworks[target].reason}")
    return record_for(RECOMPUTE_MODE_RECORDS.values(), target, setting, setting_name)


def recomputed_by(modes) -> dict[str, bool]:
    """For each of :data:`RECOMPUTED`, whether one of ``modes`` (names) recomputes it: what
    the planner's per-stage counts of recomputed layers may use."""
    records = [recompute_mode(m) for m in modes]
    return {what: any(r.recomputes == what for r in records) for what in RECOMPUTED}


def framework_recompute_modes(target: str) -> tuple[str, ...]:
    """The recompute modes ``target`` (one of FRAMEWORK_TARGETS) runs."""
    return tuple(r.name for r in framework_records(RECOMPUTE_MODE_RECORDS.values(), target))
