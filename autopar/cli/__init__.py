"""The ``autopar`` command line: six verbs (plan, evaluate, compare, report, calibrate,
verify); ``main`` is the entry point."""

from autopar.cli.commands import main

__all__ = ["main"]
