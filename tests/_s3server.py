"""A real S3 API for tests: moto's standalone server on 127.0.0.1.

``S3Server`` runs ``python -m moto.server`` in its own process (so stopping
it is a real outage for the client: connections refused), on a free port
the OS picks, and waits until it answers. ``fs()`` is an ``s3fs``
filesystem against it (credentials "testing"); ``storage_options`` are the
keyword arguments ``FsspecWriter`` / ``FsspecReader`` pass to fsspec.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One moto S3 server process; ``start()`` / ``stop()`` may be repeated
    (a fresh, empty server each start, on a new port)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        # skip_instance_cache: each server (port) gets its own client, and a
        # stopped server's connections are not reused by the next test
        return {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def start(self, timeout: float = 30.0) -> S3Server:
        self.port = _free_port()
        env = dict(os.environ, **_KEYS)
        env["PYTHONWARNINGS"] = "ignore"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, OSError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto server exited with {self.proc.returncode}") \
                        from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not answer in time") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def fs(self) -> Any:
        import s3fs

        o = self.storage_options
        return s3fs.S3FileSystem(key=o["key"], secret=o["secret"], skip_instance_cache=True,
                                 client_kwargs=o["client_kwargs"])

    def make_bucket(self, name: str) -> None:
        self.fs().mkdir(name)


@contextlib.contextmanager
def serving(bucket: str) -> Iterator[S3Server]:
    """A server started with ``bucket`` made, stopped at the end (a test
    module's fixture)."""
    server = S3Server().start()
    try:
        server.make_bucket(bucket)
        yield server
    finally:
        server.stop()
