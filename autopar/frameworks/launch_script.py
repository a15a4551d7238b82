"""A launch script's words as bash would pass them, for the flag readers.

Megatron-LM's example scripts keep their flags in bash arrays, set sizes in variables
(``TP_SIZE=1``, ``MASTER_PORT=${MASTER_PORT:-6000}``) and sometimes quote a flag with its
value as one array element (``"--vocab-size 128256"``): :func:`script_words` reads such a
script, or a plain flags string, as the words of the command it runs without arguments.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["script_words"]


_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$")
_DEFAULT = re.compile(r"^\$\{\w+:-(.*)\}$")  # ${X:-default}


def _variables(lines: list[str]) -> dict[str, str]:
    """A launch script's plain assignments, ``NAME=value`` (quoted or not) and
    ``NAME=${OTHER:-default}`` (its default): what a script without arguments and
    environment sets. Anything else (arithmetic, command substitution) is left out."""
    out = {}
    for line in lines:
        match = _ASSIGN.match(line)
        if not match:
            continue
        try:
            words = shlex.split(match.group(2))
        except ValueError:
            continue
        value = words[0] if len(words) == 1 else "" if not words else None
        default = _DEFAULT.match(value or "")
        value = default.group(1).strip('"\'') if default else value
        if value is not None and "$" not in value and "`" not in value:
            out[match.group(1)] = value
    return out


def _substitute(word: str, variables: dict[str, str]) -> str:
    """``word`` with ``$NAME`` and ``${NAME}`` of ``variables`` replaced (others kept)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), word)


def script_words(source: str) -> list[str]:
    """The words of ``source`` (flags text, or the path of a file holding it), comments
    and line continuations removed, the script's plain variables substituted
    (:func:`_variables`), and a quoted bash-array element holding a flag and its value
    (``"--vocab-size 128256"``, as Megatron-LM's Llama scripts write them) split in two."""
    text = source
    if not source.lstrip().startswith("-") and not any(c.isspace() for c in source.strip()):
        path = Path(source)  # one word, not a flag: a file
        if not path.is_file():
            raise ValueError(f"{source!r} is neither Megatron-LM flags nor a file holding them")
        text = path.read_text(encoding="utf-8")
    lines = [re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines()]  # comments
    variables = _variables(lines)
    words = []
    for word in shlex.split("\n".join(lines).replace("\\\n", " ")):
        word = _substitute(word, variables)
        words += word.split() if word.startswith("--") and " " in word.strip() else [word]
    return words
