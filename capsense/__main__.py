"""``python -m capsense``: the same as the ``capsense`` command."""

from capsense.cli import main

main()
