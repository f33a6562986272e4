"""Export one fingerprint of a cache into a Zarr v3 snapshot (CPU only).

:func:`export_snapshot` reads every record of a fingerprint's index from a source store
(normally the LMDB cache), checks it (header checksum, per-field xxh3, metadata naming
its key) and writes the layout described in :mod:`cache_store.snapshot.zarr.format`.

Two passes over the source: the first reads and checks every record and keeps its
header, so each array can be created at its final shape with chunks sized for it; the
second streams the tensors into chunk-aligned writes (no chunk is written twice) and
makes sure no record changed in between. A local export compresses and writes its data
chunks on a pool of threads (:class:`~cache_store.snapshot.zarr.chunks.LocalChunkWriter`,
the bytes zarr would write); an object store is written through zarr. The passes are
:mod:`~cache_store.snapshot.zarr.plan` and :mod:`~cache_store.snapshot.zarr.write`,
publishing is :mod:`~cache_store.snapshot.zarr.publish`; this module holds the choices
(codecs, chunk sizes) and the entry point.

Publishing is atomic for readers:

* a local destination (a path or ``file://`` URL) is written as a whole group in a hidden
  sibling directory, fsynced, and renamed into ``DEST/<fingerprint>``; a killed export
  leaves only the hidden directory, which the next export sweeps away (with any
  ``*.partial`` files zarr's own atomic writes left inside ``DEST``). One export at a time
  per destination: a lock (``flock`` on the ``DEST`` directory) refuses a second writer.
* an object-store URL (no rename there) is written in place under a group whose
  ``complete`` attribute is false, set true as the very last write. Readers ignore
  incomplete groups; ``verify`` reports them. Object stores offer no lock: run one
  export per destination; a writer token in the attributes detects a concurrent writer
  before completion.

Chunking: along the first axis. When every record has the same rows for a field, a
chunk holds whole records (a sample is never split); otherwise at least the mean
record's rows (a sample touches one or two chunks). Either way about ``chunk_bytes``
(the rows split evenly between chunks, so the last is not mostly padding), so small
fields are not split into tiny objects. Chunks are blosc compressed (zstd, lz4hc or lz4;
byte shuffle for multi-byte dtypes) or, with the ``none`` codec, the rows as they are;
either way they end in a CRC-32C. The default codec is ``none`` for a local destination
and ``zstd`` for a URL (:func:`default_codec`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_store.errors import ParameterError, SpcacheError, UnknownName
from cache_store.keys import validate_fingerprint
from cache_store.location import LocationLike, local_path, parse_location
from cache_store.snapshot.zarr import plan
from cache_store.snapshot.zarr.publish import publish_local, publish_remote
from cache_store.stores.base import Store
from cache_store.stores.opener import open_store

__all__ = [
    "CODECS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CLEVEL",
    "DEFAULT_LOCAL_CODEC",
    "DEFAULT_REMOTE_CODEC",
    "RAW_CHUNK_BYTES",
    "ExportSummary",
    "default_codec",
    "export_snapshot",
]

log = logging.getLogger(__name__)

#: Smallest uncompressed chunk of a data array, in bytes, for a compressing codec: a
#: read decompresses whole chunks, so they stay small.
DEFAULT_CHUNK_BYTES = 256 * 1024
#: The same for ``codec="none"``: a local read takes only a record's own rows from a
#: chunk file, whatever its size, so chunks are large (fewer files to open, keep open
#: and fsync).
RAW_CHUNK_BYTES = 16 * 1024 * 1024
#: Blosc's ``clevel`` (1-9, one scale for every blosc codec; blosc maps it onto the
#: codec's own levels, so it is not a zstd level). docs/BENCHMARKS.md compares levels.
DEFAULT_CLEVEL = 3


@dataclass
class ExportSummary:
    """What an export wrote: samples, what it left out and why, sizes and time."""

    fingerprint: str
    destination: str
    samples: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    record_bytes: int = 0
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "destination": self.destination,
            "samples": self.samples,
            "skipped": dict(self.skipped),
            "record_bytes": self.record_bytes,
            "seconds": round(self.seconds, 3),
        }


#: Chunk codecs offered: blosc with zstd compresses best; lz4hc reads 1.2-1.9x faster at
#: 11-15% more size and exports slowest; lz4 exports fastest of the three; ``none``
#: stores the rows as they are (with their CRC-32C), and a local reader then reads only
#: a record's own bytes, as from the LMDB cache. docs/BENCHMARKS.md compares them.
CODECS = ("zstd", "lz4hc", "lz4", "none")
#: Chosen by measurement (docs/BENCHMARKS.md): a local snapshot is for reading
#: (training), and only ``none`` lets a read take just the record's bytes (0.6-0.95x the
#: LMDB cache's rate, vs 0.15-0.45x for lz4 and 0.08-0.4x for zstd, which decompress
#: whole chunks), at the cache's own size; an object-store snapshot is for moving and
#: sharing, read through zarr one whole chunk at a time, so there the smallest: zstd
#: (~2.8x smaller than the records on spc_query data).
DEFAULT_LOCAL_CODEC = "none"
DEFAULT_REMOTE_CODEC = "zstd"


def default_codec(dest: LocationLike) -> str:
    """The codec an export to ``dest`` uses when none is named."""
    return DEFAULT_LOCAL_CODEC if parse_location(dest).is_local else DEFAULT_REMOTE_CODEC


# --------------------------------------------------------------------------- entry


def export_snapshot(
    source: Store | LocationLike,
    fingerprint: str,
    dest: LocationLike,
    *,
    overwrite: bool = False,
    skip_bad: bool = False,
    chunk_bytes: int | None = None,
    clevel: int = DEFAULT_CLEVEL,
    codec: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> ExportSummary:
    """Export the records of ``fingerprint`` in ``source`` to the snapshot ``dest``.

    Args:
        source: a store, or a cache location for :func:`open_store` (read-only).
        fingerprint: the dataset to export (its index gives the records and their order).
        dest: ``*.zarr`` path, ``file://`` URL or fsspec URL; other fingerprints already
            there are kept.
        overwrite: replace an already exported fingerprint. Open readers re-open it when
            a read finds the replaced files; until then they may serve records of the
            old export from their chunk caches (whole, verified records).
        skip_bad: leave out records that are missing, corrupt or shaped unlike the
            first one (each is logged and listed in the summary) instead of failing.
        chunk_bytes: smallest uncompressed chunk of a data array (default
            :data:`DEFAULT_CHUNK_BYTES`, or :data:`RAW_CHUNK_BYTES` for ``codec="none"``).
        clevel: blosc's compression level, 1-9 for any codec (blosc maps it onto the
            codec's own scale: not a zstd level).
        codec: one of :data:`CODECS` (any reader decodes all); default
            :func:`default_codec`: ``none`` for a local destination, ``zstd`` for a URL.
        storage_options: fsspec options for a URL ``dest``.
        progress: show progress bars (stderr).

    Returns:
        ExportSummary.

    Raises:
        FingerprintLookupError: ``fingerprint`` has no index in ``source``.
        SpcacheError: bad records (without ``skip_bad``), an existing export (without
            ``overwrite``), a concurrent export, a destination that is not a snapshot.
    """
    validate_fingerprint(fingerprint)
    if not 1 <= int(clevel) <= 9:
        raise ParameterError([f"clevel: {clevel!r} is outside 1..9"])
    if codec is None:
        codec = default_codec(dest)
    if codec not in CODECS:
        raise UnknownName("snapshot codec", codec, CODECS)
    if chunk_bytes is None:
        chunk_bytes = RAW_CHUNK_BYTES if codec == "none" else DEFAULT_CHUNK_BYTES
    if int(chunk_bytes) < 1:
        raise ParameterError([f"chunk_bytes: {chunk_bytes!r} must be positive"])
    started = time.perf_counter()
    owned = not isinstance(source, Store)
    store = source if isinstance(source, Store) else open_store(source, readonly=True)
    try:
        index = store.get_index(fingerprint)
        survey = plan.survey(store, index, progress)
        if survey.bad:
            for key, reason in survey.bad.items():
                log.warning("export: %s: %s", key, reason)
            if not skip_bad:
                listed = "; ".join(f"{k}: {r}" for k, r in list(survey.bad.items())[:20])
                raise SpcacheError(
                    f"{len(survey.bad)} record(s) of {fingerprint} cannot be "
                    f"exported (skip_bad / --skip-bad leaves them out): {listed}"
                )
        if parse_location(dest).is_local:
            publish_local(
                Path(local_path(dest)).absolute(),
                store,
                index,
                survey,
                overwrite,
                int(chunk_bytes),
                int(clevel),
                codec,
                progress,
            )
        else:
            publish_remote(
                parse_location(dest).target,
                store,
                index,
                survey,
                overwrite,
                int(chunk_bytes),
                int(clevel),
                codec,
                progress,
                storage_options,
            )
    finally:
        if owned:
            store.close()
    summary = ExportSummary(
        fingerprint,
        str(dest),
        len(survey.sample_ids),
        dict(survey.bad),
        survey.record_bytes,
        time.perf_counter() - started,
    )
    log.info(
        "exported %d records of %s to %s in %.1f s",
        summary.samples,
        fingerprint,
        summary.destination,
        summary.seconds,
    )
    return summary
