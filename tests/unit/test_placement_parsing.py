"""Placements are parsed in one place: autopar/contract/placement.py.

DESIGN.md: ``Placement = Replicate | Shard(dim) | Partial`` and the strategy keys
("column:S2") live in autopar/contract/placement.py, "the only code that reads or writes" them.
This test greps the rest of autopar/ for the string forms that code used to take apart by
hand ("S2"[1:], == "R", f"S{d}", key.rpartition(":"), ...) and lists every hit as
file:line.
"""

from __future__ import annotations

import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
OWNER = REPO / "autopar" / "contract" / "placement.py"

FORBIDDEN = {
    "startswith('S') on a placement": re.compile(r"""startswith\(\s*["']S["']\s*\)"""),
    "int(p[1:]): the dim of a shard": re.compile(r"""int\([\w.\[\]]+\[1:\]\)"""),
    '== "P": a partial placement': re.compile(r"""[!=]=\s*["']P["']"""),
    '== "R": a replicated placement': re.compile(r"""[!=]=\s*["']R["']"""),
    'f"S{...}": building a shard': re.compile(r"""["']S\{"""),
    'rpartition(":") on a strategy key': re.compile(r"""rpartition\(\s*["']:["']\s*\)"""),
    'startswith("vocab_parallel:") on a key': re.compile(r"""startswith\(\s*["']vocab_parallel:["']\s*\)"""),
}


def placement_string_hits(root: Path = REPO / "autopar") -> list[str]:
    """Every line outside autopar/contract/placement.py that parses or builds placement strings."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path == OWNER:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            hits += [f"{path.relative_to(root.parent)}:{number}: {what}: {line.strip()}"
                     for what, pattern in FORBIDDEN.items() if pattern.search(code)]
    return hits


def test_the_patterns_find_what_they_are_meant_to(tmp_path):
    (tmp_path / "bad.py").write_text(
        'a = p.startswith("S")\nb = int(placement[1:])\nc = x == "P"\nd = y == \'R\'\n'
        'e = f"S{d}"\nf = key.rpartition(":")\ng = k.startswith("vocab_parallel:")\n'
        'h = shape[1:]  # not a placement\n# "R" == x only in a comment\ni = z != "R"\n')
    hits = placement_string_hits(tmp_path)
    assert [h.split(":")[1] for h in hits] == ["1", "2", "3", "4", "5", "6", "7", "10"], hits


def test_no_placement_string_parsing_outside_placement_module():
    hits = placement_string_hits()
    assert hits == [], (f"{len(hits)} places parse placement strings outside autopar/contract/placement.py "
                        "(use its Placement / strategy-key functions):\n" + "\n".join(hits))
