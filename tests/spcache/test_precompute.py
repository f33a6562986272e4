"""``spcache precompute`` / ``verify`` / ``stats`` as a user runs them: real processes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from cache_store.errors import SpcacheError
from cache_store.stores.opener import open_store
from tests.helpers.procs import run_spcache, start_spcache, wait_for, wait_gone
from spcache.cli import main

SMALL = [
    "--param",
    "level=5",
    "--param",
    "surface_samples=2000",
    "--param",
    "uniform_queries=500",
    "--param",
    "surface_queries=500",
]


def test_bad_inputs_each_end_in_an_error_or_a_record(
    tmp_path: Path, bad_inputs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    folder = bad_inputs[0].parent
    out = run_spcache(
        "precompute",
        str(folder),
        "--recipe",
        "spc_query",
        *SMALL,
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "2",
        "--json",
    )
    assert out.returncode == 1, out.stderr
    summary = json.loads(out.stdout)
    assert {"fingerprint", "done", "skipped", "failed", "errors"} <= set(summary)
    assert summary["done"] + summary["failed"] == len(bad_inputs)
    assert summary["failed"] >= 10 and summary["done"] >= 1
    by_path = {e["path"]: e for e in summary["errors"]}
    with open_store(cache) as store:
        for path in bad_inputs:
            key = f"{summary['fingerprint']}/{path.stem}"
            if str(path) in by_path:
                error = by_path[str(path)]
                assert error["id"] == path.stem and error["reason"]
                assert not store.has(key)
            else:
                record = store.get_record(key)
                assert record.metadata["sample_id"] == path.stem
        assert store.verify().ok
    # without --json: a readable summary with the reasons and the fingerprint
    assert (
        main(
            [
                "precompute",
                str(folder),
                "--recipe",
                "spc_query",
                *SMALL,
                "--cache",
                str(cache),
                "--device",
                "cpu",
                "--loaders",
                "0",
            ]
        )
        == 1
    )
    text = capsys.readouterr().out
    assert f"fingerprint {summary['fingerprint']}" in text
    assert f"skipped {summary['done']}" in text
    # a failure found before hashing is remembered too: the second run says it is a repeat
    assert "empty.obj): failed again, same reason: file is empty" in text


def _stored_values(cache: Path) -> dict[str, bytes]:
    try:
        with open_store(cache) as store:
            return {key: store.get(key) for key in store.keys()}
    except (SpcacheError, OSError):
        return {}


@pytest.mark.slow
def test_killed_run_resumes_without_recomputing(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    src = tmp_path / "src"
    for copy in range(2):
        (src / f"set{copy}").mkdir(parents=True)
        for mesh in corpus_meshes:
            os.symlink(mesh, src / f"set{copy}" / mesh.name)
    total = 2 * len(corpus_meshes)
    cache = tmp_path / "cache"
    args = [
        "precompute",
        str(src),
        "--recipe",
        "spc_query",
        *SMALL,
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "1",
        "--write-batch",
        "1",
        "--json",
    ]
    with start_spcache(*args) as proc:
        wait_for(lambda: len(_stored_values(cache)) >= 3, what="three stored records", proc=proc)
        helpers = psutil.Process(proc.pid).children(recursive=True)
        assert helpers, "expected loader processes"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the loader processes do not outlive a killed engine (and are not killed by
        # the clean-up at the end of this block before this is checked)
        assert wait_gone(helpers) == []
    before = _stored_values(cache)
    assert 3 <= len(before) < total

    out = run_spcache(*args)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["skipped"] == len(before) and summary["done"] == total - len(before)
    after = _stored_values(cache)
    assert len(after) == total
    for key, value in before.items():
        assert after[key] == value  # not recomputed: byte for byte, creation time included
    verify = run_spcache("verify", "--cache", str(cache), "--json")
    assert verify.returncode == 0, verify.stdout
    assert json.loads(verify.stdout)["ok"] is True
    with open_store(cache) as store:
        ids = store.get_index(summary["fingerprint"]).sample_ids.tolist()
    assert sorted(ids) == sorted(k.split("/", 1)[1] for k in after)
    stats = run_spcache("stats", "--cache", str(cache), "--json")
    assert stats.returncode == 0
    assert json.loads(stats.stdout)["records"] == total


def _json_run(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(list(args))
    summary = json.loads(capsys.readouterr().out)
    assert code == (1 if summary["failed"] else 0)
    return summary


def test_changed_parameter_or_source_is_never_a_stale_hit(
    tmp_path: Path, corpus_meshes: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.obj"
    src.write_bytes(next(m for m in corpus_meshes if m.suffix == ".obj").read_bytes())
    cache = tmp_path / "cache"
    base = [
        "precompute",
        str(src),
        "--recipe",
        "spc",
        "--param",
        "surface_samples=1000",
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "0",
        "--json",
    ]
    first = _json_run(capsys, *base, "--param", "level=5")
    again = _json_run(capsys, *base, "--param", "level=5")
    assert (first["done"], again["skipped"], again["done"]) == (1, 1, 0)
    other = _json_run(capsys, *base, "--param", "level=6")
    assert other["fingerprint"] != first["fingerprint"] and other["done"] == 1
    src.write_bytes(src.read_bytes() + b"\n# changed\n")
    changed = _json_run(capsys, *base, "--param", "level=5")
    assert changed["fingerprint"] == first["fingerprint"] and changed["done"] == 1


def test_verify_and_stats_of_a_fresh_cache(
    tmp_path: Path, corpus_meshes: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    fingerprint = _json_run(
        capsys,
        "precompute",
        str(corpus_meshes[0]),
        "--recipe",
        "spc",
        "--param",
        "level=4",
        "--param",
        "surface_samples=500",
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "0",
        "--json",
    )["fingerprint"]
    assert main(["verify", "--cache", str(cache)]) == 0
    assert "verifies clean" in capsys.readouterr().out
    assert main(["stats", "--cache", str(cache)]) == 0
    assert fingerprint in capsys.readouterr().out
    assert main(["verify", "--cache", str(tmp_path / "nothing")]) == 2


def test_a_full_cache_stops_precompute_with_one_line_and_a_rerun_finishes(
    tmp_path: Path,
    corpus_meshes: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import cache_store.stores.opener
    from cache_store.stores.lmdb import LMDBStore

    cache = tmp_path / "cache"
    args = [
        "precompute",
        *map(str, corpus_meshes),
        "--recipe",
        "spc",
        "--param",
        "level=6",
        "--param",
        "surface_samples=4000",
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "0",
    ]
    # the cache's disk, as small as an LMDB map bound makes it
    monkeypatch.setattr(
        cache_store.stores.opener,
        "open_store",
        lambda path, readonly: LMDBStore(
            path, readonly=readonly, map_size=128 * 1024, max_map_size=512 * 1024
        ),
    )
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "stopped: no space left on" in err and "run the same command again" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    with open_store(cache) as store:
        kept = len(list(store.keys()))
        assert 0 < kept < len(corpus_meshes) and store.verify().ok
    assert main(args) == 0
    with open_store(cache) as store:
        assert len(list(store.keys())) == len(corpus_meshes) and store.verify().ok


def test_sigterm_commits_what_was_computed_and_writes_the_index(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    args = [
        "precompute",
        *map(str, corpus_meshes),
        "--recipe",
        "spc_query",
        *SMALL,
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--loaders",
        "1",
        "--write-batch",
        "1",
        "--json",
    ]
    with start_spcache(*args) as proc:
        wait_for(lambda: len(_stored_values(cache)) >= 2, what="two stored records", proc=proc)
        assert proc.stop(signal.SIGTERM) == 130, proc.stderr()[-3000:]
    stored = _stored_values(cache)
    assert 2 <= len(stored) < len(corpus_meshes)
    fingerprint = next(iter(stored)).split("/", 1)[0]
    with open_store(cache) as store:
        assert sorted(store.get_index(fingerprint).sample_ids.tolist()) == sorted(
            k.split("/", 1)[1] for k in stored
        )
        assert store.verify().ok
