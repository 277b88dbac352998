"""``python -m collector`` runs the ``tracejudge`` command."""

from .cli import main

main()
