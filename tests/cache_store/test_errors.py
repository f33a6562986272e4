"""Every error class lives in ``cache_store.errors``, whose ``__all__`` is the one list
the front doors export; ``one_line`` is the one way an error becomes a line of text."""

from __future__ import annotations

import ast

import pytest

import cache_store
import spcache
from cache_store import errors
from cache_store.errors import SpcacheError, one_line
from tests.conftest import REPO_ROOT


def test_the_list_is_every_class_and_both_front_doors_export_it() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, SpcacheError)
    }
    assert set(errors.__all__) == defined
    for package in (spcache, cache_store):
        assert set(errors.__all__) <= set(package.__all__), package.__name__
        for name in errors.__all__:
            assert getattr(package, name) is getattr(errors, name)
    # the classes the lists once missed or that lived elsewhere are among them
    assert {"FingerprintRemoved", "StoreFull", "CacheDamaged", "CacheOwned", "WaitingFull"} <= (
        set(cache_store.__all__)
    )


def test_no_package_defines_an_error_class_outside_errors_py() -> None:
    """A class whose base is one of the error classes, anywhere in the four packages
    (read from the source, so a module nobody imports is covered too)."""
    offenders = []
    for package in ("cache_store", "workers", "service", "spcache"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path == REPO_ROOT / "cache_store" / "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                if bases & set(errors.__all__):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}: {node.name}")
    assert not offenders


@pytest.mark.parametrize(
    "exc, expected",
    [
        (ValueError("a\n  b\tc "), "a b c"),
        (ValueError(""), "ValueError"),
        (KeyError("no such key"), "no such key"),  # KeyError's quotes taken off
        (KeyError(3), "3"),
        (errors.RecordNotFound("fp/a", "/c"), "no record 'fp/a' in cache /c"),
        (RuntimeError("x" * 1000), "x" * 1000),  # a command's last word is never cut
    ],
)
def test_one_line(exc: BaseException, expected: str) -> None:
    assert one_line(exc) == expected


def test_a_failure_reason_is_cut_to_its_limit() -> None:
    cut = one_line(RuntimeError("x" * 1000), limit=errors.REASON_MAX)
    assert cut == "x" * (errors.REASON_MAX - 3) + "..."
    assert one_line(RuntimeError("short"), limit=errors.REASON_MAX) == "short"


def test_one_line_with_its_class() -> None:
    assert one_line(OSError("disk\ngone"), with_class=True) == "OSError: disk gone"
    assert one_line(ValueError(), with_class=True) == "ValueError"


def test_every_error_crosses_a_process_boundary_as_its_own_class() -> None:
    """Pickled, as a process pool returns it (the default rebuild called each subclass's
    constructor with its message and failed, breaking the pool), and as plain values
    (JSON): the same class, message and attributes."""
    import concurrent.futures as cf
    import json
    import multiprocessing
    import pickle

    made = [
        errors.UnknownName("recipe", "nope", ["spc", "spc_query"]),
        errors.RecipeUnusable("broken", "its constructor raised ValueError", ["spc"]),
    ]
    for error in made:
        for back in (
            pickle.loads(pickle.dumps(error)),
            errors.error_from_values(json.loads(json.dumps(errors.error_values(error)))),
        ):
            assert type(back) is type(error) and str(back) == str(error)
            assert vars(back) == vars(error)
    every = [
        getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)
    ]
    for cls in every:  # built without a constructor, so every class is tried alike
        error = cls.__new__(cls)
        error.args = ("a message",)
        error.detail = "kept"
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and back.args == ("a message",) and back.detail == "kept"
    ctx = multiprocessing.get_context("forkserver")
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with pytest.raises(errors.UnknownName) as raised:
            pool.submit(_raise_unknown_name).result(timeout=120)
    assert raised.value.known == ["spc"] and raised.value.name == "nope"


def _raise_unknown_name() -> None:
    raise errors.UnknownName("recipe", "nope", ["spc"])
