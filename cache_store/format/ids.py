"""Sample ids packed as UTF-8 bytes plus offsets (dataset indexes, snapshots): no
Python object per id at rest."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


__all__ = ["pack_ids", "unpack_ids"]


def pack_ids(sample_ids: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """Sample ids packed as UTF-8: ``(blob uint8 [total_bytes], offsets int64 [n + 1])``,
    id i being ``blob[offsets[i]:offsets[i + 1]]`` (dataset indexes, snapshots)."""
    import numpy as np

    encoded = [s.encode("utf-8") for s in sample_ids]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    return blob, offsets


def unpack_ids(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_ids`: the ids as a NumPy str array [n] (``<U1`` when empty)."""
    import numpy as np

    raw = blob.tobytes()
    ids = [raw[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]
    return np.array(ids, dtype=str) if ids else np.array([], dtype="<U1")
