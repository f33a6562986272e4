"""Records the real engine wrote in format 1, before record format 2
(``tests/data/records_v1/``); format 1's writer is
:func:`cache_store.testing.format1.encode_record_v1`."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["GOLDEN_V1", "golden_v1_records"]

#: Records the engine wrote in format 1 (spcache precompute --recipe spc --param level=3
#: over 64-point clouds, at commit e541b9c), with their sources.
GOLDEN_V1 = Path(__file__).resolve().parent.parent / "data" / "records_v1"


def golden_v1_records() -> dict[str, bytes]:
    """The golden format-1 records: key -> the bytes the engine wrote."""
    keys = json.loads((GOLDEN_V1 / "keys.json").read_text())["records"]
    return {key: (GOLDEN_V1 / f"{name}.safetensors").read_bytes() for name, key in keys.items()}
