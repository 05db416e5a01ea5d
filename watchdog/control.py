"""The local control channel: an AF_UNIX datagram socket in ``run_dir``
(``control.sock``) through which ``faultinject`` drills (and later the
``trainwatch`` operator commands) reach the running trainwatch.

A request is one JSON datagram ``{"v": 1, "op": ..., "args": {...}}``; the reply
is one datagram ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``
sent back to the sender's address. The client binds an abstract-namespace
address for that (``request()`` does).

Who may ask: root, the daemon's own user, and members of the ``trainwatch``
group. The socket file is mode 0o660 and group-owned by that group when it
exists, and the kernel attaches the sender's pid, uid and gid to every datagram
(SO_PASSCRED), which is checked again here: a socket file whose mode was
loosened does not let anyone else in. Refused, malformed and oversized requests
are counted and answered with an error when there is an address to answer;
a handler that raises becomes an error reply, never a crash of the loop.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import os
import pwd
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwatch.sources.heartbeat import SocketInUse, listening

log = logging.getLogger("trainwatch")

GROUP = "trainwatch"  # the group whose members may use the channel
MAX_REQUEST = 4096  # bytes of one request datagram
MAX_REPLY = 65536  # bytes of one reply datagram
# sun_path in struct sockaddr_un is 108 bytes including the terminating NUL.
_MAX_PATH = 107
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_TRUNC = int(socket.MSG_TRUNC)
_BATCH = 64  # requests per handle() call, so a flood cannot starve the loop
_ERROR_MAX = 300  # characters of an error line

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]

__all__ = [
    "GROUP",
    "ControlError",
    "ControlSocket",
    "Counters",
    "Handler",
    "SocketInUse",
    "control_path",
    "request",
]


class ControlError(Exception):
    """The control channel cannot be used: one line for the user."""


@dataclass
class Counters:
    requests: int = 0  # datagrams received
    refused: int = 0  # senders without the right to ask
    malformed: int = 0  # not a v1 request, or larger than MAX_REQUEST
    failed: int = 0  # the handler raised
    unanswered: int = 0  # replies that could not be sent (no address, gone, queue full)


def control_path(run_dir: str) -> str:
    return os.path.join(run_dir, "control.sock")


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= _ERROR_MAX else line[: _ERROR_MAX - 3] + "..."


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
    ``handle()`` returns."""

    def __init__(self, run_dir: str, handler: Handler, *, group: str = GROUP) -> None:
        self.path = control_path(run_dir)
        self.handler = handler
        self.counters = Counters()
        if len(os.fsencode(self.path)) > _MAX_PATH:
            raise ControlError(
                f"{self.path}: too long for an AF_UNIX socket address ({_MAX_PATH} bytes)"
            )
        try:
            self.gid: int | None = grp.getgrnam(group).gr_gid
        except KeyError:
            self.gid = None  # no such group: root and the daemon's user only
        self.group = group
        self._uid = os.geteuid()
        os.makedirs(run_dir, mode=0o755, exist_ok=True)
        if listening(self.path):
            raise SocketInUse(f"{self.path}: another trainwatch is listening here")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            s.bind(self.path)
            os.chmod(self.path, 0o660)
            if self.gid is not None:
                try:
                    os.chown(self.path, -1, self.gid)
                except PermissionError:
                    # A non-root daemon outside the group cannot hand the file to it.
                    log.warning("control: cannot give %s to group %s; only root and this "
                                "user can use it", self.path, group)
            s.setblocking(False)
        except BaseException:
            s.close()
            raise
        self.sock = s

    def fileno(self) -> int:
        return self.sock.fileno()

    def allowed(self, uid: int, gid: int) -> bool:
        """May a sender with these credentials use the channel?"""
        if uid in (0, self._uid):
            return True
        if self.gid is None:
            return False
        if gid == self.gid:
            return True
        try:
            user = pwd.getpwuid(uid).pw_name
            return self.gid in os.getgrouplist(user, gid)
        except (KeyError, OSError):  # a uid with no passwd entry has no groups
            return False

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
        if pid <= 0 or not self.allowed(uid, gid):
            c.refused += 1
            log.warning("control: refused a request from pid %d uid %d gid %d", pid, uid, gid)
            self._reply(addr, {"ok": False, "error": f"not permitted: only root and the "
                                                     f"{self.group} group may use {self.path}"})
            return
        if flags & _TRUNC:
            c.malformed += 1
            self._reply(addr, {"ok": False,
                               "error": f"request larger than {MAX_REQUEST} bytes"})
            return
        try:
            op, args = _parse(data)
        except ValueError as e:
            c.malformed += 1
            self._reply(addr, {"ok": False, "error": f"malformed request: {e}"})
            return
        log.info("control: %s %s from pid %d uid %d", op, json.dumps(args, sort_keys=True),
                 pid, uid)
        try:
            result = self.handler(op, args)
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not a dict")
            reply = {"ok": True, **{k: v for k, v in result.items() if k != "ok"}}
        except Exception as e:
            c.failed += 1
            if not isinstance(e, ValueError | LookupError | ControlError):
                log.exception("control: %s failed", op)
            reply = {"ok": False, "error": _one_line(f"{op}: {e}" if str(e) else
                                                     f"{op}: {type(e).__name__}")}
        self._reply(addr, reply)

    def _reply(self, addr: Any, reply: dict[str, Any]) -> None:
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
            self.sock.sendto(data, addr)
        except OSError:
            # Gone, not listening, or its queue is full: the client times out.
            self.counters.unanswered += 1

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


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
        # An abstract address (no file to clean up) for the reply to come to.
        s.bind(f"\0faultinject-{os.getpid()}-{secrets.token_hex(8)}".encode())
        try:
            # Connected: the kernel then delivers datagrams from the server only.
            s.connect(path)
            s.send(data)
        except FileNotFoundError:
            raise ControlError(f"{path}: no control socket (is trainwatch running with "
                               "this run_dir?)") from None
        except ConnectionRefusedError:
            raise ControlError(f"{path}: nothing is listening (is trainwatch running with "
                               "this run_dir?)") from None
        except PermissionError:
            raise ControlError(f"{path}: permission denied (only root and the {GROUP} "
                               "group may use it)") from None
        except BlockingIOError:
            raise ControlError(f"{path}: trainwatch is busy (its queue is full); "
                               "try again") from None
        except OSError as e:
            raise ControlError(f"{path}: cannot send: {e.strerror or e}") from None
        s.settimeout(timeout)
        try:
            raw = s.recv(MAX_REPLY)
        except TimeoutError:
            raise ControlError(f"{path}: no reply within {timeout:g}s (is trainwatch's "
                               "loop stuck?)") from None
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ECONNRESET):  # it closed after we sent
                raise ControlError(f"{path}: trainwatch went away before it "
                                   "replied") from None
            raise ControlError(f"{path}: cannot receive: {e.strerror or e}") from None
    finally:
        s.close()
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ControlError(f"{path}: malformed reply from trainwatch")
    return reply
