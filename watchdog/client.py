"""The training side: heartbeats and checkpoint reports to the trainwatch daemon.

Standard library only, and importing it pulls in nothing else of trainwatch.
Nothing here blocks the training loop or raises into it: with no daemon, a
full queue or a daemon that is restarting, a beat is dropped (the next one
supersedes it). A checkpoint report is retried briefly, because a lost one
costs more; the daemon's catalog also finds checkpoints on disk.

    from trainwatch import client
    hb = client.connect()
    for step in ...:
        hb.beat(step, loss=loss, grad_norm=gn)
    hb.checkpoint(step, path)
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

__all__ = ["Heartbeat", "NullHeartbeat", "connect", "resume_from", "skip_steps"]

# A reconnect after a failed send is tried at most this often, so that a
# missing daemon costs a failed syscall per beat at worst, not a connect().
_RECONNECT_EVERY = 1.0
# Beats closer together than this are not sent (a step loop faster than 200 Hz
# gains nothing from more): the kernel queues only ~10 datagrams per job, and
# a burst from one rank would crowd out the others'. A non-finite loss or grad
# norm is always sent.
_MIN_INTERVAL = 0.005
_CHECKPOINT_RETRY_FOR = 0.2


def _num(x: float | None) -> str:
    if x is None:
        return "null"
    x = float(x)
    # JSON has no NaN or Infinity; send them as strings the daemon understands.
    return repr(x) if math.isfinite(x) else f'"{x}"'


_monotonic = time.monotonic


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def _head(rank: int) -> str:
    return f'{{"v":1,"k":"beat","rank":{int(rank)},"step":'


class Heartbeat:
    """A connected heartbeat sender. Cheap to call every step."""

    __slots__ = ("_head", "_last_sent", "_last_try", "_path", "_sock", "dropped", "rank", "skipped")

    def __init__(self, path: str, rank: int = 0) -> None:
        self._path = path
        self.rank = rank
        self.dropped = 0  # could not be sent (no daemon, queue full)
        self.skipped = 0  # not sent: within _MIN_INTERVAL of the previous beat
        self._last_sent = -_MIN_INTERVAL
        self._sock: socket.socket | None = None
        self._last_try = 0.0
        self._head = _head(rank)
        self._connect()

    def _connect(self) -> None:
        self._last_try = time.monotonic()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        s: socket.socket | None = None
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            s.setblocking(False)
            s.connect(self._path)
        except OSError:
            if s is not None:
                s.close()  # not left to the garbage collector: no fd kept, no ResourceWarning
            return
        self._sock = s

    def _send(self, data: bytes) -> bool:
        s = self._sock
        if s is not None:
            try:
                s.send(data)
                return True
            except BlockingIOError:
                self.dropped += 1  # queue full: the next beat supersedes this one
                return False
            except OSError:
                pass  # the daemon went away or restarted: reconnect below
        self.dropped += 1
        if time.monotonic() - self._last_try >= _RECONNECT_EVERY:
            self._connect()
        return False

    def beat(
        self,
        step: int,
        loss: float | None = None,
        grad_norm: float | None = None,
        rank: int | None = None,
    ) -> None:
        """Report that ``step`` finished. Never blocks, never raises."""
        try:
            if rank is None:  # an explicit rank is always sent: it may be another rank's beat
                now = _monotonic()
                if now - self._last_sent < _MIN_INTERVAL and _finite(loss) and _finite(grad_norm):
                    self.skipped += 1
                    return
                self._last_sent = now
            head = self._head if rank is None else _head(rank)
            if loss is None and grad_norm is None:
                msg = f"{head}{int(step)}}}"
            else:
                msg = f'{head}{int(step)},"loss":{_num(loss)},"grad_norm":{_num(grad_norm)}}}'
            self._send(msg.encode())
        except Exception:
            self.dropped += 1

    def checkpoint(self, step: int, path: str | os.PathLike[str], rank: int | None = None) -> bool:
        """Report that the checkpoint at ``path`` is complete. Retries briefly;
        returns whether the report was sent. Never raises."""
        try:
            body = {"v": 1, "k": "ckpt", "rank": self.rank if rank is None else rank,
                    "step": int(step), "path": os.path.abspath(os.fspath(path))}
            data = json.dumps(body, separators=(",", ":")).encode()
        except Exception:
            return False
        deadline = time.monotonic() + _CHECKPOINT_RETRY_FOR
        while True:
            if self._sock is None:
                self._connect()
            if self._send(data):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class NullHeartbeat:
    """What connect() returns outside trainwatch: every call does nothing."""

    rank = 0
    dropped = 0
    skipped = 0

    def beat(self, step: int, loss: float | None = None, grad_norm: float | None = None,
             rank: int | None = None) -> None:
        pass

    def checkpoint(self, step: int, path: str | os.PathLike[str], rank: int | None = None) -> bool:
        return False

    def close(self) -> None:
        pass

    def __enter__(self) -> NullHeartbeat:
        return self

    def __exit__(self, *_: object) -> None:
        pass


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def connect(path: str | None = None, rank: int | None = None) -> Heartbeat | NullHeartbeat:
    """A heartbeat sender for TRAINWATCH_SOCKET (or ``path``); a no-op object
    when neither is set. The rank defaults to $RANK, as torchrun sets it."""
    path = path or os.environ.get("TRAINWATCH_SOCKET")
    if not path:
        return NullHeartbeat()
    return Heartbeat(path, _env_rank() if rank is None else rank)


def resume_from() -> str | None:
    """The checkpoint to resume from (TRAINWATCH_RESUME_FROM), or None on a fresh start."""
    return os.environ.get("TRAINWATCH_RESUME_FROM") or None


def skip_steps() -> tuple[int, int] | None:
    """(start, end) steps whose data to skip after a rollback, or None."""
    raw = os.environ.get("TRAINWATCH_SKIP_STEPS")
    if not raw:
        return None
    try:
        a, b = raw.split(":")
        return int(a), int(b)
    except ValueError:
        return None
