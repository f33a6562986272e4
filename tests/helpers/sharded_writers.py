"""A sharded snapshot's writer held at the one moment maintenance could hurt it: its
part written, its manifest not yet (the orphan sweep's and the superseded-part
reclaim's fault tests)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cache_store.snapshot.sharded import ShardedSnapshot, storage
from tests.helpers.local_cache import FP
from tests.helpers.synthetic import make_record

__all__ = ["HeldWriter"]


class HeldWriter:
    """A writer thread whose next manifest commit waits until :meth:`release`: its
    part is written, its manifest not yet."""

    def __init__(self, location: str, options: dict[str, Any], ids: list[str]) -> None:
        self.store = ShardedSnapshot(location, readonly=False, storage_options=options)
        self.ids = ids
        self.at_commit = threading.Event()
        self._go = threading.Event()
        self._commit = True
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, daemon=True)

    def start(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = storage.write_once

        def held(fs: Any, path: str, data: bytes) -> None:
            if "/commits/" in path and not self._go.is_set():
                self.at_commit.set()
                assert self._go.wait(120), "never released"
                if not self._commit:
                    raise RuntimeError("the writer died before its manifest")
            real(fs, path, data)

        monkeypatch.setattr(storage, "write_once", held)
        self._thread.start()
        assert self.at_commit.wait(120), "the writer never reached its commit"

    def _write(self) -> None:
        try:
            self.store.put_many(
                [(f"{FP}/{sid}", make_record(FP, sid, seed=n)) for n, sid in enumerate(self.ids)]
            )
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    def release(self, *, commit: bool = True) -> None:
        self._commit = commit
        self._go.set()
        self._thread.join(120)
        assert not self._thread.is_alive()
        self.store.close()
