"""The plan report as one self-contained HTML file (``report.html``).

The HTML is converted from the Markdown of :func:`autopar.report.document.render_markdown`, so the
two never disagree. The converter knows only what that report emits: ``#`` headings, pipe
tables (the rule row sets each column's alignment), paragraphs, ``- `` bullet lists, and
inline code, bold, italics and images. Images named by a relative path are read from the
report directory and embedded as ``data:image/png;base64,...`` URIs, so the file can be
mailed or attached on its own. No dependencies beyond the standard library.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

__all__ = ["markdown_to_html", "write_html"]

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto;
       padding: 0 1rem; color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.92rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; }
th { background: #f3f3f3; }
code { background: #f3f3f3; padding: 0 0.2rem; border-radius: 3px; }
img { max-width: 100%; }
h1 { font-size: 1.6rem; } h2 { border-bottom: 1px solid #ddd; margin-top: 2rem; }
"""

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_ITALIC = re.compile(r"(?<![\w*])\*(?![\s*])([^*]+?)\*(?![\w*])")
_RULE_CELL = re.compile(r"^:?-{3,}:?$")


def _data_uri(src: str, image_dir: Path | None) -> str:
    """``src`` as a base64 data URI when it names a readable PNG in ``image_dir``."""
    path = image_dir / src if image_dir is not None else None
    if path is None or not path.is_file():
        return src
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _inline(text: str, image_dir: Path | None) -> str:
    """Escape ``text`` and render inline code, images, bold and italics."""
    parts = text.split("`")
    out = []
    for i, part in enumerate(parts):
        if i % 2 and i < len(parts) - 1:  # between a pair of backticks: code, verbatim
            out.append(f"<code>{html.escape(part)}</code>")
            continue
        part = html.escape(part if i % 2 == 0 else "`" + part, quote=False)
        part = _IMAGE.sub(lambda m: f'<img alt="{m[1].replace(chr(34), "&quot;")}" '
                                    f'src="{_data_uri(m[2], image_dir)}">', part)
        part = _BOLD.sub(r"<strong>\1</strong>", part)
        out.append(_ITALIC.sub(r"<em>\1</em>", part))
    return "".join(out)


def _cells(line: str) -> list[str]:
    """The cells of a pipe-table row."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(rows: list[str], image_dir: Path | None) -> list[str]:
    """A pipe table (header, rule, body rows) as an HTML table."""
    header, body = _cells(rows[0]), rows[1:]
    aligns = ["left"] * len(header)
    if body and all(_RULE_CELL.match(c) for c in _cells(body[0])):
        aligns = ["right" if c.endswith(":") and not c.startswith(":") else "left"
                  for c in _cells(body[0])]
        body = body[1:]

    def row(cells: list[str], tag: str) -> str:
        tds = "".join(f'<{tag} style="text-align:{aligns[k] if k < len(aligns) else "left"}">'
                      f"{_inline(c, image_dir)}</{tag}>" for k, c in enumerate(cells))
        return f"<tr>{tds}</tr>"

    return (["<table>", "<thead>", row(header, "th"), "</thead>", "<tbody>"]
            + [row(_cells(r), "td") for r in body] + ["</tbody>", "</table>"])


def _blocks(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Group Markdown lines into (kind, lines) blocks: heading, table, list, paragraph."""
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        kind = ("blank" if not line.strip() else "heading" if re.match(r"#{1,6} ", line)
                else "table" if line.lstrip().startswith("|")
                else "list" if line.startswith("- ") else "paragraph")
        if kind in ("table", "list", "paragraph") and blocks and blocks[-1][0] == kind:
            blocks[-1][1].append(line)
        elif kind != "blank":
            blocks.append((kind, [line]))
        else:
            blocks.append(("blank", []))
    return [b for b in blocks if b[0] != "blank"]


def markdown_to_html(text: str, image_dir: str | Path | None = None,
                     title: str = "autopar plan") -> str:
    """A complete HTML document for the Markdown ``text`` of the report.

    image_dir: where relative image paths are read from to embed them; None leaves them
        as links.
    """
    image_dir = Path(image_dir) if image_dir is not None else None
    body: list[str] = []
    for kind, lines in _blocks(text.splitlines()):
        if kind == "heading":
            level = len(lines[0]) - len(lines[0].lstrip("#"))
            body.append(f"<h{level}>{_inline(lines[0][level:].strip(), image_dir)}</h{level}>")
        elif kind == "table":
            body += _table(lines, image_dir)
        elif kind == "list":
            body += ["<ul>"] + [f"<li>{_inline(x[2:], image_dir)}</li>" for x in lines] + ["</ul>"]
        else:
            body.append(f"<p>{_inline(' '.join(x.strip() for x in lines), image_dir)}</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def write_html(markdown: str, out_dir: str | Path, name: str = "report.html") -> Path:
    """Write ``out_dir/name`` from the report's Markdown, charts embedded; return its path."""
    out_dir = Path(out_dir)
    first = markdown.splitlines()[0] if markdown else ""
    title = first.lstrip("#").strip() or "autopar plan"
    path = out_dir / name
    path.write_text(markdown_to_html(markdown, out_dir, title), encoding="utf-8")
    return path
