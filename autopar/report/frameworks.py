"""The report's "Run this plan with Megatron-LM, torchtitan or DeepSpeed" section.

For each framework, the configuration that runs the plan (:func:`autopar.frameworks.emit`)
when the plan is inside what the framework executes, else why not and the command that
plans for it (``--target``).
"""

from __future__ import annotations

from autopar.frameworks import FRAMEWORKS, emit, model_problem
from autopar.contract.plan import Plan

__all__ = ["frameworks_section"]

_NAMES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "deepspeed": "DeepSpeed"}
_LANG = {"megatron": "bash", "torchtitan": "toml", "deepspeed": "json"}
_WHAT = {"megatron": "`pretrain_gpt.py` flags", "torchtitan": "a job TOML",
         "deepspeed": "a config JSON"}


def _block(framework: str, text: str) -> list[str]:
    return ["", f"```{_LANG[framework]}", text.rstrip("\n"), "```", ""]


def frameworks_section(plan: Plan, framework_plans: dict[str, Plan | str] | None = None
                       ) -> list[str]:
    """Markdown lines: per framework, the configuration that runs ``plan`` in a code
    block; where the plan is outside the framework's space, why, then the plan searched
    for that framework (``framework_plans``: ``autopar.plan(..., target=)``, or why none)
    with its step time against this plan's and its configuration."""
    lines = ["## Run this plan with Megatron-LM, torchtitan or DeepSpeed", "",
             "`autopar plan ... --emit megatron|torchtitan|deepspeed` writes these; "
             "`--target` plans inside what one framework executes (README, \"Use autopar's "
             "plan with Megatron-LM / torchtitan / DeepSpeed\").", ""]
    framework_plans = framework_plans or {}
    for framework in FRAMEWORKS:
        name = _NAMES[framework]
        problem = model_problem(plan.model_config, framework)
        if problem:  # no layout helps: the framework would train another model
            lines += [f"- **{name}**: not this model: {problem}.", ""]
            continue
        try:
            lines += [f"- **{name}** ({_WHAT[framework]}):"] + _block(framework, emit(plan, framework))
            continue
        except ValueError as exc:
            lines += [f"- **{name}**: not this plan: {exc}."]
        other = framework_plans.get(framework)
        if isinstance(other, Plan):
            ratio = other.predicted.step_time_s / plan.predicted.step_time_s
            kernel = (f" (priced with {other.attention_kernel} attention, the kernel {name} "
                      f"runs in {other.dtype})"
                      if other.attention_kernel != plan.attention_kernel else "")
            lines += [f"  The best plan {name} runs (`--target {framework}`): "
                      f"`{other.headline()}`{kernel}, {ratio:.3f}× this plan's step time; "
                      f"{_WHAT[framework]}:"] + _block(framework, emit(other, framework))
        elif other is not None:
            lines += [f"  No plan for {name}: {other}", ""]
        else:
            lines += [""]
    return lines
