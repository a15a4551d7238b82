"""examples/train_gpt.py killed after a checkpoint and restarted with ``--resume`` continues
the loss curve exactly: three ``torchrun --nproc-per-node 2`` runs of 6 steps (B = 8,
s = 16) on one saved plan: one that dies right after the checkpoint of step 3 (exit status
17, no cleanup: ``--crash-after-checkpoint``), its ``--resume``, and an uninterrupted one.
The first three losses of the killed run and the last three of the resumed one equal the
uninterrupted run's, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "6", "--batch-size", "8", "--seq-len", "16", "--max-bytes", "200000",
        "--log-every", "1", "--tp", "2", "--pp", "1", "--dp", "1"]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "examples/train_gpt.py", *ARGS, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def test_a_killed_run_resumes_its_loss_curve_exactly(tmp_path):
    plan, ckpt = tmp_path / "plan.json", tmp_path / "ckpt"
    killed = _torchrun("--save-plan", str(plan), "--checkpoint-dir", str(ckpt),
                       "--checkpoint-every", "3", "--crash-after-checkpoint", "3",
                       "--losses-file", str(tmp_path / "killed.jsonl"))
    assert killed.returncode != 0, killed.stdout  # it died after the checkpoint
    assert (ckpt / "step_000003" / ".metadata").is_file(), killed.stdout + killed.stderr[-3000:]
    resumed = _torchrun("--plan", str(plan), "--checkpoint-dir", str(ckpt), "--resume",
                        "--losses-file", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout, resumed.stdout
    whole = _torchrun("--plan", str(plan), "--losses-file", str(tmp_path / "whole.jsonl"))
    assert whole.returncode == 0, whole.stdout + whole.stderr[-3000:]
    first, second = _losses(tmp_path / "killed.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(first) == [0, 1, 2] and sorted(second) == [3, 4, 5]
    assert {**first, **second} == _losses(tmp_path / "whole.jsonl")
