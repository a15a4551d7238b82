"""Command line: ``autopar plan``, ``evaluate``, ``report``, ``compare`` and ``calibrate``.

argparse turns flags into the plain calls of the library (``autopar.load_model``,
``Cluster.from_name``, ``autopar.plan`` / ``autopar.evaluate``, ``report.write_report``);
nothing here decides anything the library would not. ``compare`` prints the solver's plan
beside hand-written layouts (views in :mod:`autopar.cli_compare`); ``calibrate`` measures
the local CPU profile with ``autopar.calibrate.calibrate_local``.

Exit codes: 0 success · 2 bad input (a flag, a model or cluster name, a layout that breaks
a divisibility rule) · 3 no layout fits (``autopar.InfeasibleError``) · 4 the model cannot
be traced (``autopar.TraceError``) · 1 anything else (a bug: please report it). Errors
print one line on stderr; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import traceback
from pathlib import Path

import autopar
from autopar.cli_verify import add_verify_parser, run_verify
from autopar.cli_compare import (compare, comparison_lines, format_compare, plan_table,
                                 profile_lines)
from autopar.plan import RECOMPUTE_MODES, SCHEDULES, Layout, Plan
from autopar.report import write_report
from cost_models.hardware import PRESET_NAMES, Cluster

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_TRACE = 0, 1, 2, 3, 4
# Narayanan et al. 2021 (Table 1): GPT-3 175B on 1024 A100 GPUs, t=8, p=16, d=8, b=1.
MEGATRON_GPT3 = "tp=8,pp=16,dp={dp},mbs=1,recompute=full"

EPILOG = """\
examples:
  autopar plan --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 --report reports/gpt3
  autopar plan --model gpt-1.3b --cluster dgx-h100 --nodes 4 --global-batch-size 512 --tp 2 --json
  autopar evaluate --model gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch-size 1536 \\
      --tp 8 --pp 16 --dp 8 --micro-batch-size 1 --recompute full
  autopar report plan.json --out reports/again
  autopar compare --model gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch-size 1536 \\
      --seq-len 2048 --megatron "tp=8,pp=16,dp=8,mbs=1,recompute=full"
  autopar calibrate --processes 4 --out local-cpu.json

exit codes: 0 ok, 2 bad input, 3 no layout fits the cluster, 4 model cannot be traced,
1 internal error.
"""


def _wrap(text: str) -> str:
    """A paragraph wrapped for the raw-description help formatter."""
    return textwrap.fill(text, width=88, break_on_hyphens=False)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_problem_args(parser: argparse.ArgumentParser) -> None:
    """Model, cluster and batch flags shared by ``plan`` and ``evaluate``."""
    g = parser.add_argument_group("what to train, and where")
    g.add_argument("--model", required=True, metavar="SPEC",
                   help="a preset name (gpt-tiny, gpt2-124m, gpt-1.3b, gpt-8.3b, gpt3-175b, "
                        "gpt-1t ...) or 'module:factory', a function returning an nn.Module; "
                        "the model is built on the meta device, never materialised")
    g.add_argument("--cluster", default="dgx-a100", metavar="NAME|FILE",
                   help=f"a cluster preset ({', '.join(PRESET_NAMES)}) or a cluster JSON file "
                        "as written by Cluster.to_json_file (default: dgx-a100)")
    g.add_argument("--nodes", type=_positive_int, default=None, metavar="N",
                   help="number of nodes (default: 1 for a preset, the file's value for a file)")
    g.add_argument("--global-batch-size", type=_positive_int, required=True, metavar="B",
                   help="sequences per optimizer step, B = d · b · m")
    g.add_argument("--seq-len", type=_positive_int, default=None, metavar="S",
                   help="tokens per sequence (default: the model's block_size)")


def _add_layout_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The layout flags; for ``plan`` each one fixes that decision and the solver picks the rest."""
    title = "layout (all four sizes required)" if required else \
        "layout (optional: each flag fixes one decision, the solver chooses the rest)"
    g = parser.add_argument_group(title)
    g.add_argument("--tp", type=_positive_int, required=required, metavar="T",
                   help="tensor-parallel size t (must divide the head count and GPUs per node)")
    g.add_argument("--pp", type=_positive_int, required=required, metavar="P",
                   help="pipeline-parallel size p (number of stages)")
    g.add_argument("--dp", type=_positive_int, required=required, metavar="D",
                   help="data-parallel size d; t · p · d must equal the number of GPUs")
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


def _add_output_args(parser: argparse.ArgumentParser, *, hand: bool = True) -> None:
    """Output flags: JSON, saved plan, report directory, hand layouts to compare, --debug."""
    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help="print the plan as JSON on stdout (messages go to stderr)")
    g.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="also save the plan as JSON to FILE (read it back with `autopar report`)")
    g.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="write DIR/report.md, DIR/report.html and PNG charts: the plan, its predicted "
                        "time and memory, why it was chosen, hand layouts side by side")
    if hand:
        g.add_argument("--megatron", "--hand-layout", dest="megatron", action="append",
                       default=[], metavar="FLAGS",
                       help="a hand-written layout to price with the same cost model and show "
                            "beside the plan, e.g. \"tp=8,pp=16,dp=8,mbs=1,recompute=full\"; "
                            "repeat for several. With --report and no --megatron, GPT-3 175B on "
                            "DGX A100 is compared with the published Megatron-LM layout")
    g.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser with its three subcommands."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="autopar", formatter_class=fmt, epilog=EPILOG,
        description=_wrap("Plan tensor, pipeline and data parallel training of a GPT on a GPU "
                    "cluster, price hand-written layouts with the same cost model, and "
                    "explain the choice in a Markdown report."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser(
        "plan", formatter_class=fmt, epilog=EPILOG, help="search for the fastest layout that fits",
        description=_wrap("Search the layouts (t, p, d, b, m, schedule, ZeRO, recompute per layer) "
                    "that fit the cluster's memory and print the fastest, as predicted by the "
                    "cost model. Layout flags fix decisions; the solver chooses the rest."))
    _add_problem_args(plan)
    _add_layout_args(plan, required=False)
    _add_output_args(plan)
    evaluate = sub.add_parser(
        "evaluate", formatter_class=fmt, epilog=EPILOG, help="price one fixed layout",
        description=_wrap("Price one fully specified layout with the same cost model the planner "
                    "uses: step time, TFLOP/s per GPU, MFU, memory per stage."))
    _add_problem_args(evaluate)
    _add_layout_args(evaluate, required=True)
    _add_output_args(evaluate, hand=False)
    report = sub.add_parser(
        "report", formatter_class=fmt, help="write the report of a saved plan JSON",
        description=_wrap("Read a plan saved with --output (or --json) and write its report "
                    "without solving again."))
    report.add_argument("plan_file", type=Path, metavar="PLAN.json", help="the saved plan")
    report.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="directory for report.md")
    report.add_argument("--megatron", "--hand-layout", dest="megatron", action="append",
                        default=[], metavar="FLAGS",
                        help="hand layouts to price beside the plan (rebuilds the model from "
                             "the plan's model name and the cluster from the plan)")
    report.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    _add_compare_parsers(sub, fmt)
    add_verify_parser(sub)
    return parser


def _add_compare_parsers(sub, fmt) -> None:
    """The ``compare`` and ``calibrate`` subcommands."""
    cmp = sub.add_parser(
        "compare", formatter_class=fmt, epilog=EPILOG,
        help="the auto plan beside hand layouts, and where the difference comes from",
        description=_wrap("Solve for the auto plan, price each --megatron layout with the same "
                          "cost model, and print them side by side: step time, TFLOP/s per "
                          "GPU, MFU, peak memory per stage, the auto/hand ratio, and the "
                          "difference per kind of time (bubble, tp_comm, dp_comm, recompute, "
                          "compute ...)."))
    _add_problem_args(cmp)
    g = cmp.add_argument_group("hand layouts and output")
    g.add_argument("--megatron", "--hand-layout", dest="megatron", action="append", default=[],
                   metavar="FLAGS", help="a hand layout, e.g. \"tp=8,pp=16,dp=8,mbs=1,"
                   "recompute=full\"; repeat for several (default: the published Megatron-LM "
                   "layout where one is known)")
    g.add_argument("--json", action="store_true", help="print the comparison as JSON")
    g.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    cal = sub.add_parser(
        "calibrate", formatter_class=fmt, help="measure this machine's CPU profile",
        description=_wrap("Run small matmuls and gloo collectives on local processes and "
                          "write a cluster JSON usable with --cluster (calls "
                          "autopar.calibrate.calibrate_local)."))
    cal.add_argument("--processes", type=_positive_int, default=4, metavar="N",
                     help="local processes to measure collectives across (default: 4)")
    cal.add_argument("--out", type=Path, default=Path("local-cpu-calibrated.json"),
                     metavar="FILE", help="where to write the measured cluster JSON")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    cal.add_argument("--debug", action="store_true", help="show tracebacks of errors")


# ------------------------------------------------------------------ building blocks
def load_cluster(name: str, nodes: int | None) -> Cluster:
    """A preset by name, or a cluster JSON file; ``nodes`` overrides the node count."""
    path = Path(name)
    if name.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"cluster file {name} does not exist")
        cluster = Cluster.from_json_file(path)
        if nodes is not None:
            cluster = dataclasses.replace(cluster, nodes=nodes)
        return cluster
    return Cluster.from_name(name, nodes or 1)


def _load_problem(args: argparse.Namespace):
    """(model on meta, model name, cluster, seq_len) from the problem flags."""
    cluster = load_cluster(args.cluster, args.nodes)  # before the model: cheap checks first
    model, name = autopar.load_model(args.model)
    seq_len = args.seq_len or getattr(getattr(model, "config", None), "block_size", None)
    if seq_len is None:
        raise ValueError(f"--seq-len is required: model {name!r} has no config.block_size")
    return model, name, cluster, seq_len


def _layout(args: argparse.Namespace) -> Layout:
    """The Layout of the layout flags (None where a flag was not given)."""
    return Layout(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch_size=args.micro_batch_size,
                  zero_stage=args.zero_stage, recompute=args.recompute, schedule=args.schedule,
                  virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel)


def default_hand_layouts(model_name: str, cluster: Cluster) -> dict[str, Layout]:
    """Published layouts for well-known setups: Megatron-LM's GPT-3 175B on DGX A100."""
    if model_name == "gpt3-175b" and cluster.name == "dgx-a100" and cluster.num_gpus % 128 == 0:
        text = MEGATRON_GPT3.format(dp=cluster.num_gpus // 128)
        return {f"Megatron-LM `{text}` (Narayanan et al. 2021)": Layout.parse(text)}
    return {}


def price_hand_layouts(layouts: dict[str, Layout], model, cluster: Cluster, *,
                       global_batch_size: int, seq_len: int,
                       model_name: str) -> dict[str, Plan | str]:
    """``autopar.evaluate`` each layout; one that cannot fit keeps its error message instead."""
    priced: dict[str, Plan | str] = {}
    for name, layout in layouts.items():
        try:
            priced[name] = autopar.evaluate(model, cluster, layout, model_name=model_name,
                                            global_batch_size=global_batch_size, seq_len=seq_len)
        except autopar.InfeasibleError as exc:
            priced[name] = f"infeasible: {exc}"
    return priced


def _emit(plan: Plan, args: argparse.Namespace, hand: dict[str, Plan | str]) -> None:
    """Print the plan (text or JSON), save it and write the report as the flags ask."""
    info = sys.stderr if args.json else sys.stdout
    if args.json:
        print(plan.to_json())
    else:
        print(plan.summary())
        print(plan_table(plan))
        if hand:
            print("compared with hand-written layouts:")
            print("\n".join(comparison_lines(plan, hand)))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(plan.to_json() + "\n", encoding="utf-8")
        print(f"plan saved to {args.output}", file=info)
    if args.report:
        path = write_report(plan, args.report, hand_layouts=hand or None)
        print(f"report written to {path} and {path.with_suffix('.html')}", file=info)


# ------------------------------------------------------------------------ commands
def _cmd_plan(args: argparse.Namespace) -> int:
    """``autopar plan``: solve, print, save, report."""
    model, name, cluster, seq_len = _load_problem(args)
    batch = dict(global_batch_size=args.global_batch_size, seq_len=seq_len)
    layouts = {f"hand `{text}`": Layout.parse(text) for text in args.megatron}
    if not layouts and args.report:
        layouts = default_hand_layouts(name, cluster)
    # Hand layouts first: a mistyped one fails in seconds, not after the search.
    hand = price_hand_layouts(layouts, model, cluster, model_name=name, **batch)
    plan = autopar.plan(model, cluster, layout=_layout(args), model_name=name, **batch)
    _emit(plan, args, hand)
    return EXIT_OK


def _cmd_evaluate(args: argparse.Namespace) -> int:
    """``autopar evaluate``: price one fixed layout, print, save, report."""
    model, name, cluster, seq_len = _load_problem(args)
    plan = autopar.evaluate(model, cluster, _layout(args), model_name=name,
                            global_batch_size=args.global_batch_size, seq_len=seq_len)
    _emit(plan, args, {})
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    """``autopar report``: the report of a saved plan, optionally with hand layouts priced."""
    if not args.plan_file.is_file():
        raise ValueError(f"plan file {args.plan_file} does not exist")
    plan = Plan.from_json(args.plan_file.read_text(encoding="utf-8"))
    hand: dict[str, Plan | str] = {}
    if args.megatron:
        model, name = autopar.load_model(plan.model)
        layouts = {f"hand `{text}`": Layout.parse(text) for text in args.megatron}
        hand = price_hand_layouts(layouts, model, Cluster.from_dict(plan.cluster), model_name=name,
                                  global_batch_size=plan.global_batch_size, seq_len=plan.seq_len)
    path = write_report(plan, args.out, hand_layouts=hand or None)
    print(f"report written to {path} and {path.with_suffix('.html')}")
    return EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    """``autopar compare``: solve, price the hand layouts, print them side by side."""
    model, name, cluster, seq_len = _load_problem(args)
    batch = dict(global_batch_size=args.global_batch_size, seq_len=seq_len)
    layouts = ({f"`{text}`": Layout.parse(text) for text in args.megatron}
               or default_hand_layouts(name, cluster))
    if not layouts:
        raise ValueError("compare needs at least one --megatron layout, e.g. "
                         "--megatron \"tp=8,pp=1,dp=1,mbs=1\"")
    hand = price_hand_layouts(layouts, model, cluster, model_name=name, **batch)
    plan = autopar.plan(model, cluster, model_name=name, **batch)
    result = compare(plan, hand)
    print(json.dumps(result, indent=2) if args.json else format_compare(result))
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """``autopar calibrate``: measure the local profile (``autopar.calibrate``)."""
    try:
        from autopar.calibrate import calibrate_local
    except ImportError as exc:
        raise ImportError(f"autopar.calibrate is not available in this installation ({exc})") from exc
    result = calibrate_local(processes=args.processes, out_path=str(args.out))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print("\n".join(profile_lines(result)))
        print(f"measured profile written to {args.out}; use it with --cluster {args.out}")
    return EXIT_OK


COMMANDS = {"plan": _cmd_plan, "evaluate": _cmd_evaluate, "report": _cmd_report,
            "compare": _cmd_compare, "calibrate": _cmd_calibrate, "verify": run_verify}


def _exit_code(exc: BaseException) -> tuple[int, str]:
    """(exit code, message prefix) for an exception; library errors are checked first."""
    if isinstance(exc, getattr(autopar, "InfeasibleError", ())):
        return EXIT_INFEASIBLE, "no layout fits"
    if isinstance(exc, getattr(autopar, "TraceError", ())):
        return EXIT_TRACE, "cannot trace the model"
    if isinstance(exc, (ValueError, FileNotFoundError, ImportError)):
        return EXIT_BAD_INPUT, "error"
    return EXIT_INTERNAL, f"internal error ({type(exc).__name__}; rerun with --debug)"


def main(argv: list[str] | None = None) -> int:
    """Run the ``autopar`` command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 after --help, 2 after a bad flag (message printed)
        return int(exc.code or 0)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code and one line
        code, prefix = _exit_code(exc)
        if args.debug:
            traceback.print_exc()
        else:
            print(f"autopar {args.command}: {prefix}: {exc}", file=sys.stderr)
        return code
