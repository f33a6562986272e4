"""A real S3 HTTP API on 127.0.0.1 (moto's server mode) for the object-store tests.

Nothing here mocks s3fs or botocore: requests go over HTTP to a server that speaks S3
(conditional puts, multipart uploads, range reads, listings), found through the
``AWS_ENDPOINT_URL`` environment variable as a real deployment would set it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint: str

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


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port and point this process (and the
    processes it starts: Ray actors, CLI children) at it through the environment."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    try:
        yield S3Server(endpoint)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
