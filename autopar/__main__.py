"""``python -m autopar ...`` runs the command line (see :mod:`autopar.cli.commands`)."""

from autopar.cli.commands import main

raise SystemExit(main())
