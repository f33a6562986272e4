"""The installed recipes, and every lookup of one: the built-ins, entry points, and
``SPCACHE_RECIPES``.

Every process (the CLI, the worker, loader processes, Ray actors, the service, readers)
finds recipes the same way, once per process, on first use:

1. the built-in recipes: the entry points of spcache's own distribution (its
   ``pyproject.toml`` names :mod:`workers.builtin_recipes`' classes), a plugin like any
   other, found first;
2. the entry points of the group ``spcache.recipes`` of every other installed
   distribution (``[project.entry-points."spcache.recipes"]``
   ``my_recipe = "mypkg.recipes:MyRecipe"``), in the order of (distribution name, entry
   point name);
3. the environment variable ``SPCACHE_RECIPES``: comma-separated ``module:Class``
   entries, for a recipe in a script or a source tree that is not installed (the module
   must be importable: on ``sys.path`` / ``PYTHONPATH``).

Finding a recipe imports its module (the class attributes are its schema) and constructs
a plugin's class once (a constructor assigns: it must not raise; none of ``prepare`` or
``compute`` runs). A recipe that cannot be used (its module fails to import, the class
breaks the contract, its constructor raises, its name is taken) is left out with one
line naming the entry and the reason (:attr:`Registry.problems`, logged at ERROR when
found); the others still work, and asking for it by name raises
:class:`~cache_store.errors.RecipeUnusable` with that line.
A name taken twice is refused for both plugins (nothing says which one computed a
record), and a plugin never replaces a built-in.

The service imports the recipe classes to learn their schemas (it runs no recipe code),
so a recipe module whose top level imports torch makes the service import it too; it
works, but a recipe that keeps ``import torch`` inside ``prepare``/``compute`` (as the
built-ins do) keeps the service light.

Lookups by name go through here: :func:`get_entry` (class, schema, origin),
:func:`get_recipe_spec` and :data:`RECIPE_SPECS` (schemas); :mod:`cache_store.recipes.specs`
and :mod:`cache_store.recipes.api` below it know no installed recipe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import ParameterError, RecipeUnusable, UnknownName, UsageError, one_line
from cache_store.recipes.api import Recipe, code_digest, contract_problems
from cache_store.recipes.specs import RecipeSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "BUILTIN_DISTRIBUTION",
    "RECIPE_SPECS",
    "get_recipe_spec",
    "installed_variable_fields",
    "RecipeEntry",
    "Registry",
    "installed_recipes",
    "load_registry",
    "get_entry",
    "report_problems_here",
    "installed_code_digest",
    "code_changed",
    "LOCAL_KIND",
    "add_local_recipe",
    "recipe_name_of",
    "require_installed",
    "is_local",
]

logger = logging.getLogger(__name__)

#: The entry-point group recipes register under.
ENTRY_POINT_GROUP = "spcache.recipes"
#: ``module:Class[,module:Class...]``: recipes from modules that are not installed.
ENV_VAR = "SPCACHE_RECIPES"
#: The distribution whose entry points are the built-in recipes.
BUILTIN_DISTRIBUTION = "spcache"


@dataclass
class RecipeEntry:
    """One usable recipe: its class, schema and where it came from."""

    name: str
    cls: type[Recipe]
    spec: RecipeSpec
    #: ``{"kind": "builtin"|"entry point"|ENV_VAR, "entry": "name = module:Class",
    #: "package": distribution or None, "package_version": its version or None}``
    origin: dict[str, Any]
    _digest: str | None = field(default=None, repr=False)

    @property
    def code_digest(self) -> str:
        """Digest of the recipe's module source (see :func:`code_digest`)."""
        if self._digest is None:
            self._digest = code_digest(self.cls)
        return self._digest

    def new(self) -> Recipe:
        """A fresh instance of the recipe (what a worker computes with); a constructor
        that raises is :class:`~cache_store.errors.RecipeUnusable`, in one line."""
        try:
            recipe = self.cls()
        except Exception as exc:  # the plugin's problem, said in one line
            raise RecipeUnusable(self.name, _constructor_problem(exc), ()) from exc
        recipe.spec = self.spec  # also when the class's __init__ skipped Recipe's
        return recipe

    def as_json(self) -> dict[str, Any]:
        return {**self.spec.as_json(), "origin": dict(self.origin), "code_digest": self.code_digest}


@dataclass
class Registry:
    """The recipes usable in this process, and the lines saying why others are not."""

    recipes: dict[str, RecipeEntry]
    problems: list[str]
    #: recipe name -> the problem line of a plugin of that name that is left out
    unusable: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> RecipeEntry:
        """The recipe called ``name``; raises :class:`RecipeUnusable` (why) for a plugin
        that is installed but left out, else :class:`UnknownName` listing the known ones."""
        try:
            return self.recipes[name]
        except KeyError:
            if name in self.unusable:
                raise RecipeUnusable(name, self.unusable[name], self.recipes) from None
            raise UnknownName("recipe", name, self.recipes) from None


def _distribution_of(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    """The name and version of the distribution that installed ``ep``.

    Read from the metadata's header block only, two of its fields, without the email
    parser: ``dist.metadata`` parses the whole file, long description included, on every
    call, a noticeable part of the start of every command (each of which finds the
    installed recipes)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    fields: dict[str, str] = {}
    for line in text.replace("\r\n", "\n").split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep and not line[:1].isspace():  # not a continuation line
            fields.setdefault(name.strip().lower(), value.strip())
    return fields.get("name"), fields.get("version")


def _import_class(value: str) -> Any:
    module_name, sep, attr = value.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{value!r} is not 'module:Class'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _candidates() -> list[tuple[str, str, dict[str, Any], Any]]:
    """``(label, expected name or "", origin, loader)`` for every entry point and every
    ``SPCACHE_RECIPES`` entry, in registration order."""
    out: list[tuple[str, str, dict[str, Any], Any]] = []
    try:
        points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # noqa: BLE001 - broken metadata must not stop the program
        logger.error(
            "recipe entry points of group %r could not be listed: %s", ENTRY_POINT_GROUP, exc
        )
        points = []

    origins = {id(ep): _distribution_of(ep) for ep in points}

    def order(ep: importlib.metadata.EntryPoint) -> tuple[bool, str, str]:
        package = origins[id(ep)][0] or ""
        return (package != BUILTIN_DISTRIBUTION, package, ep.name)  # the built-ins first

    points.sort(key=order)
    for ep in points:
        package, version = origins[id(ep)]
        where = f" (package {package} {version})" if package else ""
        label = f"recipe entry point '{ep.name} = {ep.value}'{where}"
        origin = {
            "kind": "builtin" if package == BUILTIN_DISTRIBUTION else "entry point",
            "entry": f"{ep.name} = {ep.value}",
            "package": package,
            "package_version": version,
        }
        out.append((label, ep.name, origin, ep.load))
    for value in (v.strip() for v in os.environ.get(ENV_VAR, "").split(",")):
        if value:
            origin = {"kind": ENV_VAR, "entry": value, "package": None, "package_version": None}
            out.append(
                (
                    f"recipe {value!r} from {ENV_VAR}",
                    "",
                    origin,
                    lambda value=value: _import_class(value),
                )
            )
    return out


def load_registry() -> Registry:
    """Find the installed recipes now (no cache; see :func:`installed_recipes`)."""
    recipes: dict[str, RecipeEntry] = {}
    problems: list[str] = []
    refused: dict[str, str] = {}  # name -> label of the first plugin that claimed it
    unusable: dict[str, str] = {}  # name -> why the plugin of that name is left out
    for label, expected, origin, load in _candidates():
        try:
            cls = load()
        except Exception as exc:  # noqa: BLE001 - any import failure is this entry's alone
            problems.append(f"{label}: failed to import: {one_line(exc, with_class=True)}")
            continue
        bad = contract_problems(cls)
        if not bad and expected and expected != cls.name:
            bad = [
                (
                    f"the class's name is {cls.name!r}; the entry point must be named after "
                    "the recipe"
                )
            ]
        if bad:
            problems.append(f"{label}: not a usable recipe: {'; '.join(bad)}")
            _note_unusable(unusable, cls, problems[-1])
            continue
        name = cls.name
        if name in refused:
            problems.append(
                f"{label}: recipe name {name!r} is also claimed by {refused[name]}; neither is used"
            )
            continue
        current = recipes.get(name)
        if current is not None and current.cls is cls:
            continue  # the same class named twice (an entry point and SPCACHE_RECIPES)
        if current is not None and current.origin["kind"] == "builtin":
            problems.append(
                f"{label}: recipe name {name!r} is a built-in recipe; this one is not used"
            )
            continue
        if current is not None:
            first = recipes.pop(name)
            first_label = first.origin.get("label", repr(first.origin.get("entry")))
            refused[name] = first_label
            problems.append(
                f"{label}: recipe name {name!r} is also claimed by {first_label}; neither is used"
            )
            continue
        try:
            spec = cls.schema()
        except Exception as exc:  # noqa: BLE001 - a schema that cannot be built is this entry's
            problems.append(f"{label}: not a usable recipe: {one_line(exc, with_class=True)}")
            _note_unusable(unusable, cls, problems[-1])
            continue
        try:
            cls()  # a constructor that raises would fail every run that asks for it
        except Exception as exc:  # noqa: BLE001 - this entry's, said in one line
            problems.append(f"{label}: not a usable recipe: {_constructor_problem(exc)}")
            _note_unusable(unusable, cls, problems[-1])
            continue
        recipes[name] = RecipeEntry(name, cls, spec, {**origin, "label": label})
    for entry in recipes.values():
        entry.origin.pop("label", None)
    return Registry(recipes, problems, unusable)


def _constructor_problem(exc: BaseException) -> str:
    return f"its constructor raised {one_line(exc, with_class=True)}"


def _note_unusable(unusable: dict[str, str], cls: Any, problem: str) -> None:
    """Remember why a plugin whose name can be read is left out (asked for by name, the
    error says so)."""
    name = getattr(cls, "name", None)
    if isinstance(name, str) and name:
        unusable.setdefault(name, problem)


_lock = threading.Lock()
_cached: tuple[str, Registry] | None = None
_report = True
#: recipes made in this process (``spcache.recipe``, a class passed as an object), by name
_local: dict[str, RecipeEntry] = {}
LOCAL_KIND = "this process"


def add_local_recipe(cls: type[Recipe]) -> RecipeEntry:
    """Make the recipe class ``cls`` usable by name in this process only (a recipe made
    by ``spcache.recipe``, or a class written in a notebook and passed as an object).
    The same name made again replaces the earlier one (a notebook cell run again).

    Raises:
        ParameterError: ``cls`` breaks the recipe contract, or its name is an installed
            recipe's.
    """
    problems = contract_problems(cls)
    if problems:
        raise ParameterError(problems, what=f"recipe {getattr(cls, 'name', cls)!r}")
    with _lock:
        current = _local.get(cls.name)
        if current is not None and current.cls is cls:
            return current
    installed = installed_recipes().recipes.get(cls.name)
    if installed is not None and installed.origin.get("kind") != LOCAL_KIND:
        raise ParameterError(
            [f"{cls.name!r} is the name of an installed recipe ({installed.origin.get('kind')})"],
            what="recipe name",
        )
    entry = RecipeEntry(
        cls.name,
        cls,
        cls.schema(),
        {
            "kind": LOCAL_KIND,
            "entry": f"{cls.name} = {cls.__module__}:{cls.__qualname__}",
            "package": None,
            "package_version": None,
        },
    )
    with _lock:
        _local[cls.name] = entry
    return entry


def recipe_name_of(recipe: Any) -> str:
    """The name of ``recipe``: a name (as given), or a recipe class or instance, which is
    made usable in this process (:func:`add_local_recipe`) unless it is the installed
    recipe of that name.

    Raises:
        ParameterError: not a name nor a recipe; a recipe breaking the contract.
    """
    if isinstance(recipe, str):
        return recipe
    cls = type(recipe) if isinstance(recipe, Recipe) else recipe
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        raise ParameterError(
            [f"recipe: expected a recipe's name or a Recipe class, got {type(recipe).__name__}"]
        )
    installed = installed_recipes().recipes.get(cls.name)
    if installed is not None and installed.cls is cls:
        return cls.name
    return add_local_recipe(cls).name


def require_installed(name: str, where: str) -> None:
    """Refuse a recipe of this process only (:func:`add_local_recipe`) where another
    process must run it (``where``: the service's worker, Ray actors), saying how to
    install it instead."""
    entry = installed_recipes().recipes.get(name)
    if entry is not None and entry.origin.get("kind") == LOCAL_KIND:
        raise UsageError(
            f"recipe {name!r} was made in this process ({entry.origin['entry']}); {where} "
            f"cannot import it: install it instead, as a class in a module of your package "
            f"registered under the {ENTRY_POINT_GROUP!r} entry-point group, or name it in "
            f"{ENV_VAR}=module:Class for every process (see spcache.recipes)"
        )


def is_local(name: str) -> bool:
    """Whether the recipe ``name`` is usable in this process only."""
    entry = installed_recipes().recipes.get(name)
    return entry is not None and entry.origin.get("kind") == LOCAL_KIND


def report_problems_here(enabled: bool) -> None:
    """Whether this process logs the unusable recipes (a loader process does not: its
    engine already said so once)."""
    global _report
    _report = bool(enabled)


def installed_recipes(*, reload: bool = False) -> Registry:
    """The recipes of this process, found once (again when ``SPCACHE_RECIPES`` changes or
    ``reload`` is given). Each problem is logged once, at ERROR, when found."""
    global _cached
    key = os.environ.get(ENV_VAR, "")
    with _lock:
        if _cached is None or reload or _cached[0] != key:
            registry = load_registry()
            for line in registry.problems if _report else ():
                logger.error("%s", line)
            _cached = (key, registry)
        registry = _cached[1]
        if not _local:
            return registry
        return Registry({**registry.recipes, **_local}, registry.problems, registry.unusable)


def get_entry(name: str) -> RecipeEntry:
    """The installed recipe called ``name`` (raises :class:`UnknownName`)."""
    return installed_recipes().get(name)


def installed_code_digest(recipe: str, recipe_version: int | None = None) -> str | None:
    """The installed ``recipe``'s code digest; None when it is not installed here, or (with
    ``recipe_version``) installed at another version."""
    entry = installed_recipes().recipes.get(recipe)
    if entry is None or (recipe_version is not None and entry.spec.version != recipe_version):
        return None
    return entry.code_digest


def code_changed(installed: str, recorded: str | None) -> bool | None:
    """The one rule for a record computed by other recipe code than the installed one:
    its code digest (metadata ``code_digest``) differs from ``installed``. None for a
    record that carries no digest (``"none"`` in a stats entry's ``code_digests``)."""
    if recorded is None or recorded == "none":
        return None
    return recorded != installed


def schemas() -> Mapping[str, RecipeSpec]:
    """Every installed recipe's schema, by name."""
    return {name: entry.spec for name, entry in installed_recipes().recipes.items()}


class _InstalledSpecs(Mapping[str, RecipeSpec]):
    """The schemas of the installed recipes (built-ins and plugins), by name; found on
    first use."""

    def __getitem__(self, name: str) -> RecipeSpec:
        return schemas()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(schemas())

    def __len__(self) -> int:
        return len(schemas())

    def __repr__(self) -> str:
        return f"RECIPE_SPECS({sorted(self)})"


#: Every installed recipe's schema, by name (a live view of the registry).
RECIPE_SPECS: Mapping[str, RecipeSpec] = _InstalledSpecs()


def get_recipe_spec(name: str) -> RecipeSpec:
    """The installed recipe ``name``'s schema; :class:`UnknownName` listing the known ones
    (:class:`~cache_store.errors.RecipeUnusable`, saying why, for a plugin left out)."""
    return get_entry(name).spec


def installed_variable_fields(
    recipe: str, version: int, params: Mapping[str, Any]
) -> frozenset[str]:
    """The fields ``recipe`` declares with a per-record first dimension, when that
    recipe at that version is installed here (else none: collate then goes by shapes)."""
    spec = RECIPE_SPECS.get(recipe)
    if spec is None or spec.version != version:
        return frozenset()
    return spec.variable_length_fields(params)
