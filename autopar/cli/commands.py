"""Command line, seven verbs: ``autopar plan``, ``evaluate``, ``compare``, ``report``,
``calibrate``, ``verify`` and ``dryrun``.

argparse turns flags into the plain calls of the library (``autopar.load_model``,
``Cluster.from_name``, ``autopar.plan`` / ``autopar.evaluate``, ``report.write_report``);
nothing here decides anything the library would not. ``compare`` prints the solver's plan
beside hand-written layouts (views in :mod:`autopar.cli.compare`); ``calibrate`` measures
the local CPU profile with ``autopar.runtime.calibrate.calibrate_local``; ``verify`` runs a
saved plan on local processes against one device (:mod:`autopar.cli.verify`); ``dryrun``
builds ranks of a saved plan at its full size on this CPU (:mod:`autopar.cli.dry_run`). The flags and --help
texts live in :mod:`autopar.cli.parser`; the search's progress line (stderr, on a terminal
only, never with --json) in :mod:`autopar.cli.progress`. Every verb takes ``--json``:
stdout then holds one JSON document and nothing else.

Exit codes: 0 success · 2 bad input (a flag, a model or cluster name, a layout that breaks
a divisibility rule, a plan file that is not a valid plan: ``autopar.contract.plan_check.PlanError``,
an output path that cannot be written) · 3 no layout fits (``autopar.InfeasibleError``) ·
4 the model cannot be traced (``autopar.TraceError``) · 5 ``verify``: the program does not
match one device, or is not finite · 6 CP-SAT stopped at its time limit without a plan
(``autopar.SolverTimeLimitError``) · 7 ``dryrun``: a rank cannot be built at the plan's
size or disagrees with the prediction · 1 anything else (a bug: please report it). Errors print one line on stderr; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

import autopar
import autopar.frameworks
from autopar.api import what_if_plans
from autopar.cli.dry_run import run_dry_run
from autopar.cli.verify import run_verify
from autopar.cli.compare import (compare, comparison_lines, format_compare, plan_table,
                                 profile_lines, report_summary)
from autopar.cli.outputs import (check_dir_output, check_file_output, check_outputs,
                                 save_plan, write_whole)
from autopar.cli.parser import build_parser
from autopar.cli.progress import SearchProgress
from autopar.frameworks.model_shape import build_model, model_shape
from autopar.models import default_seq_len, model_config
from autopar.contract.plan import Layout, Plan
from autopar.contract.plan_check import read_plan
from autopar.report import write_report
from cost_models.hardware import Cluster

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_TRACE = 0, 1, 2, 3, 4
EXIT_TIME_LIMIT = 6  # 5 is verify's (autopar.cli.verify.EXIT_VERIFY_FAILED)
# Narayanan et al. 2021 (Table 1): GPT-3 175B on 1024 A100 GPUs, t=8, p=16, d=8, b=1.
MEGATRON_GPT3 = "tp=8,pp=16,dp={dp},mbs=1,recompute=full"


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
    """(model on meta, model name, cluster (with ``--memory-headroom`` when given), seq_len)
    from the problem flags."""
    cluster = load_cluster(args.cluster, args.nodes)  # before the model: cheap checks first
    if args.memory_headroom is not None:
        cluster = dataclasses.replace(cluster, memory_headroom_gib=args.memory_headroom)
    model, name = autopar.load_model(args.model)
    seq_len = args.seq_len or default_seq_len(model)
    if seq_len is None:
        raise ValueError(f"--seq-len is required: model {name!r} has no config.block_size, "
                         "n_positions or max_position_embeddings")
    return model, name, cluster, seq_len


def _layout(args: argparse.Namespace) -> Layout:
    """The Layout of the layout flags (None where a flag was not given)."""
    return Layout(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch_size=args.micro_batch_size,
                  zero_stage=args.zero_stage, recompute=args.recompute, schedule=args.schedule,
                  virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel,
                  dtype=args.dtype, ep=args.ep, cp=args.cp)


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


def _progress(args: argparse.Namespace) -> SearchProgress | None:
    """The search's progress line on stderr: only on a terminal and never with --json."""
    return SearchProgress.for_stream(sys.stderr, enabled=not args.json)


def _emit(plan: Plan, args: argparse.Namespace, hand: dict[str, Plan | str],
          what_ifs: dict[str, Plan | str] | None = None) -> None:
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
        save_plan(plan, args.output)
        print(f"plan saved to {args.output}", file=info)
    if args.report:
        path = write_report(plan, args.report, hand_layouts=hand or None, what_ifs=what_ifs)
        print(f"report written to {path} and {path.with_suffix('.html')}", file=info)


# ------------------------------------------------------------------------ commands
def _check_emit(args: argparse.Namespace) -> str:
    """The target of ``plan`` (``--target``, else the ``--emit`` framework, else autopar);
    ValueError before any work for --emit with --json but no --emit-to, or an --emit-to
    that cannot be written."""
    if args.emit is None and args.emit_to is not None:
        raise ValueError("--emit-to needs --emit megatron|torchtitan|deepspeed")
    if args.emit and args.json and args.emit_to is None:
        raise ValueError("--emit with --json prints the plan's JSON on stdout; give "
                         "--emit-to FILE for the framework's configuration")
    if args.emit_to is not None:
        check_file_output(args.emit_to, "--emit-to")
    return args.target or args.emit or "autopar"


def _write_emitted(plan: Plan, args: argparse.Namespace) -> None:
    """The ``--emit`` configuration, printed or written to ``--emit-to``."""
    text = autopar.frameworks.emit(plan, args.emit)
    if args.emit_to is None:
        print(f"{args.emit} configuration:\n{text}", end="")
        return
    write_whole(args.emit_to, text, "--emit-to")
    print(f"{args.emit} configuration written to {args.emit_to}",
          file=sys.stderr if args.json else sys.stdout)


def _cmd_plan(args: argparse.Namespace) -> int:
    """``autopar plan``: solve, print, save, report (with what-ifs unless --no-whatif), and
    the ``--emit`` configuration of the plan (searched within ``--target``)."""
    check_outputs(args)
    target = _check_emit(args)
    model, name, cluster, seq_len = _load_problem(args)
    batch = dict(global_batch_size=args.global_batch_size, seq_len=seq_len)
    layouts = {f"hand `{text}`": Layout.parse(text) for text in args.megatron}
    if not layouts and args.report:
        layouts = default_hand_layouts(name, cluster)
    # Hand layouts first: a mistyped one fails in seconds, not after the search.
    hand = price_hand_layouts(layouts, model, cluster, model_name=name, **batch)
    progress = _progress(args)
    plan = autopar.plan(model, cluster, layout=_layout(args), model_name=name,
                        progress=progress, time_limit_s=args.time_limit, target=target, **batch)
    what_ifs = None
    if args.report and args.whatif:
        what_ifs = what_if_plans(model, cluster, plan, layout=_layout(args), target=target,
                                 progress=progress.relabel if progress else None)
    _emit(plan, args, hand, what_ifs)
    if args.emit:
        _write_emitted(plan, args)
    return EXIT_OK


def _cmd_evaluate(args: argparse.Namespace) -> int:
    """``autopar evaluate``: price one fixed layout, print, save, report."""
    check_outputs(args)
    model, name, cluster, seq_len = _load_problem(args)
    plan = autopar.evaluate(model, cluster, _layout(args), model_name=name,
                            global_batch_size=args.global_batch_size, seq_len=seq_len,
                            time_limit_s=args.time_limit)
    _emit(plan, args, {})
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    """``autopar report``: the report of a saved plan, optionally with hand layouts priced."""
    plan = read_plan(args.plan_file)  # the one plan validator (autopar.contract.plan_check)
    check_dir_output(args.out, "--out")
    hand: dict[str, Plan | str] = {}
    if args.megatron:
        layouts = {f"hand `{text}`": Layout.parse(text) for text in args.megatron}
        model, name = autopar.load_model(plan.model)
        hand = price_hand_layouts(layouts, model, Cluster.from_dict(plan.cluster), model_name=name,
                                  global_batch_size=plan.global_batch_size, seq_len=plan.seq_len)
    path = write_report(plan, args.out, hand_layouts=hand or None)
    if args.json:
        print(json.dumps(report_summary(plan, path), indent=2))
    else:
        print(f"report written to {path} and {path.with_suffix('.html')}")
    return EXIT_OK


def _megatron_runs(args: argparse.Namespace, cluster: Cluster) -> dict:
    """Each ``--megatron-args`` read (:func:`autopar.frameworks.read_megatron_args`), by a
    short name; the first also fills in --model (its shape), --global-batch-size and
    --seq-len when they are not given."""
    runs = {}
    for i, source in enumerate(args.megatron_args, 1):
        run = autopar.frameworks.read_megatron_args(source, cluster.num_gpus)
        label = source if len(source) <= 40 and "\n" not in source else f"flags {i}"
        runs[f"Megatron-LM args `{label}`"] = run
    return runs


def _compare_problem(args: argparse.Namespace, runs: dict):
    """(model, name, cluster, seq_len, global_batch_size) of ``compare``: the flags, else
    the first --megatron-args run's model, batch and sequence length."""
    cluster = load_cluster(args.cluster, args.nodes)
    if args.memory_headroom is not None:
        cluster = dataclasses.replace(cluster, memory_headroom_gib=args.memory_headroom)
    first = next(iter(runs.values()), None)
    if args.model is None and first is None:
        raise ValueError("compare needs --model (or --megatron-args, whose flags give the shape)")
    if args.model is not None:
        model, name = autopar.load_model(args.model)
        shape = model_shape(model_config(model)) if runs else {}
        for label, run in runs.items():
            differ = [k for k in ("num_layers", "hidden_size", "num_attention_heads")
                      if k in run.model and run.model[k] != shape.get(k)]
            if differ:
                stated = ", ".join(f"{k}={run.model[k]}" for k in differ)
                has = ", ".join(f"{k}={shape.get(k)}" for k in differ)
                raise ValueError(f"{label} states {stated} but --model {args.model} has {has}; "
                                 "drop --model to price the flags' own shape")
    else:
        model, name = build_model(first.model)
    seq_len = args.seq_len or (first.seq_len if first else None) or default_seq_len(model)
    batch = args.global_batch_size or (first.global_batch_size if first else None)
    if seq_len is None or batch is None:
        missing = "--seq-len" if seq_len is None else "--global-batch-size"
        raise ValueError(f"compare needs {missing} (the --megatron-args flags do not give it)")
    return model, name, cluster, seq_len, batch


def _cmd_compare(args: argparse.Namespace) -> int:
    """``autopar compare``: solve, price the hand layouts (``--megatron``, each
    ``--megatron-args`` launch as written), print them side by side."""
    runs = _megatron_runs(args, load_cluster(args.cluster, args.nodes))
    model, name, cluster, seq_len, batch_size = _compare_problem(args, runs)
    batch = dict(global_batch_size=batch_size, seq_len=seq_len)
    layouts = ({f"`{text}`": Layout.parse(text) for text in args.megatron}
               or ({} if runs else default_hand_layouts(name, cluster)))
    if not layouts and not runs:
        raise ValueError("compare needs at least one --megatron layout, e.g. "
                         "--megatron \"tp=8,pp=1,dp=1,mbs=1\", or --megatron-args")
    hand = price_hand_layouts(layouts, model, cluster, model_name=name, **batch)
    for label, run in runs.items():
        try:
            hand[label] = autopar.frameworks.price_run(run, cluster, model=model,
                                                        model_name=name, **batch)
        except autopar.InfeasibleError as exc:
            hand[label] = f"infeasible: {exc}"
        if run.ignored:
            print(f"{label}: not priced: {'; '.join(run.ignored)}", file=sys.stderr)
    plan = autopar.plan(model, cluster, model_name=name, progress=_progress(args),
                        time_limit_s=args.time_limit, **batch)
    result = compare(plan, hand)
    for row in result["hand"]:  # what each Megatron-LM launch said that was not priced
        if row["name"] in runs:
            row["ignored"] = runs[row["name"]].ignored
    print(json.dumps(result, indent=2) if args.json else format_compare(result))
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """``autopar calibrate``: measure the local profile (``autopar.runtime.calibrate``)."""
    try:
        from autopar.runtime.calibrate import calibrate_local
    except ImportError as exc:
        raise ImportError(f"autopar.runtime.calibrate is not available in this installation ({exc})") from exc
    check_file_output(args.out, "--out")  # before the measurement, not after it
    result = calibrate_local(processes=args.processes, out_path=str(args.out))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print("\n".join(profile_lines(result)))
        print(f"measured profile written to {args.out}; use it with --cluster {args.out}")
    return EXIT_OK


COMMANDS = {"plan": _cmd_plan, "evaluate": _cmd_evaluate, "report": _cmd_report,
            "compare": _cmd_compare, "calibrate": _cmd_calibrate, "verify": run_verify,
            "dryrun": run_dry_run}


def _exit_code(exc: BaseException) -> tuple[int, str]:
    """(exit code, message prefix) for an exception; library errors are checked first."""
    if isinstance(exc, getattr(autopar, "InfeasibleError", ())):
        return EXIT_INFEASIBLE, "no layout fits"
    if isinstance(exc, getattr(autopar, "TraceError", ())):
        return EXIT_TRACE, "cannot trace the model"
    if isinstance(exc, getattr(autopar, "SolverTimeLimitError", ())):
        return EXIT_TIME_LIMIT, "the solver stopped at its time limit"
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
    except BrokenPipeError:  # e.g. `autopar plan ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code and one line
        code, prefix = _exit_code(exc)
        if args.debug:
            traceback.print_exc()
        else:
            print(f"autopar {args.command}: {prefix}: {exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
