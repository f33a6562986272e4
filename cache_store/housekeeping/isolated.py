"""Housekeeping in a child process, one protocol: a damaged LMDB page cannot turn into
a dead caller, and a writer never opens the cache inside a reader.

Some damage to ``records/data.mdb`` does not raise: LMDB's own assertions (e.g.
``IS_LEAF(mp)`` in ``mdb_cursor_next``) call ``abort()`` and take the whole process
down. A walk over every page (verify, stats, the service's listings) therefore runs in
a child process (``python -m cache_store.housekeeping.isolated OP PATH [ARG...]``), and
so does the service's ``rm`` (``DELETE /v1/caches/{fp}``: the service's own store stays
read-only). The child answers one JSON object on stdout: ``{"result": ...}``, or the
error it raised as values (:func:`cache_store.errors.error_values`), which
:func:`run_in_child` raises again as its own class. A child killed by a signal becomes::

    cache damaged: <path>: walk aborted (SIGABRT)

Functions here never return half a result: :func:`verify_cache` returns a report (with
``damaged`` set when the store itself is damaged), :func:`stats_cache` raises
:class:`CacheDamaged`. Both raise :class:`CacheNotFound` for a path without a cache and
:class:`SpcacheError` when the child fails otherwise (timeout, crash at start).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cache_store.log_setup import configure_logging
from cache_store.errors import (
    CacheDamaged,
    CorruptRecord,
    SpcacheError,
    error_from_values,
    error_values,
)

__all__ = ["verify_cache", "stats_cache", "run_in_child", "child_answer", "DEFAULT_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: A walk longer than this is killed and reported as an error (not as damage).
DEFAULT_TIMEOUT_S = 3600.0
_OPS = ("verify", "stats", "rm")


def _package_root() -> str:
    # the child imports this very copy of cache_store, whatever the cwd or install
    return str(Path(__file__).resolve().parent.parent)


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_in_child(
    op: str, path: str | os.PathLike[str], *args: str, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> Any:
    """Run ``op`` (``verify`` or ``stats`` walks, ``rm FINGERPRINT...``) on the cache at
    ``path`` in a child; its JSON result.

    Raises:
        CacheDamaged: the child reported damage, or was killed by a signal.
        SpcacheError: what the child raised, as its own class (``CacheNotFound``,
            ``StoreBusy``, ``FingerprintLookupError``...); or the child timed out or
            failed without an answer.
    """
    if op not in _OPS:
        raise ValueError(f"unknown walk {op!r}; known: {', '.join(_OPS)}")
    path = os.fspath(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "cache_store.housekeeping.isolated", op, path, *args]
    try:
        done = subprocess.run(command, capture_output=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SpcacheError(f"{path}: {op} took longer than {timeout_s:g} s; stopped") from exc
    if done.returncode < 0:
        reason = f"walk aborted ({_signal_name(done.returncode)})"
        log.error(
            "cache damaged: %s: %s; the walk's last words: %s", path, reason, _tail(done.stderr)
        )
        raise CacheDamaged(path, reason)
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or done.returncode != 0:
        raise SpcacheError(f"{path}: {op} failed (exit {done.returncode}): {_tail(done.stderr)}")
    if "error" in answer:
        error = error_from_values(answer)
        if type(error) is SpcacheError:  # not one of spcache's own (an OSError, say)
            raise SpcacheError(f"{path}: {op} failed: {error}")
        raise error
    if "result" not in answer:
        raise SpcacheError(f"{path}: {op} answered no result")
    return answer["result"]


def _tail(stderr: bytes, lines: int = 3) -> str:
    text = stderr.decode("utf-8", "replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(nothing on stderr)"


def verify_cache(
    path: str | os.PathLike[str],
    fingerprint: str | None = None,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """``Store.verify`` of the cache at ``path``, walked in a child process.

    Returns the report's JSON (``checked``, ``ok``, ``corrupt``, ``missing``,
    ``unindexed``) plus
    ``damaged``: None, or the reason the store itself is damaged (then ``ok`` is False).
    """
    args = () if fingerprint is None else (fingerprint,)
    try:
        report = run_in_child("verify", path, *args, timeout_s=timeout_s)
    except CacheDamaged as exc:
        return {
            "checked": 0,
            "ok": False,
            "corrupt": {},
            "missing": [],
            "unindexed": {},
            "damaged": str(exc),
        }
    report.setdefault("damaged", None)
    return report


def stats_cache(
    path: str | os.PathLike[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """``Store.stats`` of the cache at ``path``: from the summaries its writers keep,
    read here (a few pages, no walk: :func:`summarized_stats`), else walked in a child
    process.

    Raises :class:`CacheDamaged` (naming the cache) when the walk cannot finish.
    """
    kept = summarized_stats(path)
    if kept is not None:
        return kept
    result: dict[str, Any] = run_in_child("stats", path, timeout_s=timeout_s)
    return result


def summarized_stats(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The stats of the cache directory at ``path`` from its writers' summaries
    (:mod:`cache_store.stores.lmdb.summaries`), or None where there are none to trust (a
    snapshot, a URL, a cache no writer of this version wrote, any error: the child's
    walk then says what is wrong)."""
    from cache_store.location import parse_location
    from cache_store.stores.lmdb import LMDBStore, has_cache

    where = parse_location(path)
    if where.kind != "lmdb" or not where.is_local or not has_cache(Path(where.target)):
        return None
    store = LMDBStore(where.target, readonly=True)
    try:
        if store.summaries() is None:
            return None
        return store.stats()
    except SpcacheError:
        return None
    finally:
        store.close()


# ------------------------------------------------------------------------- the child


def child_answer(op: str, path: str, args: list[str]) -> dict[str, Any]:
    """What the child answers for ``op`` on ``path``: ``{"result": ...}``, or the error
    it raised as values (a record that cannot be read during a walk is the store's
    damage)."""
    try:
        if op == "rm":
            from cache_store.housekeeping.removal import rm

            return {"result": rm(path, args)}
        return {"result": _walk(op, path, args)}
    except CorruptRecord as exc:  # e.g. an unreadable index in stats
        return error_values(CacheDamaged(path, str(exc)))
    except (SpcacheError, OSError) as exc:
        return error_values(exc)


def _walk(op: str, path: str, args: list[str]) -> dict[str, Any]:
    from cache_store.stores.opener import open_store

    store = open_store(path, readonly=True)
    try:
        if op == "verify":
            return store.verify(args[0] if args else None).as_json()
        return store.stats()
    finally:
        store.close()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in _OPS:
        print(
            f"usage: python -m cache_store.housekeeping.isolated {{{'|'.join(_OPS)}}} "
            "PATH [FINGERPRINT...]",
            file=sys.stderr,
        )
        return 2
    configure_logging(logging.WARNING)
    answer = child_answer(argv[0], argv[1], argv[2:])
    sys.stdout.write(json.dumps(answer, default=str))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
