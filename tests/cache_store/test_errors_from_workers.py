"""An spcache error raised in a DataLoader worker reaches the training process as the
same class, its message the worker's traceback and its attributes read back from it
(torch rebuilds it as ``type(exc)(text)``). Real forked DataLoader workers."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, Dataset

import cache_store.errors as errors
from cache_store.errors import (
    CorruptRecord,
    RecordNotFound,
    SampleFailed,
    SourceError,
    SpcacheError,
    StaleRecord,
)


class Raising(Dataset):
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        raise self.error


def _through_a_worker(error: BaseException) -> BaseException:
    loader = DataLoader(Raising(error), batch_size=2, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(Exception) as caught:
        next(iter(loader))
    return caught.value


CASES = [
    (
        SampleFailed("chair/01", "/data/chair 01.obj", "no faces: 0 triangles"),
        "sample_id path reason",
    ),
    (RecordNotFound("0123456789abcdef0123456789abcdef/a"), "key"),
    (CorruptRecord("fp/a b", "checksum mismatch (crc 12 != 34)"), "key reason"),
    (SourceError("/data/bad mesh.obj", "not a mesh: line 3"), "path reason"),
    (StaleRecord("fp/a", "/data/a.obj", "h1", "h2"), "key path"),
]


@pytest.mark.parametrize(("error", "fields"), CASES, ids=lambda c: type(c).__name__)
def test_an_error_keeps_its_class_and_attributes_through_a_worker(
    error: SpcacheError, fields: str | SpcacheError
) -> None:
    got = _through_a_worker(error)
    assert type(got) is type(error)
    assert str(error) in str(got) and "DataLoader worker process" in str(got)
    for name in str(fields).split():
        assert getattr(got, name) == getattr(error, name), name


def test_every_error_class_accepts_the_workers_text() -> None:
    text = "Caught X in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    for name in errors.__all__:
        cls = getattr(errors, name)
        got = cls(text.replace("X", name) + f"cache_store.errors.{name}: something\n")
        assert type(got) is cls and str(got).startswith(f"Caught {name}"), name


def test_a_message_that_is_not_the_workers_keeps_the_old_meaning() -> None:
    assert SampleFailed("a", "/p", "r").sample_id == "a"
    assert str(SourceError("/p", "reason")) == "/p: reason"
    assert RecordNotFound("k").key == "k"
