"""The recipe contract: what a user's recipe class declares and implements.

A recipe is a class deriving from :class:`Recipe` whose class attributes are its public
schema (``name``, ``version``, ``params``, ``fields``) and whose two methods compute it:

- :meth:`Recipe.prepare` (CPU only; may run in a loader process): from the loaded source
  and the sample's seeded CPU ``torch.Generator``, a dict of NumPy arrays;
- :meth:`Recipe.compute` (on the worker's device): from those arrays, a dict of tensors,
  exactly the declared fields, on the CPU.

This module imports no torch: the schema is plain class attributes, so the service and
the readers learn a recipe's parameters and fields by importing its class, never by
running it. Users import these names from :mod:`spcache.recipes`.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from cache_store.engine_options import (
    DEFAULT_MIN_QUERY_CHUNK,
    DEFAULT_QUERY_CHUNK,
    DEFAULT_TIME_LIMIT_S,
    time_limit_problem,
)
from cache_store.recipes.digest import code_digest
from cache_store.recipes.params import ReadOnlyParams
from cache_store.recipes.specs import (
    FieldSpec,
    ParamSpec,
    RecipeSpec,
    fixed_size,
    param_symbols,
    shape_dims,
    shape_problem,
)

if TYPE_CHECKING:  # pragma: no cover - for annotations only
    import numpy as np
    import torch

__all__ = [
    "Recipe",
    "Param",
    "Field",
    "ChunkBudget",
    "ReadOnlyParams",
    "check_outputs",
    "code_digest",
    "contract_problems",
    "FIELD_DTYPES",
    "RESERVED_PARAM_NAMES",
    "is_out_of_memory",
]

logger = logging.getLogger(__name__)

#: ``Param(type, default, minimum=None, maximum=None, doc="")``: one recipe parameter.
Param = ParamSpec
#: ``Field(dtype, shape, meaning, finite=False)``: one output tensor.
Field = FieldSpec

#: The dtypes a field may declare (torch's names; records store exactly these).
FIELD_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
#: What a field or parameter may be called: a letter, then letters, digits and ``_`` (at
#: most 64): a record's tensor name, a ``?fields=a,b`` item, a Zarr array name, a
#: ``<name>_lengths`` batch key and a Python keyword argument, all at once.
_KEY_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
#: Parameter names a recipe may not declare: ``spcache.precompute`` and
#: ``CachedDataset`` take these keyword arguments themselves, so a recipe parameter of
#: that name could never be passed.
RESERVED_PARAM_NAMES = frozenset(
    {
        # spcache.precompute
        "sources",
        "recipe",
        "cache",
        "device",
        "backend",
        "loaders",
        "skip_failed",
        "progress",
        "engine",
        "address",
        "actors",
        "query_chunk",
        "write_batch",
        "id_template",
        "variants",
        "time_limit_s",
        # CachedDataset
        "fingerprint_or_recipe",
        "fields",
        "transform",
        "store_options",
        "on_miss",
        "warm_ahead",
        "miss_timeout",
        "on_error",
        "on_stale",
        "variant",
        "variant_seed",
        "local_cache",
        "cache_limit",
        "views",
        "verify",
        "pin_memory",
    }
)


class Recipe:
    """Base class of every recipe (the built-in ones included).

    Class attributes (the schema; read without running anything):
        name: the recipe's name (lowercase letters, digits, ``_``), as in its entry point.
        version: an integer >= 1; bump it when the output changes, so old records become
            a different fingerprint instead of stale hits.
        params: ``{name: Param(...)}``; every parameter with its default. A name is a
            letter, then letters, digits and ``_``, and not one of
            :data:`RESERVED_PARAM_NAMES` (``device``, ``cache``, ... : arguments of
            ``spcache.precompute`` and ``CachedDataset`` themselves).
        fields: ``{name: Field(...)}``; exactly the tensors :meth:`compute` returns,
            named like parameters. A field's shape lists dimensions fixed by the
            parameters (``3``, ``level``, ``level+2``) or variable (a name that is not
            a parameter, ``N``); see :class:`~cache_store.recipes.specs.FieldSpec`.
        doc: one line for ``spcache recipes`` (default: the class docstring's first line).
        record_bytes: optional ``staticmethod(params) -> int``, the worst-case record size
            for resolved parameters; parameters over the record limit are then refused.
        record_bytes_doc: how ``record_bytes`` bounds it, in words.
        code_modules: extra modules (dotted names) whose source counts in the recipe's
            code digest, besides the class's own module.
        code_functions: a recipe made from functions (``spcache.recipe``): their source
            is the code digest instead of the module's.
        time_limit_s: seconds each stage of one sample may take, loading with
            :meth:`prepare` and :meth:`compute` each (default
            :data:`~cache_store.engine_options.DEFAULT_TIME_LIMIT_S`, 600); a run's
            ``time_limit_s`` option replaces it. A sample past it fails naming the limit
            (:mod:`workers.time_limits` says how each process enforces it).

    ``params`` reach ``prepare`` and ``compute`` read-only (:class:`ReadOnlyParams`): they
    make the fingerprint, and a change would file records under the wrong one.

    Per run, the engine sets ``self.chunks``: a :class:`ChunkBudget` shared by the run's
    samples, for recipes that split device work into chunks. ``self.spec`` (and
    :meth:`schema` on the class) is the schema as a :class:`RecipeSpec`.
    """

    name: ClassVar[str] = ""
    version: ClassVar[int] = 0
    params: ClassVar[Mapping[str, ParamSpec]] = {}
    fields: ClassVar[Mapping[str, FieldSpec]] = {}
    doc: ClassVar[str] = ""
    #: ``staticmethod(params) -> int`` or None (typed Any: a callable class attribute)
    record_bytes: ClassVar[Any] = None
    record_bytes_doc: ClassVar[str] = ""
    code_modules: ClassVar[tuple[str, ...]] = ()
    time_limit_s: ClassVar[float] = DEFAULT_TIME_LIMIT_S

    def __init__(self) -> None:
        #: the run's chunk budget (the engine sets it per run)
        self.chunks = ChunkBudget(DEFAULT_QUERY_CHUNK)
        #: the schema (:meth:`schema`)
        self.spec: RecipeSpec = type(self).schema()

    def prepare(
        self, source: Any, params: Mapping[str, Any], generator: torch.Generator
    ) -> dict[str, np.ndarray]:
        """CPU only. ``source.path``, ``source.vertices`` (float64 ``[V, 3]``, the file's
        coordinates), ``source.faces`` (int64 ``[F, 3]``, None for a point cloud). Draw
        every random number from ``generator``. Raise
        :class:`cache_store.errors.SourceError` for a source this recipe cannot use."""
        raise NotImplementedError

    def compute(
        self,
        prepared: dict[str, np.ndarray],
        params: Mapping[str, Any],
        device: torch.device,
        ops: Any,
    ) -> dict[str, torch.Tensor]:
        """On ``device``; ``ops`` is the SPC backend in use (``quantize_points``,
        ``unbatched_points_to_octree``, ``scan_octrees``, ...). Return CPU tensors."""
        raise NotImplementedError

    @classmethod
    def schema(cls) -> RecipeSpec:
        """The schema as a :class:`RecipeSpec` (built once per class)."""
        cached = cls.__dict__.get("_spec_cache")
        if cached is None:
            doc = cls.doc or (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
            bound = getattr(cls, "record_bytes", None)
            cached = RecipeSpec(
                cls.name,
                int(cls.version),
                dict(cls.params),
                dict(cls.fields),
                doc,
                bound,
                cls.record_bytes_doc,
            )
            cls._spec_cache = cached  # type: ignore[attr-defined]
        return cached

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, version={self.version})"


def contract_problems(cls: Any) -> list[str]:
    """Why ``cls`` is not a usable recipe class (empty when it is)."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)):
        return [f"{cls!r} is not a subclass of spcache.recipes.Recipe"]
    problems = []
    if not isinstance(cls.name, str) or not _NAME.match(cls.name):
        problems.append(
            f"name {cls.name!r} is not lowercase letters, digits and '_' (starting with a letter)"
        )
    if isinstance(cls.version, bool) or not isinstance(cls.version, int) or cls.version < 1:
        problems.append(f"version {cls.version!r} is not an integer >= 1")
    if not isinstance(cls.params, Mapping):
        problems.append("params is not a mapping of name to Param")
    else:
        for key, param in cls.params.items():
            if not isinstance(key, str) or not isinstance(param, ParamSpec):
                problems.append(f"params[{key!r}] is not a Param")
            elif not _KEY_NAME.match(key):
                problems.append(
                    f"parameter name {key!r} is not a letter then letters, digits and '_'"
                )
            elif key in RESERVED_PARAM_NAMES:
                problems.append(
                    f"parameter name {key!r} is reserved: spcache.precompute or "
                    "CachedDataset takes it as its own argument"
                )
            elif param.type not in (int, float, str, bool):
                problems.append(
                    f"params[{key!r}]: type {param.type!r} is not int, float, str or bool"
                )
            elif not isinstance(param.choices, tuple) or any(
                param.check(key, choice)[1] for choice in param.choices
            ):
                problems.append(f"params[{key!r}]: its choices are not a tuple of its type")
            else:
                _, problem = param.check(key, param.default)
                if problem:
                    problems.append(f"params[{key!r}]: its default is invalid ({problem})")
    if not isinstance(cls.fields, Mapping) or not cls.fields:
        problems.append("fields is not a non-empty mapping of name to Field")
    else:
        for key, field in cls.fields.items():
            if not isinstance(key, str) or not isinstance(field, FieldSpec):
                problems.append(f"fields[{key!r}] is not a Field")
            elif not _KEY_NAME.match(key):
                problems.append(f"field name {key!r} is not a letter then letters, digits and '_'")
            elif field.dtype not in FIELD_DTYPES:
                problems.append(
                    f"fields[{key!r}]: dtype {field.dtype!r} is not one of "
                    f"{', '.join(FIELD_DTYPES)}"
                )
            elif problem := shape_problem(
                field.shape, cls.params if isinstance(cls.params, Mapping) else {}
            ):
                problems.append(f"recipe {cls.name!r}, fields[{key!r}]: {problem}")
            elif unknown := [
                p
                for p in field.with_params
                if not isinstance(cls.params, Mapping) or p not in cls.params
            ]:
                problems.append(
                    f"fields[{key!r}]: with_params names {', '.join(map(repr, unknown))}, "
                    "not parameters of this recipe"
                )
    for method in ("prepare", "compute"):
        if getattr(cls, method, None) is getattr(Recipe, method):
            problems.append(f"{method}() is not implemented")
    if cls.record_bytes is not None and not callable(cls.record_bytes):
        problems.append("record_bytes is not callable")
    if problem := time_limit_problem(getattr(cls, "time_limit_s", None)):
        problems.append(f"time_limit_s: {problem}")
    return problems


# --- out-of-memory back-off -------------------------------------------------------------


# Kaolin's C++ bindings have no exception translator for c10's OutOfMemoryError, so an
# allocation failing inside its kernels reaches Python as a plain RuntimeError whose message
# is the allocator's ("CUDA out of memory. Tried to allocate ...") or a CUDA runtime error
# ("CUDA error: out of memory").
_OOM_MESSAGE = re.compile(r"CUDA (error: )?out of memory", re.IGNORECASE)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device out-of-memory error: ``torch.cuda.OutOfMemoryError``, or a plain
    ``RuntimeError`` carrying CUDA's out-of-memory message (raised from C++ extensions
    such as Kaolin's)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_OOM_MESSAGE.search(str(exc)))


class ChunkBudget:
    """A chunk size shared by the samples of a run; halves on out-of-memory.

    :meth:`run` applies a step to ``[start, stop)`` ranges of at most ``size`` items. When
    a step raises a device out-of-memory error (:func:`is_out_of_memory`: also the plain
    ``RuntimeError`` of an allocation failing inside Kaolin's C++), the device cache is emptied, ``size`` is
    halved (and stays halved for later samples) and the same range is retried; when
    ``size`` would drop below ``minimum`` the error propagates, so the sample fails with
    a recorded reason while the run goes on.

    Args:
        size: first chunk size (> 0).
        minimum: smallest chunk worth trying (> 0).
        before_query_chunk: called with the chunk size before every attempt; tests make
            it raise an out-of-memory error to prove the back-off without a GPU.
    """

    def __init__(
        self,
        size: int,
        *,
        minimum: int = DEFAULT_MIN_QUERY_CHUNK,
        before_query_chunk: Callable[[int], None] | None = None,
    ) -> None:
        if size < 1 or minimum < 1:
            raise ValueError(f"chunk size and minimum must be positive, got {size}, {minimum}")
        self.size = int(size)
        self.minimum = min(int(minimum), self.size)
        self.before_query_chunk = before_query_chunk
        self.backoffs = 0

    def run(self, total: int, step: Callable[[int, int], Any], device: Any) -> list[Any]:
        """Results of ``step(start, stop)`` over ``[0, total)``, in order."""
        parts: list[Any] = []
        start = 0
        while start < total:
            stop = min(total, start + self.size)
            try:
                if self.before_query_chunk is not None:
                    self.before_query_chunk(stop - start)
                parts.append(step(start, stop))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                _free_device_cache(device)
                if self.size // 2 < self.minimum:
                    raise
                self.size //= 2
                self.backoffs += 1
                logger.warning(
                    "out of device memory on a %d-item chunk; retrying with %d",
                    stop - start,
                    self.size,
                )
                continue
            start = stop
        return parts


def _free_device_cache(device: Any) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# --- output checking -------------------------------------------------------------------


def check_outputs(spec: RecipeSpec, tensors: Any, params: Mapping[str, Any]) -> None:
    """Raise :class:`cache_store.errors.SpcacheError` unless ``tensors`` are exactly the
    fields ``spec`` declares: no field missing or extra, each a CPU tensor of the declared
    dtype and rank, finite where the field says so.

    Shapes are checked against the symbolic shapes: integers, parameter expressions such
    as ``level+2``, and symbols (``M``, ``num_bytes``) that must take the same value
    wherever they appear. The message names the recipe and every field at fault.
    """
    import torch

    from cache_store.errors import SpcacheError

    def fail(problems: list[str]) -> None:
        raise SpcacheError(
            f"recipe {spec.name!r} produced the wrong outputs: " + "; ".join(problems)
        )

    if not isinstance(tensors, Mapping):
        fail([f"compute() returned {type(tensors).__name__}, expected a dict of tensors"])
    problems: list[str] = []
    fields = spec.fields_for(params)
    missing = sorted(set(fields) - set(tensors))
    extra = sorted(set(tensors) - set(fields), key=str)
    if missing:
        problems.append(f"field(s) {', '.join(missing)} missing")
    if extra:
        problems.append(f"field(s) {', '.join(map(str, extra))} not declared")
    symbols = param_symbols(params)
    for name, field in fields.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: a {type(tensor).__name__}, expected a torch.Tensor")
            continue
        if str(tensor.dtype).removeprefix("torch.") != field.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, declared {field.dtype}")
        if tensor.device.type != "cpu":
            problems.append(f"{name}: left on {tensor.device}, expected cpu")
        if (
            getattr(field, "finite", False)
            and tensor.is_floating_point()
            and tensor.device.type == "cpu"
            and not bool(torch.isfinite(tensor).all())
        ):
            problems.append(f"{name}: holds NaN or infinite values, declared finite")
        dims = shape_dims(field.shape)
        if len(dims) != tensor.dim():
            problems.append(
                f"{name}: shape {tuple(tensor.shape)} (rank {tensor.dim()}), declared {field.shape}"
            )
            continue
        for dim, size in zip(dims, tensor.shape, strict=True):
            if _dim_value(dim, params, symbols, size) != size:
                problems.append(f"{name}: shape {tuple(tensor.shape)}, declared {field.shape}")
                break
    if problems:
        fail(problems)


def _dim_value(dim: str, params: Mapping[str, Any], symbols: dict[str, int], size: int) -> int:
    fixed = fixed_size(dim, params)
    if fixed is not None:
        return fixed
    return symbols.setdefault(dim, size)


# --- code digest ---------------------------------------------------------------------------
