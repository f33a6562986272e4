"""Every error class lives in ``cache_store.errors``, whose ``__all__`` is the one list
the front doors export; ``one_line`` is the one way an error becomes a line of text."""

from __future__ import annotations

import pytest

import cache_store
import spcache
from cache_store import errors
from cache_store.errors import SpcacheError, one_line


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


@pytest.mark.parametrize(
    "exc, expected",
    [
        (ValueError("a\n  b\tc "), "a b c"),
        (ValueError(""), "ValueError"),
        (KeyError("no such key"), "no such key"),  # KeyError's quotes taken off
        (KeyError(3), "3"),
        (errors.RecordNotFound("fp/a", "/c"), "no record 'fp/a' in cache /c"),
        (RuntimeError("x" * 1000), "x" * (errors.ONE_LINE_MAX - 3) + "..."),
    ],
)
def test_one_line(exc: BaseException, expected: str) -> None:
    assert one_line(exc) == expected
    assert len(one_line(exc)) <= errors.ONE_LINE_MAX


def test_one_line_with_its_class() -> None:
    assert one_line(OSError("disk\ngone"), with_class=True) == "OSError: disk gone"
    assert one_line(ValueError(), with_class=True) == "ValueError"
