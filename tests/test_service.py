"""systemd integration (trainwatch.host.service): the exact sd_notify datagrams a real
child process sends to a real AF_UNIX socket standing in for systemd's, the
watchdog's pid rule, the no-op without systemd-python, and journald fields."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import missing
from trainwatch.host.service import STATUS_MAX, journal_handler

SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "INVOCATION_ID",
                "JOURNAL_STREAM")


@pytest.fixture
def need_systemd_python() -> None:
    if importlib.util.find_spec("systemd") is None:
        missing("systemd-python is not installed (pip install -e '.[dev]'; it builds against"
                " libsystemd-dev and pkg-config)")


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in a short temp dir: the service manager's end."""
    root = tempfile.mkdtemp(prefix="twsd", dir="/tmp")
    path = os.path.join(root, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(10)
    try:
        yield s, path
    finally:
        s.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def notify_socket(
    need_systemd_python: None, listener: tuple[socket.socket, str],
) -> tuple[socket.socket, str]:
    """The manager's socket, for tests that need systemd-python to reach it."""
    return listener


def child(code: str, prelude: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh Python with only the systemd variables given here."""
    base = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
    script = prelude + textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
        from trainwatch.host.service import Service, journal_handler
    """) + textwrap.dedent(code)
    p = subprocess.run([sys.executable, "-c", script], env={**base, **env},
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    return p


def received(s: socket.socket) -> list[str]:
    """Every datagram queued on s (the sender has exited, so all are there)."""
    out: list[str] = []
    s.setblocking(False)
    try:
        while True:
            out.append(s.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        s.settimeout(10)


# A prelude that makes systemd-python unimportable, as on a host without libsystemd-dev.
NO_SYSTEMD_PYTHON = "import sys; sys.modules['systemd'] = None\n"


@pytest.mark.parametrize("sender", ["systemd-python", "own"])
def test_notify_sends_exact_datagrams(listener: tuple[socket.socket, str], sender: str) -> None:
    """ready/status/watchdog/reloading/stopping send sd_notify's exact messages, once each,
    through systemd-python or, when it is not installed, trainwatch's own sender."""
    if sender == "systemd-python" and importlib.util.find_spec("systemd") is None:
        missing("systemd-python is not installed (pip install -e '.[dev]')")
    s, path = listener
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    p = child("""
        s = Service()
        print(s.watchdog_interval)
        s.ready("starting 2 jobs")
        s.status("epoch 3\\nloss 0.5\\t" + "x" * 300)
        s.status("epoch 3 loss 0.5 " + "x" * 300)  # the same line once cleaned: not resent
        s.watchdog(100.0)
        s.watchdog(100.9)  # under the interval (1 s): no ping
        s.watchdog(101.0)
        s.reloading()
        s.stopping()
        print(s.notify_failures)
    """, prelude=NO_SYSTEMD_PYTHON if sender == "own" else "",
        NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert p.stdout.split() == ["1.0", "0"]
    got = received(s)
    status = ("epoch 3 loss 0.5 " + "x" * 300)[:STATUS_MAX]
    assert got[:4] == ["READY=1\nSTATUS=starting 2 jobs", f"STATUS={status}",
                       "WATCHDOG=1", "WATCHDOG=1"]
    reload_lines = got[4].split("\n")
    assert reload_lines[0] == "RELOADING=1"
    key, _, usec = reload_lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after
    assert got[5:] == ["STOPPING=1"]
    assert len(status) == STATUS_MAX


def test_watchdog_of_another_pid_is_not_ours(notify_socket: tuple[socket.socket, str]) -> None:
    """WATCHDOG_PID naming another process (inherited variables): no interval, no pings."""
    s, path = notify_socket
    p = child("""
        s = Service()
        print(s.watchdog_interval)
        for t in range(5):
            s.watchdog(float(t * 100))
        s.stopping()
    """, NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000", WATCHDOG_PID=str(os.getpid()))
    assert p.stdout.split() == ["None"]
    assert received(s) == ["STOPPING=1"]


def test_watchdog_pid_of_our_own_is_honoured(notify_socket: tuple[socket.socket, str]) -> None:
    """WATCHDOG_PID equal to our own pid: pings at half of WATCHDOG_USEC."""
    s, path = notify_socket
    p = child("""
        s = Service()
        print(s.watchdog_interval)
        s.watchdog(5.0)
    """, prelude="import os; os.environ['WATCHDOG_PID'] = str(os.getpid())\n",
        NOTIFY_SOCKET=path, WATCHDOG_USEC="500000")
    assert p.stdout.split() == ["0.25"]
    assert received(s) == ["WATCHDOG=1"]


def test_without_systemd_python_one_line_and_ready_still_sent(
    listener: tuple[socket.socket, str],
) -> None:
    """With systemd-python not importable: one info line naming the fallback, and READY=1
    reaches the manager's socket (a Type=notify unit starts)."""
    s, path = listener
    p = child("""
        for _ in range(2):
            s = Service()
        s.ready("up")
        print(s.watchdog_interval, journal_handler(), s.notify_failures)
    """, prelude=NO_SYSTEMD_PYTHON,
        NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000", INVOCATION_ID="0123abcd")
    assert p.stdout.split() == ["1.0", "None", "0"]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "systemd-python is not installed" in lines[0], p.stderr
    assert "own minimal sender" in lines[0]
    assert received(s) == ["READY=1\nSTATUS=up"]


def test_own_sender_reaches_an_abstract_socket() -> None:
    """NOTIFY_SOCKET=@name (the abstract namespace, as systemd may pass): the datagram
    arrives at the socket bound to NUL + name."""
    name = f"trainwatch-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        child("""
            Service().ready("up")
        """, prelude=NO_SYSTEMD_PYTHON, NOTIFY_SOCKET="@" + name)
        s.settimeout(10)
        assert s.recv(4096) == b"READY=1\nSTATUS=up"


def test_own_sender_refuses_an_address_it_cannot_speak_in_one_line(tmp_path: Any) -> None:
    """NOTIFY_SOCKET=vsock:... without systemd-python: `trainwatch daemon` exits 2 at once
    with one line naming what is missing, instead of never saying READY."""
    config = tmp_path / "trainwatch.yaml"
    config.write_text(f"state_dir: {tmp_path / 's'}\nrun_dir: {tmp_path / 'r'}\n"
                      "metrics: {port: 0}\ngpu: {backend: off, kmsg: null}\njobs: []\n")
    base = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
    p = subprocess.run(
        [sys.executable, "-c", NO_SYSTEMD_PYTHON + "from trainwatch.cli import main\n"
         f"sys.exit(main(['daemon', '--config', {str(config)!r}]))"],
        env={**base, "NOTIFY_SOCKET": "vsock:2:1234"}, capture_output=True, text=True,
        timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainwatch: NOTIFY_SOCKET: "), p.stderr
    assert "vsock:2:1234" in lines[0] and "systemd-python" in lines[0]


def test_daemon_without_systemd_python_says_ready(listener: tuple[socket.socket, str],
                                                  tmp_path: Any) -> None:
    """`trainwatch daemon` with systemd-python unimportable (a host that lacked
    libsystemd-dev at `make install`) still sends READY=1 to a real NOTIFY_SOCKET."""
    s, path = listener
    root = tempfile.mkdtemp(prefix="twrd", dir="/tmp")  # control.sock must fit sun_path
    config = tmp_path / "trainwatch.yaml"
    config.write_text(f"state_dir: {root}/s\nrun_dir: {root}/r\nmetrics: {{port: 0}}\n"
                      "gpu: {backend: off, kmsg: null}\njobs: []\n")
    base = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
    d = subprocess.Popen(
        [sys.executable, "-c", NO_SYSTEMD_PYTHON + "from trainwatch.cli import main\n"
         f"sys.exit(main(['daemon', '--config', {str(config)!r}]))"],
        env={**base, "NOTIFY_SOCKET": path, "INVOCATION_ID": "0123abcd"},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        s.settimeout(60)
        first = s.recv(4096).decode()
        assert first.startswith("READY=1\nSTATUS="), first
        d.send_signal(signal.SIGTERM)
        assert d.wait(timeout=30) == 0
        assert "STOPPING=1" in received(s)
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(timeout=30)
        out = d.stdout.read().decode() if d.stdout else ""
        if d.stdout:
            d.stdout.close()
        shutil.rmtree(root, ignore_errors=True)
    assert "Traceback" not in out, out
    assert "own minimal sender" in out, out


def test_notify_to_a_vanished_socket_is_counted_and_logged_once(
    notify_socket: tuple[socket.socket, str],
) -> None:
    """The manager's socket gone: no exception, each failure counted, one warning line."""
    _s, path = notify_socket
    p = child("""
        s = Service()
        s.ready("up"); s.status("working"); s.watchdog(1.0); s.stopping()
        print(s.notify_failures)
    """, NOTIFY_SOCKET=path + ".gone", WATCHDOG_USEC="2000000")
    assert p.stdout.split() == ["4"]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "systemd notify failed" in lines[0], p.stderr


def test_journal_handler_sends_uppercase_extras_as_fields(
    need_systemd_python: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under systemd, extra={"TRAINWATCH_JOB": ...} becomes a journal field (sender stands in
    for journald, which this VM does not run) and SYSLOG_IDENTIFIER is trainwatch."""
    monkeypatch.setenv("INVOCATION_ID", "0123abcd")
    sent: list[tuple[str, dict[str, Any]]] = []
    # Positional like journal.send(MESSAGE, ...): the record's own "msg" comes as a field.
    handler = journal_handler(lambda msg, /, **fields: sent.append((msg, fields)))
    assert handler is not None
    logger = logging.getLogger("trainwatch.test_service")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("job %s: %s", "llama", "hang", extra={
            "TRAINWATCH_JOB": "llama", "TRAINWATCH_FAULT": "hang", "TRAINWATCH_INCIDENT": 7})
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    [(msg, fields)] = sent
    assert msg == "job llama: hang"
    assert fields["SYSLOG_IDENTIFIER"] == "trainwatch"
    assert fields["PRIORITY"] == "4"  # warning
    assert {k: fields[k] for k in ("TRAINWATCH_JOB", "TRAINWATCH_FAULT", "TRAINWATCH_INCIDENT")} \
        == {"TRAINWATCH_JOB": "llama", "TRAINWATCH_FAULT": "hang", "TRAINWATCH_INCIDENT": 7}


def test_no_journal_handler_outside_systemd(
    need_systemd_python: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a terminal (no JOURNAL_STREAM, no INVOCATION_ID) logs stay on stderr."""
    for k in SYSTEMD_VARS:
        monkeypatch.delenv(k, raising=False)
    assert journal_handler() is None


def test_service_outside_systemd_sends_nothing(need_systemd_python: None) -> None:
    """No NOTIFY_SOCKET (trainwatch run in a terminal): no interval, every call a no-op."""
    p = child("""
        s = Service()
        s.ready("up"); s.watchdog(1.0); s.stopping()
        print(s.watchdog_interval, s.notify_failures)
    """, WATCHDOG_USEC="2000000")
    assert p.stdout.split() == ["None", "0"]
    assert p.stderr == ""
