"""Recipe schemas: names, versions, parameters and output fields.

A recipe's *schema* is public contract shared by every process: the service validates
warm-up parameters with it, ``CachedDataset`` resolves ``("spc_query", level=8)`` to a
fingerprint with it, and the worker computes what it declares. Recipes declare their
schema as class attributes (:mod:`cache_store.recipes.api`); the installed ones are
found, and looked up by name, by :mod:`cache_store.recipes.registry`. This module is
pure data, imports no torch and knows no installed recipe.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cache_store.errors import ParameterError

__all__ = [
    "ParamSpec",
    "FieldSpec",
    "RecipeSpec",
    "MAX_RECORD_BYTES",
    "param_symbols",
    "fixed_size",
    "shape_dims",
    "shape_problem",
]

#: Largest record a recipe's parameters may call for (worst case, from the parameters):
#: a request above it is refused, so one record always fits one response of the service.
MAX_RECORD_BYTES = 256 << 20


# The one grammar of a declared shape: "[d, d, ...]" (or "[]"), each dimension
#   an integer                         fixed:    3
#   an int parameter                   fixed:    level
#   an int parameter +- an integer     fixed:    level+2, level - 1
#   a name that is not a parameter     variable: N, num_points (each record sets it; one
#                                      name takes one value across a record's fields)
# and nothing else: "2**grid", "N+1", "level*2" or a float parameter are refused when
# the recipe registers (shape_problem), never guessed at.
_SHAPE = re.compile(r"^\[\s*([^\[\],]+(\s*,\s*[^\[\],]+)*)?\s*\]$")
_DIM = re.compile(
    r"^(?:(?P<size>\d+)|(?P<name>[A-Za-z_]\w*)(?:\s*(?P<sign>[+-])\s*(?P<offset>\d+))?)$"
)
_DIM_RULE = (
    "a dimension is fixed (an integer, an int parameter, or one +- an integer) or "
    "variable (a name that is not a parameter, set by each record)"
)


def shape_dims(shape: str) -> list[str]:
    """The dimensions of a declared shape as written: ``"[N, level+2]"`` ->
    ``["N", "level+2"]``; ``"[]"`` -> ``[]``."""
    return [d.strip() for d in shape.strip().strip("[]").split(",") if d.strip()]


def shape_problem(shape: object, params: Mapping[str, ParamSpec]) -> str | None:
    """Why ``shape`` does not follow the shape grammar for a recipe with ``params``
    (the parameter schemas), or None when it does."""
    if not isinstance(shape, str) or not _SHAPE.match(shape):
        return f"shape {shape!r} is not like '[N, 3]' or '[]'"
    for dim in shape_dims(shape):
        match = _DIM.match(dim)
        name = None if match is None else match.group("name")
        if match is None:
            return (
                f"shape {shape!r}: {dim!r} is neither fixed nor a variable dimension ({_DIM_RULE})"
            )
        if name is None:
            continue
        kind = getattr(getattr(params.get(name), "type", int), "__name__", "?")
        if name in params and kind != "int":
            return (
                f"shape {shape!r}: {dim!r}: parameter {name!r} is a {kind}; only an int "
                f"parameter sizes a dimension"
            )
        if name not in params and match.group("sign"):
            return (
                f"shape {shape!r}: {dim!r}: {name!r} is not a parameter, so it is a "
                f"variable dimension, which takes no offset ({_DIM_RULE})"
            )
    return None


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
    """The size of one declared dimension when the resolved ``params`` fix it for every
    record (an integer, an int parameter, ``level+2``, :func:`param_symbols`); None for
    a variable dimension each record sets for itself (``N``, ``num_points``).

    Raises:
        ValueError: ``dim`` follows neither form (:func:`shape_problem` refuses such a
            shape when its recipe registers, so no registered recipe has one).
    """
    match = _DIM.match(dim.strip())
    if match is None:
        raise ValueError(f"dimension {dim!r}: {_DIM_RULE}")
    if match.group("size") is not None:
        return int(match.group("size"))
    name, sign = match.group("name"), match.group("sign")
    value = params.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        offset = int(match.group("offset") or 0)
        return value - offset if sign == "-" else value + offset
    if name in params or sign:
        raise ValueError(f"dimension {dim!r}: {name!r} is not an int parameter; {_DIM_RULE}")
    return param_symbols(params).get(name)


@dataclass(frozen=True)
class ParamSpec:
    """One recipe parameter: its type, default and inclusive bounds.

    ``choices``: the values a parameter may take (a ``str`` parameter's names), empty
    for any. ``omit_default``: the parameter is left out of the resolved parameters
    (and so of the fingerprint, the index and the records) while it has its default:
    a parameter added to a recipe that already has caches, whose default keeps the old
    output, leaves those caches current instead of orphaning them under a new
    fingerprint (the built-in recipes' augmentation parameters are such).
    ``augmentation``: the parameter says how variants >= 1 of a sample are augmented
    (:mod:`cache_store.recipes.augment`); variant 0 ignores it, and so do the seeds of
    every variant's generator (:meth:`RecipeSpec.seed_params`), so variant 0 of an
    augmented run is the record of the same run without augmentation.
    """

    type: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""
    choices: tuple[Any, ...] = ()
    omit_default: bool = False
    augmentation: bool = False

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
        if self.choices and value not in self.choices:
            return None, (
                f"{name}: {value!r} is not one of {', '.join(repr(c) for c in self.choices)}"
            )
        if self.minimum is not None and value < self.minimum:
            return None, f"{name}: {value!r} is below the minimum {self.minimum!r}"
        if self.maximum is not None and value > self.maximum:
            return None, f"{name}: {value!r} is above the maximum {self.maximum!r}"
        return value, None

    def as_json(self) -> dict[str, Any]:
        out = {
            "type": self.type.__name__,
            "default": self.default,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "doc": self.doc,
        }
        if self.choices:
            out["choices"] = list(self.choices)
        if self.omit_default:
            out["omit_default"] = True
        if self.augmentation:
            out["augmentation"] = True
        return out


@dataclass(frozen=True)
class FieldSpec:
    """One output tensor: dtype name (as in torch), symbolic shape, and meaning; ``finite``
    says a floating field may hold no NaN or infinity (checked on every record).

    ``shape`` is ``"[d, ...]"`` (``"[]"``: a scalar); each dimension is fixed by the
    parameters (``3``, ``level``, ``level+2``, ``level-1``: an int parameter) or a
    variable dimension, a name that is not a parameter (``N``), set by each record. A
    field whose first dimension is variable is concatenated in a batch
    (``collate_spc``), a fixed one stacked. Anything else (``2**grid``, ``N+1``) is
    refused when the recipe registers.
    """

    dtype: str
    shape: str
    meaning: str
    finite: bool = False
    #: the field exists only in records computed with one of these parameters away
    #: from its default (empty: in every record): a field added together with
    #: ``omit_default`` parameters leaves the records of the default unchanged
    with_params: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": self.shape, "meaning": self.meaning}
        if self.finite:
            out["finite"] = True
        if self.with_params:
            out["with_params"] = list(self.with_params)
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
        """Validate ``params`` and fill defaults; raises :class:`ParameterError`.

        The result names the fingerprint: every parameter, except one declared
        ``omit_default`` while it has its default (:meth:`with_defaults` gives every
        parameter, as a recipe's ``prepare`` and ``compute`` receive them).
        """
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
            if not (spec.omit_default and value == spec.default and type(value) is spec.type):
                resolved[name] = value
        if not problems:
            problems += self.range_problems(self.with_defaults(resolved))
        if not problems and self.record_bytes is not None:
            worst = self.record_bytes(self.with_defaults(resolved))
            if worst > MAX_RECORD_BYTES:
                problems.append(
                    f"these parameters allow records of up to {worst} bytes, over the "
                    f"{MAX_RECORD_BYTES}-byte record limit ({self.record_bytes_doc}); "
                    "lower them"
                )
        if problems:
            raise ParameterError(problems, what=f"parameters for recipe {self.name!r}")
        return resolved

    def range_problems(self, params: Mapping[str, Any]) -> list[str]:
        """A pair of parameters ``NAME_min`` and ``NAME_max`` is a range: the minimum may
        not be above the maximum (the augmentations' ``scale_min``, ``scale_max``)."""
        problems = []
        for name in self.params:
            if name.endswith("_min") and (top := name[: -len("_min")] + "_max") in self.params:
                low, high = params.get(name), params.get(top)
                if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
                    problems.append(f"{name}: {low!r} is above {top} {high!r}")
        return problems

    def seed_params(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        """``resolved`` without its augmentation parameters: what seeds each sample's
        generators (their fingerprint, :func:`cache_store.keys.compute_fingerprint`), so
        a sample's variant 0, and the points every variant draws before it is augmented,
        are the same whatever the augmentation."""
        return {
            name: value
            for name, value in resolved.items()
            if not (name in self.params and self.params[name].augmentation)
        }

    def with_defaults(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter: ``resolved`` (of :meth:`resolve`) with the defaults of those
        it leaves out (``omit_default``) filled in; what a recipe runs with."""
        full = {name: spec.default for name, spec in self.params.items()}
        full.update(resolved)
        return full

    def fields_for(self, params: Mapping[str, Any]) -> dict[str, FieldSpec]:
        """The fields a record computed with ``params`` holds: every declared field but
        those ``with_params`` leaves out (none of its parameters off its default)."""
        full = self.with_defaults(params)
        return {
            name: field
            for name, field in self.fields.items()
            if not field.with_params
            or any(
                p in self.params and full.get(p) != self.params[p].default
                for p in field.with_params
            )
        }

    def variable_length_fields(self, params: Mapping[str, Any]) -> frozenset[str]:
        """The fields whose first dimension each record sets for itself (``[N, 3]``),
        not ``params`` (``[M, 3]`` of the built-ins, ``[level+1]``, ``[3]``): batched,
        they are concatenated, never stacked (``collate_spc``)."""
        out = set()
        for name, field in self.fields.items():
            dims = shape_dims(field.shape)
            if dims and fixed_size(dims[0], params) is None:
                out.add(name)
        return frozenset(out)

    def worst_case_record_bytes(self, params: Mapping[str, Any] | None = None) -> int | None:
        """The largest record ``params`` (defaults filled in) can produce, or None."""
        if self.record_bytes is None:
            return None
        return self.record_bytes(self.with_defaults(params or {}))

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
