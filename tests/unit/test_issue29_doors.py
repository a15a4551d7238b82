"""The smaller doors of issue 29, each a test that failed before the fix: output paths
refused before any work, concurrent writers of one plan path, stale report files, and
model configs with impossible dimensions.

Tests run as root, which ignores permission bits, so unwritable paths are ones root cannot
write either (under a regular file, under ``/proc``), and read-only files are simulated
through ``os.access`` as well as ``chmod``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

import autopar
from autopar.cli.commands import save_plan
from autopar.contract.plan import Plan
from helpers import run_cli, tiny_plan

PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8"]
EVAL = ["evaluate", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size",
        "8", "--tp", "1", "--pp", "1", "--dp", "1", "--mbs", "8"]
NO_PROC = not Path("/proc/self").is_dir()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid saved gpt-tiny plan (tp=1) and its path."""
    plan = tiny_plan(1, 1)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.to_json())
    return plan, path


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model, solving, pricing and measuring fail the test when called: an
    output path must be refused before any of them (exit 2, never the 1 they give)."""
    def work(*args, **kwargs):
        raise AssertionError("work started before the output paths were checked")

    for name in ("load_model", "plan", "evaluate"):
        monkeypatch.setattr(autopar, name, work)
    import autopar.runtime.calibrate as calibrate

    monkeypatch.setattr(calibrate, "calibrate_local", work)


# ------------------------------------------------------- 1. output paths, before any work
def _unwritable(tmp_path: Path) -> dict[str, Path]:
    """Paths root cannot write: under a regular file, in /proc, in a folder under /proc."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return {"under a file": blocker / "out", "in /proc": Path("/proc/autopar-out"),
            "under /proc": Path("/proc/autopar-missing/out")}


@pytest.mark.skipif(NO_PROC, reason="needs Linux /proc")
@pytest.mark.parametrize("case", ["under a file", "in /proc", "under /proc"])
@pytest.mark.parametrize("verb, flag", [
    ("plan", "-o"), ("plan", "--emit-to"), ("plan", "--report"), ("evaluate", "-o"),
    ("evaluate", "--report"), ("report", "--out"), ("calibrate", "--out")])
def test_unwritable_output_is_exit_2_before_any_work(verb, flag, case, saved, no_work,
                                                     tmp_path):
    path = _unwritable(tmp_path)[case]
    argv = {"plan": PLAN, "evaluate": EVAL, "calibrate": ["calibrate"],
            "report": ["report", str(saved[1]), "--megatron", "tp=1,pp=1,dp=1,mbs=8"]}[verb]
    extra = ["--emit", "megatron"] if flag == "--emit-to" else []
    code, _, err = run_cli([*argv, *extra, flag, str(path)])
    assert code == 2, err
    assert f"{flag} {path}" in err and "cannot be written" in err, err


def test_a_read_only_file_is_refused_before_any_work(no_work, tmp_path, monkeypatch):
    """chmod 444 (which root ignores), and os.access saying so (as it does for others)."""
    path = tmp_path / "plan.json"
    path.write_text("{}")
    path.chmod(0o444)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == path
                        else access(p, mode, **kw))
    for argv in ([*PLAN, "-o", str(path)], [*PLAN, "--emit", "megatron", "--emit-to",
                                            str(path)]):
        code, _, err = run_cli(argv)
        assert code == 2 and f"{path} is read-only" in err, err
    assert path.read_text() == "{}"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused_before_any_work(no_work, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, _, err = run_cli([*PLAN, "-o", str(folder / "plan.json")])
    finally:
        folder.chmod(0o755)
    assert code == 2 and "takes no new files" in err, err


def test_writable_outputs_are_accepted_and_leave_no_probe(tmp_path):
    """The check creates and removes one file; a plan still runs and writes everything."""
    out, emitted = tmp_path / "new" / "plan.json", tmp_path / "megatron.args"
    code, _, err = run_cli([*PLAN, "--no-whatif", "-o", str(out), "--emit", "megatron",
                            "--emit-to", str(emitted)])
    assert code == 0, err
    assert Plan.from_json(out.read_text()).model == "gpt-tiny" and emitted.read_text()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["megatron.args", "new", "plan.json"]


# ----------------------------------------------- 2. two writers of one plan path
def test_concurrent_writers_of_one_plan_path_each_write_a_whole_file(saved, tmp_path):
    """Two threads saving two plans to one path, 40 times each: none fails, the file is
    always one whole plan, and no temporary file remains (one shared temp name lost
    the race: a rename of a file the other had already moved, or half of each)."""
    plans = [saved[0], tiny_plan(1, 1, 2)]
    texts = {plan.to_json() + "\n" for plan in plans}
    path, errors = tmp_path / "plan.json", []
    start = threading.Barrier(len(plans))

    def writer(plan: Plan) -> None:
        start.wait()
        for _ in range(40):
            try:
                save_plan(plan, path)
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert path.read_text() in texts
    assert Plan.from_json(path.read_text()).num_gpus in (1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_failed_save_leaves_no_temporary_file(saved, tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ValueError, match=re.escape(f"-o {path} cannot be written (No space")):
        save_plan(saved[0], path)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert path.read_text() == "old"


# ------------------------------------------------ 3. a report over an older report
def _charts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.png"))


def test_a_report_over_an_older_one_leaves_none_of_its_charts(saved, tmp_path):
    """An earlier report with hand layouts drew comparison.png; `autopar report` of the
    plan alone into the same folder must not leave it (nor link it); the user's files
    (notes, a plan, a picture of their own) stay."""
    pytest.importorskip("matplotlib")
    from autopar.report import write_report

    plan, plan_path = saved
    out = tmp_path / "report"
    write_report(plan, out, hand_layouts={"the same layout": plan})
    assert "comparison.png" in _charts(out)
    for name in ("notes.txt", "my-chart.png", "plan.json"):
        (out / name).write_text("the user's")
    code, stdout, err = run_cli(["report", str(plan_path), "--out", str(out), "--json"])
    assert code == 0, err
    images = sorted(Path(p).name for p in json.loads(stdout)["files"]["images"])
    assert "comparison.png" not in images
    assert _charts(out) == sorted([*images, "my-chart.png"])
    for name in ("notes.txt", "my-chart.png", "plan.json"):
        assert (out / name).read_text() == "the user's"


def test_a_report_over_one_from_before_manifests_removes_its_chart_files(saved, tmp_path):
    """A folder holding report.md and charts but no manifest (an older autopar): its chart
    names are the report's; without charts (chart=False) none remains."""
    from autopar.report import write_report
    from autopar.report.owned import MANIFEST

    out = tmp_path / "report"
    out.mkdir()
    for name in ("report.md", "timeline.png", "comparison.png", "notes.txt"):
        (out / name).write_text("old")
    write_report(saved[0], out, chart=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "notes.txt",
                                                            "report.html", "report.md"])
    assert json.loads((out / MANIFEST).read_text())["files"] == ["report.html", "report.md"]


def test_a_report_into_a_new_folder_removes_nothing(saved, tmp_path):
    """Chart names in a folder without an earlier report are the user's files."""
    from autopar.report import write_report

    out = tmp_path / "report"
    out.mkdir()
    (out / "comparison.png").write_text("the user's")
    write_report(saved[0], out, chart=False)
    assert (out / "comparison.png").read_text() == "the user's"


# ------------------------------------- 4. a model config with impossible dimensions
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 128, "max_position_embeddings": 16}


@pytest.fixture
def no_solve(monkeypatch):
    """Solving and pricing fail the test when called: a bad config stops at the model."""
    def work(*args, **kwargs):
        raise AssertionError("the solver ran on a config that describes no model")

    monkeypatch.setattr(autopar, "plan", work)
    monkeypatch.setattr(autopar, "evaluate", work)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", -32), ("hidden_size", 0), ("hidden_size", "64"), ("hidden_size", 64.5),
    ("hidden_size", True), ("num_attention_heads", 0), ("num_hidden_layers", -1),
    ("vocab_size", 0), ("intermediate_size", 0), ("num_key_value_heads", -2),
    ("max_position_embeddings", 0)])
@pytest.mark.parametrize("verb", ["plan", "evaluate"])
def test_a_config_with_a_bad_dimension_is_exit_2_naming_it(verb, field, value, no_solve,
                                                           tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(LLAMA, **{field: value})))
    argv = {"plan": PLAN, "evaluate": EVAL}[verb]
    code, _, err = run_cli([argv[0], "--model", f"hf:{path}", *argv[3:], "--seq-len", "16"])
    assert code == 2, err
    assert f"{field} = {json.dumps(value)}" in err and "positive integer" in err, err
    assert "internal error" not in err


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "gpt2", "n_embd": -32}, "n_embd = -32"),
    ({"num_key_value_heads": 3}, "num_attention_heads = 4, not divisible by "
                                 "num_key_value_heads = 3"),
    ({"hidden_size": 30}, "not a valid llama config"),  # the config class's own check
])
def test_other_impossible_configs_are_exit_2(fields, message, no_solve, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    base = {"model_type": "gpt2"} if fields.get("model_type") == "gpt2" else LLAMA
    path.write_text(json.dumps(dict(base, **fields)))
    code, _, err = run_cli(["plan", "--model", f"hf:{path}", *PLAN[3:], "--seq-len", "16"])
    assert code == 2 and message in err and "internal error" not in err, err


def test_every_default_causal_lm_config_passes_the_shape_check():
    """No architecture transformers can build is refused for its own defaults (per-layer
    widths as lists, XLNet's -1 positions, a head_dim apart from the width)."""
    tf = pytest.importorskip("transformers")
    from autopar.hf_models import HF_ARCHITECTURES, check_config_shape

    checked = 0
    for model_type in ("gemma3n_text", "glm4_moe", "reformer", "xlnet", *HF_ARCHITECTURES):
        if model_type in tf.CONFIG_MAPPING:
            check_config_shape(tf.AutoConfig.for_model(model_type), model_type)
            checked += 1
    assert checked >= len(HF_ARCHITECTURES)
