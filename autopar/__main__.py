"""``python -m autopar ...`` runs the command line (see :mod:`autopar.cli`)."""

from autopar.cli import main

raise SystemExit(main())
