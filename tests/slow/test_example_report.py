"""Regenerate the cheapest example report (a 1.3B GPT on one DGX A100 node, about 10 s)
with ``examples/make_reports.py`` into a temporary directory and check its structure: the
sections in order, every image present and a non-empty PNG (as a file and embedded in the
HTML), the numbers equal to the Plan's, and the checked-in ``reports/`` copy up to date.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from PIL import Image

from autopar.report.format import format_bytes, format_seconds, format_tflops
from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
SECTIONS = ["# gpt-1.3b on 1 DGX A100 node", "## Chosen plan", "### Pipeline stages",
            "## Prediction", "## Memory per GPU by pipeline stage", "## Where the step time goes",
            "## Rank layout", "## Communication per GPU per step",
            "## Ops every tensor-parallel rank runs whole", "## Why this plan",
            "### Binding constraints", "### Best alternatives the search priced",
            "## Run this plan with Megatron-LM, torchtitan or DeepSpeed",
            "## Hand-written layouts priced by the same cost model", "## What if",
            "## How the cost model is checked"]
# each chart sits in its section: timeline under the chosen plan, memory under memory ...
CHARTS = {"timeline.png": "### Pipeline stages", "memory.png": "## Memory per GPU",
          "breakdown.png": "## Where the step time goes",
          "comparison.png": "## Hand-written layouts"}


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """(plan, Megatron plan, report.md path, checked-in directory) of the 1.3B example."""
    make_reports = load_script("examples/make_reports.py")
    case = next(c for c in make_reports.CASES if c[1] == "gpt-1.3b")
    plan, megatron, path = make_reports.write_example(
        *case, out_root=tmp_path_factory.mktemp("reports"))
    return plan, megatron, path, ROOT / "reports" / case[0]


def _table(text: str, heading: str) -> dict[str, list[str]]:
    """The pipe table under ``heading``: first cell -> the other cells of its row (the
    header row included, under its first cell)."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in row.strip("|").split("|")] for row in rows[:1] + rows[2:])}


def test_sections_in_order_and_charts_in_their_sections(example):
    text = example[2].read_text(encoding="utf-8")
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert sorted(links) == sorted(CHARTS)
    for image, section in CHARTS.items():
        start = text.index(section)
        end = text.index("\n## ", start + 1)
        assert f"({image})" in text[start:end], (image, section)
    page = example[2].with_suffix(".html").read_text(encoding="utf-8")
    for section in SECTIONS:
        level = len(section.split()[0])
        title = section[level + 1:]
        assert re.search(rf"<h{level}>{re.escape(title)}", page), section


def test_every_image_is_a_non_empty_png_and_embedded(example):
    out = example[2].parent
    page = example[2].with_suffix(".html").read_text(encoding="utf-8")
    embedded = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == len(CHARTS)
    files = {name: (out / name).read_bytes() for name in CHARTS}
    assert sorted(base64.b64decode(e) for e in embedded) == sorted(files.values())
    for name, data in files.items():
        assert data.startswith(PNG) and len(data) > 5000, name
        with Image.open(out / name) as image:
            assert image.width >= 400 and image.height >= 150, name
            assert len(image.convert("RGB").getcolors(1 << 16) or range(257)) > 16, name


def test_numbers_equal_the_plans(example):
    plan, megatron, path, _ = example
    text, p = path.read_text(encoding="utf-8"), plan.predicted
    chosen = _table(text, "## Chosen plan")
    assert chosen["tensor parallel t"] == [str(plan.tp)]
    assert chosen["pipeline parallel p"] == [str(plan.pp)]
    assert chosen["data parallel d"] == [str(plan.dp)]
    assert chosen["micro-batch size b"] == [str(plan.micro_batch_size)]
    assert chosen["micro-batches per step m"] == [str(plan.num_micro_batches)]
    assert plan.dp * plan.micro_batch_size * plan.num_micro_batches == 512
    prediction = _table(text, "## Prediction")
    assert prediction["step time"] == [format_seconds(p.step_time_s)]
    assert prediction["throughput per GPU"] == [f"{format_tflops(p.tflops_per_gpu)} TFLOP/s"]
    assert prediction["model FLOPs utilisation (MFU)"] == [f"{p.mfu:.1%}"]
    assert prediction["peak memory per GPU"][0].startswith(format_bytes(p.peak_memory_bytes))
    memory = _table(text, "## Memory per GPU by pipeline stage (GiB)")
    stage = p.memory_bytes_by_stage[0]
    row = dict(zip(memory["stage"], memory["0"]))
    assert float(row["total"]) == pytest.approx(sum(stage.values()) / 2**30, abs=0.006)
    reserve = sum(p.memory_reserve_bytes_by_stage[0].values())
    assert float(row["reserve"]) == pytest.approx(reserve / 2**30, abs=0.006)
    assert float(memory["0"][0]) == pytest.approx(stage["parameters"] / 2**30, abs=0.006)
    times = _table(text, "## Where the step time goes")
    assert times["compute"][0] == format_seconds(p.time_s_by_kind["compute"])
    hand = _table(text, "## Hand-written layouts")
    row = next(v for k, v in hand.items() if k.startswith("Megatron-LM"))
    assert row[1] == format_seconds(megatron.predicted.step_time_s)
    assert row[5] == f"{p.step_time_s / megatron.predicted.step_time_s:.2f}"
    page = path.with_suffix(".html").read_text(encoding="utf-8")
    assert f">{format_seconds(p.step_time_s)}</td>" in page
    assert f">{format_tflops(p.tflops_per_gpu)} TFLOP/s</td>" in page


def test_checked_in_report_is_up_to_date(example):
    """reports/ holds what `python examples/make_reports.py` writes today (bar solve time)."""
    def stable(text: str) -> str:
        return re.sub(r"\| solver time \| [^|]+ \|", "| solver time | … |", text)

    fresh = stable(example[2].read_text(encoding="utf-8"))
    checked_in = stable((example[3] / "report.md").read_text(encoding="utf-8"))
    assert fresh == checked_in, ("reports/ is stale: regenerate it with "
                                 "`python examples/make_reports.py`")
