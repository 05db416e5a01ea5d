"""The local control channel: an AF_UNIX datagram socket in ``run_dir``
(``control.sock``) through which ``faultinject`` drills (and later the
``trainwatch`` operator commands) reach the running trainwatch.

A request is one JSON datagram ``{"v": 1, "op": ..., "args": {...}}``; the reply
is one datagram ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``
sent back to the sender's address. The client binds an abstract-namespace
address for that (``request()`` does); a sender bound at a path is answered only
there, through the socket file itself opened without following a link, and only
if it is the sender's own (``_send_to_requester``).

Who may ask what is decided per request (access.py): the socket file is mode
0o666, so every local user reaches it, and the kernel attaches the sender's
pid, uid and gid to every datagram (SO_PASSCRED). The handler gets that sender
as an ``access.Peer``: root, the daemon's own user and members of the admin
group (``admin_group``, by default ``trainwatch``) act on every job, anyone else
only on the jobs that run as them, and a handler raises ``access.Refused`` for
the rest.

Because anyone may send, a flood must stay cheap and must not shut out the
others: the cheap checks come first (credentials, a per-sender rate for all
but admins, size, JSON); a sender past its rate is dropped unread and
unanswered; refusals and drops are logged at most once per sender per
``senders.NOTE_EVERY`` seconds. Replies leave from a socket of their own, never the
listening one: a reply waiting in the queue of a client that never reads is
charged to the socket that sent it, and on the listening socket a few hundred
of those would leave no room to answer anyone (EAGAIN). A client therefore
does not connect() (a connected client's queue is not bounded by
net.unix.max_dgram_qlen for its peer) and believes a reply only from the
socket file's owner, as the kernel vouches (SO_PASSCRED).

Refused, malformed and oversized requests are counted and answered with an
error when there is an address to answer; a handler that raises becomes an
error reply, never a crash of the loop.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwatch.host.deferred import Deferrals, Later
from trainwatch.host.senders import ERROR_MAX, RATE, Senders, one_line
from trainwatch.privsep.access import GROUP, Peer, Peers, Refused
from trainwatch.sources.heartbeat import SocketInUse, listening

log = logging.getLogger("trainwatch")

MAX_REQUEST = 4096  # bytes of one request datagram
MAX_REPLY = 65536  # bytes of one reply datagram
# sun_path in struct sockaddr_un is 108 bytes including the terminating NUL.
_MAX_PATH = 107
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_TRUNC = int(socket.MSG_TRUNC)
_BATCH = 64  # requests per handle() call, so a flood cannot starve the loop

Handler = Callable[[str, dict[str, Any], Peer], "dict[str, Any] | Later"]

__all__ = [
    "GROUP",
    "ControlError",
    "ControlSocket",
    "Counters",
    "Handler",
    "Later",
    "Peer",
    "Refused",
    "SocketInUse",
    "control_path",
    "request",
]


class ControlError(Exception):
    """The control channel cannot be used: one line for the user."""


@dataclass
class Counters:
    requests: int = 0  # datagrams received
    refused: int = 0  # requests the sender had no right to make (access.Refused)
    throttled: int = 0  # dropped unread: the sender was past its rate
    malformed: int = 0  # not a v1 request, or larger than MAX_REQUEST
    failed: int = 0  # the handler raised
    unanswered: int = 0  # replies that could not be sent (no address, gone, queue full)


def control_path(run_dir: str) -> str:
    return os.path.join(run_dir, "control.sock")


def _parse(data: bytes) -> tuple[str, dict[str, Any]]:
    """One request datagram -> (op, args). Raises ValueError if malformed."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError("not JSON") from e
    if not isinstance(msg, dict) or type(msg.get("v")) is not int or msg["v"] != 1:
        raise ValueError('not a v1 request (expected {"v": 1, "op": ..., "args": {...}})')
    op = msg.get("op")
    if not isinstance(op, str) or not op:
        raise ValueError("request without an op")
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    return op, args


class ControlSocket:
    """The listening end. Register ``fileno()`` with a selector and call
    ``handle()`` when it is readable; each request is answered before
    ``handle()`` returns, but one whose handler returns a ``Later``: that one
    is answered by ``settle()``, which the loop calls once ``wake`` woke it.
    Ops in ``quiet`` (reads anyone may flood) are logged at DEBUG, the others
    at INFO with their sender."""

    def __init__(self, run_dir: str, handler: Handler, *, group: str = GROUP,
                 quiet: frozenset[str] = frozenset(),
                 clock: Callable[[], float] = time.monotonic,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.path = control_path(run_dir)
        self.handler = handler
        self.deferred = Deferrals(wake)  # requests waiting for a job's hand (deferred.py)
        self.counters = Counters()
        if len(os.fsencode(self.path)) > _MAX_PATH:
            raise ControlError(
                f"{self.path}: too long for an AF_UNIX socket address ({_MAX_PATH} bytes)"
            )
        self.peers = Peers(group, clock)
        self.group = group
        self.quiet = quiet
        self.clock = clock
        self.senders = Senders(clock)  # each sender's rate, and its lines in the log
        os.makedirs(run_dir, mode=0o755, exist_ok=True)
        if listening(self.path):
            raise SocketInUse(f"{self.path}: another trainwatch is listening here")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            s.bind(self.path)
            # Every local user may ask about their own jobs: who may do what is
            # decided per request from the kernel's credentials, not by the file.
            os.chmod(self.path, 0o666)
            s.setblocking(False)
        except BaseException:
            s.close()
            raise
        self.sock = s

    def set_group(self, group: str) -> None:
        """Judge senders against another admin group from now on (a reload)."""
        self.peers = Peers(group, self.clock)
        self.group = group

    def fileno(self) -> int:
        return self.sock.fileno()

    def handle(self) -> int:
        """Answer the pending requests. Returns how many were read. Never raises
        for bad input or a handler's exception."""
        n = 0
        for _ in range(_BATCH):
            try:
                data, anc, flags, addr = self.sock.recvmsg(MAX_REQUEST, _ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                log.warning("control: receive failed: %s", e.strerror)
                break
            n += 1
            self._one(data, anc, flags, addr)
        return n

    def _one(self, data: bytes, anc: list[tuple[int, int, bytes]], flags: int,
             addr: Any) -> None:
        c = self.counters
        c.requests += 1
        pid = uid = gid = -1
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS:
                pid, uid, gid = _CREDS.unpack_from(cdata)
        if pid <= 0:  # SO_PASSCRED always attaches them; without them, nobody is vouched for
            c.refused += 1
            self._reply(addr, {"ok": False, "error": "not permitted: a request without "
                                                     "credentials"}, -1)
            return
        peer = self.peers.peer(pid, uid, gid)
        if not self.senders.within_rate(peer):
            c.throttled += 1
            self.senders.note(peer, "dropped", f"more than {RATE:g} requests a second")
            return
        if flags & _TRUNC:
            c.malformed += 1
            self._reply(addr, {"ok": False,
                               "error": f"request larger than {MAX_REQUEST} bytes"}, peer.uid)
            return
        try:
            op, args = _parse(data)
        except ValueError as e:
            c.malformed += 1
            self._reply(addr, {"ok": False, "error": f"malformed request: {e}"}, peer.uid)
            return
        self._answer(op, args, peer, addr, lambda: self.handler(op, args, peer))

    def _answer(self, op: str, args: dict[str, Any], peer: Peer, addr: Any,
                make: Callable[[], dict[str, Any] | Later]) -> None:
        """Reply with what ``make`` returns (or the one line it raised), or,
        when it returns a Later, once its work is done (``settle()``)."""
        c = self.counters
        try:
            result = make()
            if isinstance(result, Later):
                self.deferred.start(result, op, lambda then: self._answer(op, args, peer,
                                                                         addr, then))
                return
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not a dict")
            reply = {"ok": True, **{k: v for k, v in result.items() if k != "ok"}}
            log.log(logging.DEBUG if op in self.quiet else logging.INFO,
                    "control: %s %s from pid %d %s", op,
                    json.dumps(args, sort_keys=True, default=str)[:ERROR_MAX], peer.pid, peer)
        except Refused as e:
            c.refused += 1
            self.senders.note(peer, f"refused {op}", str(e))
            reply = {"ok": False, "error": one_line(f"{op}: {e}")}
        except Exception as e:
            c.failed += 1
            if not isinstance(e, ValueError | LookupError | ControlError):
                log.exception("control: %s failed", op)
            reply = {"ok": False, "error": one_line(f"{op}: {e}" if str(e) else
                                                     f"{op}: {type(e).__name__}")}
        self._reply(addr, reply, peer.uid)

    def settle(self) -> int:
        """Answer the deferred requests whose work is done (call it from the loop
        after ``wake``); how many were."""
        return self.deferred.settle()

    def _reply(self, addr: Any, reply: dict[str, Any], uid: int) -> None:
        if not addr:  # an unbound sender: nowhere to answer
            self.counters.unanswered += 1
            return
        try:
            data = json.dumps(reply, allow_nan=False, default=str).encode()
        except (ValueError, TypeError):
            data = b'{"ok": false, "error": "reply not encodable as JSON"}'
        if len(data) > MAX_REPLY:
            data = json.dumps({"ok": False, "error": f"reply larger than {MAX_REPLY} bytes"}
                              ).encode()
        try:
            # A socket of its own (see the module's docstring); the kernel binds it
            # to an address of its own, and vouches for our uid to the client.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                               | socket.SOCK_NONBLOCK) as s:
                _send_to_requester(s, data, addr, uid)
        except OSError:
            # Gone, not listening, its queue is full, or not the requester's: the
            # client times out.
            self.counters.unanswered += 1

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _send_to_requester(s: socket.socket, data: bytes, addr: str | bytes, uid: int) -> None:
    """``data`` to the requester's address. An abstract one is the requester's socket
    (the kernel gave it as the sender's). A path is only a name: by the time root
    answers, the requester may have swapped it for a link to another user's socket,
    and root's sendto follows links and passes every permission check (replies were
    delivered, stamped uid 0, into a socket its requester could not write to). So the
    file is opened without following a link (O_PATH | O_NOFOLLOW), must be a socket
    the requester owns, and is sent to through that descriptor, as systemd does for
    a long path: what was judged is what gets the reply."""
    if (addr[:1] == b"\0") if isinstance(addr, bytes) else addr.startswith("\0"):
        s.sendto(data, addr)
        return
    fd = os.open(addr, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid or uid < 0:
            raise PermissionError(errno.EPERM, "not a socket of the requester's", addr)
        s.sendto(data, f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _reply_from(s: socket.socket, path: str, uid: int, deadline: float,
                timeout: float) -> bytes:
    """The first datagram the kernel says uid sent; anyone else's are ignored."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ControlError(f"{path}: no reply within {timeout:g}s (is trainwatch's "
                               "loop stuck?)")
        s.settimeout(left)
        try:
            raw, anc, _flags, _addr = s.recvmsg(MAX_REPLY, _ANC_SIZE)
        except TimeoutError:
            continue
        except OSError as e:
            raise ControlError(f"{path}: cannot receive: {e.strerror or e}") from None
        for level, typ, cdata in anc:
            if (level, typ) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS) \
                    and _CREDS.unpack_from(cdata)[1] == uid:
                return raw


def request(run_dir: str, op: str, args: dict[str, Any],
            timeout: float = 5.0) -> dict[str, Any]:
    """Send one request to the trainwatch serving ``run_dir`` and return its
    reply (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``). Raises
    ControlError, one line, when it cannot be delivered or no reply comes."""
    path = control_path(run_dir)
    data = json.dumps({"v": 1, "op": op, "args": args}, allow_nan=False).encode()
    if len(data) > MAX_REQUEST:
        raise ControlError(f"{op}: request larger than {MAX_REQUEST} bytes")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        # An abstract address (no file to clean up) for the reply to come to; not
        # connected (see the module's docstring): the reply's sender is checked.
        s.bind(f"\0faultinject-{os.getpid()}-{secrets.token_hex(8)}".encode())
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        s.settimeout(timeout)
        try:
            server_uid = os.stat(path).st_uid  # the daemon's own file: its uid replies
            s.sendto(data, path)
        except FileNotFoundError:
            raise ControlError(f"{path}: no control socket (is trainwatch running with "
                               "this run_dir?)") from None
        except ConnectionRefusedError:
            raise ControlError(f"{path}: nothing is listening (is trainwatch running with "
                               "this run_dir?)") from None
        except PermissionError:
            # The socket is open to all; its folder (run_dir) is not open to this user.
            raise ControlError(f"{path}: permission denied (run_dir is not open to this "
                               "user)") from None
        except (BlockingIOError, TimeoutError):
            raise ControlError(f"{path}: trainwatch is busy (its queue stayed full for "
                               f"{timeout:g}s); try again") from None
        except OSError as e:
            raise ControlError(f"{path}: cannot send: {e.strerror or e}") from None
        raw = _reply_from(s, path, server_uid, time.monotonic() + timeout, timeout)
    finally:
        s.close()
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ControlError(f"{path}: malformed reply from trainwatch")
    return reply
