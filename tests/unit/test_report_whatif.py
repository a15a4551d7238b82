"""What-if re-plans in the report: real plans for changed inputs, rendered as a section."""

import torch

import autopar
from autopar.models import GPT, preset
from autopar.api import what_if_plans
from autopar.report.whatif import what_if_markdown


def test_what_if_section_replans_and_reports(tmp_path):
    with torch.device("meta"):
        model = GPT(preset("gpt-tiny"))
    cluster = autopar.Cluster.local_cpu(processes=2)
    plan = autopar.plan(model, cluster, global_batch_size=4, seq_len=16)
    what_ifs = what_if_plans(model, cluster, plan)
    assert set(what_ifs) == {"twice the nodes", "twice the global batch"}  # no H100 for a CPU
    assert what_ifs["twice the nodes"].num_gpus == 4
    assert what_ifs["twice the global batch"].global_batch_size == 8
    section = what_if_markdown(plan, what_ifs)
    assert "## What if" in section and "twice the nodes" in section
    path = autopar.report.write_report(plan, tmp_path, chart=False, what_ifs=what_ifs)
    assert "## What if" in path.read_text() and "What if" in (tmp_path / "report.html").read_text()
