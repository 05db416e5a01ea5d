"""Shared fixtures: a short temp workspace (AF_UNIX paths are limited to 107
bytes, so not pytest's long tmp_path), a config writer, and a real
`trainwatch run` process with helpers to wait on its ledger and status."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from accounts import (  # noqa: F401  (hooks and a fixture pytest finds here)
    _accounts_removed,
    accounts,
    local_group,
    local_user,
    missing,
    need_root,
    pytest_configure,
    pytest_sessionfinish,
    remove_accounts,
    run_name,
)

WORKER = Path(__file__).parent / "jobs" / "worker.py"


@dataclass
class Workspace:
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def journal(self) -> Path:
        return self.root / "journal.jsonl"

    def worker(self, *args: str) -> list[str]:
        """The command line of the scriptable test job."""
        return [sys.executable, str(WORKER), "--ckpt-dir", str(self.ckpt),
                "--journal", str(self.journal), *args]

    def config(self, job: dict[str, Any], policy: dict[str, Any] | None = None,
               **top: Any) -> Path:
        """Write a config for one job named `job` and return its path."""
        job = {"name": "job", "checkpoints": {"dir": str(self.ckpt)}, **job}
        # The exporter is off unless a test asks for it: tests must not race for a port.
        doc: dict[str, Any] = {"state_dir": str(self.state), "run_dir": str(self.root / "run"),
                               "metrics": {"port": 0}, "jobs": [job], **top}
        pol = {"backoff": {"initial": "0.05s", "max": "1s", "jitter": 0}, "kill_grace": "2s"}
        pol.update(policy or {})
        doc["policies"] = {"default": pol}
        path = self.root / "trainwatch.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def run(self, config: Path, *extra: str) -> subprocess.Popen[bytes]:
        """Start `trainwatch run --config` as a real process."""
        p = subprocess.Popen(
            [sys.executable, "-m", "trainwatch.cli", "run", "--config", str(config),
             "--no-passthrough", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def faultinject(self, *args: str, job: str = "job") -> subprocess.CompletedProcess[str]:
        """Run the real `faultinject` CLI against this workspace's trainwatch."""
        return subprocess.run(
            [sys.executable, "-m", "faultinject.cli", args[0], "--job", job,
             "--state-dir", str(self.state), *args[1:]],
            capture_output=True, text=True, timeout=30, check=False,
        )

    def events(self) -> list[dict[str, Any]]:
        if not self.journal.exists():
            return []
        return [json.loads(x) for x in self.journal.read_text().splitlines() if x]

    def incidents(self) -> list[dict[str, Any]]:
        db = self.state / "ledger.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute("SELECT * FROM incidents ORDER BY id")]
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def transitions(self) -> list[str]:
        con = sqlite3.connect(f"file:{self.state / 'ledger.db'}?mode=ro", uri=True)
        try:
            return [r[0] for r in con.execute("SELECT to_state FROM transitions ORDER BY id")]
        finally:
            con.close()

    def status(self, job: str = "job") -> dict[str, Any]:
        try:
            return dict(json.loads((self.state / "jobs" / job / "status.json").read_text()))
        except (OSError, ValueError):
            return {}


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll until cond() is truthy; fail the test with `what` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def finish(p: subprocess.Popen[bytes], timeout: float = 30.0) -> tuple[int, str]:
    """Wait for a trainwatch process; its exit code and output."""
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out.decode(errors="replace")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM a helper process (a server, a daemon), SIGKILL past ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pid_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def workspace() -> Iterator[Workspace]:
    """A short temp dir; every trainwatch started in it is stopped (SIGINT) at the end."""
    root = Path(tempfile.mkdtemp(prefix="tw", dir="/tmp"))
    w = Workspace(root)
    w.ckpt.mkdir()
    try:
        yield w
    finally:
        for p in w.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if p.stdout:
                p.stdout.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def ws() -> Iterator[Workspace]:
    with workspace() as w:
        yield w


@pytest.fixture(autouse=True)
def _no_inherited_trainwatch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TRAINWATCH_"):
            monkeypatch.delenv(k)


def need_binary(name: str) -> str:
    """The path of an integration binary (prometheus, promtool, ...)."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (Debian package prometheus; make test installs it)")
        raise AssertionError("unreachable")
    return path


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick, released again)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def reachable_install() -> Iterator[None]:
    """A job's hand loads what it lacks (botocore's data for a pull) from trainwatch's
    install, as the job's user; a clean clone in a 0700 temp dir is not reachable by
    that user (make install's is). Let others traverse the folders above it for the
    test (never /root), and restore their modes after."""
    import sysconfig

    import trainwatch
    from trainwatch.privsep.jobhands import unreadable

    paths = (os.path.dirname(trainwatch.__file__), sysconfig.get_paths()["purelib"])
    opened: list[tuple[str, int]] = []
    try:
        while (d := unreadable(paths)) is not None:
            if d == "/root" or d.startswith("/root/") or os.geteuid() != 0 \
                    or any(d == o for o, _ in opened):
                missing(f"trainwatch's install is not reachable by other users ({d})")
            opened.append((d, os.stat(d).st_mode & 0o7777))
            os.chmod(d, opened[-1][1] | 0o001)
        yield
    finally:
        for d, mode in reversed(opened):
            os.chmod(d, mode)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder under /tmp that other users can traverse (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="twv", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# What `python -m trainwatch.cli` imports at run time, besides trainwatch itself.
_RUNTIME = ("psutil", "yaml", "_yaml", "prometheus_client", "pynvml.py")


@dataclass
class UserPython:
    """How another user runs trainwatch: an interpreter they may execute and a
    PYTHONPATH with trainwatch and its run-time dependencies."""

    python: str
    path: str

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": self.path, **extra}


@pytest.fixture(scope="session")
def user_python() -> Iterator[UserPython]:
    """The checkout, its venv and our own interpreter may sit in folders only root
    can enter (a clean clone in a 0700 temp dir; pyenv under /root): copy trainwatch
    and what it imports into a folder anyone can read, and pick an interpreter of
    the same version that uid 65534 can run with it."""
    need_root("running trainwatch as another user")
    import importlib.util

    import trainwatch

    site = Path(tempfile.mkdtemp(prefix="twsite", dir="/tmp"))
    site.chmod(0o755)
    try:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(Path(trainwatch.__file__).parent, site / "trainwatch", ignore=ignore)
        for name in _RUNTIME:
            spec = importlib.util.find_spec(name.removesuffix(".py"))
            if spec is None or spec.origin is None:
                continue
            src = Path(spec.origin)
            if src.name == "__init__.py":
                shutil.copytree(src.parent, site / src.parent.name, ignore=ignore)
            else:
                shutil.copy2(src, site / src.name)
        for root, dirs, files in os.walk(site):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
            for f in files:
                os.chmod(os.path.join(root, f), 0o644 if not f.endswith(".so") else 0o755)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        for python in (f"/usr/bin/{version}", f"/usr/local/bin/{version}",
                       os.path.realpath(sys.executable)):
            # Importable, and executable by the check trainwatch makes of a job's program.
            probe = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                 "import os, sys, trainwatch.cli, trainwatch.host.supervisor; "
                 "sys.exit(not os.access(sys.argv[1], os.X_OK))", python],
                env={"PATH": os.defpath, "PYTHONPATH": str(site)}, capture_output=True,
                check=False, timeout=60)
            if probe.returncode == 0:
                yield UserPython(python, str(site))
                return
        missing(f"no {version} that another user may run with trainwatch's copy in {site}")
    finally:
        shutil.rmtree(site, ignore_errors=True)


class ServedControl:
    """A control socket answered by a selector loop in a thread, as the daemon's is."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self._r, self._w = os.pipe()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._r:
                        return
                self.sock.handle()

    def stop(self) -> None:
        os.write(self._w, b"x")
        self._thread.join(timeout=10)
        self.sock.close()
        os.close(self._r)
        os.close(self._w)
