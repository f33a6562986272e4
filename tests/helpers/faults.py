"""Helpers for the fault suite: child processes with line-by-line output, sizes from the
environment, and the figures each case reports.

Every case prints its figures as one ``FIGURES <case> {json}`` line (shown with
``pytest -s`` or ``-rA``) and, when ``SPCACHE_FAULT_FIGURES`` names a file, appends the
same JSON there; ``docs/RELIABILITY.md`` quotes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from tests.helpers.fault_children import FAULT_CHILD
from tests.helpers.procs import Proc


def env_int(name: str, default: int) -> int:
    """A size read from the environment at test time (CI defaults otherwise)."""
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def report(case: str, figures: dict[str, Any]) -> None:
    line = json.dumps({"case": case, **figures}, sort_keys=True, default=str)
    print(f"FIGURES {line}")
    target = os.environ.get("SPCACHE_FAULT_FIGURES")
    if target:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


class Child(Proc):
    """A ``python -m tests.helpers.fault_children`` child whose stdout lines are taken
    in order: :meth:`expect` the next one of a kind, :meth:`drain` the rest."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        super().__init__([*FAULT_CHILD, *args], stdin=stdin)
        self._taken = 0  # stdout lines consumed by expect/drain

    def expect(self, prefix: str | tuple[str, ...], timeout: float = 60.0) -> str:
        """The next stdout line starting with ``prefix`` (the lines before it are passed
        over); fails if the child exits or ``timeout`` passes first."""
        prefixes = (prefix,) if isinstance(prefix, str) else prefix
        pattern = "^(?:" + "|".join(re.escape(p) for p in prefixes) + ")"
        index, match = self.next_line(pattern, timeout, stream="stdout", start=self._taken)
        self._taken = index + 1
        return match.string

    def drain(self) -> list[str]:
        """Every stdout line not taken yet (after the process is gone: all of them)."""
        rest = self.out_lines[self._taken :]
        self._taken += len(rest)
        return rest


@contextlib.contextmanager
def served(settings: Any, attempts: int = 3) -> Iterator[Any]:
    """The app under a real uvicorn on loopback (``InProcessServer``), started again on
    another port if a start fails (a loaded machine can miss the start deadline)."""
    from tests.helpers.service import InProcessServer

    for attempt in range(attempts):
        server = InProcessServer(settings)
        try:
            server.__enter__()
        except RuntimeError:
            server.server.should_exit = True
            server.socket.close()
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield server
        finally:
            server.__exit__(None, None, None)
        return


def plant_lmdb_value(cache_dir: str | os.PathLike[str], key: str, value: bytes) -> None:
    """Write ``value`` under ``key`` in the LMDB cache at ``cache_dir`` with the lmdb
    module itself, past every check of ``LMDBStore.put_many`` (no store of this process
    may have the cache open)."""
    import lmdb

    env = lmdb.open(os.path.join(os.fspath(cache_dir), "records"), max_dbs=4, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key.encode(), value, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()
