"""A recipe's code digest: what its records carry as ``code_digest``, so a record
computed by other code than the installed recipe's is noticed (the fingerprint names
recipe, version and parameters only).

The digest is of source text, read from files without importing anything (the service
must not import ``workers``): the class's module and its ``code_modules``; for a recipe
made from functions (``spcache.recipe``), its ``code_functions``' own source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any

__all__ = ["code_digest"]


def code_digest(cls: type) -> str:
    """A digest of the recipe's code: the source of the class's module and of its
    ``code_modules`` (read from their files, nothing imported). Two records of one
    fingerprint with different digests were computed by different code."""
    h = hashlib.blake2b(digest_size=8)
    functions = getattr(cls, "code_functions", ())
    if functions:  # a recipe made from functions (spcache.recipe): their source
        for fn in functions:
            h.update(_function_source(fn) + b"\0")
        return h.hexdigest()
    for module in (cls.__module__, *getattr(cls, "code_modules", ())):
        h.update(module.encode() + b"\0")
        h.update(_module_source(module, cls))
    return h.hexdigest()


def _function_source(fn: Any) -> bytes:
    """A function's source (a notebook cell's too); its compiled code where the source
    cannot be found (``python -``)."""
    try:
        return inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        if code is None:
            return repr(fn).encode()
        return code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode()


def _module_file(module: str) -> str | None:
    """The file of ``module`` found without importing it or its parent packages
    (``find_spec("a.b")`` would import ``a``: the service must not import ``workers``)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        found = None
        for where in locations:
            package = os.path.join(where, part)
            if os.path.isfile(os.path.join(package, "__init__.py")):
                found = package
                break
            if last and os.path.isfile(package + ".py"):
                return package + ".py"
        if found is None:
            return None
        if last:
            return os.path.join(found, "__init__.py")
        locations = [found]
    return None


def _module_source(module: str, cls: type) -> bytes:
    loaded = sys.modules.get(module)
    origin = getattr(loaded, "__file__", None) or _module_file(module)
    if origin and origin.endswith(".py"):
        try:
            with open(origin, "rb") as fh:
                return fh.read()
        except OSError:
            pass
    try:  # a class defined in a notebook or __main__ without a file
        return inspect.getsource(cls).encode()
    except (OSError, TypeError):
        return b"unknown:" + f"{module}.{cls.__qualname__}".encode()
