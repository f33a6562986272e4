"""spcache: the program's front door.

``spcache COMMAND ...`` (:mod:`spcache.cli`) dispatches to the package that does the work:
``cache_store`` for what reads a cache at rest (verify, stats, export, recipes, here in
``spcache``), ``service`` for ``serve``, ``workers`` for what may touch a GPU
(precompute, worker, demo). Importing this package imports none of them.
"""

__version__ = "0.1.0"
