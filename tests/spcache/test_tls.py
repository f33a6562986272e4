"""``spcache serve`` over HTTPS, and readers that trust its certificate.

A TLS file that is not a regular file (a FIFO, which hung ``serve`` silently at start)
is refused at once, exit 2, naming it and why, as sources are checked.

The certificate in ``tests/data/tls`` is self-signed for 127.0.0.1 and localhost, made
for these tests only (``openssl req -x509 -newkey rsa:2048 -nodes -days 36500
-subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1,DNS:localhost``).
"""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from cache_store.readers.dataset import CachedDataset
from cache_store.keys import compute_fingerprint
from cache_store.stores.http import HTTPStore
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.index import DatasetIndex
from tests.helpers.synthetic import make_record, spc_fields
from tests.conftest import REPO_ROOT
from tests.helpers.faults import report
from tests.helpers.procs import run_spcache, serve
from tests.helpers.service import TOKEN

TLS = REPO_ROOT / "tests" / "data" / "tls"
CERT, KEY = TLS / "cert.pem", TLS / "key.pem"
FP = compute_fingerprint("spc", 1, {})


def test_serve_speaks_https_and_a_reader_trusting_its_certificate_reads_records(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    store = LMDBStore(cache, readonly=False)
    value = make_record(FP, "a1", 0)
    store.put_many([(f"{FP}/a1", value)])
    store.put_index(DatasetIndex(FP, "spc", 1, {}, np.array(["a1"])))
    store.close()
    trust = ssl.create_default_context(cafile=str(CERT))
    with serve(
        "--cache", cache, "--no-worker", "--tls-certfile", CERT, "--tls-keyfile", KEY, verify=trust
    ) as server:
        url = server.url
        assert url == f"https://127.0.0.1:{server.port}"
        with HTTPStore(url, ca_file=CERT, retries=0) as reader:
            record = reader.get_record(f"{FP}/a1")
            assert torch.equal(record["octree"], spc_fields(0)["octree"])
            assert reader.fingerprints() == [FP]
        dataset = CachedDataset(url, FP, store_options={"ca_file": str(CERT), "retries": 0})
        assert torch.equal(dataset[0]["octree"], spc_fields(0)["octree"])
        dataset.close()
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", timeout=5)  # the system's CAs do not know it
        with pytest.raises(httpx.TransportError):  # and nothing answers in plain HTTP
            httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5)
        server.stop()
    assert f"spcache serve: listening on {url}" in server.proc.stderr()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tls-certfile", str(CERT)], "tls_certfile and tls_keyfile go together"),
        (["--tls-certfile", str(KEY), "--tls-keyfile", str(KEY)], "cannot load TLS certificate"),
        (
            ["--tls-certfile", str(CERT), "--tls-keyfile", "/nowhere/key.pem"],
            "TLS file /nowhere/key.pem: cannot read file: it does not exist",
        ),
    ],
)
def test_bad_tls_files_are_one_line_at_start(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    out = run_spcache("serve", "--cache", tmp_path / "cache", "--port", "0", "--no-worker", *flags)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("ca_file", [KEY, TLS / "missing.pem"])
def test_a_ca_file_that_does_not_load_is_named_when_the_store_is_made(ca_file: Path) -> None:
    with pytest.raises(ValueError, match=f"ca_file {ca_file}: cannot load"):
        HTTPStore("https://127.0.0.1:1", ca_file=ca_file)


def test_a_fifo_as_the_tls_certificate_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "cert.pem"
    os.mkfifo(fifo)
    (tmp_path / "cache").mkdir()
    start = time.monotonic()
    done = run_spcache(  # a hang on the FIFO fails here, after the bound
        "serve",
        "--cache",
        tmp_path / "cache",
        "--port",
        "0",
        "--no-worker",
        "--source-root",
        tmp_path,
        "--tls-certfile",
        fifo,
        "--tls-keyfile",
        fifo,
        env={"SPCACHE_TOKEN": TOKEN},
        timeout=120,
    )
    seconds = time.monotonic() - start
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "not a regular file (it is a FIFO)" in done.stderr and str(fifo) in done.stderr
    report("tls_fifo", {"exit": done.returncode, "seconds": round(seconds, 2)})
