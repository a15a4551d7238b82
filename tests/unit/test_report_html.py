"""The HTML report, its charts and the rank map.

The report is written for a real small plan (gpt-tiny on four CPU processes, pp=2) and its
HTML and PNGs are checked. The pipeline schedule the timeline draws:
tests/unit/test_report_schedule.py.
"""

from __future__ import annotations

import base64
import re

import pytest
import torch

import autopar
from autopar.models import GPT, preset
from autopar.report import write_report
from autopar.report.format import format_seconds
from autopar.report.html import markdown_to_html
from autopar.report.plots import write_timeline_chart
from autopar.report.ranks import rank_groups, rank_layout_section

PNG = b"\x89PNG"


# -------------------------------------------------------------------- rank map
def test_rank_groups_follow_megatron_order():
    groups = rank_groups(tp=2, pp=2, dp=2)  # rank = t + 2·(d + 2·p)
    assert groups["TP"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["DP"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["PP"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kind in groups:  # each kind partitions the ranks
        assert sorted(r for g in groups[kind] for r in g) == list(range(8))


# ---------------------------------------------------------------------- report
@pytest.fixture(scope="module")
def tiny_plans():
    """gpt-tiny on 4 CPU processes with pp=2, and a hand layout priced by evaluate."""
    with torch.device("meta"):
        model = GPT(preset("gpt-tiny"))
    cluster = autopar.Cluster.local_cpu(processes=4)
    plan = autopar.plan(model, cluster, global_batch_size=8, seq_len=16,
                        layout=autopar.Layout(pp=2))
    hand = autopar.evaluate(model, cluster, autopar.Layout.parse("tp=2,pp=1,dp=2,mbs=1"),
                            global_batch_size=8, seq_len=16)
    return plan, hand


def test_write_report_html_and_charts(tiny_plans, tmp_path):
    plan, hand = tiny_plans
    md = write_report(plan, tmp_path, hand_layouts={"Megatron-LM": hand, "pure DP": "no fit"})
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    for heading in ("Chosen plan", "Pipeline stages", "Rank layout", "Prediction",
                    "Where the step time goes", "Memory per GPU", "Why this plan",
                    "Hand-written layouts"):
        assert re.search(rf"<h[1-3]>{heading}", page), heading
    step = format_seconds(plan.predicted.step_time_s)
    assert step in md.read_text() and f">{step}</td>" in page
    images = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4 and all(base64.b64decode(i).startswith(PNG) for i in images)
    for name in ("timeline", "memory", "breakdown", "comparison"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert len(data) > 100 and data.startswith(PNG), name
        assert f"({name}.png)" in md.read_text()
    assert "| PP | 0 | 0, 2 | 0 |" in md.read_text()   # tp=1, dp=2: stages are ranks 0 and 2


def test_write_report_without_charts_still_writes_html(tiny_plans, tmp_path):
    write_report(tiny_plans[0], tmp_path, chart=False)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<h2>Rank layout</h2>" in page and "<img" not in page
    assert not list(tmp_path.glob("*.png"))


def test_big_plan_rank_map_and_timeline_are_truncated(tiny_plans, tmp_path):
    import dataclasses

    plan = dataclasses.replace(tiny_plans[0], tp=8, pp=4, dp=4, num_micro_batches=40,
                               cluster={**tiny_plans[0].cluster, "gpus_per_node": 8})
    text = "\n".join(rank_layout_section(plan))
    assert "| TP | 3 | 24, 25, 26, 27, 28, 29, 30, 31 | 3 |" in text
    assert "12 more groups (16 TP groups in all)" in text and "| TP | 4 |" not in text
    predicted = dataclasses.replace(plan.predicted, stage_time_s=[3e-3] * 4)
    plan = dataclasses.replace(plan, predicted=predicted)
    assert write_timeline_chart(plan, tmp_path / "t.png").read_bytes().startswith(PNG)


def test_markdown_to_html_inline_constructs():
    page = markdown_to_html("# T\n\nA `x<y` and **b** and *i*.\n\n- one\n- two\n\n"
                            "| a | b |\n| :--- | ---: |\n| 1 | 2 |\n")
    assert "<h1>T</h1>" in page and "<code>x&lt;y</code>" in page
    assert "<strong>b</strong>" in page and "<em>i</em>" in page
    assert "<ul>\n<li>one</li>\n<li>two</li>\n</ul>" in page
    assert '<td style="text-align:right">2</td>' in page and "<th" in page
