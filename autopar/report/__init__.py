"""The plan report (Markdown, HTML, charts). Reads only the :class:`~autopar.contract.plan.Plan`.

In flow order: :mod:`~autopar.report.format` (numbers with units, display order of kinds),
:mod:`~autopar.report.formulas` (the published closed forms, as data),
:mod:`~autopar.report.sections`, :mod:`~autopar.report.ranks` and
:mod:`~autopar.report.whatif` (Markdown sections), :mod:`~autopar.report.plots` (PNG
charts), :mod:`~autopar.report.html` (the self-contained page),
:mod:`~autopar.report.owned` (the files a report owns in its directory) and
:mod:`~autopar.report.document` (``render_markdown``, ``write_report``: the whole report).
Nothing here imports the planner or sympy.
"""

from autopar.report.document import render_markdown, write_report

__all__ = ["render_markdown", "write_report"]
