"""The version of rhino (one place: setup.cfg reads it, ``rhino --version`` prints it)."""

__version__ = "0.1.0"
