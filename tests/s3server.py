"""A real S3-compatible server for the tests: moto's standalone server, started
as a subprocess on a free port and spoken to over HTTP (never an in-process
patch). Import the fixtures into a test module (`from s3server import s3,
s3server`) or list the module in conftest's `pytest_plugins`.

`s3server` (one per session) is the process; `s3` (one per test) is a fresh
bucket, with the standard AWS variables set for this process and handed out
for subprocesses. Without moto_server the tests skip; under CI=true they fail."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_port, missing, stop

_buckets = itertools.count()


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point botocore (and so s3fs) here."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def create_bucket(self, name: str) -> None:
        # moto does not check signatures: a plain PUT creates the bucket.
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()


@dataclass
class S3Bucket:
    server: S3Server
    name: str

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    @property
    def env(self) -> dict[str, str]:
        return self.server.env

    def subprocess_env(self, **extra: str) -> dict[str, str]:
        """os.environ plus the AWS variables, for a child that talks to this bucket."""
        env = {k: v for k, v in os.environ.items() if k != "AWS_PROFILE"}
        return {**env, **self.env, **extra}


def moto_server_binary() -> str | None:
    # The venv's bin folder need not be on PATH (.venv/bin/pytest run directly).
    beside = Path(sys.executable).parent / "moto_server"
    if beside.exists():
        return str(beside)
    return shutil.which("moto_server")


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/", timeout=2) as r:
            r.read()
        return True
    except (urllib.error.URLError, OSError):
        return False


def start(binary: str, timeout: float = 30.0) -> S3Server:
    """Start moto_server on a free port and wait until it answers HTTP."""
    last = ""
    for _ in range(3):  # free_port() can race with another process: retry on a fresh port
        port = free_port()
        # Its log goes to a file: moto logs every request, and a pipe nobody reads
        # fills (64 KiB) and stops the server in the middle of a session.
        log = tempfile.TemporaryFile()  # noqa: SIM115  (the server writes it all session)
        proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log)
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(endpoint):
                return S3Server(endpoint, proc)
            time.sleep(0.05)
        stop(proc)
        log.seek(0)
        last = log.read().decode(errors="replace")[-500:]
        log.close()
    raise AssertionError(f"moto_server did not answer: {last}")


def _forget_s3_clients() -> None:
    # fsspec caches filesystem instances by their arguments, not by the environment:
    # a client made for another server's endpoint must not be reused.
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3server() -> Iterator[S3Server]:
    """moto_server as a real subprocess, for the whole session."""
    binary = moto_server_binary()
    if binary is None:
        missing("moto_server is not installed (pip install 'moto[server]'; in the dev extra)")
        raise AssertionError("unreachable")
    try:
        import s3fs  # noqa: F401  (the remote code under test needs it)
    except ImportError:
        missing("s3fs is not installed (the snapshot extra)")
    server = start(binary)
    try:
        yield server
    finally:
        stop(server.proc)


@pytest.fixture
def s3(s3server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on the server; this process's AWS variables point at it."""
    name = f"tw-{os.getpid()}-{next(_buckets)}"
    s3server.create_bucket(name)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for k, v in s3server.env.items():
        monkeypatch.setenv(k, v)
    _forget_s3_clients()
    try:
        yield S3Bucket(s3server, name)
    finally:
        _forget_s3_clients()
