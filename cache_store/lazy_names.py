"""The front doors' lazy names (PEP 562), one rule for ``spcache`` and ``cache_store``.

A package lists ``name -> module that defines it``; the first access to a name imports
that module (an entry naming the package's own submodule, ``"recipes":
"spcache.recipes"``, is that module itself) and keeps the value in the package, so the
package imports nothing heavy until a name that needs it is used. ``dir()`` shows the
public names (``__all__``) and the dunders, never the helpers the package imports for
itself. Standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``), whose names in
    ``table`` load lazily; assign both in the package's ``__init__``."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        value = loaded if module == f"{package}.{name}" else getattr(loaded, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        namespace = vars(sys.modules[package])
        dunders = {name for name in namespace if name.startswith("__") and name.endswith("__")}
        return sorted(set(namespace.get("__all__", ())) | dunders)

    return __getattr__, __dir__
