"""Subcommands of the ``capsense`` CLI, one module each."""
