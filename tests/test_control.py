"""The control channel on real AF_UNIX sockets (round trips, the kernel's
SO_PASSCRED credentials of a child dropped to uid 65534 handed to the handler
as its sender, refusals counted and logged without flooding, malformed and
oversized requests, a failing handler) and the `faultinject` GPU drills run as
real processes against it, including the kernel-log drill read back by the
kernel-log source."""

from __future__ import annotations

import grp
import json
import os
import pwd
import selectors
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ServedControl, Workspace, missing, need_root, wait_for
from trainwatch.host.control import (
    MAX_REQUEST,
    ControlError,
    ControlSocket,
    Later,
    Peer,
    Refused,
    SocketInUse,
    control_path,
    request,
)
from trainwatch.host.deferred import MAX_PENDING
from trainwatch.sources.kmsg import KernelLog
from trainwatch.sources.kmsgparse import parse_line

NOBODY = 65534
Calls = list[tuple[str, dict[str, Any]]]
Handler = Callable[[str, dict[str, Any], Peer], dict[str, Any]]


def _require_root() -> None:
    need_root("dropping privileges to uid 65534")


@pytest.fixture
def run_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="tw", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _recorder(calls: Calls, peers: list[Peer] | None = None) -> Handler:
    def handler(op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        calls.append((op, args))
        if peers is not None:
            peers.append(peer)
        if op == "boom":
            raise RuntimeError("exploded\nwith a second line")
        if op == "forbidden":
            raise Refused(f"job x runs as alice; {peer} may act only on its own jobs")
        if args.get("gpu") == 9:
            raise ValueError("no GPU 9 on this host")
        return {"done": op}

    return handler


class Served(ServedControl):
    """A ControlSocket answered by a selector loop in a thread, as the daemon would."""

    def __init__(self, run_dir: str, group: str = "trainwatch") -> None:
        self.calls: Calls = []
        super().__init__(ControlSocket(run_dir, _recorder(self.calls), group=group))



@pytest.fixture
def served(run_dir: str) -> Iterator[Served]:
    s = Served(run_dir)
    yield s
    s.stop()


def _client() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(f"\0tw-test-{os.getpid()}-{id(s)}".encode())
    s.settimeout(10)
    return s


def _as_nobody(run_dir: str, cs: ControlSocket, gid: int = NOBODY) -> dict[str, Any]:
    """request() from a forked child running as uid 65534 (no supplementary
    groups, primary group ``gid``), served here by handle(); the child's result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, ask, report through the pipe
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(NOBODY)
            try:
                out: dict[str, Any] = {"reply": request(run_dir, "gpu-xid", {"gpu": 0}, 10)}
            except ControlError as e:
                out = {"error": str(e)}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with selectors.DefaultSelector() as sel:
        sel.register(cs, selectors.EVENT_READ)
        sel.register(r, selectors.EVENT_READ)
        while not any(key.fileobj == r for key, _ in sel.select(timeout=10)):
            cs.handle()
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data))


def _open_to_all(run_dir: str, path: str) -> None:
    """Loosen the file modes so that only the SO_PASSCRED check stands in the way."""
    os.chmod(run_dir, 0o755)
    os.chmod(path, 0o666)


def _faultinject(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultinject.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


# --- the socket --------------------------------------------------------------


def test_request_round_trip(served: Served, run_dir: str) -> None:
    """A v1 request reaches the handler with its args and its reply comes back."""
    reply = request(run_dir, "gpu-xid", {"gpu": 1, "xid": 79})
    assert reply == {"ok": True, "done": "gpu-xid"}
    assert served.calls == [("gpu-xid", {"gpu": 1, "xid": 79})]
    assert served.sock.counters.requests == 1
    assert served.sock.counters.refused == served.sock.counters.malformed == 0


def test_socket_is_open_to_every_local_user(run_dir: str) -> None:
    """The socket file is mode 0o666: who may do what is decided per request."""
    cs = ControlSocket(run_dir, _recorder([]))
    try:
        st = os.stat(control_path(run_dir))
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o666
    finally:
        cs.close()
    assert not os.path.exists(control_path(run_dir))


def test_any_user_reaches_the_handler_as_the_kernel_vouches(run_dir: str) -> None:
    """A uid-65534 sender outside the group reaches the handler as uid 65534, not an admin."""
    _require_root()
    calls: Calls = []
    peers: list[Peer] = []
    cs = ControlSocket(run_dir, _recorder(calls, peers), group="tw-no-such-group")
    try:
        os.chmod(run_dir, 0o755)  # the socket itself is 0o666
        out = _as_nobody(run_dir, cs)
        assert out["reply"] == {"ok": True, "done": "gpu-xid"}
        assert calls == [("gpu-xid", {"gpu": 0})]
        assert [(p.uid, p.gid, p.admin) for p in peers] == [(NOBODY, NOBODY, False)]
        assert peers[0].pid > 0
        assert cs.counters.refused == 0
    finally:
        cs.close()


def test_a_closed_run_dir_keeps_outsiders_out(run_dir: str) -> None:
    """A run_dir of mode 0o700: an outsider's request() fails at the folder with one line."""
    _require_root()
    cs = ControlSocket(run_dir, _recorder([]), group="tw-no-such-group")
    try:
        os.chmod(run_dir, 0o700)
        out = _as_nobody(run_dir, cs)
        assert "permission denied" in out["error"]
        assert "\n" not in out["error"]
        assert cs.counters.requests == 0
    finally:
        cs.close()


def test_member_of_the_group_is_an_admin(run_dir: str) -> None:
    """A non-root sender whose group is the configured group reaches the handler as an admin."""
    _require_root()
    try:
        group = grp.getgrgid(NOBODY).gr_name
    except KeyError:
        missing("no group with gid 65534 on this machine")
    peers: list[Peer] = []
    cs = ControlSocket(run_dir, _recorder([], peers), group=group)
    try:
        os.chmod(run_dir, 0o755)
        out = _as_nobody(run_dir, cs, gid=NOBODY)
        assert out["reply"] == {"ok": True, "done": "gpu-xid"}
        assert [(p.uid, p.admin) for p in peers] == [(NOBODY, True)]
    finally:
        cs.close()


def test_refusal_is_counted_and_logged_once_per_sender_per_interval(
    served: Served, run_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler's Refused: ok=false with its one line, counted; 20 refusals log one line."""
    caplog.set_level("WARNING", logger="trainwatch")
    for _ in range(20):
        reply = request(run_dir, "forbidden", {"job": "x"})
        assert reply == {"ok": False, "error": "forbidden: job x runs as alice; "
                                               f"uid 0 ({pwd.getpwuid(0).pw_name}) may act "
                                               "only on its own jobs"}
    assert served.sock.counters.refused == 20
    assert served.sock.counters.failed == 0
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("control: refused forbidden from pid ")


@pytest.mark.parametrize("data", [
    pytest.param(b"not json", id="not-json"),
    pytest.param(b"\xff\xfe", id="not-utf8"),
    pytest.param(b"[1, 2]", id="not-an-object"),
    pytest.param(b'{"v": 2, "op": "gpu-xid", "args": {}}', id="wrong-version"),
    pytest.param(b'{"v": true, "op": "gpu-xid"}', id="bool-version"),
    pytest.param(b'{"v": 1, "args": {}}', id="no-op"),
    pytest.param(b'{"v": 1, "op": "gpu-xid", "args": [1]}', id="args-not-object"),
    pytest.param(b"[" * 100000, id="oversized"),
])
def test_malformed_request_gets_an_error_and_is_counted(
    served: Served, run_dir: str, data: bytes
) -> None:
    """Malformed and oversized requests get ok=false, are counted, never reach the handler."""
    with _client() as c:
        c.sendto(data, control_path(run_dir))
        reply = json.loads(c.recv(65536))
    assert reply["ok"] is False
    assert "\n" not in reply["error"]
    assert served.sock.counters.malformed == 1
    assert served.calls == []
    if len(data) > MAX_REQUEST:
        assert "larger than" in reply["error"]


def test_unbound_sender_is_counted_without_a_reply(served: Served, run_dir: str) -> None:
    """A malformed request from an unbound socket is counted; there is nowhere to answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"garbage", control_path(run_dir))
    assert request(run_dir, "ping", {}) == {"ok": True, "done": "ping"}  # served in order
    assert served.sock.counters.malformed == 1
    assert served.sock.counters.unanswered == 1


def test_a_reply_goes_only_to_a_socket_its_requester_owns_never_through_a_link(
        run_dir: str) -> None:
    """A requester bound at a path of theirs swaps it, before the answer, for a link to
    another user's private socket (in a 0700 folder), then for that user's socket file
    itself: neither gets the reply (root's sendto followed the link, passed the file's
    permissions and delivered it stamped uid 0); the requester's own socket does."""
    _require_root()
    cs = ControlSocket(run_dir, _recorder([]))
    hidden = Path(run_dir) / "victim"
    hidden.mkdir(mode=0o700)
    victim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        victim.bind(str(hidden / "v.sock"))
        other.bind(str(hidden / "o.sock"))
        for path in (hidden / "v.sock", hidden / "o.sock", hidden):
            os.chown(path, NOBODY, NOBODY)
        victim.setblocking(False)
        at = Path(run_dir) / "mine.sock"
        mine.bind(str(at))
        mine.settimeout(10)
        ping = json.dumps({"v": 1, "op": "ping", "args": {}}).encode()
        mine.sendto(ping, control_path(run_dir))
        assert cs.handle() == 1
        assert json.loads(mine.recv(4096)) == {"ok": True, "done": "ping"}
        for swap in ("link", "rename"):
            mine.sendto(ping, control_path(run_dir))
            at.unlink()
            if swap == "link":
                at.symlink_to(hidden / "v.sock")
            else:
                os.rename(hidden / "o.sock", at)  # another user's socket file, not a link
            assert cs.handle() == 1
            with pytest.raises(BlockingIOError):
                victim.recv(4096)
            other.settimeout(0.0)
            with pytest.raises(BlockingIOError):
                other.recv(4096)
        assert cs.counters.unanswered == 2
    finally:
        for sock in (victim, other, mine):
            sock.close()
        cs.close()


def test_handler_exception_is_one_line_and_the_server_lives_on(
    served: Served, run_dir: str
) -> None:
    """A handler that raises gives an ok=false reply of one line; the next request is served."""
    reply = request(run_dir, "boom", {})
    assert reply["ok"] is False
    assert reply["error"] == "boom: exploded with a second line"
    assert served.sock.counters.failed == 1
    assert request(run_dir, "gpu-lost", {"gpu": 2}) == {"ok": True, "done": "gpu-lost"}


def test_clients_that_never_read_their_replies_do_not_silence_the_others(
    served: Served, run_dir: str
) -> None:
    """500 requests each from a connected and an unbound-reply client that never read:
    the next request() is still answered (replies leave from sockets of their own)."""
    path = control_path(run_dir)
    ping = b'{"v": 1, "op": "ping"}'
    with _client() as loose, _client() as connected:
        connected.connect(path)
        for _ in range(500):
            loose.sendto(ping, path)
            connected.send(ping)
        wait_for(lambda: served.sock.counters.requests >= 1000, what="1000 requests read")
        assert request(run_dir, "ping", {}) == {"ok": True, "done": "ping"}


def test_a_sender_past_its_rate_is_dropped_unread_and_logged_once(
    run_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """400 requests at one instant from uid 65534: a burst of 200 served, 200 dropped
    without reaching the handler, one log line."""
    _require_root()
    caplog.set_level("WARNING", logger="trainwatch")
    calls: Calls = []
    served = ServedControl(ControlSocket(run_dir, _recorder(calls), group="tw-no-such-group",
                                         clock=lambda: 1000.0))  # time stands still
    try:
        os.chmod(run_dir, 0o755)
        pid = os.fork()
        if pid == 0:  # uid 65534, from an unbound socket (nowhere to answer)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    for _ in range(400):
                        s.sendto(b'{"v": 1, "op": "status"}', control_path(run_dir))
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        c = served.sock.counters
        wait_for(lambda: c.requests == 400, what="400 requests read")
        assert (c.throttled, len(calls)) == (200, 200)
    finally:
        served.stop()
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and f"uid {NOBODY}" in lines[0], lines


def test_a_reply_not_from_the_socket_files_owner_is_ignored(run_dir: str) -> None:
    """A socket file root owns, answered by a uid-65534 process: request() believes
    no reply from it (the kernel names the sender) and times out in one line."""
    _require_root()
    os.chmod(run_dir, 0o777)
    path = control_path(run_dir)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a stranger answering in trainwatch's place
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.bind(path)
                os.write(w, b"x")
                s.settimeout(20)
                _, addr = s.recvfrom(4096)
                s.sendto(b'{"ok": true, "forged": true}', addr)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        os.chown(path, 0, 0)  # as trainwatch's own socket file is
        with pytest.raises(ControlError, match="no reply within 2s"):
            request(run_dir, "status", {}, timeout=2)
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_request_to_a_missing_socket_is_one_line(run_dir: str) -> None:
    """request() with no trainwatch behind run_dir raises ControlError naming the path."""
    with pytest.raises(ControlError) as e:
        request(run_dir, "gpu-xid", {"gpu": 1})
    text = str(e.value)
    assert "\n" not in text
    assert control_path(run_dir) in text
    assert "is trainwatch running with this run_dir?" in text


def test_request_to_a_stale_socket_is_one_line(run_dir: str) -> None:
    """A socket file nobody is bound to any more: ControlError, one line."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(control_path(run_dir))
    s.close()
    with pytest.raises(ControlError, match="nothing is listening") as e:
        request(run_dir, "gpu-xid", {"gpu": 1})
    assert "\n" not in str(e.value)


def test_request_without_a_reply_times_out(run_dir: str) -> None:
    """A listener that never answers: ControlError after the timeout, one line."""
    cs = ControlSocket(run_dir, _recorder([]))  # never handle()d
    try:
        with pytest.raises(ControlError, match="no reply within") as e:
            request(run_dir, "gpu-xid", {"gpu": 1}, timeout=0.2)
        assert "\n" not in str(e.value)
    finally:
        cs.close()


def test_second_socket_on_a_live_path_is_refused(served: Served, run_dir: str) -> None:
    """Another ControlSocket on the same run_dir is refused; the first keeps serving."""
    with pytest.raises(SocketInUse, match="another trainwatch is listening"):
        ControlSocket(run_dir, _recorder([]))
    assert request(run_dir, "ping", {})["ok"] is True


def test_stale_socket_file_is_replaced(run_dir: str) -> None:
    """A socket file left by a dead trainwatch is removed and bound afresh."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(control_path(run_dir))
    s.close()
    srv = Served(run_dir)
    try:
        assert request(run_dir, "ping", {}) == {"ok": True, "done": "ping"}
    finally:
        srv.stop()


class _DeferringLoop:
    """A ControlSocket whose handler defers ``slow`` (work that waits for
    ``gate``) and ``broken`` (work that raises), served by a loop in a thread
    that settles the deferred replies when woken, as the daemon's does."""

    def __init__(self, run_dir: str) -> None:
        self.gate = threading.Event()
        self.then_threads: list[str] = []
        self._wake_r, self._wake_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self.sock = ControlSocket(run_dir, self._handle, wake=self._wake)
        self._thread = threading.Thread(target=self._loop, name="the loop", daemon=True)
        self._thread.start()

    def _handle(self, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any] | Later:
        if op == "slow":
            return Later(lambda: self.gate.wait(60) and args["n"] * 2, self._then)
        if op == "broken":
            def fail() -> None:
                raise ValueError("the remote did not answer")
            return Later(fail, self._then)
        return {"done": op}

    def _wake(self) -> None:
        os.write(self._wake_w, b"\0")

    def _then(self, got: Any) -> dict[str, Any]:
        self.then_threads.append(threading.current_thread().name)
        return {"got": got}

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            sel.register(self._stop_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._stop_r:
                        return
                    if key.fileobj == self._wake_r:
                        os.read(self._wake_r, 512)
                        self.sock.settle()
                    else:
                        self.sock.handle()

    def stop(self) -> None:
        self.gate.set()
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=10)
        self.sock.close()
        for fd in (self._wake_r, self._wake_w, self._stop_r, self._stop_w):
            os.close(fd)


def _asking(run_dir: str, op: str, args: dict[str, Any]) -> tuple[threading.Thread,
                                                                   list[Any]]:
    out: list[Any] = []

    def ask() -> None:
        try:
            out.append(request(run_dir, op, args, timeout=60))
        except ControlError as e:
            out.append(str(e))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    return t, out


def test_a_deferred_reply_comes_when_its_work_is_done_and_others_are_answered_meanwhile(
        run_dir: str) -> None:
    """A request whose handler returns a Later is answered once its work (in a
    thread) is done, with what its ``then`` makes of the result on the loop; while
    it waits, the loop answers other requests."""
    loop = _DeferringLoop(run_dir)
    try:
        slow, got = _asking(run_dir, "slow", {"n": 21})
        wait_for(lambda: len(loop.sock.deferred) == 1, timeout=10, what="the slow request")
        assert request(run_dir, "quick", {}) == {"ok": True, "done": "quick"}
        assert got == [] and slow.is_alive()
        loop.gate.set()
        slow.join(30)
        assert got == [{"ok": True, "got": 42}]
        assert loop.then_threads == ["the loop"]  # not the worker's thread
        assert len(loop.sock.deferred) == 0
        assert request(run_dir, "broken", {}, timeout=30) == {
            "ok": False, "error": "broken: the remote did not answer"}
        assert loop.sock.counters.failed == 1
    finally:
        loop.stop()


def test_deferred_requests_past_the_limit_are_refused_at_once(run_dir: str) -> None:
    """MAX_PENDING requests waiting for their work: the next one is refused with
    one line, not queued; once they are answered, a new one is taken again."""
    loop = _DeferringLoop(run_dir)
    try:
        waiting = [_asking(run_dir, "slow", {"n": i}) for i in range(MAX_PENDING)]
        wait_for(lambda: len(loop.sock.deferred) == MAX_PENDING, timeout=10,
                 what="the slow requests")
        reply = request(run_dir, "slow", {"n": 99})
        assert reply["ok"] is False and reply["error"].startswith("slow: busy:"), reply
        loop.gate.set()
        for t, _ in waiting:
            t.join(30)
        assert sorted(out[0]["got"] for _, out in waiting) == [2 * i for i in
                                                              range(MAX_PENDING)]
        assert request(run_dir, "slow", {"n": 5}, timeout=30) == {"ok": True, "got": 10}
    finally:
        loop.stop()


# --- faultinject -------------------------------------------------------------


def test_faultinject_gpu_xid_reaches_the_handler(served: Served, run_dir: str) -> None:
    """`faultinject gpu-xid --gpu 1 --xid 79` sends gpu 1, Xid 79 and prints one line."""
    p = _faultinject("gpu-xid", "--gpu", "1", "--xid", "79", "--run-dir", run_dir)
    assert p.returncode == 0, p.stderr
    assert len(served.calls) == 1
    op, args = served.calls[0]
    assert op == "gpu-xid"
    assert {"gpu": args["gpu"], "xid": args["xid"]} == {"gpu": 1, "xid": 79}
    assert args["message"] == "GPU has fallen off the bus"  # the catalog's text by default
    assert p.stdout.count("\n") == 1
    assert "Xid 79 on GPU 1" in p.stdout
    assert '"done": "gpu-xid"' in p.stdout


@pytest.mark.parametrize(("argv", "op", "args"), [
    (["gpu-lost", "--gpu", "2"], "gpu-lost", {"gpu": 2}),
    (["ecc", "--gpu", "0"], "ecc", {"gpu": 0, "uncorrected": False}),
    (["ecc", "--gpu", "0", "--uncorrected"], "ecc", {"gpu": 0, "uncorrected": True}),
    (["thermal", "--gpu", "3"], "thermal", {"gpu": 3}),
    (["gpu-xid", "--gpu", "0", "--xid", "13", "--message", "Graphics SM Warp Exception"],
     "gpu-xid", {"gpu": 0, "xid": 13, "message": "Graphics SM Warp Exception"}),
])
def test_faultinject_gpu_drills_send_their_ops(
    served: Served, run_dir: str, argv: list[str], op: str, args: dict[str, Any]
) -> None:
    """Each GPU drill sends its op with its args and exits 0."""
    p = _faultinject(*argv, "--run-dir", run_dir)
    assert p.returncode == 0, p.stderr
    assert served.calls == [(op, args)]


def test_faultinject_finds_run_dir_in_the_config(ws: Workspace) -> None:
    """--config F: the drill goes to the run_dir that F names."""
    config = ws.config({"command": ["true"]})
    srv = Served(str(ws.root / "run"))
    try:
        p = _faultinject("thermal", "--gpu", "1", "--config", str(config))
        assert p.returncode == 0, p.stderr
        assert srv.calls == [("thermal", {"gpu": 1})]
    finally:
        srv.stop()


def test_faultinject_without_a_daemon_is_one_line(run_dir: str) -> None:
    """With nothing listening: exit 2, one stderr line saying what to check."""
    p = _faultinject("gpu-xid", "--gpu", "1", "--xid", "79", "--run-dir", run_dir)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1
    assert p.stderr.startswith("faultinject: ")
    assert "is trainwatch running with this run_dir?" in p.stderr


def test_faultinject_refused_by_trainwatch_is_one_line(served: Served, run_dir: str) -> None:
    """trainwatch's ok=false reply: exit 2 and its error on one stderr line."""
    p = _faultinject("gpu-lost", "--gpu", "9", "--run-dir", run_dir)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1
    assert "no GPU 9 on this host" in p.stderr


def test_faultinject_kmsg_writes_a_line_the_kernel_log_source_reads(run_dir: str) -> None:
    """--kmsg appends a real-format NVRM: Xid line: parse_line and KernelLog read Xid 79 there."""
    log = Path(run_dir) / "kern.log"
    log.write_text("kernel: unrelated line\n")
    reader = KernelLog(str(log), pci_to_gpu={"00000000:06:00.0": 1})  # starts at the end
    try:
        p = _faultinject("gpu-xid", "--xid", "79", "--kmsg", str(log), "--pci", "0000:06:00")
        assert p.returncode == 0, p.stderr
        assert p.stdout.count("\n") == 1
        last = log.read_text().splitlines()[-1]
        assert last.startswith("NVRM: Xid (PCI:0000:06:00): 79, pid=")
        parsed = parse_line(last)
        assert parsed is not None
        assert (parsed.xid, parsed.pci, parsed.process) == (79, "00000000:06:00.0", "faultinject")
        assert parsed.message == "GPU has fallen off the bus"
        events = reader.read()
        assert [(e.xid, e.gpu, e.pci, e.source) for e in events] == [
            (79, 1, "00000000:06:00.0", "kmsg")]
    finally:
        reader.close()


def test_faultinject_kmsg_takes_the_nvml_bus_id_form(run_dir: str) -> None:
    """--pci in NVML's form (as the sim backend names its GPUs) gives the kernel's form."""
    log = Path(run_dir) / "kern.log"
    p = _faultinject("gpu-xid", "--xid", "48", "--kmsg", str(log), "--pci", "00000000:1B:00.0")
    assert p.returncode == 0, p.stderr
    parsed = parse_line(log.read_text().splitlines()[-1])
    assert parsed is not None
    assert (parsed.xid, parsed.pci) == (48, "00000000:1B:00.0")


@pytest.mark.parametrize(("argv", "says"), [
    (["--xid", "79", "--kmsg", "F"], "expected --pci too"),
    (["--xid", "79", "--kmsg", "F", "--pci", "0000:06:00", "--gpu", "1"], "--pci alone"),
    (["--xid", "79", "--kmsg", "F", "--pci", "not-a-bus"], "expected a PCI address"),
    (["--xid", "79", "--kmsg", "F", "--pci", "0000:06:00.1"], "function 0 only"),
    (["--xid", "79", "--kmsg", "F", "--pci", "0000:06:00", "--message", "a\nb"], "one line"),
    (["--xid", "79"], "expected --gpu N"),
    (["--gpu", "1", "--xid", "79", "--pci", "0000:06:00"], "only with --kmsg"),
])
def test_faultinject_gpu_xid_mistakes_are_one_line(
    run_dir: str, argv: list[str], says: str
) -> None:
    """A wrong combination of gpu-xid flags: exit 2, one line saying what was expected."""
    args = [str(Path(run_dir) / "kern.log") if a == "F" else a for a in argv]
    p = _faultinject("gpu-xid", *args)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1
    assert says in p.stderr
    assert not (Path(run_dir) / "kern.log").exists()


def test_faultinject_kmsg_refuses_a_device(run_dir: str) -> None:
    """--kmsg /dev/kmsg: refused with one line (userspace lines there are ignored as foreign)."""
    if not os.path.exists("/dev/kmsg"):
        missing("no /dev/kmsg here")
    p = _faultinject("gpu-xid", "--xid", "79", "--kmsg", "/dev/kmsg", "--pci", "0000:06:00")
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1
    assert "is a device" in p.stderr
