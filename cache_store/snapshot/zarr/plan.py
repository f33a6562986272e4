"""Pass one of an export: survey the records, and plan the arrays they fill.

:func:`survey` reads and checks every record of a fingerprint's index (in place where
the source store lends its memory) and keeps its header, so that each array can be
created at its final shape; records missing, corrupt or shaped unlike the first are
listed with the reason. :func:`chunk_rows` sizes a field's chunks (the rule is in
:mod:`cache_store.snapshot.zarr.export`'s doc).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_store.errors import CorruptRecord, RecordNotFound
from cache_store.format.decode import check_record
from cache_store.format.descriptor import Descriptor, descriptor_name
from cache_store.format.header import DTYPES, RecordHeader
from cache_store.format.index import DatasetIndex
from cache_store.keys import record_id
from cache_store.snapshot.zarr.format import validate_field_name
from cache_store.stores.base import Store

__all__ = ["FieldLayout", "Survey", "chunk_rows", "progress_bar", "survey"]


@dataclass
class FieldLayout:
    dtype: str  # safetensors name (F32 ...)
    trailing: tuple[int, ...]  # shape after the first axis
    scalar: bool  # 0-d tensors: one row per record
    rows: list[int] = field(default_factory=list)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype("uint16" if self.dtype == "BF16" else DTYPES[self.dtype])

    def rows_of(self, shape: tuple[int, ...]) -> int:
        return 1 if self.scalar else shape[0]

    def describe(self, meaning: str) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "zarr_dtype": str(self.numpy_dtype),
            "shape": [] if self.scalar else [None, *self.trailing],
            "meaning": meaning,
        }


@dataclass
class Survey:
    """Pass one: the records to export, their headers and the field layouts."""

    sample_ids: list[str] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    checksums: list[str] = field(default_factory=list)
    fields: dict[str, FieldLayout] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)
    record_bytes: int = 0
    descriptors: dict[str, Descriptor] = field(default_factory=dict)  # by digest

    def descriptor(self, fingerprint: str, digest: str) -> Descriptor:
        """A descriptor pass one found (a lookup for pass two's checks)."""
        found = self.descriptors.get(digest)
        if found is None or found.fingerprint != fingerprint:
            raise CorruptRecord(
                descriptor_name(fingerprint, digest), "not named by a record the export checked"
            )
        return found


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rec", disable=not enabled, leave=False)


def layout_problem(layouts: Mapping[str, FieldLayout], header: RecordHeader) -> str | None:
    if set(header.tensors) != set(layouts):
        return f"fields {sorted(header.tensors)} differ from the first record's {sorted(layouts)}"
    for name, info in header.tensors.items():
        lay = layouts[name]
        if (
            info.dtype != lay.dtype
            or (len(info.shape) == 0) != lay.scalar
            or (not lay.scalar and tuple(info.shape[1:]) != lay.trailing)
        ):
            return (
                f"field {name!r} is {info.dtype} {list(info.shape)}, unlike the first "
                f"record's {lay.dtype} {'[]' if lay.scalar else ['*', *lay.trailing]}"
            )
    return None


def survey(store: Store, index: DatasetIndex, progress: bool) -> Survey:
    survey = Survey()
    counts = index.variant_counts().tolist()
    # every variant's record is a row of its own, named by its record id (a1#v3)
    record_ids = [
        record_id(sample_id, variant)
        for sample_id, count in zip(index.sample_ids.tolist(), counts, strict=True)
        for variant in range(count)
    ]
    with progress_bar(len(record_ids), "checking", progress) as bar:
        for sample_id in record_ids:
            key = f"{index.fingerprint}/{sample_id}"
            bar.update(1)
            try:
                with store.read_view(key) as value:  # checked in place, not copied
                    header = check_record(value, key=key, lookup=store.descriptor)
                    header_bytes = bytes(memoryview(value)[8 : header.data_start])
                    size = len(value)
            except (RecordNotFound, CorruptRecord) as exc:
                survey.bad[key] = exc.reason if isinstance(exc, CorruptRecord) else "no record"
                continue
            if not survey.fields:
                survey.fields = {
                    validate_field_name(name): FieldLayout(
                        info.dtype, tuple(info.shape[1:]), len(info.shape) == 0
                    )
                    for name, info in sorted(header.tensors.items())
                }
            problem = layout_problem(survey.fields, header)
            if problem:
                survey.bad[key] = problem
                continue
            for name, lay in survey.fields.items():
                lay.rows.append(lay.rows_of(header.tensors[name].shape))
            digest = header.metadata.get("descriptor")
            if digest is not None and digest not in survey.descriptors:  # checked just now
                survey.descriptors[digest] = store.descriptor(index.fingerprint, digest)
            survey.sample_ids.append(sample_id)
            survey.headers.append(header_bytes)
            survey.checksums.append(header.checksum)
            survey.record_bytes += size
    return survey


def even_rows(total: int, per_chunk: int) -> int:
    """``per_chunk`` lowered so that ``total`` splits into as many chunks, evenly: the
    last chunk (stored at full size, padded) is then not mostly padding."""
    return math.ceil(total / math.ceil(total / per_chunk)) if total > per_chunk else per_chunk


def chunk_rows(lay: FieldLayout, n: int, chunk_bytes: int) -> int:
    """Rows per chunk: records of one size get whole records per chunk (a sample is
    never split); otherwise at least the mean record. About ``chunk_bytes`` each, the
    rows split evenly between the chunks."""
    total = sum(lay.rows)
    row_bytes = lay.numpy_dtype.itemsize * math.prod(lay.trailing)
    if n and lay.rows[0] > 0 and all(r == lay.rows[0] for r in lay.rows):
        record_bytes = lay.rows[0] * row_bytes
        per_chunk = max(1, chunk_bytes // record_bytes) if record_bytes else n
        return lay.rows[0] * even_rows(n, min(n, per_chunk))
    mean_rows = math.ceil(total / n) if n else 1
    by_bytes = math.ceil(chunk_bytes / row_bytes) if row_bytes else total
    rows = max(1, min(max(total, 1), max(mean_rows, by_bytes)))
    return max(even_rows(total, rows), min(rows, mean_rows))
