"""The heartbeat source: an AF_UNIX datagram socket that turns the job's
messages into Beat and CheckpointReport observations.

The kernel attaches the sender's pid, uid and gid to every datagram
(SO_PASSCRED), so a message is believed only when the supervisor says its
sender belongs to the job's tree (or is root). Malformed, oversized and foreign
datagrams are dropped and counted, never raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainwatch.types import Beat, CheckpointReport

MAX_DATAGRAM = 4096
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the flag test runs per datagram
# Drain at most this many datagrams per wake-up so one chatty job cannot
# starve the rest of the loop.
_BATCH = 256


@dataclass
class Counters:
    received: int = 0
    malformed: int = 0
    oversized: int = 0
    foreign: int = 0
    errors: int = 0  # the socket itself failed to read


Observation = Beat | CheckpointReport
Believe = Callable[[int, int], bool]  # (pid, uid) -> is this sender one of the job's?


def _float(x: object) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool):
        raise ValueError(x)
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str) and x.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(x)  # the client sends non-finite values as strings
    raise ValueError(x)


def _int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(x)
    return x


def parse(data: bytes, pid: int, at: float) -> Observation:
    """One v1 datagram -> an observation. Raises ValueError if malformed."""
    msg = json.loads(data)
    if not isinstance(msg, dict) or type(msg.get("v")) is not int or msg["v"] != 1:
        raise ValueError("not a v1 message")
    kind = msg.get("k")
    rank = _int(msg.get("rank", 0))
    step = _int(msg.get("step"))
    if rank < 0 or step < 0:
        raise ValueError("negative rank or step")
    if kind == "beat":
        loss = _float(msg.get("loss"))
        grad_norm = _float(msg.get("grad_norm"))
        return Beat(rank=rank, step=step, at=at, pid=pid, loss=loss, grad_norm=grad_norm)
    if kind == "ckpt":
        path = msg.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("checkpoint without a path")
        return CheckpointReport(step=step, path=path, rank=rank, at=at)
    raise ValueError(f"unknown kind {kind!r}")


class SocketInUse(OSError):
    """The job's socket belongs to a live listener: the job is already supervised."""


def listening(path: str) -> bool:
    """Is a live socket bound at this path (a stale file is not)?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False  # absent, or a stale file nobody is bound to
    finally:
        probe.close()


class HeartbeatSocket:
    """The listening end for one job. Register ``fileno()`` with a selector and
    call ``drain()`` when it is readable."""

    def __init__(self, path: str, believe: Believe, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.believe = believe
        self.clock = clock
        self.counters = Counters()
        if listening(path):
            raise SocketInUse(f"{path}: another trainwatch is listening here")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        s.bind(path)
        # Anyone may send (jobs run as their own users); SO_PASSCRED decides
        # who is believed.
        os.chmod(path, 0o666)
        s.setblocking(False)
        self.sock = s
        self.last_drain: float | None = None  # seconds the last drain took

    @property
    def open(self) -> bool:
        return self.sock.fileno() >= 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[Observation]:
        t0 = time.perf_counter()
        try:
            return self._drain()
        finally:
            self.last_drain = time.perf_counter() - t0

    def _drain(self) -> list[Observation]:
        out: list[Observation] = []
        c = self.counters
        for _ in range(_BATCH):
            try:
                data, anc, flags, _addr = self.sock.recvmsg(MAX_DATAGRAM, _ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                c.errors += 1
                break
            c.received += 1
            if flags & _TRUNC:
                c.oversized += 1
                continue
            pid = uid = -1
            for level, typ, cdata in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS:
                    pid, uid, _gid = _CREDS.unpack_from(cdata)
            if pid <= 0 or not self.believe(pid, uid):
                c.foreign += 1
                continue
            try:
                obs = parse(data, pid, self.clock())
            except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
                c.malformed += 1
                continue
            out.append(obs)
        return out

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
