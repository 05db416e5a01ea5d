"""A config file that YAML cannot even read (a NUL or another control character) or
that is not a regular file: one line naming the file and where, exit 2, from
`check-config`, `run` and `daemon`; on a reload the daemon logs one line and keeps
the config it has (issue 21, item 23)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_for
from trainwatch.config import ConfigError, load

GOOD = "metrics: {port: 0}\ngpu: {backend: off, kmsg: null}\njobs: []\n"
NUL_AT = "line 3, column 9: expected text without control characters (YAML allows none)," \
         " got a NUL byte"


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short folder: the daemon's control socket path must fit sun_path."""
    root = Path(tempfile.mkdtemp(prefix="twc", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _until(cond: Callable[[], bool], what: str, out: Path) -> None:
    """wait_for, failing with what the daemon wrote."""
    try:
        wait_for(cond, timeout=60, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the daemon wrote {out.read_text()[-2000:]!r}") from None


def _with_dirs(root: Path, body: str) -> str:
    return f"state_dir: {root / 'state'}\nrun_dir: {root / 'run'}\n" + body


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"metrics: {port: 0}\ngpu: {backend: off}\njobs: []\x00\n", NUL_AT),
        (b"jobs: []\n# a comment\nstate_dir: /var/lib/\x1b[31mx\n",
         "line 3, column 21: expected text without control characters (YAML allows none),"
         " got the character '\\x1b'"),
    ],
    ids=["nul-byte", "escape-character"],
)
def test_a_control_character_in_the_file_is_one_line_with_its_position(
        tmp_path: Path, content: bytes, message: str) -> None:
    """PyYAML's ReaderError (raised as the loader is built) is ConfigError: file, line, column."""
    path = tmp_path / "trainwatch.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == f"{path}: {message}"


def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A FIFO (whose open would wait for a writer) and /dev/zero are not read: one line each."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        start = time.monotonic()
        result = _cli("check-config", str(path), timeout=30)
        assert time.monotonic() - start < 20
        assert result.returncode == 2, result.stderr
        assert result.stderr == f"trainwatch: {path}: expected a regular file, got {kind}\n"


@pytest.mark.parametrize("verb", ["check-config", "run", "daemon"])
def test_a_nul_byte_is_one_line_and_exit_2_from_every_command(
        short_tmp: Path, verb: str) -> None:
    """`check-config`, `run --config` and `daemon --config`: exit 2, one line, no traceback."""
    path = short_tmp / "trainwatch.yaml"
    path.write_bytes(_with_dirs(short_tmp, "metrics: {port: 0}\ngpu: {backend: off}\n"
                                "jobs: []\x00\n").encode())
    args = {"check-config": ["check-config", str(path)],
            "run": ["run", "--config", str(path), "--metrics-port", "0"],
            "daemon": ["daemon", "--config", str(path)]}[verb]
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"trainwatch: {path}: line 5, column 9: expected text without" \
                            " control characters (YAML allows none), got a NUL byte\n"
    assert result.stdout == ""


@pytest.mark.parametrize("verb", ["check-config", "run", "daemon"])
def test_a_metrics_address_that_does_not_resolve_is_one_line_and_exit_2(
        short_tmp: Path, verb: str) -> None:
    """`metrics.address: nosuchhost.invalid` was ok to check-config, and the daemon then
    exited with a 35-line double traceback (the resolver's error, then the scheduler
    closed before it was made). Now one line from every command, exit 2."""
    path = short_tmp / "trainwatch.yaml"
    path.write_text(_with_dirs(short_tmp, "metrics: {address: nosuchhost.invalid}\n"
                                          "gpu: {backend: off}\njobs: []\n"))
    args = {"check-config": ["check-config", str(path)],
            "run": ["run", "--config", str(path), "--metrics-port", "0"],
            "daemon": ["daemon", "--config", str(path)]}[verb]
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"trainwatch: {path}: metrics.address: expected an address to listen on: an IP such "
        "as 127.0.0.1, or a name that resolves ("), result.stderr
    assert result.stderr.endswith("), got 'nosuchhost.invalid'\n"), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_metrics_address_the_daemon_cannot_listen_on_is_one_line_and_exit_2(
        short_tmp: Path) -> None:
    """An address that resolves but is not this host's (TEST-NET-1): the bind fails at
    start, and the daemon closes what it opened and says so in one line."""
    path = short_tmp / "trainwatch.yaml"
    path.write_text(_with_dirs(short_tmp, "metrics: {address: 192.0.2.1, port: 9}\n"
                                          "gpu: {backend: off}\njobs: []\n"))
    result = _cli("daemon", "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("trainwatch: metrics: cannot listen on 192.0.2.1:9: "), \
        result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_reload_of_a_file_with_a_nul_byte_keeps_the_old_config(short_tmp: Path) -> None:
    """SIGHUP and `trainwatch reload` after a NUL is written: one log line each naming the
    file and position, no traceback; the daemon goes on serving."""
    path = short_tmp / "trainwatch.yaml"
    path.write_text(_with_dirs(short_tmp, GOOD))
    run_dir = str(short_tmp / "run")
    out = short_tmp / "daemon.out"
    with open(out, "wb") as f:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(path)],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        _until(lambda: _cli("status", "--run-dir", run_dir).returncode == 0,
               "the daemon answering", out)
        path.write_bytes(_with_dirs(short_tmp, GOOD).replace("jobs: []", "jobs: []\x00")
                         .encode())
        daemon.send_signal(signal.SIGHUP)
        _until(lambda: "reload refused" in out.read_text(), "the refusal", out)
        reply = _cli("reload", "--run-dir", run_dir)
        assert reply.returncode == 1, (reply, out.read_text())
        assert reply.stderr.count("\n") == 1 and str(path) in reply.stderr, reply.stderr
        assert "got a NUL byte" in reply.stderr
        assert _cli("status", "--run-dir", run_dir).returncode == 0, out.read_text()
        assert daemon.poll() is None, out.read_text()
        log = out.read_text()
        refused = [x for x in log.splitlines() if "reload refused" in x]
        assert len(refused) == 2, log
        assert all(f"{path}: line 5, column 9:" in x and "NUL byte" in x for x in refused), log
        assert "Traceback" not in log, log
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=30)
