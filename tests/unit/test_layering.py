"""The layering DESIGN.md's "Architecture" section promises, checked on the code.

Each import check runs in a fresh interpreter (``python -c``) and reads ``sys.modules``
afterwards: what a module drags in is what its users pay for. Checks of one package's own
imports ("isolated") put a bare ``autopar`` package in ``sys.modules`` first, so that
``autopar/__init__.py`` (which imports the planner for ``autopar.plan``) does not count
against, say, the report. Static checks read the source: no private name imported across
autopar modules, no file of autopar or cost_models over 400 lines (STYLE.md, practice 2).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AUTOPAR = REPO / "autopar"
MAX_LINES = 400

# autopar.runtime modules the rewrite may load: Megatron's TP operators and their modules,
# the vocab-parallel embedding/cross-entropy, context-parallel attention, and the RNG
# tracker (and the package itself).
REWRITE_MAY_LOAD = {"autopar.runtime", "autopar.runtime.rng", "autopar.runtime.device",
                    "autopar.runtime.tp_ops", "autopar.runtime.tp_modules",
                    "autopar.runtime.vocab_parallel", "autopar.runtime.context_parallel",
                    "autopar.runtime.compat"}  # the TP operators' collectives across torch versions

_BARE_AUTOPAR = """\
import importlib.util, sys, types
_spec = importlib.util.find_spec("autopar")
_pkg = types.ModuleType("autopar")
_pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules["autopar"] = _pkg
"""


def _modules_after(code: str, *, isolated: bool = False) -> list[str]:
    """The names in sys.modules after running ``code`` in a fresh interpreter."""
    source = (_BARE_AUTOPAR if isolated else "") + code + (
        "\nimport json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", source], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _under(modules: list[str], *packages: str) -> list[str]:
    """The modules that are one of ``packages`` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def _submodules(package: str) -> list[str]:
    """Every module under ``package``, sub-packages' included."""
    folder = AUTOPAR / package.split(".", 1)[1]
    return [f"{package}." + ".".join(p.relative_to(folder).with_suffix("").parts)
            for p in sorted(folder.rglob("*.py")) if p.stem != "__init__"]


# the planner's sub-packages in the order of the flow: each imports only those before it
PLANNER_STEPS = ("strategies", "costs", "cpsat", "search")


def test_planner_sub_packages_import_only_earlier_steps():
    """strategies -> costs -> cpsat -> search: no sub-package of the planner imports a later
    one (the modules directly in autopar/planner/, the planner's doors, may import any)."""
    wrong = []
    for i, step in enumerate(PLANNER_STEPS):
        for path in sorted((AUTOPAR / "planner" / step).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["autopar", "planner"] and len(parts) > 2 and (
                            parts[2] not in PLANNER_STEPS[:i + 1]):
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert wrong == [], wrong


# ---------------------------------------------------------------------------- imports
def test_cost_models_imports_without_torch_or_autopar():
    assert _under(_modules_after("import cost_models"), "torch", "autopar") == []


def test_import_autopar_loads_no_fsdp_or_dtensor():
    loaded = _under(_modules_after("import autopar"), "torch.distributed.fsdp",
                    "torch.distributed.tensor")
    assert loaded == [], loaded[:10]


PLAN_GPT_TINY = f"""\
import {", ".join(_submodules("autopar.planner"))}, autopar.api
import torch, autopar
from autopar.models import GPT, preset
with torch.device("meta"):
    model = GPT(preset("gpt-tiny"))
autopar.plan(model, autopar.Cluster.local_cpu(processes=4), global_batch_size=8, seq_len=16)
"""


def test_planner_loads_no_runtime_rewrite_or_oracle():
    """Planning gpt-tiny end to end loads no runtime, no rewrite, and no oracle (the oracle
    checks the planner and is never imported by plan())."""
    loaded = _under(_modules_after(PLAN_GPT_TINY), "autopar.runtime", "autopar.rewrite",
                    "autopar.oracle")
    assert loaded == [], loaded


REPORT_FORBIDS = ("autopar.planner", "autopar.api", "autopar.oracle", "ortools", "sympy")


def test_report_modules_import_no_planner_oracle_or_sympy():
    code = "import " + ", ".join(["autopar.report", *_submodules("autopar.report")])
    loaded = _under(_modules_after(code, isolated=True), *REPORT_FORBIDS)
    assert loaded == [], loaded[:10]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    from helpers import tiny_plan

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(tiny_plan(2, 1).to_json())
    return path


def test_report_renders_a_saved_plan_without_planner_oracle_or_sympy(plan_file):
    code = (f"import autopar.report\nfrom autopar.contract.plan import Plan\n"
            f"plan = Plan.from_json(open({str(plan_file)!r}).read())\n"
            f"assert autopar.report.render_markdown(plan)\n")
    loaded = _under(_modules_after(code, isolated=True), *REPORT_FORBIDS)
    assert loaded == [], loaded[:10]


def test_runtime_loads_no_rewrite():
    """The runtime executes what the rewrite made; the recipe (autopar.recipe) composes
    them, so the runtime never imports the rewrite (no runtime <-> rewrite cycle)."""
    code = "import " + ", ".join(["autopar.runtime", *_submodules("autopar.runtime")])
    loaded = _under(_modules_after(code, isolated=True), "autopar.rewrite", "autopar.recipe")
    assert loaded == [], loaded


def test_frameworks_load_no_report():
    """The framework emitters and readers describe a plan to another engine; the report
    explains it to a person. Neither builds on the other (the CLI composes them)."""
    code = "import " + ", ".join(["autopar.frameworks", *_submodules("autopar.frameworks")])
    loaded = _under(_modules_after(code, isolated=True), "autopar.report")
    assert loaded == [], loaded


def test_the_planner_entry_loads_no_framework_emitters():
    """``autopar.api`` plans for a target from :mod:`autopar.targets` (data); the framework
    emitters and readers price a framework's run through the api, so the two packages do not
    import each other."""
    loaded = _under(_modules_after("import autopar.api", isolated=True), "autopar.frameworks")
    assert loaded == [], loaded


def test_rewrite_loads_only_tp_operators_and_rng_from_runtime():
    """The rewrite reads the plan: from the runtime only the operators it inserts (TP's,
    context-parallel attention; with the
    compatibility module their collectives' names come from) and the RNG tracker (with the
    device module it forks generators through); from the planner only the strategy vocabulary that decodes the plan's keys
    (``planner.strategies.decode_placements``), never the solver, search or OR-Tools."""
    code = "import " + ", ".join(["autopar.rewrite", *_submodules("autopar.rewrite")])
    loaded = _modules_after(code, isolated=True)
    runtime = set(_under(loaded, "autopar.runtime"))
    assert runtime <= REWRITE_MAY_LOAD, sorted(runtime - REWRITE_MAY_LOAD)
    planner = set(_under(loaded, "autopar.planner", "autopar.api", "autopar.oracle", "ortools"))
    assert planner <= {"autopar.planner", "autopar.planner.strategies",
                       "autopar.planner.strategies.nodes", "autopar.planner.strategies.aten"
                       }, sorted(planner)


# ----------------------------------------------------------------------------- source
def _sources() -> list[Path]:
    return sorted(AUTOPAR.rglob("*.py"))


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_private_name_is_imported_across_autopar_modules():
    hits = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _absolute(path, node)
            if module != "autopar" and not module.startswith("autopar."):
                continue
            hits += [f"{path.relative_to(REPO)}:{node.lineno}: from {module} import {a.name}"
                     for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert hits == [], "private names imported across modules:\n" + "\n".join(hits)


def test_no_autopar_or_cost_models_file_exceeds_400_lines():
    sources = _sources() + sorted((REPO / "cost_models").rglob("*.py"))
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in sources
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert long == [], "files over 400 lines (STYLE.md, practice 2):\n" + "\n".join(long)
