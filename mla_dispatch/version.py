"""The package version (one place; the front end re-exports it as ``mla_dispatch.__version__``)."""

__version__ = "0.1.0"
