"""Benchmark: what a cache of N tiny records costs (issue 37: a million shapes).

Tiny records are what a million-object dataset (Objaverse) at a coarse level makes:
recipe ``spc`` at level 3 on 64-point clouds, about 0.9 kB of tensors each. Sections
(``--sections``, all by default; each prints its own table):

``records``
    Record format 2 (what the fingerprint's records share stored once, in a descriptor)
    against format 1 (every record carrying its recipe's whole schema). ``--real``
    point clouds are precomputed by the real engine; their records (tensors and
    metadata) are the templates of ``--n`` records per format, each with its own sample
    id, source hash, stat signature and time, written into a fresh LMDB cache in
    batches of 32 (the engine's ``--write-batch``), ids in order. Reported per record:
    the value's bytes, bytes on disk (``data.mdb``; and the pages the records database
    holds: leaf and overflow), and the read cost of one random record (``get_record``,
    the read ``CachedDataset`` makes; and the header parse alone), medians of
    ``--rounds`` rounds of ``--reads`` reads, the formats interleaved. Ratios are
    format 2 against format 1 in the same run. Also printed: LMDB's largest value that
    stays on a leaf page for these keys (a larger one takes an overflow page of its
    own).

``summaries``
    One format-2 cache of ``--n`` records with its index (the ``rerun`` section's cache,
    built as below), then what a user asks of it: ``spcache stats --json`` and ``spcache
    ls --json`` (the commands, in a subprocess, wall time), ``cache_stats``/``ls`` in this
    process, and the service's ``GET /v1/caches/{fp}`` (first page and the last) and
    ``GET /v1/caches`` (its app in this process, the first request after start); and the
    cache's bytes on disk per record against its tensors; also ``stats`` in the child
    process the service runs it in (``run_in_child``). The baseline, in the same run: a
    walk over every record that reads its size and parses its header, what the answer
    cost before the writers kept summaries; the ratios against it are printed.

``rerun``
    ``--n`` point-cloud files (64 points, ``.npy`` written as bytes, mtimes a minute
    old) and, for each, its record as a finished run leaves it (a template's tensors, the
    file's real source hash and stat signature) **written through the store's writer**
    (``LMDBStore.put_many``, 32 a transaction), not computed by a precompute run (a
    million precomputed samples take about an hour on this machine). Then ``spcache
    precompute DIR --json`` over them with everything current: seconds per sample, whole
    command. The baseline in the same run: the same re-run over ``--baseline-n`` files
    whose records carry no stat signature (each file opened and hashed in a loader, as
    every re-run did before).

``--keep DIR`` builds the source files and caches of ``summaries`` and ``rerun`` in DIR
and leaves them there; a later run with the same ``--keep`` and ``--n`` measures them
again without building them.

Nothing here asserts a size or a speed.

    python bench/scale.py [--n 100000] [--real 256] [--reads 20000] [--rounds 5]
        [--sections records,summaries,rerun] [--baseline-n 20000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from cache_store.format.encode import encode_record  # noqa: E402
from cache_store.format.header import MANAGED_METADATA, read_header  # noqa: E402
from cache_store.stores.lmdb import LMDBStore  # noqa: E402
from cache_store.testing.format1 import encode_record_v1  # noqa: E402  (format 1's writer)

#: LMDB's page header (``PAGEHDRSZ``), a leaf node's header (``NODESIZE``) and the
#: fewest keys a page must hold (``MDB_MINKEYS``): lmdb.h / mdb.c, LMDB 0.9.
_PAGE_HEADER, _NODE_HEADER, _MIN_KEYS = 16, 8, 2


def leaf_limit(page_size: int, key_bytes: int) -> int:
    """The largest value LMDB keeps on a leaf page for a key of ``key_bytes``: a node
    (header, key, value) over ``me_nodemax`` moves its value to overflow pages."""
    nodemax = (((page_size - _PAGE_HEADER) // _MIN_KEYS) & -2) - 2
    return nodemax - _NODE_HEADER - key_bytes


# -------------------------------------------------------------------- templates


def real_templates(workdir: Path, count: int, level: int, points: int) -> list[Any]:
    """``count`` records the real engine computes from ``points``-point clouds."""
    from workers.engine import Engine

    workdir = Path(tempfile.mkdtemp(prefix="templates-", dir=workdir))
    sources = workdir / "sources"
    sources.mkdir()
    rng = np.random.default_rng(0)
    items = []
    for i in range(count):
        path = sources / f"t{i:05d}.npy"
        np.save(path, rng.normal(size=(points, 3)).astype(np.float32))
        items.append((f"t{i:05d}", str(path)))
    with LMDBStore(workdir / "templates", readonly=False) as store:
        engine = Engine(store, "spc", {"level": level}, device="cpu", backend="torch", loaders=0)
        summary = engine.run(items)
        if summary.failed:
            raise SystemExit(f"template samples failed: {summary.errors}")
        return [store.get_record(engine.key(sid)) for sid, _ in items]


def per_record_metadata(template: dict[str, str], i: int) -> dict[str, str]:
    """The template's metadata with what differs per record made up for record ``i``."""
    meta = {k: v for k, v in template.items() if k not in MANAGED_METADATA}
    meta["sample_id"] = f"s{i:07d}"
    meta["source_hash"] = "xxh3_128:" + f"{i:032x}"
    meta["source_stat"] = f"896:{1_795_745_488_742_621_655 + i}:{2_172_329 + i}:65024"
    meta["created"] = (
        _dt.datetime(2026, 1, 1, tzinfo=_dt.UTC) + _dt.timedelta(seconds=i)
    ).isoformat()
    return meta


# -------------------------------------------------------------------- records


def write_cache(
    path: Path,
    templates: list[Any],
    n: int,
    encode: Callable[[Any, dict[str, str]], bytes],
    metadata: Callable[[dict[str, str], int], dict[str, str]] = per_record_metadata,
) -> dict[str, Any]:
    fingerprint = templates[0].metadata["fingerprint"]
    value_bytes = 0
    start = time.perf_counter()
    with LMDBStore(path, readonly=False, map_size=1 << 30) as store:
        batch = []
        for i in range(n):
            template = templates[i % len(templates)]
            value = encode(template.tensors, metadata(template.metadata, i))
            value_bytes += len(value)
            batch.append((f"{fingerprint}/s{i:07d}", value))
            if len(batch) == 32:
                store.put_many(batch)
                batch = []
        if batch:
            store.put_many(batch)
    wall = time.perf_counter() - start
    return {
        **disk_figures(path, templates, n),
        "value_bytes": value_bytes / n,
        "write_us": wall / n * 1e6,
    }


def disk_figures(path: Path, templates: list[Any], n: int) -> dict[str, Any]:
    """Bytes on disk per record of the cache at ``path`` (``n`` records made from
    ``templates`` as :func:`write_cache` makes them), against their tensors."""
    import lmdb

    tensors = [sum(t.numel() * t.element_size() for t in x.tensors.values()) for x in templates]
    tensor_bytes = sum(tensors[i % len(tensors)] for i in range(n))
    fingerprint = templates[0].metadata["fingerprint"]
    env = lmdb.open(str(path / "records"), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            stat = txn.stat(env.open_db(b"records", txn=txn, create=False))
        page = env.stat()["psize"]
    finally:
        env.close()
    return {
        "records": n,
        "key_bytes": len(f"{fingerprint}/s{0:07d}"),
        "page_size": page,
        "tensor_bytes": tensor_bytes / n,
        "disk_bytes": (path / "records" / "data.mdb").stat().st_size / n,
        "leaf_pages": stat["leaf_pages"],
        "overflow_pages": stat["overflow_pages"],
        "records_db_bytes": (stat["leaf_pages"] + stat["branch_pages"] + stat["overflow_pages"])
        * page
        / n,
        "fingerprint": fingerprint,
    }


def read_costs(paths: dict[str, Path], fingerprint: str, n: int, reads: int, rounds: int) -> dict:
    """Median µs per read, per format: ``get_record`` and the header parse alone."""
    stores = {name: LMDBStore(path) for name, path in paths.items()}
    rng = random.Random(1)
    out: dict[str, dict[str, list[float]]] = {name: {"read": [], "header": []} for name in paths}
    try:
        for _ in range(rounds):
            keys = [f"{fingerprint}/s{rng.randrange(n):07d}" for _ in range(reads)]
            for name, store in stores.items():  # interleaved, same keys
                start = time.perf_counter()
                for key in keys:
                    store.get_record(key)
                out[name]["read"].append((time.perf_counter() - start) / reads * 1e6)
                values = [store.get(key) for key in keys[: min(reads, 5000)]]
                start = time.perf_counter()
                for key, value in zip(keys, values, strict=False):
                    read_header(value, key=key)
                out[name]["header"].append((time.perf_counter() - start) / len(values) * 1e6)
    finally:
        for store in stores.values():
            store.close()
    return {name: {k: statistics.median(v) for k, v in runs.items()} for name, runs in out.items()}


def section_records(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    templates = real_templates(workdir, args.real, args.level, args.points)
    formats = {
        "format 1": encode_record_v1,
        "format 2": encode_record,
    }
    written = {}
    for name, encode in formats.items():
        written[name] = write_cache(workdir / name.replace(" ", ""), templates, args.n, encode)
        print(f"  wrote {args.n} {name} records", file=sys.stderr, flush=True)
    fingerprint = written["format 1"]["fingerprint"]
    paths = {name: workdir / name.replace(" ", "") for name in formats}
    reads = read_costs(paths, fingerprint, args.n, args.reads, args.rounds)
    one = written["format 1"]
    limit = leaf_limit(one["page_size"], one["key_bytes"])
    print(f"\nrecords: N={args.n}, {one['tensor_bytes']:.0f} B of tensors per record (mean)")
    print(
        f"LMDB page {one['page_size']} B; a value up to {limit} B stays on a leaf page "
        f"(key {one['key_bytes']} B)"
    )
    rows = [
        ("value bytes / record", "value_bytes", "{:.0f}"),
        ("value / tensors", None, "{:.2f}x"),
        ("data.mdb bytes / record", "disk_bytes", "{:.0f}"),
        ("data.mdb / tensors", None, "{:.2f}x"),
        ("records db pages bytes / record", "records_db_bytes", "{:.0f}"),
        ("overflow pages", "overflow_pages", "{:.0f}"),
        ("write us / record", "write_us", "{:.1f}"),
    ]
    print(f"{'':34} {'format 1':>12} {'format 2':>12} {'2 vs 1':>8}")
    for label, field, fmt in rows:
        if field is None:
            base = "value_bytes" if label.startswith("value") else "disk_bytes"
            a = one[base] / one["tensor_bytes"]
            b = written["format 2"][base] / written["format 2"]["tensor_bytes"]
        else:
            a, b = one[field], written["format 2"][field]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{label:34} {fmt.format(a):>12} {fmt.format(b):>12} {ratio:>8}")
    for what in ("read", "header"):
        a, b = reads["format 1"][what], reads["format 2"][what]
        label = "get_record us / read" if what == "read" else "header parse us / read"
        print(f"{label:34} {a:12.1f} {b:12.1f} {b / a:7.2f}x")
    return {"written": written, "reads": reads, "leaf_limit": limit}


def _walk_sizes(cache: Path) -> int:
    """The records' bytes, by a walk over every record that reads its size and parses its
    header (where a record's code digest is found): what answering ``stats`` cost before
    the writers kept summaries. The baseline of the ``summaries`` section."""
    import lmdb

    env = lmdb.open(str(cache / "records"), max_dbs=8, readonly=True, lock=False)
    total = 0
    try:
        with env.begin(buffers=True) as txn:
            cursor = txn.cursor(env.open_db(b"records", txn=txn, create=False))
            for key, value in cursor:
                read_header(value, key=bytes(key).decode())
                total += len(value)
    finally:
        env.close()
    return total


def _timed(action: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def _command(*args: str | os.PathLike[str], cwd: Path) -> tuple[float, Any]:
    """``spcache ARGS --json`` in a subprocess from ``cwd``: (wall seconds, its JSON)."""
    import subprocess

    argv = [sys.executable, "-m", "spcache", *map(str, args), "--json"]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
    return wall, json.loads(done.stdout)


def _version(cwd: Path) -> None:
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "spcache", "--version"], cwd=cwd, check=True, capture_output=True
    )


def section_summaries(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from cache_store.cache_report import cache_stats
    from cache_store.housekeeping import ls
    from cache_store.housekeeping.isolated import run_in_child

    templates = real_templates(workdir, min(args.real, 64), args.level, args.points)
    _, cache = _rerun_corpus(args.corpus, "signed", templates, args.n, signed=True)
    fingerprint = templates[0].metadata["fingerprint"]
    disk = disk_figures(cache, templates, args.n)
    print(f"  {args.n} records and their index ready", file=sys.stderr, flush=True)
    out: dict[str, float] = {}
    # once each, untimed: the first command of a fresh checkout compiles its bytecode
    for command in ("stats", "ls"):
        _command(command, "--cache", cache, cwd=workdir)
    out["stats in a child process (isolated path)"], walked = _timed(
        lambda: run_in_child("stats", cache)
    )
    walk_s, walk_bytes = _timed(lambda: _walk_sizes(cache))
    out["baseline: walk every record, parse its header"] = walk_s
    out["spcache --version (a command's start)"], _ = _timed(lambda: _version(workdir))
    out["spcache stats --json (command)"], stats = _command("stats", "--cache", cache, cwd=workdir)
    out["spcache ls --json (command)"], listed = _command("ls", "--cache", cache, cwd=workdir)
    out["cache_stats() in process"], _ = _timed(lambda: cache_stats(cache))
    out["ls() in process"], _ = _timed(lambda: ls(cache))
    assert stats["fingerprints"][fingerprint]["records"] == args.n == listed[0]["records"]
    assert (
        stats["fingerprints"][fingerprint]["bytes"] == walked["fingerprints"][fingerprint]["bytes"]
    )
    assert stats["fingerprints"][fingerprint]["bytes"] == walk_bytes, (stats, walk_bytes)

    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    app = create_app(Settings(cache=str(cache), worker=False))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        out["GET /v1/caches/{fp} (first)"], view = _timed(
            lambda: client.get(f"/v1/caches/{fingerprint}?limit=100").json()
        )
        out["GET /v1/caches/{fp} (again)"], _ = _timed(
            lambda: client.get(f"/v1/caches/{fingerprint}?limit=100").json()
        )
        last = max(args.n - 100, 0)
        out["GET /v1/caches/{fp}?offset=N-100"], tail = _timed(
            lambda: client.get(f"/v1/caches/{fingerprint}?offset={last}&limit=100").json()
        )
        out["GET /v1/caches"], _ = _timed(lambda: client.get("/v1/caches").json())
    assert view.get("counts", {}).get("records") == args.n, view
    assert tail["index"]["sample_ids"][-1] == f"s{args.n - 1:07d}", tail["index"]
    print(f"\nsummaries: N={args.n} records (one fingerprint, indexed), seconds")
    for label, seconds in out.items():
        print(f"{label:40} {seconds:10.3f}")
    for label in (
        "spcache stats --json (command)",
        "spcache ls --json (command)",
        "cache_stats() in process",
    ):
        print(f"{label + ' / baseline':40} {out[label] / walk_s:10.3f}x")
    print(
        f"disk: data.mdb {disk['disk_bytes']:.0f} B / record, tensors {disk['tensor_bytes']:.0f}"
        f" B ({disk['disk_bytes'] / disk['tensor_bytes']:.2f}x); records db"
        f" {disk['records_db_bytes']:.0f} B / record; {disk['overflow_pages']} overflow pages"
    )
    return {"n": args.n, "seconds": out, "disk": disk}


def _npy_header(points: int) -> bytes:
    """The ``.npy`` header of a float32 ``[points, 3]`` array (what ``np.save`` writes)."""
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.zeros((points, 3), dtype=np.float32))
    return buffer.getvalue()[: -points * 3 * 4]


def _rerun_corpus(
    workdir: Path, name: str, templates: list[Any], n: int, *, signed: bool, points: int = 64
) -> tuple[Path, Path]:
    """``n`` source files and the cache a finished run over them leaves, built once: a
    directory that already holds them (``--keep``, a ``ready`` file naming ``n``) is
    used as it is.

    The files are written as bytes (the ``.npy`` header once, then ``points`` x 3 random
    float32), not one ``np.save`` each; their records are written through the store's
    writer (``put_many``, 32 a transaction, as the engine writes), each with its file's
    real source hash and stat signature, not computed by a precompute run."""
    from cache_store.sources.files import signature_of
    from cache_store.sources.hashing import hash_bytes

    sources, cache = workdir / f"{name}-sources", workdir / f"{name}-cache"
    ready = workdir / f"{name}-ready"
    if ready.is_file() and ready.read_text().strip() == str(n):
        print(f"  reusing {n} sources and records in {workdir}", file=sys.stderr, flush=True)
        return sources, cache
    sources.mkdir()
    header = _npy_header(points)
    rng = np.random.default_rng(7)
    old = time.time() - 60
    marks: list[tuple[str, str]] = []
    start = time.perf_counter()
    for i in range(n):
        path = sources / f"s{i:07d}.npy"
        data = header + rng.normal(size=(points, 3)).astype(np.float32).tobytes()
        with open(path, "wb") as out:
            out.write(data)
        os.utime(path, (old, old))
        marks.append((hash_bytes(data), signature_of(os.stat(path)) if signed else ""))
    print(
        f"  wrote {n} source files in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )

    def metadata(template: dict[str, str], i: int) -> dict[str, str]:
        meta = per_record_metadata(template, i)
        meta["source_hash"], meta["source_stat"] = marks[i]
        if not signed:
            del meta["source_stat"]
        return meta

    write_cache(cache, templates, n, encode_record, metadata)
    from cache_store.format.index import DatasetIndex

    template = templates[0].metadata
    with LMDBStore(cache, readonly=False) as store:
        store.put_index(
            DatasetIndex(
                template["fingerprint"],
                template["recipe"],
                int(template["recipe_version"]),
                json.loads(template["params"]),
                [f"s{i:07d}" for i in range(n)],
            )
        )
    ready.write_text(f"{n}\n")
    return sources, cache


def section_rerun(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    templates = real_templates(workdir, min(args.real, 64), args.level, args.points)
    recipe = ["--recipe", "spc", "--param", f"level={args.level}", "--device", "cpu"]
    runs = {}
    for name, n, signed in (
        ("baseline: no stat signature, hashed in a loader", min(args.baseline_n, args.n), False),
        ("stat signature: decided in the driver", args.n, True),
    ):
        sources, cache = _rerun_corpus(
            args.corpus, "signed" if signed else "hashed", templates, n, signed=signed
        )
        print(f"  {n} sources and records ready ({name})", file=sys.stderr, flush=True)
        wall, summary = _command("precompute", sources, "--cache", cache, *recipe, cwd=workdir)
        if summary["skipped"] != n or summary["done"] or summary["failed"]:
            raise SystemExit(f"{name}: not a re-run with nothing to do: {summary}")
        runs[name] = {"n": n, "wall_s": wall, "us_per_sample": wall / n * 1e6}
    runs["spcache --version (a command's start)"] = {
        "n": 1,
        "wall_s": _timed(lambda: _version(workdir))[0],
    }
    print("\nrerun: a re-run over a finished corpus (spcache precompute, whole command)")
    print(f"{'':50} {'N':>9} {'wall s':>9} {'us/sample':>10}")
    for name, run in runs.items():
        per = run.get("us_per_sample")
        shown = f"{per:10.1f}" if per is not None else f"{'':10}"
        print(f"{name:50} {run['n']:9d} {run['wall_s']:9.1f} {shown}")
    base, fast = list(runs.values())[:2]
    print(
        f"{'driver vs baseline, per sample':50} {fast['us_per_sample'] / base['us_per_sample']:>30.3f}x"
    )
    return runs


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "records": section_records,
    "summaries": section_summaries,
    "rerun": section_rerun,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="scale.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="records per cache")
    parser.add_argument("--real", type=int, default=256, help="records computed for real")
    parser.add_argument("--level", type=int, default=3, help="spc level")
    parser.add_argument("--points", type=int, default=64, help="points per cloud")
    parser.add_argument("--reads", type=int, default=20_000, help="random reads per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (medians)")
    parser.add_argument(
        "--baseline-n", type=int, default=20_000, help="samples of the re-run's baseline"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--workdir", type=Path, help="work here (default: a temp dir)")
    parser.add_argument(
        "--keep",
        type=Path,
        help="build the source files and their caches here and keep them; a later run with "
        "the same --keep and --n uses them as they are (default: a temp dir, removed)",
    )
    args = parser.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="spcache-scale-", dir=args.workdir) as tmp:
        args.corpus = args.keep or Path(tmp) / "corpus"
        args.corpus.mkdir(parents=True, exist_ok=True)
        for name in chosen:
            workdir = Path(tmp) / name
            workdir.mkdir()
            results[name] = SECTIONS[name](args, workdir)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
