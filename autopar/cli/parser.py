"""The ``autopar`` argument parser: the seven verbs (plan, evaluate, compare, report,
calibrate, verify, dryrun), their flags and their --help texts.

Flag names are shared across verbs: ``--model``, ``--cluster``, ``--nodes``,
``--global-batch-size``, ``--seq-len`` (what to train, and where) on ``plan``,
``evaluate`` and ``compare``; ``--megatron`` for hand layouts; ``--json`` and
``--debug`` on every verb. Each verb's help ends with runnable examples and the exit codes.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

from autopar.frameworks.targets import FRAMEWORKS, TARGETS
from autopar.contract.plan import DTYPES, RECOMPUTE_MODES, SCHEDULES
from autopar.planner.search import DEFAULT_TIME_LIMIT_S
from autopar.cli.help_texts import DESCRIPTIONS, EXAMPLES, EXIT_CODES_HELP, OVERVIEW_EXAMPLES
from cost_models.hardware import PRESET_NAMES

TARGET_NAMES = tuple(TARGETS)

__all__ = ["build_parser", "EXIT_CODES_HELP"]

def _wrap(text: str) -> str:
    """A paragraph wrapped for the raw-description help formatter."""
    return textwrap.fill(text, width=88, break_on_hyphens=False)


def _epilog(verb: str) -> str:
    """The examples of ``verb`` and the exit codes."""
    return f"examples:\n{EXAMPLES[verb]}\n\n{EXIT_CODES_HELP}"


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _add_problem_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Model, cluster and batch flags shared by ``plan``, ``evaluate`` and ``compare``
    (``required`` False: ``compare`` may take the model and batch from --megatron-args)."""
    g = parser.add_argument_group("what to train, and where")
    g.add_argument("--model", required=required, metavar="SPEC",
                   help="a preset name (gpt-tiny, gpt2-124m, gpt-1.3b, gpt-8.3b, gpt3-175b, "
                        "gpt-1t); 'hf:CONFIG', a Hugging Face causal LM from a config.json "
                        "path, a published shape (hf:gpt2, hf:gpt2-medium, hf:gpt2-large, "
                        "hf:gpt2-xl, hf:llama3-8b, hf:llama3-70b) or an architecture's "
                        "defaults (hf:llama, hf:mistral, hf:qwen2 ...); or 'module:factory', "
                        "a function returning an nn.Module; the model is built on the meta "
                        "device, never materialised")
    g.add_argument("--cluster", default="dgx-a100", metavar="NAME|FILE",
                   help=f"a cluster preset ({', '.join(PRESET_NAMES)}) or a cluster JSON file "
                        "as written by Cluster.to_json_file or `autopar calibrate` "
                        "(default: dgx-a100)")
    g.add_argument("--nodes", type=_positive_int, default=None, metavar="N",
                   help="number of nodes (default: 1 for a preset, the file's value for a file)")
    g.add_argument("--global-batch-size", type=_positive_int, required=required, metavar="B",
                   help="sequences per optimizer step, B = d · b · m")
    g.add_argument("--seq-len", type=_positive_int, default=None, metavar="S",
                   help="tokens per sequence (default and maximum: the model's block_size, "
                        "n_positions or max_position_embeddings)")
    g.add_argument("--memory-headroom", type=_non_negative_float, default=None, metavar="GIB",
                   help="GiB per GPU to keep free on top of the memory reserve (CUDA context, "
                        "NCCL buffers, the step's temporaries, allocator fragmentation: the "
                        "cluster's memory_reserve); plans must fit in what is left (default: "
                        "the cluster file's memory_headroom_gib, 0 for a preset)")
    g.add_argument("--time-limit", type=_positive_float, default=DEFAULT_TIME_LIMIT_S,
                   metavar="S", help="CP-SAT's deterministic time limit per config, seconds "
                   f"(default {DEFAULT_TIME_LIMIT_S:g}); a plan found at the limit is marked "
                   "FEASIBLE with its gap, none found at all is exit code 6")


def _add_layout_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The layout flags; for ``plan`` each one fixes that decision and the solver picks the rest."""
    title = "layout (tp, pp, dp and micro-batch size required)" if required else \
        "layout (optional: each flag fixes one decision, the solver chooses the rest)"
    g = parser.add_argument_group(title)
    g.add_argument("--tp", type=_positive_int, required=required, metavar="T",
                   help="tensor-parallel size t (must divide the head count and GPUs per node)")
    g.add_argument("--pp", type=_positive_int, required=required, metavar="P",
                   help="pipeline-parallel size p (number of stages)")
    g.add_argument("--dp", type=_positive_int, required=required, metavar="D",
                   help="data-parallel size d; t · c · p · d must equal the number of GPUs")
    g.add_argument("--cp", type=_positive_int, default=None, metavar="C",
                   help="context-parallel size c: each sequence's tokens split over c ranks "
                        "(2c must divide the sequence length; default: the solver's, or 1 "
                        "for a hand layout)")
    g.add_argument("--ep", type=_positive_int, default=None, metavar="E",
                   help="expert-parallel size: each MoE layer's experts over ep of the d "
                        "data-parallel ranks (ep divides d and the expert count)")
    g.add_argument("--micro-batch-size", "--mbs", dest="micro_batch_size", type=_positive_int,
                   required=required, metavar="b", help="sequences per micro-batch b")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage: 0 plain DP, 1 shards optimizer states, 2 also gradients, "
                        "3 also parameters")
    g.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="activation recomputation on every layer: none, selective (attention "
                        "core only, Megatron-3) or full (keep only each layer's input)")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (interleaved_1f1b needs --virtual-stages > 1)")
    g.add_argument("--virtual-stages", type=_positive_int, default=None, metavar="V",
                   help="model chunks per pipeline rank for the interleaved schedule")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron-3 sequence parallelism in the non-tensor-parallel regions")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="training precision: bf16 (bf16 compute, fp32 master weights) or fp32 "
                        "(default: the cluster's)")


def _add_megatron(group, extra: str = "") -> None:
    """``--megatron FLAGS`` (alias ``--hand-layout``), repeatable."""
    group.add_argument("--megatron", "--hand-layout", dest="megatron", action="append",
                       default=[], metavar="FLAGS",
                       help="a hand-written layout priced with the same cost model and shown "
                            "beside the plan, e.g. \"tp=8,pp=16,dp=8,mbs=1,recompute=full\"; "
                            "repeat for several" + extra)


def _add_common(group, json_help: str) -> None:
    """``--json`` and ``--debug``, on every verb."""
    group.add_argument("--json", action="store_true", help=json_help)
    group.add_argument("--debug", action="store_true",
                       help="show the traceback of an error instead of one line")


def _add_output_args(parser: argparse.ArgumentParser, *, search: bool) -> None:
    """Output flags of ``plan`` (search=True) and ``evaluate``."""
    g = parser.add_argument_group("output")
    _add_common(g, "print the plan as JSON on stdout (Plan.to_json, readable by `autopar "
                   "report`); messages go to stderr and no progress is drawn")
    g.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="also save the plan as JSON to FILE (read it back with `autopar report`)")
    g.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="write DIR/report.md, a self-contained DIR/report.html and PNG charts: "
                        "the plan, its predicted time and memory, why it was chosen, hand "
                        "layouts side by side")
    if search:
        g.add_argument("--no-whatif", dest="whatif", action="store_false",
                       help="with --report, skip the what-ifs (they re-run the search three "
                            "times: twice the nodes, H100 nodes, twice the global batch)")
        _add_megatron(g, ". With --report and no --megatron, GPT-3 175B on DGX A100 is "
                         "compared with the published Megatron-LM layout")


def _verb(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand with its description, examples and exit codes."""
    return sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter,
                          help=help_text, description=_wrap(DESCRIPTIONS[name]),
                          epilog=_epilog(name))


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser with its seven verbs."""
    parser = argparse.ArgumentParser(
        prog="autopar", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap(DESCRIPTIONS["autopar"]),
        epilog=f"examples (`autopar VERB --help` for more):\n{OVERVIEW_EXAMPLES}\n\n"
               f"{EXIT_CODES_HELP}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")

    plan = _verb(sub, "plan", "search for the fastest layout that fits")
    _add_problem_args(plan)
    _add_layout_args(plan, required=False)
    _add_output_args(plan, search=True)
    g = plan.add_argument_group("frameworks (Megatron-LM, torchtitan, DeepSpeed)")
    g.add_argument("--target", choices=TARGET_NAMES, default=None,
                   help="search only plans that runner executes (default: the --emit "
                        "framework, else autopar's own runtime): e.g. megatron recomputes "
                        "the first k layers of every stage, deepspeed has no TP or interleaving")
    g.add_argument("--emit", choices=FRAMEWORKS, default=None,
                   help="write the plan as that framework's configuration: Megatron-LM "
                        "pretrain_gpt.py flags, a torchtitan job TOML or a DeepSpeed config JSON")
    g.add_argument("--emit-to", type=Path, default=None, metavar="FILE",
                   help="write the --emit configuration to FILE (default: print it; needed "
                        "with --json)")

    evaluate = _verb(sub, "evaluate", "price one fixed layout")
    _add_problem_args(evaluate)
    _add_layout_args(evaluate, required=True)
    _add_output_args(evaluate, search=False)

    cmp = _verb(sub, "compare", "the auto plan beside hand layouts, and where they differ")
    _add_problem_args(cmp, required=False)
    g = cmp.add_argument_group("hand layouts and output")
    _add_megatron(g, " (default: the published Megatron-LM layout where one is known)")
    g.add_argument("--megatron-args", action="append", default=[], metavar="FILE_OR_FLAGS",
                   help="a Megatron-LM launch: its pretrain_gpt.py flags, or a file holding "
                        "them (a launch script with its variables substituted); priced as "
                        "written (stages, recompute method, virtual stages, SP, distributed "
                        "optimizer) and shown beside the plan; it also gives --model (its "
                        "shape), --global-batch-size and --seq-len when those are not given; "
                        "the flags it does not price are listed. Repeat for several")
    _add_common(g, "print the comparison as JSON on stdout; no progress is drawn")

    report = _verb(sub, "report", "write the report of a saved plan, without solving")
    report.add_argument("plan_file", type=Path, metavar="PLAN.json", help="the saved plan")
    g = report.add_argument_group("output")
    g.add_argument("--out", "--report", dest="out", type=Path, required=True, metavar="DIR",
                   help="directory for report.md, report.html and the PNG charts")
    _add_megatron(g, " (rebuilds the model from the plan's model name on the meta device "
                     "and the cluster from the plan)")
    _add_common(g, "print the written files and the plan's headline numbers as JSON")

    cal = _verb(sub, "calibrate", "measure this machine's CPU profile")
    g = cal.add_argument_group("measurement and output")
    g.add_argument("--processes", type=_positive_int, default=4, metavar="N",
                   help="local processes to measure collectives across, at least 2 (default: 4)")
    g.add_argument("--out", type=Path, default=Path("local-cpu-calibrated.json"),
                   metavar="FILE", help="where to write the measured cluster JSON "
                   "(default: local-cpu-calibrated.json)")
    _add_common(g, "print the measured profile as JSON on stdout")

    verify = _verb(sub, "verify", "run a saved plan on local processes and compare it "
                                  "with one device")
    _add_verify_args(verify)

    dry = _verb(sub, "dryrun", "build ranks of a saved plan at full size on this CPU and "
                               "check them against the prediction")
    dry.add_argument("plan_file", type=Path, metavar="PLAN.json",
                     help="a plan saved by `autopar plan -o`")
    g = dry.add_argument_group("ranks, model and output")
    g.add_argument("--rank", default=None, metavar="R[,R...]",
                   help="the ranks to build (default: one per pipeline stage)")
    g.add_argument("--model", default=None, metavar="SPEC",
                   help="preset name, hf:CONFIG or module:factory; default: the plan's model")
    _add_common(g, "print the ranks' figures as JSON")
    return parser


def _add_verify_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``verify`` (run by :func:`autopar.cli.verify.run_verify`)."""
    parser.add_argument("plan_file", type=Path, metavar="PLAN.json",
                        help="a plan saved by `autopar plan -o`")
    g = parser.add_argument_group("model, steps and tolerance")
    g.add_argument("--model", default=None, metavar="SPEC",
                   help="preset name (gpt-tiny ...), hf:CONFIG or module:factory; default: "
                        "the plan's model")
    g.add_argument("--steps", type=_positive_int, default=3, metavar="N",
                   help="training steps (default 3)")
    g.add_argument("--seed", type=int, default=0, help="model init and batch seed (default 0)")
    g.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    g.add_argument("--tolerance", type=_positive_float, default=None, metavar="REL",
                   help="relative tolerance for loss, gradients and parameters (default: 1e-5 "
                        "for fp32 plans; bf16: 2e-2, gradients 5e-2)")
    g = parser.add_argument_group("processes and output")
    g.add_argument("--max-processes", type=_positive_int, default=8, metavar="N",
                   help="refuse plans needing more local processes than this (default 8)")
    g.add_argument("--timeout", type=_positive_float, default=600, metavar="S",
                   help="seconds before the local processes are killed (default 600)")
    _add_common(g, "print the report as JSON")
