"""A job's hand, its own side: drop to the job's credentials, then answer calls.

Forked from the daemon, possibly beside other threads: up to the serving loop
it takes no lock that another thread could have held at the fork (no logging,
no imports), and it leaves only through ``os._exit`` (no atexit handler, no
flush of a buffer the parent owns). Every descriptor but its socket and stderr
is closed first: the hand holds nothing of root's (the ledger, other jobs'
pipes, the control socket). Each call runs under an alarm of its deadline, so a
read that blocks ends the hand even if root is gone; root kills it first. A
thread of its own ends it the moment root's end of the socket closes (root
killed or stopped mid-call).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import logging
import math
import os
import pickle
import resource
import select
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from trainwatch.privsep.credentials import Identity
from trainwatch.privsep.hand import BLOB, REPLY, REQUEST, Blobs

# Seconds a new hand may take to become the job's user (its imports included).
BECOME_MAX = 60
# A hand that grew this much past its size at the fork leaves after its reply
# (a listing of a million names): root forks a new one at the next call.
GROWTH_MAX = 128 << 20
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD, signal.SIGPIPE)

# Imported lazily where the hands' calls go (the standard library's, xxhash for
# manifests, the modules of ours the calls live in): loaded before the drop.
_ALWAYS = ("importlib.readers", "importlib.resources", "encodings.idna", "zipfile",
           "pickletools", "json", "shutil", "tempfile", "traceback", "linecache", "xxhash",
           "trainwatch.layouts", "trainwatch.state.checkpointlayout", "trainwatch.state.manifest",
           "trainwatch.state.retention", "trainwatch.state.catalog",
           "trainwatch.snapshot.blobs", "trainwatch.snapshot.format",
           "trainwatch.evidence.flightrecorder", "trainwatch.multihost.records")

_PR_SET_DUMPABLE = 4
_PR_SET_NAME = 15
NAME = b"trainwatch-hand"  # /proc/<pid>/comm: 15 bytes at most
try:  # loaded here, in the daemon, before any fork (the hand loads nothing of libc's)
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None

# What a call may keep for the next ones (a job's listing, digests of linked
# files): lost with the hand, which each user of it must allow for.
kept: dict[str, Any] = {}


def serve(fd: int, ident: Identity | None, env: dict[str, str],
          preload: tuple[str, ...] = ()) -> NoReturn:
    # Root's objects are never collected here: a finalizer of root's garbage (a
    # socket's, a database connection's) would close or write to a descriptor
    # number that is this process's own by then.
    gc.freeze()
    gc.enable()  # the fork disabled it until now (hand.py): the hand's own are collected
    if _prctl is not None:  # in ps and top, a hand is not another daemon (its argv is ours)
        _prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    code = 70
    try:
        _become(fd, ident, env, preload)
        threading.Thread(target=_watch, args=(fd,), daemon=True).start()
        _loop(socket.socket(fileno=fd))
        code = 0
    finally:
        os._exit(code)


def _become(fd: int, ident: Identity | None, env: dict[str, str],
            preload: tuple[str, ...]) -> None:
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # Bounded like a call: an import whose lock a thread of root's held at the fork
    # waits forever here, and root would wait for it as long as its call's deadline
    # (an hour for a hash, six for a pull).
    signal.alarm(BECOME_MAX)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    os.closerange(3, fd)
    os.closerange(fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    # Root's log handler writes through a thread that is not in this process (its
    # lines would queue forever) or to a descriptor just closed, whose number a
    # file or socket of a call may take: the hand's lines go to stderr, plainly.
    logging.getLogger().handlers[:] = [_Stderr()]
    # Imported as we are, before the drop (the job's user may not read our code),
    # in an empty environment: a module that reads a file named by it at import
    # (fsspec's FSSPEC_CONFIG_DIR, under the job's HOME) must not read it as root.
    os.environ.clear()
    for name in (*_ALWAYS, *preload):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if ident is not None and (ident.uid, ident.gid) != (os.geteuid(), os.getegid()):
        os.setgroups(list(ident.groups))
        os.setresgid(ident.gid, ident.gid, ident.gid)
        os.setresuid(ident.uid, ident.uid, ident.uid)
        if os.geteuid() != ident.uid or (ident.uid != 0 and os.getresuid()[2] == 0):
            os._exit(71)  # never go on with root's rights in a user's folder
    # Never dumpable, whatever fs.suid_dumpable says: the job's user may not read
    # /proc/<hand>/environ (root's environment at exec, which clear() does not
    # erase) or /proc/<hand>/mem (a copy of root's memory), nor ptrace the hand.
    if _prctl is None or _prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os._exit(72)
    os.chdir("/")
    os.umask(0o077)
    os.environ.update(env)  # the job's, for its calls: read as the job's user
    signal.alarm(0)


class _Stderr(logging.Handler):
    """A line per record on fd 2 (root's stderr: the journal, the terminal), with
    no lock or buffer of root's (a thread of root's may have held one at the fork)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("trainwatch: %(message)s (in a job's hand)"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # a log line never fails a call
            os.write(2, (self.format(record) + "\n").encode(errors="replace"))


def _watch(fd: int) -> NoReturn:
    """End the hand once root's end of its socket is closed, even in the middle of a
    call: root is gone (killed, stopped) or done with it, and a pull of hours or a
    hash must not go on for a daemon that no longer waits for it."""
    p = select.poll()
    p.register(fd, select.POLLRDHUP)
    while True:
        for _fd, ev in p.poll():
            if ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(0)


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _read(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _loop(sock: socket.socket) -> None:
    base = _rss()
    while True:
        head = _read(sock, REQUEST.size)
        if head is None:
            return  # root closed its end (or is gone)
        body = _read(sock, REQUEST.unpack(head)[0])
        if body is None:
            return
        fn, args, kwargs, seconds = pickle.loads(body)  # root's own bytes
        signal.alarm(max(1, math.ceil(seconds)) + 1)
        blobs: list[bytes] = []
        reply: dict[str, Any]
        try:
            result = fn(*args, **kwargs)
            if isinstance(result, Blobs):
                result, blobs = result.result, result.blobs
            reply = {"ok": True, "result": result}
            data = json.dumps(reply).encode()
        except BaseException as e:
            blobs = []
            errno_ = getattr(e, "errno", None)
            reply = {"ok": False, "type": type(e).__name__,
                     "errno": errno_ if isinstance(errno_, int) else None,
                     "error": str(getattr(e, "strerror", None) or e)[:1000]}
            data = json.dumps(reply).encode()
        signal.alarm(0)
        exiting = _rss() - base > GROWTH_MAX
        if exiting:
            reply["exiting"] = True
            data = json.dumps(reply).encode()
        out = [REPLY.pack(len(data), len(blobs)), data]
        for b in blobs:
            out += [BLOB.pack(len(b)), b]
        sock.sendall(b"".join(out))
        if exiting:
            return
