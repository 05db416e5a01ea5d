"""HeartbeatSocket on a real AF_UNIX datagram socket: real senders, the kernel's
SO_PASSCRED credentials, and JobTree deciding whom to believe."""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from trainwatch import client
from trainwatch.sources.heartbeat import MAX_DATAGRAM, HeartbeatSocket
from trainwatch.tree import JobTree
from trainwatch.types import Beat, CheckpointReport

NOBODY = 65534
JOB = "tw-unit-heartbeat-job"  # no process of this test run carries it as TRAINWATCH_JOB


def _believe_all(pid: int, uid: int) -> bool:
    return True


def _send(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))


def _require_root() -> None:
    """Dropping to another uid needs root; in CI not being root is a failure, not a skip."""
    if os.geteuid() == 0:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("this test must run as root in CI (it drops privileges to uid 65534)")
    pytest.skip("needs root to drop privileges to uid 65534")


def _read_lines(stream: IO[str] | None, n: int, timeout: float = 20.0) -> list[str]:
    """Read n lines from a subprocess pipe, failing rather than hanging past timeout."""
    assert stream is not None
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(lines) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {lines}"
            if sel.select(left):
                line = stream.readline()
                assert line, f"the process closed its output early; got {lines}"
                lines.append(line.strip())
    finally:
        sel.close()
    return lines


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "job.sock"


@pytest.fixture
def hs(sock_path: Path) -> Iterator[HeartbeatSocket]:
    h = HeartbeatSocket(str(sock_path), believe=_believe_all, clock=lambda: 42.0)
    yield h
    h.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that an unprivileged sender can traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="tw-hb-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def unrelated_leader() -> Iterator[subprocess.Popen[bytes]]:
    """A live process, in its own session, that is the leader of a job nobody else belongs to."""
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def test_beats_and_checkpoints_carry_sender_pid(hs: HeartbeatSocket, sock_path: Path) -> None:
    """Beats and checkpoint reports from a real process arrive with that process's own pid."""
    code = textwrap.dedent(
        """
        import sys
        from trainwatch import client
        hb = client.connect(sys.argv[1], rank=3)
        hb.beat(17, loss=0.5, grad_norm=2.0)
        assert hb.checkpoint(16, "/ckpt/step_16")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(sock_path)])
    assert proc.wait(timeout=30) == 0
    assert proc.pid != os.getpid()
    assert hs.drain() == [
        Beat(rank=3, step=17, at=42.0, pid=proc.pid, loss=0.5, grad_norm=2.0),
        CheckpointReport(step=16, path="/ckpt/step_16", rank=3, at=42.0),
    ]
    assert hs.counters.received == 2
    assert (hs.counters.malformed, hs.counters.oversized, hs.counters.foreign) == (0, 0, 0)


def test_empty_socket_drains_to_nothing(hs: HeartbeatSocket) -> None:
    """drain() on a socket with nothing queued returns an empty list at once."""
    assert hs.drain() == []
    assert hs.counters.received == 0


_GOOD = b'{"v":1,"k":"beat","rank":0,"step":1}'


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1, 2, 3]", id="json-list"),
        pytest.param(b'"beat"', id="json-string"),
        pytest.param(b'{"k":"beat","step":1}', id="no-version"),
        pytest.param(b'{"v":2,"k":"beat","step":1}', id="wrong-version"),
        pytest.param(b'{"v":"1","k":"beat","step":1}', id="version-as-string"),
        pytest.param(b'{"v":1,"k":"beat"}', id="missing-step"),
        pytest.param(b'{"v":1,"k":"beat","step":-1}', id="negative-step"),
        pytest.param(b'{"v":1,"k":"beat","step":1.5}', id="float-step"),
        pytest.param(b'{"v":1,"k":"beat","step":"7"}', id="string-step"),
        pytest.param(b'{"v":1,"k":"beat","rank":-2,"step":1}', id="negative-rank"),
        pytest.param(b'{"v":1,"k":"beat","rank":true,"step":1}', id="bool-rank"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"loss":"low"}', id="word-loss"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"grad_norm":false}', id="bool-grad-norm"),
        pytest.param(b'{"v":1,"k":"bogus","step":1}', id="unknown-kind"),
        pytest.param(b'{"v":1,"step":1}', id="no-kind"),
        pytest.param(b'{"v":1,"k":"ckpt","step":1}', id="ckpt-without-path"),
        pytest.param(b'{"v":1,"k":"ckpt","step":1,"path":""}', id="ckpt-empty-path"),
        pytest.param(b'{"v":1,"k":"ckpt","step":1,"path":7}', id="ckpt-numeric-path"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"x":"\xff\xfe"}', id="invalid-utf8"),
        pytest.param(b"[" * 4000, id="deeply-nested"),
    ],
)
def test_malformed_datagram_is_dropped_and_counted(
    hs: HeartbeatSocket, sock_path: Path, data: bytes
) -> None:
    """A malformed datagram is dropped and counted as malformed; the next good one still arrives."""
    _send(sock_path, data)
    _send(sock_path, _GOOD)
    obs = hs.drain()
    assert [(o.rank, o.step) for o in obs if isinstance(o, Beat)] == [(0, 1)]
    assert len(obs) == 1
    assert hs.counters.malformed == 1
    assert hs.counters.received == 2
    assert (hs.counters.oversized, hs.counters.foreign) == (0, 0)


def test_oversized_datagram_is_dropped_and_counted(hs: HeartbeatSocket, sock_path: Path) -> None:
    """A datagram longer than 4096 bytes is dropped and counted as oversized, not parsed."""
    big = _GOOD[:-1] + b',"pad":"' + b"x" * 5000 + b'"}'
    assert len(big) > MAX_DATAGRAM
    _send(sock_path, big)
    _send(sock_path, _GOOD)
    obs = hs.drain()
    assert len(obs) == 1
    assert hs.counters.oversized == 1
    assert hs.counters.malformed == 0


def test_datagram_of_exactly_max_size_is_accepted(hs: HeartbeatSocket, sock_path: Path) -> None:
    """A valid datagram of exactly 4096 bytes is accepted (the limit is inclusive)."""
    exact = _GOOD + b" " * (MAX_DATAGRAM - len(_GOOD))
    assert len(exact) == MAX_DATAGRAM
    _send(sock_path, exact)
    assert len(hs.drain()) == 1
    assert hs.counters.oversized == 0


def test_sender_rejected_by_believe_is_counted_foreign(
    sock_path: Path, unrelated_leader: subprocess.Popen[bytes]
) -> None:
    """A datagram whose sender the believe function rejects is counted foreign and not returned."""
    other = unrelated_leader.pid
    hs = HeartbeatSocket(str(sock_path), believe=lambda pid, uid: pid == other)
    try:
        _send(sock_path, _GOOD)
        assert hs.drain() == []
        assert hs.counters.foreign == 1
        assert hs.counters.malformed == 0
    finally:
        hs.close()


def test_unprivileged_sender_outside_job_tree_is_foreign(
    open_dir: Path, unrelated_leader: subprocess.Popen[bytes]
) -> None:
    """A non-root process outside the job's tree (uid 65534) is not believed by JobTree.owns."""
    _require_root()
    path = open_dir / "job.sock"
    tree = JobTree(JOB, leader=unrelated_leader.pid)
    hs = HeartbeatSocket(str(path), believe=tree.owns)
    go_r, go_w = os.pipe()  # the child stays alive until we have drained
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(go_w)
            os.close(ready_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            client.connect(str(path), rank=0).beat(1)
            os.write(ready_w, str(os.getuid()).encode())
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 16) == str(NOBODY).encode()
        assert hs.drain() == []
        assert hs.counters.foreign == 1
        assert hs.counters.received == 1
    finally:
        os.close(go_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
        hs.close()
    assert os.waitstatus_to_exitcode(status) == 0


_LEADER = textwrap.dedent(
    """
    import os, sys
    from trainwatch import client
    path = sys.argv[1]
    hb = client.connect(path, rank=0)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    hb.beat(1)  # the leader's own beat, sent as uid 65534
    pid = os.fork()
    if pid == 0:
        os.setsid()  # leave the job's session: believed only as the leader's descendant
        client.connect(path, rank=1).beat(2)
        print("child", os.getpid(), os.getuid(), flush=True)
        sys.stdin.read()  # stay alive until the test has drained
        os._exit(0)
    print("leader", os.getpid(), os.getuid(), flush=True)
    sys.stdin.read()
    os.waitpid(pid, 0)
    """
)


def test_unprivileged_leader_and_its_child_are_believed(open_dir: Path) -> None:
    """JobTree.owns believes a non-root leader and its descendant that left the session."""
    _require_root()
    path = open_dir / "job.sock"
    trees: list[JobTree] = []  # the tree needs the leader's pid; the socket must exist first
    hs = HeartbeatSocket(str(path), believe=lambda pid, uid: trees[0].owns(pid, uid))
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the supervisor starts a job
    )
    trees.append(JobTree(JOB, leader=leader.pid))
    try:
        lines = _read_lines(leader.stdout, 2)
        seen = {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in lines}
        assert seen["leader"] == (leader.pid, NOBODY)
        child_pid, child_uid = seen["child"]
        assert child_uid == NOBODY
        obs = hs.drain()
        beats = {(o.rank, o.pid) for o in obs if isinstance(o, Beat)}
        assert beats == {(0, leader.pid), (1, child_pid)}
        assert hs.counters.foreign == 0
    finally:
        assert leader.stdin is not None and leader.stdout is not None
        leader.stdin.close()
        leader.wait(timeout=30)
        leader.stdout.close()
        hs.close()


def test_root_sender_is_believed_by_job_tree(
    sock_path: Path, unrelated_leader: subprocess.Popen[bytes]
) -> None:
    """A datagram from root is believed even from outside the job's tree."""
    _require_root()
    hs = HeartbeatSocket(str(sock_path), believe=JobTree(JOB, leader=unrelated_leader.pid).owns)
    try:
        _send(sock_path, _GOOD)
        (beat,) = hs.drain()
        assert isinstance(beat, Beat)
        assert beat.pid == os.getpid()
        assert hs.counters.foreign == 0
    finally:
        hs.close()


def test_stale_socket_file_is_replaced_and_close_removes_it(sock_path: Path) -> None:
    """Binding over a stale socket file works, the socket is world-writable, close() unlinks it."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(sock_path))
    stale.close()  # left behind, as after a daemon crash
    hs = HeartbeatSocket(str(sock_path), believe=_believe_all)
    assert sock_path.stat().st_mode & 0o777 == 0o666
    _send(sock_path, _GOOD)
    assert len(hs.drain()) == 1
    hs.close()
    assert not sock_path.exists()
