"""examples/train_gpt.py killed after a checkpoint and restarted with ``--resume`` continues
the loss curve exactly: three ``torchrun --nproc-per-node 2`` runs of 6 steps (B = 8,
s = 16) on one saved plan: one that checkpoints after steps 2 and 4 and dies right after
the second (exit status 17, no cleanup: ``--crash-after-checkpoint``), its ``--resume``
once the newest checkpoint has a truncated shard, and an uninterrupted one. The resumed run
skips the damaged checkpoint, says why, and starts from step 2; the killed run's losses
(steps 0-3) and the resumed run's (steps 2-5) equal the uninterrupted run's, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autopar.runtime.checkpoint_files import MANIFEST

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
                       "--checkpoint-every", "2", "--crash-after-checkpoint", "4",
                       "--losses-file", str(tmp_path / "killed.jsonl"))
    assert killed.returncode != 0, killed.stdout  # it died after the checkpoint
    newest = ckpt / "step_000004"
    assert (newest / MANIFEST).is_file(), killed.stdout + killed.stderr[-3000:]
    shard = sorted(newest.glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size - 1)
    resumed = _torchrun("--plan", str(plan), "--checkpoint-dir", str(ckpt), "--resume",
                        "--losses-file", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert f"skipped checkpoint {newest}: {shard}" in resumed.stdout, resumed.stdout
    assert f"resumed from {ckpt / 'step_000002'} at step 2" in resumed.stdout, resumed.stdout
    whole = _torchrun("--plan", str(plan), "--losses-file", str(tmp_path / "whole.jsonl"))
    assert whole.returncode == 0, whole.stdout + whole.stderr[-3000:]
    first, second = _losses(tmp_path / "killed.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(first) == [0, 1, 2, 3] and sorted(second) == [2, 3, 4, 5]
    want = _losses(tmp_path / "whole.jsonl")
    assert first == {k: want[k] for k in first} and second == {k: want[k] for k in second}
