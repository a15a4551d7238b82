"""Measures of the code's shape that issue 33 ("one place per technique") tracks, printed.

For ``autopar/`` and ``cost_models/`` (static: the source is parsed, nothing imported):

* files over 400 lines, and functions over 60 lines;
* comparisons against a technique's value outside ``autopar/techniques/``: a ``==``, ``!=``,
  ``in`` or ``not in`` whose other side is one of a technique's names (pipeline schedules,
  recompute modes) or, for the ZeRO stage, an int compared with something named
  ``zero_stage`` / ``zero`` / ``stage``;
* cycles between packages (``autopar.graph``, ``autopar.planner``, ..., their sub-packages
  such as ``autopar.planner.search``, and each top-level
  module, ``autopar.contract``, ``autopar.api``, ...), imports inside functions included;
* layout types: classes with both a ``tp`` and a ``pp`` field or constructor argument.

Run: ``python benchmarks/architecture_measures.py`` (a second; ``--list`` prints each hit).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _technique_names() -> dict[str, set[str]]:
    from autopar.contract.plan import RECOMPUTE_MODES
    from autopar.techniques.pipeline_schedules import SCHEDULES

    return {"pipeline schedule": set(SCHEDULES), "recompute mode": set(RECOMPUTE_MODES)}


def _sources() -> list[Path]:
    return sorted((ROOT / "autopar").rglob("*.py")) + sorted((ROOT / "cost_models").rglob("*.py"))


def _strings(node: ast.AST) -> set[str]:
    """The str constants ``node`` is or holds (a tuple/list/set literal)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(
        node, ast.Attribute) else ""


def technique_comparisons(tree: ast.AST, names: dict[str, set[str]]) -> list[tuple[int, str]]:
    """(line, technique) of each comparison against a technique's value in ``tree``."""
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
        if not any(isinstance(op, ops) for op in node.ops):
            continue
        constants = set().union(*(_strings(s) for s in sides))
        for technique, values in names.items():
            if constants & values:
                hits.append((node.lineno, technique))
        ints = [s for s in sides if isinstance(s, ast.Constant) and type(s.value) is int]
        if ints and any(_name(s) in ("zero_stage", "zero", "stage") for s in sides) or any(
                isinstance(op, (ast.GtE, ast.Gt, ast.Lt, ast.LtE)) for op in node.ops) and ints \
                and any(_name(s) == "zero_stage" for s in sides):
            hits.append((node.lineno, "ZeRO stage"))
    return hits


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "cost_models":
        return "cost_models"
    if parts[0] != "autopar":
        return None
    if len(parts) == 1:
        return "autopar"
    if len(parts) > 2 and (ROOT / "autopar" / parts[1] / parts[2]).is_dir():
        return ".".join(parts[:3])  # a sub-package (autopar.planner.search, ...)
    if (ROOT / "autopar" / parts[1]).is_dir() or (ROOT / "autopar" / f"{parts[1]}.py").exists():
        return "autopar." + parts[1]
    return "autopar"  # a name autopar/__init__ defines


def _is_module(name: str) -> bool:
    """Whether dotted ``name`` is a module or package of this repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").exists()


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_edges(trees: dict[Path, ast.AST]) -> dict[str, set[str]]:
    """Package -> the packages it imports (module level or inside functions)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        src = _package(_module_of(path))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = subs if all(_is_module(m) for m in subs) else [node.module] + subs
            elif isinstance(node, ast.ImportFrom) and node.level:
                targets = ["cost_models"] if src == "cost_models" else []
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                dst = _package(target)
                if dst and src and dst != src and not (
                        src == "autopar" and dst.startswith("autopar.")
                        and target == dst):  # autopar/__init__ naming its packages
                    edges[src].add(dst)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def layout_types(trees: dict[Path, ast.AST]) -> list[str]:
    """Classes with both ``tp`` and ``pp`` as a field or an ``__init__`` argument."""
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)
                      and isinstance(t.target, ast.Name)}
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    fields |= {a.arg for a in f.args.args + f.args.kwonlyargs}
            if {"tp", "pp"} <= fields:
                out.append(f"{_module_of(path)}.{node.name}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every hit")
    args = parser.parse_args(argv)
    names = _technique_names()
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in _sources()}
    long_files = [(p, n) for p in trees if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = [(p, f.name, f.end_lineno - f.lineno + 1) for p, t in trees.items()
                      for f in ast.walk(t) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    compared: dict[str, list[str]] = defaultdict(list)
    for p, t in trees.items():
        if "techniques" in p.relative_to(ROOT).parts:
            continue
        for line, technique in technique_comparisons(t, names):
            compared[technique].append(f"{p.relative_to(ROOT)}:{line}")
    edges = package_edges(trees)
    loops = cycles(edges)
    layouts = layout_types(trees)
    print(f"files over {MAX_FILE_LINES} lines: {len(long_files)}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long_functions)}")
    for technique in (*names, "ZeRO stage"):
        print(f"comparisons against a {technique} outside autopar/techniques: "
              f"{len(compared[technique])}")
    print(f"package cycles: {len(loops)} {loops if loops else ''}".rstrip())
    print(f"layout types (classes with tp and pp): {len(layouts)}: {', '.join(layouts)}")
    if args.list:
        for p, n in long_files:
            print(f"  file {p.relative_to(ROOT)}: {n} lines")
        for p, name, n in long_functions:
            print(f"  function {p.relative_to(ROOT)}:{name}: {n} lines")
        for loop in loops:
            for a in loop:
                print(f"  cycle edge {a} -> {', '.join(sorted(edges[a] & set(loop)))}")
        for technique, where in compared.items():
            for w in where:
                print(f"  {technique}: {w}")


if __name__ == "__main__":
    main()
