"""toy_cli: the ``toy`` command line (typer)."""

__version__ = "0.1.0"
