"""trainwatch.client against real AF_UNIX datagram sockets: it never blocks and
never raises into the training loop, and what it sends the daemon can parse."""

from __future__ import annotations

import ast
import gc
import json
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
from conftest import UserPython
from trainwatch import client
from trainwatch.sources import ring, ringreader
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


def test_a_checkpoint_report_the_daemon_missed_is_sent_by_a_later_beat(
    sock_path: Path, ring_dir: Path
) -> None:
    """A report made while the daemon restarts (no socket) is not lost: once a
    daemon listens again, the next beats deliver it, before any newer report."""
    hb = client.connect(str(sock_path))
    assert hb.checkpoint(40, sock_path.parent / "step_40") is False
    assert hb.checkpoint(60, sock_path.parent / "step_60") is False
    s = _listener(sock_path)
    try:
        deadline = time.monotonic() + 10
        got: list[object] = []
        step = 61
        while len(got) < 2 and time.monotonic() < deadline:
            hb.beat(step)  # into the ring: only the unsent reports use the socket
            step += 1
            time.sleep(0.02)
            got += [o for o in (parse(d, pid=1, at=0.0) for d in _recv_all(s))
                    if isinstance(o, CheckpointReport)]
        assert [(o.step, o.path) for o in got] == [  # type: ignore[attr-defined]
            (40, str(sock_path.parent / "step_40")), (60, str(sock_path.parent / "step_60"))]
    finally:
        s.close()
        hb.close()


def test_a_non_finite_beat_never_overtakes_a_checkpoint_report_kept_unsent(
    sock_path: Path, ring_dir: Path
) -> None:
    """Reports a full queue refused reach the daemon before the NaN beat that
    follows them (the rollback it starts picks from what was reported), even
    right after a beat's retry of them failed."""
    s = _listener(sock_path)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.connect(str(sock_path))
    filler.setblocking(False)
    hb = client.connect(str(sock_path))
    try:
        hb.beat(1)  # announces this rank's ring: later finite beats use only the ring
        while True:  # a daemon whose loop is late: its queue is full
            try:
                filler.send(b"x")
            except BlockingIOError:
                break
        assert hb.checkpoint(38, sock_path.parent / "step_38") is False
        hb.beat(39, loss=0.5)  # retries the kept report: the queue is still full
        _recv_all(s)  # the loop catches up
        hb.beat(40, loss=math.inf)  # well within the retry interval of beat 39's try
        got = [parse(d, pid=1, at=0.0) for d in _recv_all(s)]
        assert [(type(o).__name__, o.step) for o in got] == [  # type: ignore[union-attr]
            ("CheckpointReport", 38), ("Beat", 40)], got
    finally:
        filler.close()
        s.close()
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
        "trainwatch.sources",  # an empty package __init__
        "trainwatch.sources.ring",  # stdlib only: the client's ring writer
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


# --- heartbeat rings (TRAINWATCH_RING_DIR) ---------------------------------------


@pytest.fixture
def ring_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(ring.ENV, str(d))
    return d


def _ring_records(d: Path, rank: int = 0, pid: int | None = None) -> list[ringreader.Record]:
    path = d / ring.file_name(rank, os.getpid() if pid is None else pid)
    with ringreader.RingReader(str(path)) as r:
        return r.read()


def test_with_a_ring_dir_every_beat_reaches_the_ring_and_one_datagram_announces_it(
    monkeypatch: pytest.MonkeyPatch, sock_path: Path, listener: socket.socket, ring_dir: Path
) -> None:
    """With TRAINWATCH_RING_DIR, 2000 back-to-back beats all land in the ring (no 5 ms skip)
    and only the first goes out as a datagram."""
    monkeypatch.setenv("TRAINWATCH_SOCKET", str(sock_path))
    monkeypatch.setenv("RANK", "2")
    hb = client.connect()
    for step in range(2000):
        hb.beat(step, loss=step * 2.0, grad_norm=None if step % 3 else 1.5)
    got = _ring_records(ring_dir, rank=2)
    assert [(x.step, x.loss, x.grad_norm) for x in got] == [
        (s, s * 2.0, None if s % 3 else 1.5) for s in range(2000)
    ]
    assert {(x.rank, x.pid) for x in got} == {(2, os.getpid())}
    steps = [parse(d, pid=1, at=0.0).step for d in _recv_all(listener)]
    assert steps == [0]
    assert (hb.skipped, hb.dropped) == (0, 0)
    hb.close()


def test_with_a_ring_a_non_finite_value_is_also_sent_at_once(
    sock_path: Path, listener: socket.socket, ring_dir: Path
) -> None:
    """A NaN loss or infinite grad norm goes into the ring as such and out as a datagram at once."""
    hb = client.connect(str(sock_path), rank=0)
    for step in range(1, 101):
        loss = math.nan if step == 50 else 1.0
        hb.beat(step, loss=loss, grad_norm=math.inf if step == 70 else 1.0)
    received = [parse(d, pid=1, at=0.0) for d in _recv_all(listener)]
    assert [b.step for b in received] == [1, 50, 70]
    assert isinstance(received[1], Beat) and received[1].loss is not None
    assert math.isnan(received[1].loss)
    got = {x.step: x for x in _ring_records(ring_dir)}
    assert len(got) == 100
    assert got[50].loss is not None and math.isnan(got[50].loss)
    assert got[70].grad_norm == math.inf
    hb.close()


def test_a_forked_child_beats_into_its_own_ring_never_its_parents(
    sock_path: Path, listener: socket.socket, ring_dir: Path
) -> None:
    """After fork (a DataLoader worker), the child's beats land in rank-<rank>-<child pid>, and the
    parent's ring holds only the parent's steps."""
    hb = client.connect(str(sock_path), rank=0)
    hb.beat(1, loss=1.0)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            hb.beat(1000, loss=5.0)
            hb.beat(1001, loss=5.0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    hb.beat(2, loss=1.0)
    assert [x.step for x in _ring_records(ring_dir)] == [1, 2]
    child = _ring_records(ring_dir, pid=pid)
    assert [(x.step, x.pid) for x in child] == [(1000, pid), (1001, pid)]
    assert ring.scan(str(ring_dir)) == sorted(
        [(0, os.getpid(), str(ring_dir / f"rank-0-{os.getpid()}")),
         (0, pid, str(ring_dir / f"rank-0-{pid}"))])
    # each new ring announced itself once: the parent's first beat, the child's first
    assert [parse(d, pid=1, at=0.0).step for d in _recv_all(listener)] == [1, 1000]
    hb.close()


def test_an_explicit_rank_gets_its_own_ring(
    sock_path: Path, listener: socket.socket, ring_dir: Path
) -> None:
    """beat(rank=N) writes to rank-N-<pid>, apart from the default rank's ring; a second
    connect() in the same process shares the rings rather than failing."""
    hb = client.connect(str(sock_path), rank=0)
    hb2 = client.connect(str(sock_path), rank=0)
    hb.beat(1, loss=1.0)
    hb.beat(10, loss=3.0, rank=3)
    hb.beat(11, loss=4.0, rank=4)
    hb2.beat(2, loss=2.0)
    assert hb2.ring_error is None
    assert [(x.step, x.loss) for x in _ring_records(ring_dir)] == [(1, 1.0), (2, 2.0)]
    assert [(x.rank, x.step) for x in _ring_records(ring_dir, rank=3)] == [(3, 10)]
    assert [(x.rank, x.step) for x in _ring_records(ring_dir, rank=4)] == [(4, 11)]
    assert len(_recv_all(listener)) == 3  # one announcement per ring
    hb.close()
    hb2.close()


def test_a_missing_ring_dir_falls_back_to_datagrams(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sock_path: Path, listener: socket.socket
) -> None:
    """If the ring folder does not exist, beats go as datagrams (rate-limited, as without rings)
    and ring_error says why."""
    monkeypatch.setenv(ring.ENV, str(tmp_path / "absent"))
    hb = client.connect(str(sock_path), rank=0)
    for step in range(1, 4):
        hb.beat(step, loss=1.0)
        time.sleep(0.011)  # beats closer than 5 ms are skipped
    assert [parse(d, pid=1, at=0.0).step for d in _recv_all(listener)] == [1, 2, 3]
    assert hb.ring_error is not None and "absent" in hb.ring_error
    assert not (tmp_path / "absent").exists()
    hb.close()


_AS_USER = """
import json, os, sys, time
from trainwatch import client
hb = client.connect()
for step in range(1, 4):
    hb.beat(step, loss=1.0)
    time.sleep(0.011)
print(json.dumps({"ring_error": hb.ring_error, "dropped": hb.dropped}))
"""


def test_an_unwritable_ring_dir_falls_back_to_datagrams(
    user_python: UserPython, open_tmp: Path
) -> None:
    """A job user who may not write in the ring folder (root's, 0700) still gets its beats through
    as datagrams, and nothing is created there."""
    rings = open_tmp / "rings"
    rings.mkdir(mode=0o700)
    sock = open_tmp / "hb.sock"
    s = _listener(sock)
    try:
        os.chmod(sock, 0o666)
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", user_python.python,
             "-c", _AS_USER],
            env=user_python.env(TRAINWATCH_SOCKET=str(sock), **{ring.ENV: str(rings)}),
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        res = json.loads(out)
        assert res["ring_error"] and "Permission denied" in res["ring_error"]
        assert res["dropped"] == 0
        assert [parse(d, pid=1, at=0.0).step for d in _recv_all(s)] == [1, 2, 3]
        assert os.listdir(rings) == []
    finally:
        s.close()
