"""examples/train_hf.py as README runs it: ``torchrun --nproc-per-node 2`` on a tiny Hugging
Face Llama (random weights), planned by autopar, trained on gloo; the loss falls. About
25 s of CPU time (two interpreters importing torch and transformers, one plan, two
captures); 40-50 s wall on two cores shared with other work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_train_hf_runs_under_torchrun_and_the_loss_falls():
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "examples/train_hf.py", "--steps", "4", "--tp", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "2 ranks; plan: tp=2" in proc.stdout
    losses = [float(x) for x in re.findall(r"step +\d+  loss (\S+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], proc.stdout
