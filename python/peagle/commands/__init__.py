"""Subcommands of the ``peagle`` command line (one module each, see :mod:`peagle.cli`)."""
