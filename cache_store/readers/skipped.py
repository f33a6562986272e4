"""The samples a ``CachedDataset(on_error="skip")`` left out, shared by all its processes.

A DataLoader's workers are separate processes (forked or spawned): what one of them
skips never reaches the parent's copy of the dataset by itself. :class:`SkippedSamples`
keeps the record in a private temporary directory made by the process that built the
dataset, one small JSON file per skipped sample id. A process that skips a sample
*links* its file into place (``os.link`` fails when the name exists), so exactly one
process of the dataset, whichever first skips an id, logs the warning for it, and every
process (the parent after an epoch included) lists the same ids.

Limits: the record belongs to one dataset object and its worker processes (a dataset
built again, e.g. one per DDP rank, keeps its own); it lives until that object is
collected or the creating process exits; it lists the ids skipped at least once, not how
often. The failures behind read-through skips are also in the cache's failure log
(``failures.sqlite``), which outlives the dataset: see
:func:`cache_store.jobs.failures.failures_of`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cache_store.errors import CorruptRecord, RecordNotFound, SampleFailed, SourceError

__all__ = ["ON_ERROR_CHOICES", "SKIPPABLE_ERRORS", "SkippedSample", "SkippedSamples"]

#: what ``on_error="skip"`` leaves out: this sample has no usable record (none stored, a
#: damaged one, the worker could not compute it, or, with ``sources=``, its source file
#: is gone or unreadable so the record cannot be checked). A missing cache, no live
#: worker or a timeout are not the sample's fault and raise whatever the policy.
SKIPPABLE_ERRORS = (RecordNotFound, CorruptRecord, SampleFailed, SourceError)
ON_ERROR_CHOICES = ("raise", "skip")


@dataclass(frozen=True)
class SkippedSample:
    """A sample left out of its batch: its id, source path (or record key), the one-line
    reason and when (Unix time) it was first skipped."""

    sample_id: str
    path: str
    reason: str
    when: float


def _remove(directory: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child's copy of the finaliser must not delete it
        shutil.rmtree(directory, ignore_errors=True)


class SkippedSamples:
    """A directory of skipped-sample files, removed when the creating process drops it."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="spcache-skipped-")
        self._finalizer: Any = weakref.finalize(self, _remove, self.directory, os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}  # a spawned worker shares the directory

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self._finalizer = None  # only the creator removes it

    def add(
        self,
        sample_id: str,
        path: str,
        reason: str,
        *,
        key: str | None = None,
        when: float | None = None,
    ) -> bool:
        """Record a skip under ``key`` (default: ``sample_id``), at ``when`` (default:
        now); True when no process of this dataset had skipped that key before (the
        caller then warns), False when one had."""
        key = sample_id if key is None else key
        name = hashlib.sha256(key.encode("utf-8")).hexdigest()[:40] + ".json"
        final = os.path.join(self.directory, name)
        if os.path.exists(final):
            return False
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "key": key,
                        "sample_id": sample_id,
                        "path": path,
                        "reason": reason,
                        "when": time.time() if when is None else when,
                    },
                    f,
                )
            try:
                os.link(temp, final)  # atomic, and refuses an existing name
            except FileExistsError:
                return False
            except FileNotFoundError:  # the directory is gone: the dataset was dropped
                return True
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    def restore(self, entries: Iterable[Sequence[Any]]) -> None:
        """Record again the skips listed as ``[key, id, path, reason, when]`` each (a
        sampler state's ``failed``), keeping their keys and times."""
        for key, sample_id, path, reason, when in entries:
            self.add(str(sample_id), str(path), str(reason), key=str(key), when=when)

    def entries(self) -> dict[str, SkippedSample]:
        """Every key (sample id, or the path ``add`` was given as key) skipped so far by
        any process of the dataset, sorted."""
        out: dict[str, SkippedSample] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return out
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            out[data.get("key", data["sample_id"])] = SkippedSample(
                data["sample_id"], data["path"], data["reason"], float(data["when"])
            )
        return dict(sorted(out.items()))
