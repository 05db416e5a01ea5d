"""A job's hand, root's side: a helper process as the job's user, called with a
deadline (privsep/__init__.py says why).

- ``call(fn, *args, timeout=...)`` runs ``fn(*args)`` in the hand and returns
  its result, which must be JSON (``Blobs`` adds raw bytes). ``fn`` is pickled
  by reference (a module-level function of ours), so the hand runs only our
  code; its arguments are root's own data. Replies are read as JSON, never
  unpickled (the hand is the job user's process), and are capped in bytes.
- One call at a time per hand (a lock); a caller that must not wait for
  another's long call (hashing) uses a hand of its own. ``close`` (and
  ``abort``) end a call in flight instead of waiting for it.
- The hand is forked on first use (and again after it died). A call that
  passes its deadline gets the hand killed (SIGKILL: a read blocked on a FIFO
  or /proc/kmsg ends there) and raises ``HandTimeout``; for ``cooldown``
  seconds, doubling while it happens again, calls raise ``HandDown`` at once,
  so a file that blocks every read costs its job a verdict per cooldown, never
  the loop's time at every turn. ``should_stop`` (polled while waiting) aborts
  a call the same way, without the cooldown: a verification pre-empting a
  manifest being made.
- The forking thread may not be the only one: the hand does nothing between
  fork and its serving loop that takes a lock another thread could hold
  (child.py), and always leaves through ``os._exit``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwatch.privsep.credentials import Identity

log = logging.getLogger("trainwatch")

# Request: length, then the pickled call. Reply: JSON length and blob count, the
# JSON, then each blob as length and bytes.
REQUEST = struct.Struct("!Q")
REPLY = struct.Struct("!QI")
BLOB = struct.Struct("!Q")
MAX_REPLY = 64 << 20  # bytes of JSON and blobs a call may bring back, unless it says
MAX_BLOBS = 4096
COOLDOWN = 30.0  # after a call that passed its deadline; doubles while they repeat
COOLDOWN_MAX = 600.0
_POLL = 0.1  # how often should_stop is asked while waiting


class HandError(Exception):
    """No answer from the hand: it is down, timed out, was aborted, or the op failed."""


class HandDown(HandError):
    """The hand is cooling down after a timeout, or died during the call."""


class HandTimeout(HandError):
    """The call passed its deadline: the hand was killed."""


class HandAborted(HandError):
    """``should_stop`` turned true: the hand was killed (no cooldown)."""


class OpFailed(HandError):
    """The function raised in the hand: its exception's type name, errno and text."""

    def __init__(self, kind: str, errno_: int | None, text: str) -> None:
        super().__init__(f"{kind}: {text}" if text else kind)
        self.kind, self.errno, self.text = kind, errno_, text

    def oserror(self) -> OSError:
        """As the OSError it was, for callers that handle those."""
        return OSError(self.errno or 0, self.text or self.kind)


def _serving() -> None:
    """What ``Hand.start`` calls in the hand: nothing (it answers once it serves)."""


@dataclass
class Blobs:
    """A result with raw bytes beside its JSON (a copy of a dump)."""

    result: Any
    blobs: list[bytes]


class Hand:
    def __init__(self, name: str, ident: Identity | None, *, cooldown: float = COOLDOWN,
                 env: dict[str, str] | None = None, preload: tuple[str, ...] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``ident``: the job's credentials; None runs as we do (still a process of
        its own: bounded in time). ``env``: the hand's environment (the job's, for
        a pull that needs its credentials); by default an empty one. ``preload``:
        modules the hand imports before it drops to the job's user (our own
        code, which that user may not be able to read: a Python under /root)."""
        self.name = name
        self.ident = ident
        self.env = dict(env or {})
        self.preload = preload
        self.cooldown = cooldown
        self.clock = clock
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self._next_cooldown = cooldown
        self._closed = False
        self._stale = False  # the job's user changed: the next call forks anew
        self._refused: str | None = None
        self.counts = dict.fromkeys(
            ("calls", "timeouts", "aborted", "failed", "down", "died", "spawns"), 0)

    # --- callers' side -------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float,
             should_stop: Callable[[], bool] | None = None, max_reply: int = MAX_REPLY,
             **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the hand; its JSON result. Raises HandError."""
        result, _ = self.call_blobs(fn, *args, timeout=timeout, should_stop=should_stop,
                                    max_reply=max_reply, **kwargs)
        return result

    def call_blobs(self, fn: Callable[..., Any], *args: Any, timeout: float,
                   should_stop: Callable[[], bool] | None = None, max_reply: int = MAX_REPLY,
                   **kwargs: Any) -> tuple[Any, list[bytes]]:
        with self._lock:
            now = self.clock()
            if self._closed:
                raise HandDown(f"{self.name}: closed")
            if self._refused is not None:
                self._kill()
                raise HandDown(f"{self.name}: {self._refused}")
            if now < self._down_until:
                self.counts["down"] += 1
                raise HandDown(f"{self.name}: cooling down for {self._down_until - now:.0f}s "
                               "after a call that did not answer")
            self.counts["calls"] += 1
            deadline = now + timeout
            try:
                sock = self._ready()
                payload = pickle.dumps((fn, args, kwargs, timeout), pickle.HIGHEST_PROTOCOL)
                sock.settimeout(max(0.001, deadline - self.clock()))
                sock.sendall(REQUEST.pack(len(payload)) + payload)
                sock.setblocking(False)
                reply, blobs = self._read_reply(sock, deadline, should_stop, max_reply)
            except HandTimeout:
                self.counts["timeouts"] += 1
                self._kill()
                self._down_until = self.clock() + self._next_cooldown
                self._next_cooldown = min(self._next_cooldown * 2, COOLDOWN_MAX)
                raise
            except HandAborted:
                self.counts["aborted"] += 1
                self._kill()
                raise
            except (OSError, ValueError, HandDown) as e:  # died, or spoke nonsense
                self.counts["died"] += 1
                self._kill()
                if isinstance(e, socket.timeout):
                    raise HandTimeout(f"{self.name}: the call was not taken in time") from None
                raise HandDown(f"{self.name}: {e}") from None
            self._next_cooldown = self.cooldown
            if reply.get("exiting"):
                self._kill()  # it grew past its bound and left after answering
            if not reply.get("ok"):
                self.counts["failed"] += 1
                errno_ = reply.get("errno")
                raise OpFailed(str(reply.get("type", "error"))[:80],
                               errno_ if isinstance(errno_, int) else None,
                               str(reply.get("error", ""))[:1000])
            return reply.get("result"), blobs

    def start(self, timeout: float) -> None:
        """Fork the hand now (unless it runs) and wait until it serves: its imports
        and its drop to the job's user, within ``timeout``, so that the deadline of
        the call after is that call's own. Raises HandError as a call does."""
        self.call(_serving, timeout=timeout)

    @property
    def down(self) -> bool:
        """Cooling down after a call that did not answer."""
        return self.clock() < self._down_until

    def close(self) -> None:
        """No more calls; the process killed and reaped. A call in flight in another
        thread is ended first (abort), never waited for (a hash, a capture)."""
        self._closed = True  # read under the lock by the next call
        if not self._lock.acquire(blocking=False):
            self.abort()
            self._lock.acquire()
        try:
            self._kill()
        finally:
            self._lock.release()

    def abort(self) -> None:
        """End a call in flight in another thread, without its lock: root's end of the
        socket is shut, the hand exits (child.py watches for it) and the call raises
        HandDown."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def rebind(self, ident: Identity | None) -> None:
        """The job's user changed (a reload): from the next call on, a new hand as
        ``ident`` (a call in flight ends as it began). Takes no lock: the loop
        must not wait for a long call on this hand."""
        if ident != self.ident or self._refused is not None:
            self.ident = ident  # read at the next spawn
            self._stale = True
            self._refused = None

    def refuse(self, why: str) -> None:
        """No call runs any more (the job's user cannot be resolved: never as
        another); the process goes at the next call or at close. No lock, as
        rebind."""
        self._refused = why
        self._stale = True

    # --- the process --------------------------------------------------------------

    def _ready(self) -> socket.socket:
        if self._stale:
            self._stale = False
            self._kill()  # a hand of the job's former user
        if self._pid is not None:
            try:
                pid, _ = os.waitpid(self._pid, os.WNOHANG)
            except ChildProcessError:
                pid = self._pid  # reaped by someone else: gone all the same
            if pid != 0:
                self._forget()
        if self._sock is None:
            self._spawn()
        assert self._sock is not None
        return self._sock

    def _spawn(self) -> None:
        from trainwatch.privsep import child

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        collecting = gc.isenabled()
        gc.disable()  # no collection in the child before it freezes root's objects
        try:
            pid = os.fork()
            if pid == 0:  # the hand: never returns
                child.serve(theirs.fileno(), self.ident, self.env, self.preload)
        finally:
            if collecting:
                gc.enable()
        theirs.close()
        self._pid, self._sock = pid, ours
        self.counts["spawns"] += 1

    def _kill(self) -> None:
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._pid, 0)
        self._forget()

    def _forget(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._pid, self._sock = None, None

    def _read_reply(self, sock: socket.socket, deadline: float,
                    should_stop: Callable[[], bool] | None,
                    max_reply: int) -> tuple[dict[str, Any], list[bytes]]:
        head = self._recv(sock, REPLY.size, deadline, should_stop)
        size, count = REPLY.unpack(head)
        if size > max_reply or count > MAX_BLOBS:
            raise ValueError(f"a reply of {size} bytes and {count} blobs (over the bound)")
        reply = json.loads(self._recv(sock, size, deadline, should_stop))
        if not isinstance(reply, dict):
            raise ValueError("a reply that is not a JSON object")
        total, blobs = size, []
        for _ in range(count):
            (n,) = BLOB.unpack(self._recv(sock, BLOB.size, deadline, should_stop))
            total += n
            if total > max_reply:
                raise ValueError(f"blobs past {max_reply} bytes")
            blobs.append(bytes(self._recv(sock, n, deadline, should_stop)))
        return reply, blobs

    def _recv(self, sock: socket.socket, n: int, deadline: float,
              should_stop: Callable[[], bool] | None) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - self.clock()
            if left <= 0:
                raise HandTimeout(f"{self.name}: no answer in time")
            if should_stop is not None and should_stop():
                raise HandAborted(f"{self.name}: stopped")
            ready, _, _ = select.select([sock], [], [], min(left, _POLL) if should_stop
                                        else left)
            if not ready:
                continue
            try:
                k = sock.recv_into(view[got:], n - got)
            except BlockingIOError:
                continue
            if k == 0:
                raise HandDown(f"{self.name}: the hand exited mid-call")
            got += k
        return buf
