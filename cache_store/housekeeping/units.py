"""The units housekeeping reads and writes: sizes (``500M``, ``1.5T``), durations (``12h``,
``30d``) and times (ISO 8601, UTC).

Parsed where they enter (a command-line option, a function argument): inner code gets
bytes and seconds.
"""

from __future__ import annotations

import datetime as _dt
import re

__all__ = ["format_size", "from_iso_time", "iso_time", "parse_duration", "parse_size"]

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str | int) -> int:
    """Bytes from ``"123"``, ``"500M"``, ``"2G"``, ``"1.5T"`` (K, M, G, T, P are powers of
    1024; a trailing ``B`` or ``iB`` is allowed). Raises ``ValueError`` naming the text."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(
            r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*", str(text), re.IGNORECASE
        )
        if match is None:
            raise ValueError(
                f"size {text!r}: expected a number of bytes, optionally with a "
                f"unit K, M, G, T (e.g. 500M, 2G, 1.5T)"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value < 0:
        raise ValueError(f"size {text!r}: must not be negative")
    return value


def parse_duration(text: str | float) -> float:
    """Seconds from ``"45s"``, ``"90m"``, ``"12h"``, ``"30d"``, ``"2w"`` (any case, as
    sizes; or a number of seconds). Raises ``ValueError`` naming the text."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(
                f"duration {text!r}: expected a number with a unit s, m, h, d or w (e.g. 12h, 30d)"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower() or "s"]
    if seconds < 0:
        raise ValueError(f"duration {text!r}: must not be negative")
    return seconds


def format_size(size: int) -> str:
    """``1536`` -> ``"1.5 KiB"``, ``512`` -> ``"512 B"``: the one way a size is shown (every
    command's tables and messages), in powers of 1024 that :func:`parse_size` reads back."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def iso_time(stamp: float | None) -> str | None:
    """A time stamp as ISO 8601 UTC to the second (None stays None)."""
    if stamp is None:
        return None
    return _dt.datetime.fromtimestamp(stamp, _dt.UTC).isoformat(timespec="seconds")


def from_iso_time(text: str | None) -> float | None:
    """An ISO 8601 time as a time stamp; None for none or an unreadable one."""
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None
