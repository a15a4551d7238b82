"""Every CLI verb: --json output that parses, exit codes, --help that documents, and the
search's progress line (on a terminal only).

Real planner runs use gpt-tiny on local CPU processes (about a second each). A cluster
file whose device has 0.1 MiB of memory makes every layout infeasible; internal errors are
provoked by replacing one library call with one that raises RuntimeError.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shlex
import sys
import types

import pytest

import autopar
from autopar import cli
from autopar.cli import commands
from autopar.cli.parser import EXAMPLES, build_parser
from autopar.cli.progress import SearchProgress
from autopar.contract.plan import Plan

TINY = ["--model", "gpt-tiny", "--cluster", "local-cpu", "--nodes", "1",
        "--global-batch-size", "8"]
HAND = "tp=2,pp=1,dp=2,mbs=1"
EVAL = ["evaluate", *TINY, "--tp", "2", "--pp", "1", "--dp", "2", "--mbs", "1"]


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal, as stderr is when a person runs the CLI."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    """A real gpt-tiny plan saved by `autopar evaluate -o` (no search: fast)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main([*EVAL, "-o", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def tiny_memory_cluster(tmp_path_factory):
    """A cluster file whose 2 devices have 0.1 MiB each: no layout of gpt-tiny fits."""
    cluster = autopar.Cluster.local_cpu(processes=2)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device,
                                                                      memory_gib=1e-4))
    path = tmp_path_factory.mktemp("cluster") / "tiny-memory.json"
    cluster.to_json_file(path)
    return str(path)


@pytest.fixture
def fake_calibrate(monkeypatch):
    """autopar.runtime.calibrate replaced by a module whose calibrate_local returns a fixed profile
    (the real one measures for tens of seconds; tests/test_calibrate.py covers it)."""
    fake = types.ModuleType("autopar.runtime.calibrate")

    def calibrate_local(processes, out_path):
        if processes < 2:
            raise ValueError("calibrate needs processes >= 2")
        return {"name": "local-cpu-calibrated", "gpus_per_node": processes}

    fake.calibrate_local = calibrate_local
    monkeypatch.setitem(sys.modules, "autopar.runtime.calibrate", fake)
    return fake


# ----------------------------------------------------------------------- --json
def test_json_of_every_verb_parses(saved_plan, fake_calibrate, tmp_path, capsys):
    assert cli.main(["plan", *TINY, "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.num_gpus == 4 and plan.global_batch_size == 8

    assert cli.main([*EVAL, "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert (evaluated["tp"], evaluated["pp"], evaluated["dp"]) == (2, 1, 2)

    assert cli.main(["compare", *TINY, "--megatron", HAND, "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert compared["hand"][0]["layout"].startswith("tp=2 pp=1 dp=2 mbs=1")

    out = tmp_path / "report"
    assert cli.main(["report", str(saved_plan), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    saved = Plan.from_json(saved_plan.read_text())
    assert summary["files"]["markdown"] == str(out / "report.md")
    assert summary["files"]["html"] == str(out / "report.html")
    assert sorted(summary["files"]["images"]) == sorted(str(p) for p in out.glob("*.png"))
    assert len(summary["files"]["images"]) == 3  # no hand layout: no comparison chart
    headline = summary["plan"]
    assert (headline["tp"], headline["pp"], headline["dp"]) == (saved.tp, saved.pp, saved.dp)
    assert headline["step_time_s"] == saved.predicted.step_time_s
    assert headline["peak_memory_bytes"] == saved.predicted.peak_memory_bytes

    assert cli.main(["calibrate", "--processes", "2", "--out", str(tmp_path / "c.json"),
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus_per_node"] == 2


def test_plan_report_has_what_ifs_unless_no_whatif(tmp_path, capsys):
    assert cli.main(["plan", *TINY, "--report", str(tmp_path / "a")]) == 0
    text = (tmp_path / "a" / "report.md").read_text()
    assert "## What if" in text and "| twice the nodes | tp=" in text
    assert "| twice the global batch | tp=" in text
    assert "What if" in (tmp_path / "a" / "report.html").read_text()
    assert cli.main(["plan", *TINY, "--report", str(tmp_path / "b"), "--no-whatif"]) == 0
    assert "## What if" not in (tmp_path / "b" / "report.md").read_text()


# ------------------------------------------------------------------- exit codes
def _raise_runtime_error(*args, **kwargs):
    raise RuntimeError("simulated bug")


@pytest.mark.parametrize("argv", [
    ["plan", *TINY[:-1], "0"],                                    # batch 0
    ["plan", *TINY, "--tp", "3"],                                 # 3 does not divide 4 heads
    ["plan", "--model", "gpt-nonexistent", "--global-batch-size", "8"],
    ["evaluate", *TINY, "--tp", "2", "--pp", "2", "--dp", "2", "--mbs", "1"],  # 8 != 4 GPUs
    ["evaluate", *TINY, "--tp", "2"],                             # --pp/--dp/--mbs missing
    ["compare", *TINY],                                           # no hand layout
    ["compare", *TINY, "--megatron", "tp=2,pipeline=1"],
    ["report", "missing-plan.json", "--out", "r"],
    ["report", "--out", "r"],                                      # no plan file
    ["calibrate", "--processes", "1"],
    ["calibrate", "--processes", "two"],
])
def test_bad_input_exits_2(argv, fake_calibrate, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "tp": 2}', "[1, 2]"])
def test_report_of_a_file_that_is_not_a_plan_exits_2(content, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(content)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err


@pytest.mark.parametrize("verb", ["plan", "evaluate", "compare"])
def test_infeasible_exits_3(verb, tiny_memory_cluster, capsys):
    argv = {"plan": ["plan"], "evaluate": ["evaluate", "--tp", "1", "--pp", "1", "--dp", "2",
                                           "--mbs", "1"],
            "compare": ["compare", "--megatron", "tp=1,pp=1,dp=2,mbs=1"]}[verb]
    argv += ["--model", "gpt-tiny", "--cluster", tiny_memory_cluster, "--global-batch-size", "4"]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    assert "no layout fits" in err and "memory" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("verb", ["plan", "evaluate", "compare", "report", "calibrate"])
def test_internal_error_exits_1(verb, saved_plan, fake_calibrate, monkeypatch, tmp_path, capsys):
    argv = {"plan": ["plan", *TINY], "evaluate": EVAL,
            "compare": ["compare", *TINY, "--megatron", HAND],
            "report": ["report", str(saved_plan), "--out", str(tmp_path)],
            "calibrate": ["calibrate", "--processes", "2", "--out", str(tmp_path / "c.json")]}
    target = {"plan": (autopar, "plan"), "evaluate": (autopar, "evaluate"),
              "compare": (autopar, "plan"), "report": (commands, "write_report"),
              "calibrate": (fake_calibrate, "calibrate_local")}[verb]
    monkeypatch.setattr(*target, _raise_runtime_error)
    assert cli.main(argv[verb]) == 1
    err = capsys.readouterr().err
    assert "internal error (RuntimeError; rerun with --debug)" in err and "Traceback" not in err
    assert cli.main([*argv[verb], "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


# ------------------------------------------------------------------------ --help
@pytest.mark.parametrize("verb", list(EXAMPLES))
def test_help_documents_each_verb_with_examples_that_parse(verb, capsys):
    assert cli.main([verb, "--help"]) == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "exit codes:" in text and "--json" in text
    assert "3  infeasible" in text and "2  bad input" in text
    commands = " ".join(line.strip() for line in EXAMPLES[verb].splitlines()
                        if not line.strip().startswith("#")).replace("\\ ", "")
    examples = [c for c in commands.split("autopar ")[1:]]
    assert examples and all(e.split()[0] in EXAMPLES for e in examples)
    parser = build_parser()
    for example in examples:  # every example in the help is a valid command line
        parser.parse_args(shlex.split(example))


def test_problem_flags_are_spelled_the_same_in_every_verb():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    shared = {"--model", "--cluster", "--nodes", "--global-batch-size", "--seq-len"}
    for verb in ("plan", "evaluate", "compare"):
        flags = {s for a in sub[verb]._actions for s in a.option_strings}
        assert shared <= flags, verb
        assert {"--megatron", "--hand-layout"} <= flags or verb == "evaluate"
    for verb, parser in sub.items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert {"--json", "--debug", "--help"} <= flags, verb


# --------------------------------------------------------------------- progress
def test_search_reports_progress_to_the_callback():
    calls = []
    model, _ = autopar.load_model("gpt-tiny")
    plan = autopar.plan(model, autopar.Cluster.local_cpu(processes=4), global_batch_size=8,
                        seq_len=16, progress=lambda *a: calls.append(a))
    visited = [c[0] for c in calls]
    total = calls[0][1]
    assert visited == sorted(visited) and visited[0] == 0 and calls[-1][:2] == (total, total)
    assert calls[0][2] is None  # nothing solved yet
    assert calls[-1][2] == pytest.approx(plan.predicted.step_time_s)


def test_search_progress_for_stream_only_on_a_terminal():
    assert SearchProgress.for_stream(io.StringIO()) is None
    assert SearchProgress.for_stream(FakeTTY(), enabled=False) is None
    tty = FakeTTY()
    progress = SearchProgress.for_stream(tty, label="search")
    progress(0, 4, None)
    progress(4, 4, 0.0125)
    text = tty.getvalue()
    assert "search: 0/4 configs (0%), nothing fits yet" in text
    assert "search: 4/4 configs (100%), best step 12.5 ms" in text and text.endswith("\n")
    quiet = SearchProgress(FakeTTY(), min_interval_s=3600)  # redraws at most once an hour
    for visited in range(5):
        quiet(visited, 4, None)
    assert quiet.stream.getvalue().count("configs") == 2  # the first and the last call


def test_plan_draws_progress_on_a_terminal_only(monkeypatch, tmp_path, capsys):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["plan", *TINY, "--report", str(tmp_path)]) == 0
    lines = tty.getvalue().split("\r\x1b[K")
    assert any(line.startswith("search: ") and "configs" in line for line in lines)
    assert any(line.startswith("what if twice the nodes: ") for line in lines)
    assert "best step" in tty.getvalue()

    tty = FakeTTY()  # --json: machine output only, even on a terminal
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["plan", *TINY, "--json"]) == 0
    assert tty.getvalue() == ""
    monkeypatch.undo()
    capsys.readouterr()

    assert cli.main(["plan", *TINY]) == 0  # piped (captured) stderr: no progress
    captured = capsys.readouterr()
    assert "configs" not in captured.err and "\r" not in captured.err + captured.out


# ------------------------------------------------- a saved plan for every rank (README)
def test_saved_plan_of_the_training_example_is_what_every_rank_loads(tmp_path, monkeypatch):
    """README's cluster recipe: `autopar plan --model examples.train_gpt:gpt_stdlib_bytes
    ... -o plan.json`, then `train_gpt.py --plan plan.json` on every rank reads it."""
    from pathlib import Path

    from helpers import load_script

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # module:factory resolves from the current directory
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "examples.train_gpt:gpt_stdlib_bytes", "--cluster",
                     "local-cpu", "--global-batch-size", "16", "--tp", "2", "--pp", "2",
                     "-o", str(path)]) == 0
    train_gpt = load_script("examples/train_gpt.py")
    cluster = autopar.Cluster.local_cpu(processes=4)
    args = train_gpt.parse_args(["--plan", str(path)])
    plan = train_gpt.load_or_solve(args, cluster, rank=3)  # no collective with --plan
    assert (plan.tp, plan.pp, plan.dp, plan.seq_len) == (2, 2, 1, 64)
    assert plan.decision_digest() == Plan.from_json(path.read_text()).decision_digest()
    with pytest.raises(ValueError, match="plans B=16, s=64 on 4 ranks, but this run has B=8"):
        train_gpt.load_or_solve(train_gpt.parse_args(["--plan", str(path), "--batch-size", "8"]),
                                cluster, rank=0)


# ------------------------------------------------------------- one model loader
def test_one_model_loader_for_presets_and_factories():
    """autopar.load_model is the loader of `--model` (plan, evaluate, compare, report) and of
    verify's seeded build; one error text names the cause and the fix."""
    import torch

    from autopar.models import load_model, preset

    assert autopar.load_model is load_model
    model, name = load_model("gpt-tiny")
    assert name == "gpt-tiny" and all(p.is_meta for p in model.parameters())
    a, _ = load_model("gpt-tiny", device="cpu", seed=3)
    b, _ = load_model("gpt-tiny", device="cpu", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    model, name = load_model("tests_factory:tiny_gpt")  # tests/ is on sys.path under pytest
    assert name == "tests_factory:tiny_gpt" and all(p.is_meta for p in model.parameters())
    for spec, cause in [("gpt-nope", "unknown model 'gpt-nope'"),
                        ("no_such_module:build", "cannot load model factory 'no_such_module:build'")]:
        with pytest.raises(ValueError, match=cause) as info:
            load_model(spec)
        assert "gpt-tiny" in str(info.value) and "module:factory" in str(info.value)
        assert "current directory" in str(info.value)
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*module:factory"):
        preset("nope")
