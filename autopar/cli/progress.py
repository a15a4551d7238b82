"""A one-line progress display of the planner's search, for a person at a terminal.

``autopar plan`` and ``autopar compare`` pass a :class:`SearchProgress` to
``autopar.plan(..., progress=...)``; the search calls it before each config
(t, p, d, b) it solves or prunes. The line is redrawn in place on stderr::

    search: 12/40 configs (30%), best step 10.3 s, 4.2 s elapsed

Only a terminal gets it: :meth:`SearchProgress.for_stream` returns None when the stream is
not a TTY (piped, redirected to a file, captured by a test) or when the caller prints JSON,
so scripts see nothing but their output. No state outside the object.
"""

from __future__ import annotations

import time
from typing import TextIO

from autopar.report.format import format_seconds

__all__ = ["SearchProgress"]


class SearchProgress:
    """Callable ``progress(visited, total, best_step_time_s)`` that redraws one line.

    stream: where to draw (stderr of the CLI); label: what is being searched;
    min_interval_s: seconds between redraws (the first and the last call always draw).
    The line ends with a newline once ``visited == total``.
    """

    def __init__(self, stream: TextIO, label: str = "search", min_interval_s: float = 0.1):
        self.stream = stream
        self.label = label
        self.min_interval_s = min_interval_s
        self._start = time.perf_counter()
        self._drawn_at: float | None = None

    @classmethod
    def for_stream(cls, stream: TextIO, *, enabled: bool = True,
                   label: str = "search") -> SearchProgress | None:
        """A display on ``stream`` if it is a terminal and ``enabled``, else None."""
        isatty = getattr(stream, "isatty", None)
        if not enabled or isatty is None or not isatty():
            return None
        return cls(stream, label)

    def relabel(self, label: str) -> SearchProgress:
        """A fresh display on the same stream for another search (its own clock)."""
        return SearchProgress(self.stream, label, self.min_interval_s)

    def __call__(self, visited: int, total: int, best_step_time_s: float | None) -> None:
        """Redraw the line: configs visited of total, best step time so far, time elapsed."""
        now = time.perf_counter()
        if (self._drawn_at is not None and visited < total
                and now - self._drawn_at < self.min_interval_s):
            return
        self._drawn_at = now
        share = visited / total if total else 1.0
        best = ("nothing fits yet" if best_step_time_s is None
                else f"best step {format_seconds(best_step_time_s)}")
        elapsed = format_seconds(now - self._start)
        end = "\n" if visited >= total else ""
        # \r returns to the start of the line, \x1b[K clears what a longer line left there
        self.stream.write(f"\r\x1b[K{self.label}: {visited}/{total} configs ({share:.0%}), "
                          f"{best}, {elapsed} elapsed{end}")
        self.stream.flush()
