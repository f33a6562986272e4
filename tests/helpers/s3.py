"""A real S3 HTTP API on 127.0.0.1 (moto's server mode) for the object-store tests.

Nothing here mocks s3fs or botocore: requests go over HTTP to a server that speaks S3
(conditional puts, multipart uploads, range reads, listings), found through the
``AWS_ENDPOINT_URL`` environment variable as a real deployment would set it.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.procs import environment

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Hold:
    """Requests the server holds unanswered until :meth:`release` (see
    :meth:`RequestLog.hold`): ``arrived`` is set when the first one comes."""

    #: how long a held request waits at most (a bound: a test releases it in its finally)
    MAX_HOLD_S = 600.0

    def __init__(self, method: str, path_suffix: str) -> None:
        self.method = method
        self.path_suffix = path_suffix
        self.arrived = threading.Event()
        self._released = threading.Event()

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and path.endswith(self.path_suffix)

    def wait(self) -> None:
        self.arrived.set()
        self._released.wait(self.MAX_HOLD_S)

    def release(self) -> None:
        self._released.set()


class RequestLog:
    """Every request the server answered, as ``"METHOD /path?query"``, in order: counted
    by the server itself (a WSGI wrapper around moto's app), so requests from any
    process, through any client, are seen. :meth:`hold` keeps chosen requests waiting
    (a download in flight, for as long as a test needs one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[str] = []
        self._holds: list[Hold] = []

    def wrap(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def counting(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            query = environ.get("QUERY_STRING", "")
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            line = f"{method} {path}"
            with self._lock:
                self._seen.append(f"{line}?{query}" if query else line)
                holds = [hold for hold in self._holds if hold.matches(method, path)]
            for hold in holds:
                hold.wait()
            return app(environ, start_response)

        return counting

    @contextlib.contextmanager
    def hold(self, method: str, path_suffix: str) -> Iterator[Hold]:
        """Hold every ``method`` request whose path ends with ``path_suffix`` unanswered
        inside the block (or until ``Hold.release``); released when the block ends."""
        held = Hold(method, path_suffix)
        with self._lock:
            self._holds.append(held)
        try:
            yield held
        finally:
            held.release()
            with self._lock:
                self._holds.remove(held)

    def since(self, mark: int) -> list[str]:
        """The requests answered after :meth:`mark` returned ``mark``."""
        with self._lock:
            return self._seen[mark:]

    def mark(self) -> int:
        with self._lock:
            return len(self._seen)


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    requests: RequestLog = field(default_factory=RequestLog)

    def new_bucket(self) -> str:
        """A fresh bucket; returns its name."""
        import boto3

        name = f"spcache-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=name)
        return name

    def storage_options(self) -> dict[str, Any]:
        """fsspec's options for this server (as a user passes ``storage_options``)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}


def snapshot_destination(request: Any, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A sharded snapshot's location and storage options for a test parametrized by
    ``"local"`` (a folder under ``tmp_path``) or ``"s3"`` (a fresh bucket on the module's
    ``s3`` fixture, moto's server)."""
    if request.param == "local":
        return str(tmp_path / "snap.zarr"), {}
    server = request.getfixturevalue("s3")
    return f"s3://{server.new_bucket()}/x/snap.zarr", server.storage_options()


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port and point this process (and the
    processes it starts: Ray actors, CLI children) at it through the environment."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    requests = RequestLog()
    wsgi = server._server  # moto keeps its werkzeug server here; its handler calls .app
    assert wsgi is not None and hasattr(wsgi, "app"), "moto's server layout changed"
    wsgi.app = requests.wrap(wsgi.app)
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with environment(**CREDENTIALS, AWS_ENDPOINT_URL=endpoint):
            yield S3Server(endpoint, requests)
    finally:
        server.stop()
