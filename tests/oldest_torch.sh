#!/usr/bin/env bash
# The oldest torch autopar supports (pyproject's range, torch>=2.11): the version the lent GPU
# machines run. In a virtual environment of its own (made on first use, then reused), torch
# 2.11.0 from PyPI (its CUDA build, about 4 GB with its NVIDIA libraries, which runs on the
# CPU here; about 1 minute to install) and autopar[test] beside it, then:
#   * the quick start's 4-rank training, with the plan it solves;
#   * the unit tier (one process, on two pytest-xdist workers) but three groups whose subject does not depend on the
#     torch version: the tests that hand autopar's emitted configurations to megatron-core,
#     torchtitan and DeepSpeed's own code and start-up (FRAMEWORK_TESTS: those frameworks are installed,
#     DeepSpeed built, against the main environment's torch only), the three property
#     tests of the input doors (DOOR_TESTS: thousands of generated JSON and CLI inputs, 2 of
#     the tier's 5 minutes), and the planner's arithmetic, closed forms, reports and CLI
#     words (PLANNER_TESTS: what they build on, capture, runs here in the capture, export and
#     repeated-layer tests);
#   * a pairwise slice of the multiprocess tier (MULTIPROCESS below, about 4 minutes): every
#     technique the runtime executes (TP and SP, every pipeline schedule, the V placement
#     included, ZeRO-1 and FSDP2, recompute) in all-pairs combinations against one process
#     with its communication bytes equal to the prediction, on the world-4 shapes that
#     pipeline two stages (where torch's pipelining differs between versions: the V
#     placement, ZeRO-1 under pipelining; the other shapes run on the main torch only),
#     ZeRO-3 (FSDP2), bf16 mixed precision, interleaving, and checkpoints saved under one
#     plan and loaded under another (DCP).
# The whole suite on 2.11, the frameworks installed there too: AUTOPAR_OLDEST_TORCH_ALL=1
# (about 40 minutes: more than CI's budget beside the main suite).
#
# Environment: AUTOPAR_OLDEST_TORCH (default 2.11.0), AUTOPAR_OLDEST_TORCH_VENV (default
# ~/.cache/autopar/venv-torch-VERSION).
set -euo pipefail
cd "$(dirname "$0")/.."
FRAMEWORK_TESTS=(--ignore tests/unit/test_framework_configs.py
    --ignore tests/unit/test_framework_startup.py
    --deselect tests/unit/test_frameworks.py::test_emitted_configurations_are_accepted_by_the_frameworks
    --deselect tests/unit/test_frameworks.py::test_example_plans_are_accepted_by_the_frameworks)
TORCH=${AUTOPAR_OLDEST_TORCH:-2.11.0}
VENV=${AUTOPAR_OLDEST_TORCH_VENV:-$HOME/.cache/autopar/venv-torch-$TORCH}
PY="$VENV/bin/python"
DOOR_TESTS=(--deselect tests/unit/test_doors_inputs.py::test_plan_cli_door
    --deselect tests/unit/test_doors_inputs.py::test_cluster_json_door
    --deselect tests/unit/test_doors_plans.py::test_plan_json_door)
MATRIX="tests/multiprocess/test_matrix.py::test_world4_every_pair_of_techniques_matches_single_process"
PLANNER_TESTS=(--ignore tests/unit/test_symbolic.py --ignore tests/unit/test_precision.py
    --ignore tests/unit/test_planner.py --ignore tests/unit/test_plan_bounds.py
    --ignore tests/unit/test_issue12_cases.py --ignore tests/unit/test_cost_models.py
    --ignore tests/unit/test_report_cli.py --ignore tests/unit/test_report_schedule.py
    --ignore tests/unit/test_report_html.py --ignore tests/unit/test_report_whatif.py
    --ignore tests/unit/test_cli_verbs.py --ignore tests/unit/test_zero_bubble_published.py
    --ignore tests/unit/test_context_parallel_pricing.py)
MULTIPROCESS=(
    "$MATRIX[tp2-pp2-dp1]" "$MATRIX[tp1-pp2-dp2]"
    "tests/multiprocess/test_matrix.py::test_bf16_mixed_precision_within_documented_tolerance"
    tests/multiprocess/test_interleaved.py
    tests/multiprocess/test_fsdp.py
    tests/multiprocess/test_checkpoint.py
)

if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" \
        2>/dev/null; then
    rm -rf "$VENV"
    python -m venv "$VENV"
    "$PY" -m pip install -q --root-user-action=ignore "torch==$TORCH"
fi
# autopar and its test extras, as a user installs them beside the torch they have: a plain
# `pip install -e` must keep it (pyproject's range holds it)
"$PY" -m pip install -q --root-user-action=ignore -e '.[test]'
"$PY" -c "import sys, torch; print('oldest supported torch:', torch.__version__)
sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH' else
         'pip install -e . replaced torch $TORCH by ' + torch.__version__)"

echo "quick start on torch $TORCH:"
"$PY" examples/quickstart.py > /tmp/autopar-quickstart-oldest-torch.log 2>&1 || {
    tail -40 /tmp/autopar-quickstart-oldest-torch.log; exit 1; }
tail -3 /tmp/autopar-quickstart-oldest-torch.log
if [ "${AUTOPAR_OLDEST_TORCH_ALL:-0}" = 1 ]; then
    # the frameworks too, DeepSpeed built against this torch (what the main environment has
    # beside them and a bare venv lacks: wheel and setuptools to build, requests for torchtitan)
    "$PY" -m pip install -q --root-user-action=ignore wheel setuptools requests
    PYTHON="$PY" bash tests/install_frameworks.sh
    exec "$PY" -m pytest -q -p no:cacheprovider
fi
"$PY" -m pytest -q -p no:cacheprovider -n 2 tests/unit "${FRAMEWORK_TESTS[@]}" "${DOOR_TESTS[@]}" \
    "${PLANNER_TESTS[@]}"
exec "$PY" -m pytest -q -p no:cacheprovider "${MULTIPROCESS[@]}"
