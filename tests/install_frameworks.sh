#!/usr/bin/env bash
# megatron-core, torchtitan and DeepSpeed for tests/unit/test_framework_configs.py, whose
# configuration code checks what autopar emits for them (tests/framework_configs.py).
#
# Their torch requirements are loose (torch>=2.x), so a plain install would pull a CUDA torch:
# everything goes in with --no-deps, the three frameworks plus exactly what importing their
# configuration code needs that this environment lacks (the rest, numpy, pydantic, pandas,
# huggingface-hub and so on, is already here). Kept out on purpose: wandb, torch_checkpointing,
# transformer-engine, apex. torchtitan is 0.2.2, the last release that reads job TOML
# files (0.3.0 replaced them by Python config registries); it imports triton on import.
# datasets 4.7 states huggingface-hub<2 and fsspec<=2026.2, which
# would downgrade what transformers uses; it imports fine with the newer ones.
#
# DeepSpeed is an sdist: built against the installed torch (--no-build-isolation), no CUDA
# ops (DS_BUILD_OPS=0) but its CPU shared-memory comm op prebuilt (DS_BUILD_SHM_COMM=1; about
# 2 minutes of C++ on 2 cores): DeepSpeedConfig reads the world size from deepspeed.comm,
# whose CPU backend loads that op and would otherwise compile it on first use.
#
# A no-op (well under a second) when the pinned versions and the DeepSpeed op are installed.
set -euo pipefail
PYTHON=${PYTHON:-python}

installed() {
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

want = {"megatron-core": "0.16.1", "torchtitan": "0.2.2", "deepspeed": "0.19.8"}
try:
    ok = all(md.version(name) == version for name, version in want.items())
except md.PackageNotFoundError:
    ok = False
modules = ["tyro", "triton", "tensorboard", "torchdata", "datasets", "pyarrow", "dill",
           "xxhash", "multiprocess", "httpx", "psutil", "hjson", "einops", "msgpack"]
ok = ok and all(importlib.util.find_spec(m) is not None for m in modules)
if ok:  # read the file, not the module: importing deepspeed takes seconds
    spec = importlib.util.find_spec("deepspeed")
    info = {}
    with open(spec.submodule_search_locations[0] + "/git_version_info_installed.py") as f:
        exec(f.read(), info)
    ok = bool(info["installed_ops"].get("deepspeed_shm_comm"))
sys.exit(0 if ok else 1)
EOF
}

if installed 2>/dev/null; then
    exit 0
fi

torch_before=$("$PYTHON" -c "import torch; print(torch.__version__)")
pip=("$PYTHON" -m pip install -q --no-deps --root-user-action=ignore)

"${pip[@]}" \
    megatron-core==0.16.1 \
    torchtitan==0.2.2 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0 \
    triton==3.9.0 \
    tensorboard==2.21.0 \
    torchdata==0.11.0 \
    datasets==4.7.0 pyarrow==26.0.1 dill==0.4.0 xxhash==4.1.0 multiprocess==0.70.18 \
    httpx==0.28.1 httpcore==1.0.9 \
    psutil==7.2.2 hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2

DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 "${pip[@]}" --no-build-isolation --no-cache-dir deepspeed==0.19.8

torch_after=$("$PYTHON" -c "import torch; print(torch.__version__)")
if [ "$torch_after" != "$torch_before" ]; then
    echo "install_frameworks.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
"$PYTHON" - >/dev/null <<'EOF'
import warnings

warnings.filterwarnings("ignore")
import megatron.core.transformer.transformer_config  # noqa: F401
import torchtitan.config  # noqa: F401
import deepspeed.runtime.config  # noqa: F401
EOF
installed
