"""Recipe schemas: names, versions, parameters and output fields.

A recipe's *schema* is public contract shared by every process: the service validates
warm-up parameters with it, ``CachedDataset`` resolves ``("spc_query", level=8)`` to a
fingerprint with it, and the worker computes what it declares. Recipes declare their
schema as class attributes (:mod:`cache_store.recipes.api`); the installed ones are
found by :mod:`cache_store.recipes.registry`. This module is pure data and imports no
torch.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cache_store.errors import ParameterError, UnknownName

__all__ = [
    "ParamSpec",
    "FieldSpec",
    "RecipeSpec",
    "RECIPE_SPECS",
    "get_recipe_spec",
    "MAX_RECORD_BYTES",
    "param_symbols",
    "fixed_size",
]

#: Largest record a recipe's parameters may call for (worst case, from the parameters):
#: a request above it is refused, so one record always fits one response of the service.
MAX_RECORD_BYTES = 256 << 20


_DIM_EXPR = re.compile(r"^([A-Za-z_]\w*)\s*([+-])\s*(\d+)$")


def param_symbols(params: Mapping[str, Any]) -> dict[str, int]:
    """Symbolic sizes that parameters fix: ``M``, the query (or SDF sample) count of the
    built-in recipes, is ``uniform_queries + surface_queries`` (``uniform_samples +
    near_samples``)."""
    symbols: dict[str, int] = {}
    if "uniform_queries" in params and "surface_queries" in params:
        symbols["M"] = int(params["uniform_queries"]) + int(params["surface_queries"])
    if "uniform_samples" in params and "near_samples" in params:
        symbols["M"] = int(params["uniform_samples"]) + int(params["near_samples"])
    return symbols


def fixed_size(dim: str, params: Mapping[str, Any]) -> int | None:
    """The size of one declared dimension when ``params`` fix it for every record (an
    integer, an integer parameter, ``level+2``, :func:`param_symbols`); None for a symbol
    each record sets for itself (``N``, ``num_points``)."""
    dim = dim.strip()
    if dim.isdigit():
        return int(dim)
    match = _DIM_EXPR.match(dim)
    if match and match.group(1) in params:
        base, sign, offset = params[match.group(1)], match.group(2), int(match.group(3))
        return int(base) + offset if sign == "+" else int(base) - offset
    if dim in params and isinstance(params[dim], int) and not isinstance(params[dim], bool):
        return int(params[dim])
    return param_symbols(params).get(dim)


@dataclass(frozen=True)
class ParamSpec:
    """One recipe parameter: its type, default and inclusive bounds."""

    type: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""

    def check(self, name: str, value: Any) -> tuple[Any, str | None]:
        """Return ``(coerced value, None)`` or ``(None, problem)``.

        An ``int`` parameter takes integers (Python's or NumPy's), never ``8.0``, ``True``
        or ``"8"``; a ``float`` takes finite real numbers (integers and NumPy's too); a
        ``bool`` exactly ``True`` or ``False``; a ``str`` only strings. The problem names
        the parameter, the value and its type.
        """

        def wrong(expected: str) -> tuple[None, str]:
            return None, f"{name}: expected {expected}, got {value!r} ({type(value).__name__})"

        if self.type is int:
            # numbers.Integral: int and NumPy's integers (bool is one too: refused here)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                return wrong("an integer")
            value = int(value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                return wrong("a number")
            value = float(value)
            if not math.isfinite(value):
                return wrong("a finite number")
        elif self.type is bool:
            # exactly True or False: 1, "yes" or "true" would each be a second spelling of
            # one value (and a second fingerprint)
            if not isinstance(value, bool):
                return wrong("a bool (true or false)")
        elif self.type is str and not isinstance(value, str):
            return wrong("a string")
        if self.minimum is not None and value < self.minimum:
            return None, f"{name}: {value!r} is below the minimum {self.minimum!r}"
        if self.maximum is not None and value > self.maximum:
            return None, f"{name}: {value!r} is above the maximum {self.maximum!r}"
        return value, None

    def as_json(self) -> dict[str, Any]:
        return {
            "type": self.type.__name__,
            "default": self.default,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "doc": self.doc,
        }


@dataclass(frozen=True)
class FieldSpec:
    """One output tensor: dtype name (as in torch), symbolic shape, and meaning; ``finite``
    says a floating field may hold no NaN or infinity (checked on every record)."""

    dtype: str
    shape: str
    meaning: str
    finite: bool = False

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": self.shape, "meaning": self.meaning}
        if self.finite:
            out["finite"] = True
        return out


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    version: int
    params: Mapping[str, ParamSpec]
    fields: Mapping[str, FieldSpec]
    doc: str = ""
    #: Worst-case record bytes for resolved parameters (None: not bounded here).
    record_bytes: Callable[[Mapping[str, Any]], int] | None = None
    record_bytes_doc: str = ""

    def resolve(self, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validate ``params`` and fill defaults; raises :class:`ParameterError`."""
        params = dict(params or {})
        problems = [
            f"{name}: unknown parameter (known: {', '.join(sorted(self.params))})"
            for name in sorted(params)
            if name not in self.params
        ]
        resolved: dict[str, Any] = {}
        for name, spec in self.params.items():
            value, problem = spec.check(name, params.get(name, spec.default))
            if problem:
                problems.append(problem)
            resolved[name] = value
        if not problems and self.record_bytes is not None:
            worst = self.record_bytes(resolved)
            if worst > MAX_RECORD_BYTES:
                problems.append(
                    f"these parameters allow records of up to {worst} bytes, over the "
                    f"{MAX_RECORD_BYTES}-byte record limit ({self.record_bytes_doc}); "
                    "lower them"
                )
        if problems:
            raise ParameterError(problems, what=f"parameters for recipe {self.name!r}")
        return resolved

    def variable_length_fields(self, params: Mapping[str, Any]) -> frozenset[str]:
        """The fields whose first dimension each record sets for itself (``[N, 3]``),
        not ``params`` (``[M, 3]`` of the built-ins, ``[level+1]``, ``[3]``): batched,
        they are concatenated, never stacked (``collate_spc``)."""
        out = set()
        for name, field in self.fields.items():
            dims = [d for d in field.shape.strip().strip("[]").split(",") if d.strip()]
            if dims and fixed_size(dims[0], params) is None:
                out.add(name)
        return frozenset(out)

    def worst_case_record_bytes(self, params: Mapping[str, Any] | None = None) -> int | None:
        """The largest record ``params`` (defaults filled in) can produce, or None."""
        if self.record_bytes is None:
            return None
        full = {name: spec.default for name, spec in self.params.items()}
        full.update(params or {})
        return self.record_bytes(full)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "doc": self.doc,
            "params": {k: v.as_json() for k, v in self.params.items()},
            "fields": {k: v.as_json() for k, v in self.fields.items()},
            "max_record_bytes": MAX_RECORD_BYTES,
            "record_bytes_bound": self.record_bytes_doc,
            "default_worst_case_record_bytes": self.worst_case_record_bytes(),
        }


class _InstalledSpecs(Mapping[str, RecipeSpec]):
    """The schemas of the installed recipes (built-ins and plugins), by name; found on
    first use (:mod:`cache_store.recipes.registry`)."""

    def _specs(self) -> Mapping[str, RecipeSpec]:
        from cache_store.recipes.registry import installed_recipes

        return {name: entry.spec for name, entry in installed_recipes().recipes.items()}

    def __getitem__(self, name: str) -> RecipeSpec:
        return self._specs()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs())

    def __len__(self) -> int:
        return len(self._specs())

    def __repr__(self) -> str:
        return f"RECIPE_SPECS({sorted(self)})"


#: Every installed recipe's schema, by name (a live view of the registry).
RECIPE_SPECS: Mapping[str, RecipeSpec] = _InstalledSpecs()


def get_recipe_spec(name: str) -> RecipeSpec:
    try:
        return RECIPE_SPECS[name]
    except KeyError:
        raise UnknownName("recipe", name, RECIPE_SPECS) from None
