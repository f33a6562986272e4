"""spcache's version, the one place it is written.

The distribution's version (``pyproject.toml`` reads it from here), ``spcache.__version__``,
``cache_store.__version__``, ``spcache --version`` and the ``spcache_version`` every record
and snapshot carries. A module of its own, importing nothing, so that any module of
``cache_store`` can read it without importing the package's ``__init__``.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
