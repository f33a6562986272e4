"""The parameters as a recipe's ``prepare`` and ``compute`` see them: read-only.

The parameters make the fingerprint: a recipe that changed one in place would store
records computed with other values under the fingerprint of these, and later runs would
skip them as current. The engine keeps its parameters in a :class:`ReadOnlyParams`, and
loaders hand one to ``prepare``; users meet it as ``spcache.recipes.ReadOnlyParams``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ReadOnlyParams"]


class ReadOnlyParams(Mapping[str, Any]):
    """The resolved parameters as ``prepare`` and ``compute`` see them: a mapping that
    cannot be changed.

    The parameters make the fingerprint: a recipe that changed one in place (``params
    ["level"] += 1``) would store records computed with other values under the
    fingerprint of these, and later runs would skip them as current. Any attempt
    raises ``TypeError`` naming the parameter, which fails that sample like any error
    its ``compute`` raises (the reason names the recipe). ``dict(params)`` is a copy a
    recipe may change for itself. Pickles as itself (loader processes get one too).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ReadOnlyParams({self._values!r})"

    def __reduce__(self) -> tuple[type[ReadOnlyParams], tuple[dict[str, Any]]]:
        return (type(self), (self._values,))

    @staticmethod
    def _refuse(what: str) -> TypeError:
        return TypeError(
            f"recipe parameters are read-only: cannot {what} (the parameters make the "
            "fingerprint; copy them with dict(params) to change a value for yourself)"
        )

    def __setitem__(self, key: str, value: Any) -> None:
        raise self._refuse(f"set {key!r}")

    def __delitem__(self, key: str) -> None:
        raise self._refuse(f"delete {key!r}")

    def __ior__(self, other: Any) -> ReadOnlyParams:
        raise self._refuse("update them")

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise self._refuse("update them")

    def pop(self, key: str, *default: Any) -> Any:
        raise self._refuse(f"pop {key!r}")

    def popitem(self) -> tuple[str, Any]:
        raise self._refuse("pop an item")

    def setdefault(self, key: str, default: Any = None) -> Any:
        raise self._refuse(f"set {key!r}")

    def clear(self) -> None:
        raise self._refuse("clear them")
