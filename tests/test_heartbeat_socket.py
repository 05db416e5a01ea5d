"""HeartbeatSocket on a real AF_UNIX datagram socket: real senders, the kernel's
SO_PASSCRED credentials, and JobTree deciding whom to believe."""

from __future__ import annotations

import json
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
from conftest import need_root
from trainwatch import client
from trainwatch.actions.tree import JobTree
from trainwatch.sources.heartbeat import MAX_DATAGRAM, HeartbeatSocket
from trainwatch.state.ownership import UnsafeDir
from trainwatch.types import Beat, CheckpointReport

NOBODY = 65534
JOB = "tw-unit-heartbeat-job"  # no process of this test run carries it as TRAINWATCH_JOB


def _believe_all(pid: int, uid: int) -> bool:
    return True


def _send(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))


def _require_root() -> None:
    need_root("dropping privileges to uid 65534")


def _read_lines(stream: IO[str] | None, n: int, timeout: float = 20.0) -> list[str]:
    """Read n lines from a subprocess pipe, failing rather than hanging past timeout."""
    assert stream is not None
    # Raw reads of the fd: a buffered readline may take both lines in one read and
    # leave select waiting for data already read (lines that arrived together).
    fd = stream.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while data.count(b"\n") < n:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {data!r}"
            if sel.select(left):
                chunk = os.read(fd, 4096)
                assert chunk, f"the process closed its output early; got {data!r}"
                data += chunk
    finally:
        sel.close()
    return [line.strip() for line in data.decode().splitlines()[:n]]


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
        pytest.param(b'{"v":1,"k":"beat","step":' + b"9" * 400 + b"}", id="step-400-digits"),
        pytest.param(b'{"v":1,"k":"beat","step":' + str(10**309).encode() + b"}",
                     id="step-beyond-float"),
        pytest.param(b'{"v":1,"k":"beat","step":9223372036854775808}', id="step-2**63"),
        pytest.param(b'{"v":1,"k":"beat","rank":9223372036854775808,"step":1}', id="rank-2**63"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"loss":' + str(10**309).encode() + b"}",
                     id="loss-beyond-float"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"grad_norm":-' + str(10**309).encode() + b"}",
                     id="grad-norm-beyond-float"),
        pytest.param(b'{"v":1,"k":"beat","step":1,"loss":[1]}', id="list-loss"),
        pytest.param(b'{"v":1,"k":"ckpt","step":9223372036854775808,"path":"/c"}',
                     id="ckpt-step-2**63"),
        pytest.param(b'{"v":1,"k":"ckpt","step":1,"path":"/c/\\u0000x"}', id="ckpt-nul-path"),
        pytest.param(b'{"v":1,"k":["beat"],"step":1}', id="unhashable-kind"),
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
    hs = HeartbeatSocket(str(path), believe=tree.owns, owner=(NOBODY, NOBODY))
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
        os.write(1, f"child {os.getpid()} {os.getuid()}\\n".encode())
        sys.stdin.read()  # stay alive until the test has drained
        os._exit(0)
    os.write(1, f"leader {os.getpid()} {os.getuid()}\\n".encode())
    sys.stdin.read()
    os.waitpid(pid, 0)
    """
)


def test_unprivileged_leader_and_its_child_are_believed(open_dir: Path) -> None:
    """JobTree.owns believes a non-root leader and its descendant that left the session."""
    _require_root()
    path = open_dir / "job.sock"
    trees: list[JobTree] = []  # the tree needs the leader's pid; the socket must exist first
    hs = HeartbeatSocket(str(path), believe=lambda pid, uid: trees[0].owns(pid, uid),
                         owner=(NOBODY, NOBODY))
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
    """Binding over a stale socket file works, the socket is private (0600), close() unlinks it."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(sock_path))
    stale.close()  # left behind, as after a daemon crash
    hs = HeartbeatSocket(str(sock_path), believe=_believe_all)
    assert sock_path.stat().st_mode & 0o777 == 0o600
    _send(sock_path, _GOOD)
    assert len(hs.drain()) == 1
    hs.close()
    assert not sock_path.exists()


_CONNECT_AS_NOBODY = textwrap.dedent(
    """
    import errno, os, socket, sys
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(sys.argv[1])
        s.send(b'{"v":1,"k":"beat","rank":0,"step":1}')
    except OSError as e:
        print(errno.errorcode[e.errno])
    else:
        print("sent")
    """
)


def _connect_as_nobody(path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", _CONNECT_AS_NOBODY, str(path)],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


def test_socket_file_is_0600_and_given_to_the_jobs_user(open_dir: Path) -> None:
    """The socket file belongs to the job's (uid, gid), mode 0600: only they and root may send."""
    _require_root()
    path = open_dir / "job.sock"
    hs = HeartbeatSocket(str(path), believe=_believe_all, owner=(NOBODY, NOBODY))
    try:
        st = path.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600)
        assert _connect_as_nobody(path) == "sent"
        (beat,) = hs.drain()
        assert isinstance(beat, Beat)
    finally:
        hs.close()


def test_another_uid_cannot_connect_and_costs_nothing(open_dir: Path) -> None:
    """A user other than the job's gets EACCES at connect(); nothing reaches the socket."""
    _require_root()
    path = open_dir / "job.sock"
    calls: list[tuple[int, int]] = []

    def believe(pid: int, uid: int) -> bool:
        calls.append((pid, uid))
        return True

    hs = HeartbeatSocket(str(path), believe=believe)  # owned by us (root), not by 65534
    try:
        assert _connect_as_nobody(path) == "EACCES"
        assert hs.drain() == []
        assert hs.counters.received == 0
        assert calls == []
    finally:
        hs.close()


def test_missing_socket_folder_is_created_private(open_dir: Path) -> None:
    """run_dir/jobs is created if absent: 0755 as root (jobs reach their own file), else 0700."""
    path = open_dir / "jobs" / "j.sock"
    hs = HeartbeatSocket(str(path), believe=_believe_all)
    try:
        mode = (path.parent.stat().st_mode & 0o777)
        assert mode == (0o755 if os.geteuid() == 0 else 0o700)
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        hs.close()


def test_socket_folder_writable_by_others_is_refused(open_dir: Path) -> None:
    """A socket folder any user could write to (swap the socket in) is refused, nothing bound."""
    folder = open_dir / "jobs"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeDir, match="writable by every user"):
        HeartbeatSocket(str(folder / "j.sock"), believe=_believe_all)
    assert list(folder.iterdir()) == []


def _flood(path: Path, data: bytes, n: int, hs: HeartbeatSocket) -> list[object]:
    """Send n datagrams from this process, draining whenever the kernel queue is full."""
    out: list[object] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(str(path))
        s.setblocking(False)
        sent = 0
        while sent < n:
            try:
                s.send(data)
                sent += 1
            except BlockingIOError:
                out += hs.drain()
    out += hs.drain()
    return out


def test_a_flood_from_one_sender_is_judged_once_per_ttl(sock_path: Path) -> None:
    """1,000 datagrams from one rejected sender cost one believe() call; each is counted foreign."""
    calls: list[tuple[int, int]] = []

    def believe(pid: int, uid: int) -> bool:
        calls.append((pid, uid))
        return False

    hs = HeartbeatSocket(str(sock_path), believe=believe, verdict_ttl=60.0)
    try:
        assert _flood(sock_path, _GOOD, 1000, hs) == []
        assert calls == [(os.getpid(), os.getuid())]
        assert hs.counters.foreign == 1000
        assert hs.counters.judged == 1
    finally:
        hs.close()


def test_a_sender_is_judged_again_after_the_ttl(sock_path: Path) -> None:
    """A cached verdict expires, so a reused pid is judged afresh."""
    verdicts = [False, True]
    hs = HeartbeatSocket(str(sock_path), believe=lambda pid, uid: verdicts.pop(0),
                         verdict_ttl=0.05)
    try:
        _send(sock_path, _GOOD)
        assert hs.drain() == []
        time.sleep(0.1)  # past the TTL: any longer pause is fine too
        _send(sock_path, _GOOD)
        assert len(hs.drain()) == 1
        assert hs.counters.judged == 2
    finally:
        hs.close()


@pytest.mark.parametrize(
    ("field", "accepted", "refused"),
    [
        ("step", 2**63 - 1, 2**63),
        ("rank", 2**63 - 1, 2**63),
    ],
)
def test_step_and_rank_are_bounded_to_int64(
    hs: HeartbeatSocket, sock_path: Path, field: str, accepted: int, refused: int
) -> None:
    """The int64 maximum is taken; one more is malformed (SQLite and Prometheus hold int64)."""
    for value in (accepted, refused):
        body = {"v": 1, "k": "beat", "rank": 0, "step": 1, field: value}
        _send(sock_path, json.dumps(body).encode())
    (beat,) = hs.drain()
    assert isinstance(beat, Beat)
    assert getattr(beat, field) == accepted
    assert hs.counters.malformed == 1


def test_non_finite_and_large_losses_are_floats(hs: HeartbeatSocket, sock_path: Path) -> None:
    """The client's "nan"/"inf" strings and big integers become floats; a beyond-float one is
    malformed and nothing raises."""
    for loss in ('"nan"', '"-inf"', "1e308", str(10**300), str(10**309)):
        _send(sock_path, b'{"v":1,"k":"beat","step":1,"loss":' + loss.encode() + b"}")
    beats = hs.drain()
    assert [str(b.loss) for b in beats if isinstance(b, Beat)] == [
        "nan", "-inf", "1e+308", "1e+300"]
    assert hs.counters.malformed == 1


def test_forget_senders_judges_every_sender_again(sock_path: Path) -> None:
    """After forget_senders() (a relaunch), a sender believed before is judged afresh."""
    verdicts = [True, False]
    hs = HeartbeatSocket(str(sock_path), believe=lambda pid, uid: verdicts.pop(0),
                         verdict_ttl=60.0)
    try:
        _send(sock_path, _GOOD)
        assert len(hs.drain()) == 1
        hs.forget_senders()
        _send(sock_path, _GOOD)
        assert hs.drain() == []
        assert (hs.counters.judged, hs.counters.foreign) == (2, 1)
    finally:
        hs.close()
