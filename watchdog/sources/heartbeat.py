"""The heartbeat source: an AF_UNIX datagram socket that turns the job's
messages into Beat, CheckpointReport and DataOrder observations.

Who can reach it: the socket file is 0600 and owned by the job's user, in a
folder only trainwatch can write to, so only that user and root can
``connect()``; anyone else gets EACCES from the kernel and costs trainwatch
nothing. Who is believed: the kernel attaches the sender's pid, uid and gid to
every datagram (SO_PASSCRED); a message counts only when ``believe(pid, uid)``
says its sender belongs to the job's tree (or is root). Verdicts are cached
for about a second per (pid, uid), so a flood from one process costs one
judgement per second, not one per datagram.

Every field is bounded (step and rank to int64, loss and gradient norm to
floats); malformed, oversized and foreign datagrams are dropped and counted,
never raised.
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

from trainwatch.state.ownership import private_dir, set_mode
from trainwatch.types import DATA_ORDERS, Beat, CheckpointReport, DataOrder

MAX_DATAGRAM = 4096
INT64_MAX = 2**63 - 1  # steps and ranks beyond this are malformed (SQLite's integer range)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the flag test runs per datagram
_CREDENTIALS = (int(socket.SOL_SOCKET), int(socket.SCM_CREDENTIALS))
# Drain at most this many datagrams per wake-up so one chatty job cannot
# starve the rest of the loop.
BATCH = 256
# A (pid, uid) is judged again after this long, so that a pid reused by
# another process is not believed (or doubted) for longer than this.
VERDICT_TTL = 1.0
# Distinct senders remembered at most; beyond it the expired ones go, then all.
_VERDICTS_MAX = 4096
_NONFINITE = frozenset({"nan", "inf", "-inf", "infinity", "-infinity"})


@dataclass
class Counters:
    received: int = 0
    malformed: int = 0
    oversized: int = 0
    foreign: int = 0
    errors: int = 0  # the socket itself failed to read
    judged: int = 0  # calls of believe(): at most one per sender per VERDICT_TTL


Observation = Beat | CheckpointReport | DataOrder
MAX_WHY = 300  # characters of a data-order report's reason kept
Believe = Callable[[int, int], bool]  # (pid, uid) -> is this sender one of the job's?


def _float(x: object) -> float | None:
    if x is None:
        return None
    if type(x) is float:
        return x  # json gives inf and nan for Infinity and NaN: allowed
    if type(x) is int:
        try:
            return float(x)
        except OverflowError:  # 10**309: no float holds it
            raise ValueError("number out of range") from None
    if isinstance(x, str) and x.lower() in _NONFINITE:
        return float(x)  # the client sends non-finite values as strings
    raise ValueError("not a number")


def _int(x: object) -> int:
    if type(x) is not int:  # not a bool, float or string
        raise ValueError("not an integer")
    if not 0 <= x <= INT64_MAX:
        raise ValueError("out of range")
    return x


# The json module's own scanner, called directly: json.loads adds encoding
# detection, a regex and, on bad input, an exception that formats a line and
# column; together about 4x the cost of the scan itself, paid per datagram.
# (scan_once is set in JSONDecoder.__init__; typeshed does not declare it.)
_scan: Callable[[str, int], tuple[object, int]]
_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_WHITESPACE = " \t\n\r"


def _json(data: bytes) -> object:
    text = data.decode()
    if text[:1] in _WHITESPACE:  # ("" is in every string: empty input fails below)
        text = text.strip(_WHITESPACE)
    obj, end = _scan(text, 0)  # StopIteration: no JSON value at all
    if end != len(text) and text[end:].strip(_WHITESPACE):
        raise ValueError("extra data after the JSON value")
    return obj


def parse(data: bytes, pid: int, at: float) -> Observation:
    """One v1 datagram -> an observation. Raises ValueError (or another
    exception, for input the json scanner refuses) if malformed."""
    msg = _json(data)
    if type(msg) is not dict or msg.get("v") != 1 or type(msg["v"]) is not int:
        raise ValueError("not a v1 message")
    kind = msg.get("k")
    rank = _int(msg.get("rank", 0))
    step = _int(msg.get("step"))
    if kind == "beat":
        loss = _float(msg.get("loss"))
        grad_norm = _float(msg.get("grad_norm"))
        return Beat(rank=rank, step=step, at=at, pid=pid, loss=loss, grad_norm=grad_norm)
    if kind == "ckpt":
        path = msg.get("path")
        if type(path) is not str or not path or "\0" in path:
            raise ValueError("checkpoint without a usable path")
        return CheckpointReport(step=step, path=path, rank=rank, at=at)
    if kind == "data":
        order, why, per = msg.get("order"), msg.get("why", ""), msg.get("epoch_steps")
        if order not in DATA_ORDERS or type(why) is not str:
            raise ValueError("a data order without a known order")
        return DataOrder(order=str(order), why=why[:MAX_WHY], step=step, rank=rank, at=at,
                         epoch_steps=None if per is None else _int(per) or None)
    raise ValueError("unknown kind")


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
    call ``drain()`` when it is readable.

    ``owner`` is the job's (uid, gid): the socket file is given to them, mode
    0600, so that only they and root can send (None: ours). Its folder is
    created if absent: 0755 when we are root (each job's user must reach
    their own socket file in it), else 0700. Raises SocketInUse, or OSError
    (``ownership.UnsafeDir``: a folder another user controls).
    """

    def __init__(
        self,
        path: str,
        believe: Believe,
        clock: Callable[[], float] = time.monotonic,
        owner: tuple[int, int] | None = None,
        verdict_ttl: float = VERDICT_TTL,
    ) -> None:
        self.path = path
        self.believe = believe
        self.clock = clock
        self.verdict_ttl = verdict_ttl
        self.counters = Counters()
        # the sender's raw struct ucred -> (believed?, its pid, monotonic expiry)
        self._verdicts: dict[bytes, tuple[bool, int, float]] = {}
        private_dir(os.path.dirname(os.path.abspath(path)), 0o755 if os.geteuid() == 0 else 0o700)
        if listening(path):
            raise SocketInUse(f"{path}: another trainwatch is listening here")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            s.bind(path)
            uid, gid = owner if owner is not None else (-1, -1)
            if (uid, gid) == (os.geteuid(), os.getegid()):
                uid = gid = -1  # ours already: no chown (which a non-root user may not do)
            set_mode(path, 0o600, uid, gid)
            s.setblocking(False)
        except BaseException:
            s.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
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

    def _judge(self, creds: bytes, now: float) -> bool:
        """Ask believe() about a sender whose verdict is unknown or expired."""
        pid, uid, _gid = _CREDS.unpack_from(creds)
        self.counters.judged += 1
        verdict = pid > 0 and bool(self.believe(pid, uid))
        v = self._verdicts
        if len(v) >= _VERDICTS_MAX:
            for k in [k for k, (_, _, until) in v.items() if until <= now]:
                del v[k]
            if len(v) >= _VERDICTS_MAX:
                v.clear()  # many live senders (a fork flood): judging again is bounded work
        v[creds] = (verdict, pid, now + self.verdict_ttl)
        return verdict

    def _drain(self) -> list[Observation]:
        # This runs once per datagram, a flood's worth of times: locals only,
        # the verdict cache keyed by the kernel's raw credentials (no unpacking
        # on a hit), one clock read per drain.
        out: list[Observation] = []
        c = self.counters
        recvmsg = self.sock.recvmsg
        verdicts = self._verdicts
        now = time.monotonic()
        at: float | None = None
        for _ in range(BATCH):
            try:
                data, anc, flags, _addr = recvmsg(MAX_DATAGRAM, _ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                c.errors += 1
                break
            c.received += 1
            if flags & _TRUNC:
                c.oversized += 1
                continue
            # SO_PASSCRED: the kernel attaches exactly one SCM_CREDENTIALS.
            if not anc or anc[0][:2] != _CREDENTIALS or len(anc[0][2]) < _CREDS.size:
                c.foreign += 1
                continue
            creds = anc[0][2]
            hit = verdicts.get(creds)
            if hit is not None and now < hit[2]:
                believed, pid = hit[0], hit[1]
            else:
                believed = self._judge(creds, now)
                pid = verdicts[creds][1]
            if not believed:
                c.foreign += 1
                continue
            if at is None:
                at = self.clock()  # one receive time per batch: they arrived together
            if data[:1] != b"{":  # not JSON at all: no exception to build for it
                c.malformed += 1
                continue
            try:
                obs = parse(data, pid, at)
            except Exception:  # whatever a datagram holds must never reach the loop
                c.malformed += 1
                continue
            out.append(obs)
        return out

    def forget_senders(self) -> None:
        """Drop every cached verdict (call at each launch: a new attempt has a
        new tree, and no sender of the last one should stay believed)."""
        self._verdicts.clear()

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
