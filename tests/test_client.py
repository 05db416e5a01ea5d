"""trainwatch.client against real AF_UNIX datagram sockets: it never blocks and
never raises into the training loop, and what it sends the daemon can parse."""

from __future__ import annotations

import ast
import gc
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainwatch import client
from trainwatch.sources.heartbeat import parse
from trainwatch.types import Beat, CheckpointReport

# Loose: a few thousand beats cost a few milliseconds; this only catches a
# client that blocks or sleeps.
_LOOSE_S = 1.0


def _listener(path: Path) -> socket.socket:
    """A bare receiving end (what the daemon binds), non-blocking."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.setblocking(False)
    return s


def _recv_all(s: socket.socket) -> list[bytes]:
    out: list[bytes] = []
    while True:
        try:
            out.append(s.recv(65536))
        except BlockingIOError:
            return out


def _recv_one(s: socket.socket, timeout: float = 2.0) -> bytes:
    s.settimeout(timeout)
    try:
        return s.recv(65536)
    finally:
        s.setblocking(False)


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "hb.sock"


@pytest.fixture
def listener(sock_path: Path) -> Iterator[socket.socket]:
    s = _listener(sock_path)
    yield s
    s.close()


def test_connect_without_socket_env_returns_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    """connect() with TRAINWATCH_SOCKET unset returns a no-op object whose calls do nothing."""
    monkeypatch.delenv("TRAINWATCH_SOCKET", raising=False)
    hb = client.connect()
    assert isinstance(hb, client.NullHeartbeat)
    hb.beat(1, loss=0.5, grad_norm=1.0, rank=3)
    assert hb.checkpoint(1, "/nowhere") is False
    with hb:
        pass
    hb.close()


def test_connect_uses_socket_env_and_rank_env(
    monkeypatch: pytest.MonkeyPatch, sock_path: Path, listener: socket.socket
) -> None:
    """connect() reads TRAINWATCH_SOCKET and takes its rank from $RANK as torchrun sets it."""
    monkeypatch.setenv("TRAINWATCH_SOCKET", str(sock_path))
    monkeypatch.setenv("RANK", "5")
    with client.connect() as hb:
        assert isinstance(hb, client.Heartbeat)
        hb.beat(12)
    obs = parse(_recv_one(listener), pid=1, at=0.0)
    assert isinstance(obs, Beat)
    assert (obs.rank, obs.step) == (5, 12)


def test_beats_to_absent_daemon_neither_raise_nor_block(sock_path: Path) -> None:
    """With nothing listening, thousands of beats return at once, each dropped or skipped."""
    hb = client.connect(str(sock_path), rank=0)
    n = 5000
    t0 = time.monotonic()
    for step in range(n):
        hb.beat(step, loss=1.0, grad_norm=2.0)
    elapsed = time.monotonic() - t0
    assert elapsed < _LOOSE_S
    assert hb.dropped >= 1 and hb.dropped + hb.skipped == n
    hb.close()


def test_checkpoint_to_absent_daemon_returns_false_quickly(sock_path: Path) -> None:
    """checkpoint() with no daemon retries only briefly, then returns False without raising."""
    hb = client.connect(str(sock_path))
    t0 = time.monotonic()
    assert hb.checkpoint(10, sock_path.parent / "step_10") is False
    assert time.monotonic() - t0 < _LOOSE_S
    hb.close()


def test_full_queue_drops_beats_without_blocking(sock_path: Path, listener: socket.socket) -> None:
    """A listener that never reads fills its queue; later beats are dropped and counted."""
    hb = client.connect(str(sock_path))
    n = 5000
    t0 = time.monotonic()
    for step in range(n):
        hb.beat(step, loss=0.25, rank=0)  # an explicit rank is never rate-limited
    elapsed = time.monotonic() - t0
    assert elapsed < _LOOSE_S
    received = _recv_all(listener)
    assert hb.dropped > 0
    assert len(received) + hb.dropped == n  # every beat either arrived or was counted
    hb.close()


def test_beats_arrive_again_after_daemon_restart(sock_path: Path) -> None:
    """After the listener is recreated at the same path, the client reconnects by itself."""
    first = _listener(sock_path)
    hb = client.connect(str(sock_path))
    hb.beat(1)
    assert parse(_recv_one(first), pid=1, at=0.0).step == 1

    # The daemon restarts: its socket goes away and a new one is bound at the same path.
    first.close()
    sock_path.unlink()
    hb.beat(2)  # to nowhere: dropped, not raised
    second = _listener(sock_path)
    try:
        time.sleep(1.1)  # the client retries a connect at most once a second
        for step in range(3, 13):
            time.sleep(0.011)  # beats closer than 5 ms are skipped
            hb.beat(step)
        steps = [parse(d, pid=1, at=0.0).step for d in _recv_all(second)]
        assert steps, "no beat reached the restarted listener"
        assert steps == sorted(steps)
        assert steps[-1] == 12
        assert hb.dropped >= 1
    finally:
        second.close()
        hb.close()


def test_failed_connects_close_their_sockets(sock_path: Path) -> None:
    """Failed connects and reconnects close their sockets rather than leave them to the GC."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        absent = client.connect(str(sock_path.with_name("absent.sock")))
        assert absent.checkpoint(1, "/ckpt/step_1") is False  # retries connect() for a while
        first = _listener(sock_path)
        hb = client.connect(str(sock_path))
        first.close()
        sock_path.unlink()  # the daemon is gone for good
        time.sleep(1.1)
        hb.beat(1)  # the send fails, and so does the reconnect
        time.sleep(0.011)
        hb.beat(2)
        gc.collect()
    leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaked == [], [str(w.message) for w in leaked]
    assert hb.dropped == 2
    hb.close()
    absent.close()


@pytest.mark.parametrize(
    ("loss", "grad_norm"),
    [(math.nan, math.inf), (-math.inf, math.nan), (math.inf, None)],
    ids=["nan-inf", "neginf-nan", "inf-none"],
)
def test_non_finite_values_round_trip_through_parse(
    sock_path: Path, listener: socket.socket, loss: float, grad_norm: float | None
) -> None:
    """NaN and infinite loss/grad_norm are sent and parsed back by the daemon as float nan/inf."""
    hb = client.connect(str(sock_path), rank=2)
    hb.beat(7, loss=loss, grad_norm=grad_norm)
    obs = parse(_recv_one(listener), pid=123, at=4.5)
    assert isinstance(obs, Beat)
    assert (obs.rank, obs.step, obs.pid, obs.at) == (2, 7, 123, 4.5)
    for sent, got in ((loss, obs.loss), (grad_norm, obs.grad_norm)):
        if sent is None:
            assert got is None
        elif math.isnan(sent):
            assert got is not None and math.isnan(got)
        else:
            assert got == sent
    hb.close()


def test_finite_values_round_trip_exactly(sock_path: Path, listener: socket.socket) -> None:
    """Finite loss and grad_norm reach the daemon bit for bit."""
    hb = client.connect(str(sock_path))
    hb.beat(3, loss=0.1 + 0.2, grad_norm=1e-300, rank=1)
    obs = parse(_recv_one(listener), pid=1, at=0.0)
    assert isinstance(obs, Beat)
    assert (obs.rank, obs.loss, obs.grad_norm) == (1, 0.1 + 0.2, 1e-300)
    hb.close()


def test_checkpoint_report_carries_absolute_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sock_path: Path, listener: socket.socket
) -> None:
    """checkpoint() with a relative path reports it absolute, resolved from the job's cwd."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    hb = client.connect(str(sock_path), rank=4)
    assert hb.checkpoint(100, "ckpt/step_100") is True
    obs = parse(_recv_one(listener), pid=1, at=0.0)
    assert isinstance(obs, CheckpointReport)
    assert obs.path == str(workdir / "ckpt" / "step_100")
    assert os.path.isabs(obs.path)
    assert (obs.step, obs.rank) == (100, 4)
    hb.close()


def test_import_pulls_in_nothing_else() -> None:
    """A fresh import of trainwatch.client loads no yaml, psutil, numpy or other trainwatch code."""
    code = "import sys; from trainwatch import client; print(sorted(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    modules = set(ast.literal_eval(out.strip()))
    assert "trainwatch.client" in modules
    assert {m for m in modules if m.split(".")[0] == "trainwatch"} == {
        "trainwatch",
        "trainwatch.client",
    }
    for heavy in ("yaml", "psutil", "numpy", "faultinject"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in modules), heavy


def test_resume_from_and_skip_steps_read_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """resume_from() and skip_steps() return the supervisor's variables, or None if unset or bad."""
    monkeypatch.delenv("TRAINWATCH_RESUME_FROM", raising=False)
    monkeypatch.delenv("TRAINWATCH_SKIP_STEPS", raising=False)
    assert client.resume_from() is None
    assert client.skip_steps() is None
    monkeypatch.setenv("TRAINWATCH_RESUME_FROM", "/ckpt/step_5")
    monkeypatch.setenv("TRAINWATCH_SKIP_STEPS", "100:120")
    assert client.resume_from() == "/ckpt/step_5"
    assert client.skip_steps() == (100, 120)
    monkeypatch.setenv("TRAINWATCH_SKIP_STEPS", "garbage")
    assert client.skip_steps() is None


def test_beats_faster_than_100_hz_are_skipped_but_non_finite_ones_are_sent(
    sock_path: Path, listener: socket.socket
) -> None:
    """A tight loop sends one beat per 5 ms at most; a NaN loss is sent regardless."""
    hb = client.connect(str(sock_path))
    t0 = time.monotonic()
    for step in range(1, 2001):
        hb.beat(step, loss=math.nan if step == 1000 else 1.0)
    elapsed = time.monotonic() - t0
    received = [parse(d, pid=1, at=0.0) for d in _recv_all(listener)]
    steps = [b.step for b in received]
    assert 1000 in steps  # the NaN beat
    assert len(received) <= elapsed / 0.005 + 2
    assert hb.skipped == 2000 - len(received) - hb.dropped
    hb.close()
