"""The Markdown report and the ``autopar`` command line.

The report is checked on hand-built Plans (its numbers must appear, formatted with
units). The CLI is checked with the library calls replaced by fakes that record what
they were asked (flags → Layout, exit codes, JSON on stdout), plus one end-to-end run
on the real planner with a tiny model when ``autopar.plan`` is available.
"""

from __future__ import annotations

import json
import re

import pytest

import autopar
from autopar import cli
from autopar.contract.plan import Alternative, Layout, Plan, Prediction
from autopar.report import render_markdown, write_report
from autopar.report.format import format_bytes, format_seconds
from cost_models.hardware import Cluster

GIB = 2**30


def make_plan(tp=4, pp=4, dp=64, mbs=2, step=12.5, model="gpt3-175b", **overrides) -> Plan:
    """A GPT-3-like plan on 128 DGX A100 nodes with round, recognisable numbers."""
    layers = 96
    per_stage = layers // pp
    memory = [{"parameters": 10 * GIB, "gradients": 5 * GIB, "optimizer_states": 20 * GIB,
               "activations": (30 - i) * GIB} for i in range(pp)]
    predicted = Prediction(
        step_time_s=step, tflops_per_gpu=151.25, mfu=0.4848, hfu=0.6464,
        peak_memory_bytes=65 * GIB, memory_bytes_by_stage=memory,
        time_s_by_kind={"compute": 8.0, "recompute": 2.0, "tp_comm": 1.0, "pp_p2p": 0.25,
                        "dp_comm": 0.5, "bubble": 0.5, "optimizer": 0.25},
        comm_bytes_by_kind={"tp_all_reduce": 3.5 * GIB, "pp_send_recv": 0.75 * GIB,
                            "dp_reduce_scatter": 2 * GIB},
        stage_time_s=[0.031] * pp)
    fields = dict(
        model=model, model_config={"n_layer": layers}, cluster=Cluster.dgx_a100(128).to_dict(),
        global_batch_size=1536, seq_len=2048, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs,
        num_micro_batches=1536 // (dp * mbs), schedule="1f1b", zero_stage=1,
        recompute=["selective"] * 90 + ["full"] * 6,
        stage_layers=[[i * per_stage, (i + 1) * per_stage] for i in range(pp)],
        placements={}, predicted=predicted,
        alternatives=[
            Alternative(layout={"tp": 8, "pp": 8, "dp": 16, "micro_batch_size": 1},
                        step_time_s=14.0, tflops_per_gpu=135.0, peak_memory_bytes=50 * GIB,
                        feasible=True, reason="more pipeline bubble"),
            Alternative(layout={"tp": 2, "pp": 4, "dp": 128}, peak_memory_bytes=120 * GIB,
                        feasible=False, reason="needs 120 GiB per GPU, device has 80 GiB")],
        binding=["memory on stage 0: 65.0 GiB of 80 GiB"])
    fields.update(overrides)
    return Plan(**fields)


# ---------------------------------------------------------------------------- report
def test_render_markdown_has_sections_and_numbers():
    text = render_markdown(make_plan())
    for heading in ("# autopar plan: gpt3-175b", "## Chosen plan", "### Pipeline stages",
                    "## Prediction", "## Where the step time goes", "## Memory per GPU",
                    "## Communication", "## Why this plan", "### Binding constraints",
                    "### Best alternatives"):
        assert heading in text
    assert "tp=4 pp=4 dp=64 mbs=2" in text
    assert "12.5 s" in text and "151.2 TFLOP/s" in text and "48.5%" in text
    assert "65 GiB of 80 GiB (81% of device memory)" in text
    assert "| compute | 8 s | 64.0% |" in text           # 8 s of a 12.5 s step
    assert "| 0 | 10.00 | 5.00 | 20.00 | 30.00 | 65.00 | 81% |" in text
    assert "3.5 GiB" in text and "768 MiB" in text
    assert "selective on layers 0–89; full on layers 90–95" in text
    assert "0–23" in text and "72–95" in text          # stage boundaries, inclusive
    assert "memory on stage 0" in text
    assert "1.12×" in text and "more pipeline bubble" in text   # 14 s / 12.5 s
    assert "infeasible: needs 120 GiB per GPU" in text


def test_render_markdown_compares_hand_layouts():
    auto = make_plan()
    megatron = make_plan(tp=8, pp=16, dp=8, mbs=1, step=15.0, recompute=["full"] * 96,
                         alternatives=[])
    text = render_markdown(auto, {"Megatron-LM": megatron, "pure DP": "infeasible: too big"})
    assert "## Hand-written layouts" in text
    row = next(line for line in text.splitlines() if line.startswith("| Megatron-LM"))
    assert "tp=8 pp=16 dp=8 mbs=1" in row and "15 s" in row and "0.83" in row  # 12.5 / 15
    assert "| pure DP |" in text and "infeasible: too big" in text
    assert "recompute=full×6+selective×90" in text   # the auto plan's per-layer recompute
    assert "1.20× faster" in text


def test_write_report_writes_markdown(tmp_path):
    path = write_report(make_plan(), tmp_path / "out", title="My plan", chart=False)
    assert path == tmp_path / "out" / "report.md"
    assert path.read_text().startswith("# My plan\n")


def test_unit_formatting():
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.5e-6) == "4.5 µs"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3 MiB"
    assert format_bytes(71.25 * GIB) == "71.2 GiB"


def test_report_imports_no_planner_no_sympy_no_privates():
    """The report reads only the Plan: no module of autopar/report imports the planner,
    the oracle, the public API (which plans) or sympy, nor another module's private name."""
    import ast
    from pathlib import Path

    import autopar.report

    forbidden = ("autopar.api", "autopar.planner", "autopar.oracle", "sympy")
    for path in sorted(Path(autopar.report.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                assert not any(a.name.startswith("_") for a in node.names), (path.name, node.module)
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}"


# ------------------------------------------------------------------------------ cli
PLAN_ARGS = ["--model", "gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128",
             "--global-batch-size", "1536", "--seq-len", "2048"]


class FakeInfeasible(Exception):
    """Stands in for autopar.InfeasibleError until the library defines it."""


class FakeTraceError(Exception):
    """Stands in for autopar.TraceError until the library defines it."""


@pytest.fixture
def fake_api(monkeypatch):
    """Replace the library calls the CLI makes; returns the list of recorded calls."""
    calls: list[tuple[str, dict]] = []
    for name, fake in (("InfeasibleError", FakeInfeasible), ("TraceError", FakeTraceError)):
        if not hasattr(autopar, name):
            monkeypatch.setattr(autopar, name, fake, raising=False)
    monkeypatch.setattr(autopar, "load_model", lambda spec: (object(), spec), raising=False)

    def fake_plan(model, cluster, *, global_batch_size, seq_len, layout=None, model_name="model",
                  progress=None, time_limit_s=1.0, target="autopar"):
        calls.append(("plan", dict(cluster=cluster, layout=layout, B=global_batch_size,
                                   progress=progress, target=target)))
        if progress is not None:
            progress(0, 2, None)
            progress(2, 2, 12.5)
        return make_plan(model=model_name)

    def fake_evaluate(model, cluster, layout, *, global_batch_size, seq_len, model_name="model",
                      time_limit_s=1.0):
        calls.append(("evaluate", dict(cluster=cluster, layout=layout)))
        return make_plan(tp=layout.tp, pp=layout.pp, dp=layout.dp, mbs=layout.micro_batch_size,
                         step=15.0, model=model_name)

    monkeypatch.setattr(autopar, "plan", fake_plan, raising=False)
    monkeypatch.setattr(autopar, "evaluate", fake_evaluate, raising=False)
    return calls


@pytest.mark.parametrize("argv", [
    ["plan", *PLAN_ARGS[:5], "0", *PLAN_ARGS[6:]],                     # --nodes 0
    ["plan", "--model", "gpt3-175b", "--cluster", "dgx-z999", "--global-batch-size", "8"],
    ["plan", "--model", "gpt3-175b", "--global-batch-size", "8", "--recompute", "most"],
    ["evaluate", *PLAN_ARGS, "--tp", "8", "--pp", "16"],               # --dp, --mbs missing
    ["plan", *PLAN_ARGS, "--megatron", "tp=8,pipeline=16"],            # bad layout text
])
def test_cli_bad_input_exits_2(argv, fake_api, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


def test_cli_help_exits_0(capsys):
    assert cli.main(["plan", "--help"]) == 0
    assert "--global-batch-size" in capsys.readouterr().out


def test_cli_plan_json_passes_fixed_flags(fake_api, capsys):
    assert cli.main(["plan", *PLAN_ARGS, "--tp", "4", "--recompute", "selective", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.model == "gpt3-175b" and plan.tp == 4
    (kind, call), = fake_api
    assert kind == "plan" and call["B"] == 1536 and call["cluster"].num_gpus == 1024
    assert call["layout"] == Layout(tp=4, recompute="selective")


def test_cli_plan_report_prices_megatron_by_default(fake_api, tmp_path, capsys):
    assert cli.main(["plan", *PLAN_ARGS, "--report", str(tmp_path), "--no-whatif"]) == 0
    out = capsys.readouterr().out
    assert "tp=4 pp=4 dp=64" in out and "auto/hand step time 0.83" in out
    kinds = [kind for kind, _ in fake_api]
    assert kinds == ["evaluate", "plan"]  # hand layouts first: a typo fails before the search
    assert fake_api[0][1]["layout"] == Layout.parse("tp=8,pp=16,dp=8,mbs=1,recompute=full")
    assert "Megatron-LM" in (tmp_path / "report.md").read_text()


def test_cli_cluster_from_json_file_with_nodes(fake_api, tmp_path, capsys):
    path = tmp_path / "my-cluster.json"
    Cluster.dgx_h100(nodes=2).to_json_file(path)
    assert cli.main(["plan", "--model", "gpt-1.3b", "--cluster", str(path), "--nodes", "4",
                     "--global-batch-size", "64", "--seq-len", "2048"]) == 0
    cluster = fake_api[0][1]["cluster"]
    assert cluster.nodes == 4 and cluster.name == "dgx-h100"


def test_cli_plan_repeated_megatron_flags(fake_api, capsys):
    argv = ["plan", *PLAN_ARGS, "--megatron", "tp=8,pp=16,dp=8,mbs=1",
            "--megatron", "tp=8,pp=8,dp=16,mbs=1,recompute=full"]
    assert cli.main(argv) == 0
    assert [c["layout"].pp for kind, c in fake_api if kind == "evaluate"] == [16, 8]


@pytest.mark.parametrize("error, code", [
    (lambda: autopar.InfeasibleError("needs 300 GiB per GPU, device has 80 GiB"), 3),
    (lambda: autopar.TraceError("node 'assert' cannot be traced"), 4),
    (lambda: RuntimeError("boom"), 1),
])
def test_cli_exit_codes(error, code, fake_api, monkeypatch, capsys):
    def failing_plan(*args, **kwargs):
        raise error()

    monkeypatch.setattr(autopar, "plan", failing_plan)
    assert cli.main(["plan", *PLAN_ARGS]) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_evaluate_then_report_roundtrip(fake_api, tmp_path, capsys):
    saved = tmp_path / "plan.json"
    argv = ["evaluate", *PLAN_ARGS, "--tp", "8", "--pp", "16", "--dp", "8", "--mbs", "1",
            "--output", str(saved)]
    assert cli.main(argv) == 0
    assert fake_api[0][1]["layout"] == Layout(tp=8, pp=16, dp=8, micro_batch_size=1)
    assert cli.main(["report", str(saved), "--out", str(tmp_path / "r")]) == 0
    assert "tp=8 pp=16 dp=8" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.skipif(not callable(getattr(autopar, "plan", None)) or
                    not callable(getattr(autopar, "load_model", None)),
                    reason="autopar.plan / load_model not available yet")
def test_cli_real_planner_tiny_model(tmp_path, capsys):
    argv = ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8",
            "--json", "--report", str(tmp_path)]
    assert cli.main(argv) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.global_batch_size == 8
    assert plan.dp * plan.micro_batch_size * plan.num_micro_batches == 8
    assert "## Chosen plan" in (tmp_path / "report.md").read_text()


# -------------------------------------------------------------------------- compare
def test_cli_compare_real_planner_explains_the_difference(capsys):
    """gpt-1.3b on one DGX A100 node: the auto plan beside a Megatron-style hand layout."""
    argv = ["compare", "--model", "gpt-1.3b", "--cluster", "dgx-a100", "--nodes", "1",
            "--global-batch-size", "16", "--seq-len", "2048",
            "--megatron", "tp=2,pp=2,dp=2,mbs=1,recompute=full"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for text in ("auto/hand", "TFLOP/s/GPU", "MFU / HFU", "memory per stage",
                 "tp=2 pp=2 dp=2 mbs=1", "where the difference comes from", "auto − hand by kind"):
        assert text in out, text
    hand_row = [line for line in out.splitlines() if line.strip().startswith("hand 1 ")][-1]
    assert re.search(r"\d\.\d / \d+\.\d GiB", hand_row)  # memory of each of the 2 stages
    assert "recompute" in out.split("where the difference comes from")[1]


def test_cli_compare_json_differences_add_up(capsys):
    argv = ["compare", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size",
            "8", "--megatron", "tp=2,pp=1,dp=2,mbs=1", "--megatron", "tp=1,pp=2,dp=2,mbs=1",
            "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    auto = result["auto"]
    assert result["model"] == "gpt-tiny" and result["num_gpus"] == 4 and len(result["hand"]) == 2
    for row in result["hand"]:
        assert row["auto_over_hand"] == pytest.approx(auto["step_time_s"] / row["step_time_s"])
        assert sum(row["difference_s_by_kind"].values()) == pytest.approx(row["difference_s"])
        assert row["difference_s"] == pytest.approx(auto["step_time_s"] - row["step_time_s"])
        assert auto["step_time_s"] <= row["step_time_s"] * (1 + 1e-9)  # the solver's optimum
    assert len(result["hand"][1]["memory_bytes_by_stage"]) == 2


def test_cli_compare_with_fakes_shows_unpriceable_layouts(fake_api, monkeypatch, capsys):
    evaluate = autopar.evaluate

    def evaluate_or_infeasible(model, cluster, layout, **kwargs):
        if layout.pp == 2:
            raise autopar.InfeasibleError("needs 95 GiB per GPU, device has 80 GiB")
        return evaluate(model, cluster, layout, **kwargs)

    monkeypatch.setattr(autopar, "evaluate", evaluate_or_infeasible)
    argv = ["compare", *PLAN_ARGS, "--megatron", "tp=8,pp=16,dp=8,mbs=1",
            "--megatron", "tp=8,pp=2,dp=64,mbs=1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "0.833" in out                                 # 12.5 s auto / 15 s hand
    assert "auto is 2.5 s faster" in out
    assert "other" in out   # the fakes' kinds do not add up to the step times
    assert "cannot be priced: infeasible: needs 95 GiB per GPU" in out
    assert [kind for kind, _ in fake_api] == ["evaluate", "plan"]  # hand layouts first


def test_cli_compare_defaults_to_the_published_megatron_layout(fake_api, capsys):
    assert cli.main(["compare", *PLAN_ARGS]) == 0
    assert fake_api[0][1]["layout"] == Layout.parse("tp=8,pp=16,dp=8,mbs=1,recompute=full")
    assert "Narayanan et al. 2021" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code, message", [
    (["compare", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8"],
     2, "compare needs at least one --megatron layout"),
    (["compare", *PLAN_ARGS, "--megatron", "tp=8,pipeline=16"], 2, "cannot parse layout item"),
    (["compare", "--model", "gpt-tiny", "--cluster", "local-cpu", "--global-batch-size", "8",
      "--megatron", "tp=1,pp=1,dp=1,mbs=1"], 2, "make the product equal 4"),
])
def test_cli_compare_bad_input_exits_2(argv, code, message, capsys):
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_compare_infeasible_auto_plan_exits_3(fake_api, monkeypatch, capsys):
    def failing_plan(*args, **kwargs):
        raise autopar.InfeasibleError("needs 300 GiB per GPU, device has 80 GiB")

    monkeypatch.setattr(autopar, "plan", failing_plan)
    assert cli.main(["compare", *PLAN_ARGS, "--megatron", "tp=8,pp=16,dp=8,mbs=1"]) == 3
    assert "no layout fits" in capsys.readouterr().err


# ------------------------------------------------------------------------ calibrate
def test_cli_calibrate_calls_calibrate_local(monkeypatch, tmp_path, capsys):
    import sys
    import types

    calls = []
    fake = types.ModuleType("autopar.runtime.calibrate")

    def calibrate_local(processes, out_path):
        calls.append((processes, out_path))
        return {"matmul_tflops": 0.12, "gloo_bandwidth_gbps": 1.5}

    fake.calibrate_local = calibrate_local
    monkeypatch.setitem(sys.modules, "autopar.runtime.calibrate", fake)
    out = tmp_path / "cpu.json"
    assert cli.main(["calibrate", "--processes", "2", "--out", str(out), "--json"]) == 0
    assert calls == [(2, str(out))]
    assert json.loads(capsys.readouterr().out)["matmul_tflops"] == 0.12
    profile = {"name": "local-cpu-calibrated", "gpus_per_node": {"value": 2, "source": "s"},
               "device": {"peak_tflops": {"value": 0.05, "source": "s"}, "source": "s"},
               "notes": {"fit": {"alpha_s": 1e-5}}}
    fake.calibrate_local = lambda processes, out_path: profile
    assert cli.main(["calibrate", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gpus_per_node" in text and "device.peak_tflops" in text and "0.05" in text
    assert "alpha_s" not in text and f"--cluster {out}" in text


def test_cli_calibrate_without_the_module_is_a_clear_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "autopar.runtime.calibrate", None)  # import fails
    assert cli.main(["calibrate", "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert "autopar.runtime.calibrate is not available" in err and "Traceback" not in err
