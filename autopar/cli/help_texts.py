"""The ``autopar`` command line's help texts: each verb's description and runnable
examples, the overview's examples and the exit codes (:mod:`autopar.cli.parser` lays them
out)."""

from __future__ import annotations

__all__ = ["EXIT_CODES_HELP", "EXAMPLES", "OVERVIEW_EXAMPLES", "DESCRIPTIONS"]

EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  internal error (a bug: rerun with --debug and report the traceback)
  2  bad input: a flag, model or cluster name, file, or a layout that breaks a
     divisibility rule (the message says what to change)
  3  infeasible: no layout fits the cluster's memory (the message names the
     binding constraint and the smallest memory any layout needs)
  4  the model cannot be traced (the message names the node)
  5  verify: the parallel program does not match the single-device model, or
     a loss, gradient or parameter is NaN/inf (the message names the first step)
  6  the solver stopped at its time limit without a plan (not an out-of-memory
     verdict: raise --time-limit)
  7  dryrun: a rank cannot be built at the plan's size, or its step disagrees
     with the plan's prediction (the message names the rank and the op or figure)
"""

EXAMPLES = {
    "plan": """\
  # the fastest layout for a 1.3B GPT on one DGX A100 node (about 3 s)
  autopar plan --model gpt-1.3b --cluster dgx-a100 --nodes 1 \\
      --global-batch-size 512 --seq-len 2048
  # GPT-3 175B on 128 nodes: save the plan and write the report (beside Megatron-LM)
  autopar plan --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 -o plan.json --report reports/gpt3
  # pin tp=2 and let the solver choose the rest; JSON for scripts
  autopar plan --model gpt-tiny --cluster local-cpu --global-batch-size 8 --tp 2 --json
  # keep 4 GiB per GPU free beyond the reserve (other processes, a safety margin)
  autopar plan --model gpt-1.3b --nodes 1 --global-batch-size 512 --memory-headroom 4
  # a Hugging Face model by its published shape (or hf:path/to/config.json, hf:mistral)
  autopar plan --model hf:llama3-8b --cluster dgx-a100 --nodes 1 \\
      --global-batch-size 64 --seq-len 2048
  # the best plan Megatron-LM can run, written as its pretrain_gpt.py flags
  autopar plan --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 --emit megatron --emit-to megatron.args""",
    "evaluate": """\
  # Megatron-LM's published GPT-3 layout, priced by the planner's cost model
  autopar evaluate --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 \\
      --tp 8 --pp 16 --dp 8 --micro-batch-size 1 --recompute full
  autopar evaluate --model gpt-tiny --cluster local-cpu --global-batch-size 8 \\
      --tp 2 --pp 1 --dp 2 --mbs 1 --json""",
    "compare": """\
  autopar compare --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 \\
      --megatron "tp=8,pp=16,dp=8,mbs=1,recompute=full"
  autopar compare --model gpt-tiny --cluster local-cpu --global-batch-size 8 \\
      --megatron "tp=2,pp=1,dp=2,mbs=1" --megatron "tp=1,pp=2,dp=2,mbs=1" --json
  # a Megatron-LM launch's own flags (the model, batch and sequence come from them)
  autopar compare --cluster dgx-a100 --nodes 128 \\
      --megatron-args examples/megatron/gpt3_175b.args""",
    "report": """\
  autopar plan --model gpt-1.3b --nodes 1 --global-batch-size 512 -o plan.json
  autopar report plan.json --out reports/again
  autopar report plan.json --out reports/again \\
      --megatron "tp=1,pp=1,dp=8,mbs=4,recompute=full" --json""",
    "calibrate": """\
  autopar calibrate --processes 2 --out local-cpu-calibrated.json
  autopar plan --model gpt-tiny --cluster local-cpu-calibrated.json \\
      --global-batch-size 8""",
    "verify": """\
  # a 2-way tensor-parallel plan of a tiny GPT, checked against one device on 2 processes
  autopar plan --model gpt-tiny --cluster local-cpu --global-batch-size 8 --tp 2 -o plan.json
  autopar verify plan.json --steps 3
  # a Hugging Face model from its config.json (random weights): plan, then verify
  autopar plan --model hf:my-llama/config.json --cluster local-cpu --global-batch-size 8 \\
      --seq-len 16 --tp 2 -o hf-plan.json
  autopar verify hf-plan.json
  autopar verify plan.json --model mypkg.models:tiny_gpt --tolerance 1e-4 --json""",
    "dryrun": """\
  # every rank class of GPT-3 175B's plan on 1,024 GPUs, built and stepped on this CPU
  autopar dryrun reports/gpt3-175b-dgx-a100-128/plan.json
  # two ranks, JSON for scripts
  autopar dryrun plan.json --rank 0,517 --json""",
}

OVERVIEW_EXAMPLES = """\
  autopar plan --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 -o plan.json --report reports/gpt3
  autopar plan --model hf:llama3-8b --cluster dgx-a100 --nodes 1 \\
      --global-batch-size 64 --seq-len 2048
  autopar evaluate --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 --tp 8 --pp 16 --dp 8 --mbs 1 --recompute full
  autopar compare --model gpt3-175b --cluster dgx-a100 --nodes 128 \\
      --global-batch-size 1536 --seq-len 2048 --megatron "tp=8,pp=16,dp=8,mbs=1,recompute=full"
  autopar report plan.json --out reports/again
  autopar calibrate --processes 2 --out local-cpu-calibrated.json
  autopar verify plan.json --steps 3
  autopar dryrun plan.json --rank 517"""

DESCRIPTIONS = {
    "autopar": "Plan tensor, pipeline and data parallel training of a GPT on a GPU cluster, "
               "price hand-written layouts with the same cost model, and explain the choice "
               "in a Markdown + HTML report, and check a plan's program against one device "
               "or at its full size. Seven verbs: plan, evaluate, compare, report, "
               "calibrate, verify, dryrun. Every verb "
               "takes --json (machine-readable stdout) and --debug (tracebacks).",
    "plan": "Search the layouts (t, p, d, b, m, schedule, ZeRO, recompute per layer) that fit "
            "the cluster's memory and print the fastest, as predicted by the cost model. "
            "Layout flags fix decisions; the solver chooses the rest. On a terminal a "
            "progress line on stderr follows the search (none when stderr is piped or with "
            "--json). --report DIR also writes the report, with what-ifs (twice the nodes, "
            "H100 instead of A100 nodes, twice the global batch: three more searches, "
            "about three times the plan's own search time; --no-whatif skips them).",
    "evaluate": "Price one fully specified layout with the same cost model the planner uses: "
                "step time, TFLOP/s per GPU, MFU, memory per stage. Nothing is searched.",
    "compare": "Solve for the auto plan, price each --megatron layout with the same cost model, "
               "and print them side by side: step time, TFLOP/s per GPU, MFU, peak memory per "
               "stage, the auto/hand ratio, and the difference per kind of time (bubble, "
               "tp_comm, dp_comm, recompute, compute ...).",
    "report": "Read a plan saved with `plan -o FILE` (or `plan --json > FILE`) and write its "
              "report (report.md, a self-contained report.html and PNG charts) without "
              "solving again. --json prints the written files and the plan's headline numbers.",
    "calibrate": "Run small matmuls and gloo all-reduces on local processes and write a "
                 "cluster JSON usable with --cluster (calls autopar.runtime.calibrate.calibrate_local). "
                 "Takes about ten seconds.",
    "verify": "Run STEPS training steps of a saved plan's parallel program on tp*pp*dp local "
              "gloo CPU processes (or the processes torchrun started) and of the "
              "single-device model on the same random batch, and report the largest loss, "
              "gradient and parameter differences per stage and per parameter. Exit code 5 "
              "when they differ past the tolerance.",
    "dryrun": "Build ranks of a saved plan at the plan's full world size in this one CPU "
              "process (torch's fake process group, fake tensors: nothing is allocated or "
              "sent) and run one training step: every micro-batch through the schedule and "
              "the optimizer step. Prints each rank's stage, layers and process groups, and "
              "its measured collective bytes (equal to the prediction), model states "
              "(equal) and saved-activation peak (within 5%). Default: one rank per pipeline "
              "stage (the ranks of a stage build the same program). Exit code 7 when a rank "
              "cannot be built or disagrees.",
}
