"""The plan report (Markdown, HTML, charts). Reads only the :class:`~autopar.plan.Plan`."""

from autopar.report.document import render_markdown, write_report

__all__ = ["render_markdown", "write_report"]
