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
    hb.data_order("step", "a sampler seeded by step")   # once: is the skip window exact?

With TRAINWATCH_RING_DIR set (a daemon that reads heartbeat rings), every
beat goes into this process's ring file for its rank (trainwatch.sources.ring:
shared memory, no syscall, no 5 ms limit) and a datagram is sent only to
announce a new ring (the first beat of each rank in each process) and at
once for a non-finite loss or gradient norm, so that the daemon acts on a NaN
without waiting for its next read. Without it, or if the ring file cannot be
made, every beat is a datagram, as before. In a Slurm step that trainwatch did
not launch, connect() first attaches the rank to the node's daemon.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from types import ModuleType

from trainwatch.sources.ring import ENV as RING_ENV
from trainwatch.sources.ring import RingWriter

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
_UNSENT_KEPT = 4  # unsent checkpoint reports kept for a later beat to send
_UNSENT_RETRY = 0.1  # seconds between two tries from beat()
_FLUSH_FOR = 1.0  # before a non-finite value (rare: it starts a rollback), kept reports retried
_MAX_WHY = 300  # characters of a data-order reason sent (the daemon keeps as many)
_monotonic, _isfinite = time.monotonic, math.isfinite  # bound once: the beat's hot path


def _num(x: float | None) -> str:
    if x is None:
        return "null"
    x = float(x)
    # JSON has no NaN or Infinity; send them as strings the daemon understands.
    return repr(x) if math.isfinite(x) else f'"{x}"'


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def _head(rank: int) -> str:
    return f'{{"v":1,"k":"beat","rank":{int(rank)},"step":'


# This process's ring writers, one per (ring folder, rank), shared by every
# Heartbeat in it (two connect() calls must not fight over one file). None:
# the ring could not be made; beats for that rank go as datagrams.
_rings: dict[tuple[str, int], RingWriter | None] = {}
# Bumped in a forked child, where every inherited writer is dropped: the
# parent's ring is the parent's. The child makes its own on its next beat.
_fork_gen = 0


# A rank of a Slurm step that trainwatch did not launch attaches once per
# process (trainwatch.slurmattach), a failure included: a second connect()
# neither registers again nor waits again.
_attach_lock = threading.Lock()
_attach_tried = False
_attached = False


def _after_fork_in_child() -> None:
    global _fork_gen, _attach_lock
    _fork_gen += 1
    # Forked while another thread was attaching: the child must not wait on a lock
    # no thread of its own will release (it asks nothing: _attach_tried is set).
    _attach_lock = threading.Lock()
    for w in _rings.values():
        if w is not None:
            w.close()  # unmaps the child's copy of the mapping only
    _rings.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Heartbeat:
    """A connected heartbeat sender. Cheap to call every step."""

    __slots__ = ("_head", "_last_sent", "_last_try", "_path", "_ring", "_ring_dir", "_ring_gen",
                 "_sock", "_unsent", "_unsent_at", "dropped", "rank", "ring_error", "skipped")

    def __init__(self, path: str, rank: int = 0, ring_dir: str | None = None) -> None:
        self._path = path
        self.rank = rank
        self.dropped = 0  # could not be sent (no daemon, queue full)
        self.skipped = 0  # not sent: within _MIN_INTERVAL of the previous beat
        self._last_sent = -_MIN_INTERVAL
        self._sock: socket.socket | None = None
        self._last_try = 0.0
        self._head = _head(rank)
        self._ring_dir = ring_dir or None
        self._ring: RingWriter | None = None  # the writer for self.rank, once looked up
        self._ring_gen = -1  # the _fork_gen it was looked up in; -1: not yet
        self.ring_error: str | None = None  # why a ring could not be made (then: datagrams)
        # Checkpoint reports the daemon could not take (it was restarting): sent
        # again from beat() until it can, so that a restart costs no checkpoint.
        self._unsent: list[bytes] = []
        self._unsent_at = 0.0
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
            if self._unsent:
                if _finite(loss) and _finite(grad_norm):
                    self._send_unsent()
                else:  # it starts a rollback, judged by the checkpoints reported before it
                    self._send_unsent(flush=True)
            if self._ring_dir is not None:
                if rank is None and self._ring_gen == _fork_gen:
                    w = self._ring
                else:
                    w = self._writer(rank)
                if w is not None and w.write(step, loss, grad_norm):
                    if (loss is None or _isfinite(loss)) and (
                        grad_norm is None or _isfinite(grad_norm)
                    ):
                        if w.announced:
                            return
                        # Until the daemon has heard of this ring, a datagram now
                        # and then: it wakes the daemon, which then reads the ring.
                        now = _monotonic()
                        if now < w.announce_at:
                            return
                        w.announce_at = now + _MIN_INTERVAL
                    if self._send(self._message(step, loss, grad_norm, rank)):
                        w.announced = True
                    return
            if rank is None:  # an explicit rank is always sent: it may be another rank's beat
                now = _monotonic()
                if now - self._last_sent < _MIN_INTERVAL and _finite(loss) and _finite(grad_norm):
                    self.skipped += 1
                    return
                self._last_sent = now
            self._send(self._message(step, loss, grad_norm, rank))
        except Exception:
            self.dropped += 1

    def _message(self, step: int, loss: float | None, grad_norm: float | None,
                 rank: int | None) -> bytes:
        head = self._head if rank is None else _head(rank)
        if loss is None and grad_norm is None:
            return f"{head}{int(step)}}}".encode()
        return f'{head}{int(step)},"loss":{_num(loss)},"grad_norm":{_num(grad_norm)}}}'.encode()

    def _writer(self, rank: int | None) -> RingWriter | None:
        """The ring writer for ``rank`` (self.rank if None) in this process,
        made on first use; None if it cannot be made."""
        r = self.rank if rank is None else rank
        key = (str(self._ring_dir), r)
        if key in _rings:
            w = _rings[key]
        else:
            w = RingWriter(key[0], r)
            if not w.ok:
                self.ring_error = w.error
                w = None
            _rings[key] = w
        if rank is None:
            self._ring, self._ring_gen = w, _fork_gen
        return w

    def _send_unsent(self, flush: bool = False) -> None:
        """Send the reports kept for later, in order; ``flush``: now, retried
        briefly as a report is (a non-finite value must not overtake them, on the
        socket or in the ring: the rollback it starts picks from what was reported),
        for up to _FLUSH_FOR."""
        now = _monotonic()
        if now < self._unsent_at and not flush:
            return
        self._unsent_at = now + _UNSENT_RETRY
        if self._sock is None:
            self._connect()  # not once a second: a report is waiting
        deadline = now + (_FLUSH_FOR if flush else 0.0)
        while True:
            while self._unsent and self._send(self._unsent[0]):
                del self._unsent[0]
            if not self._unsent or _monotonic() >= deadline:
                break
            time.sleep(0.005)
        if self._unsent:
            self._connect()

    def checkpoint(self, step: int, path: str | os.PathLike[str], rank: int | None = None) -> bool:
        """Report that the checkpoint at ``path`` is complete. Retries briefly;
        returns whether the report was sent; one that was not is sent again
        with a later beat (the newest few are kept). Never raises."""
        try:
            body = {"v": 1, "k": "ckpt", "rank": self.rank if rank is None else rank,
                    "step": int(step), "path": os.path.abspath(os.fspath(path))}
            data = json.dumps(body, separators=(",", ":")).encode()
        except Exception:
            return False
        return self._report(data)

    def data_order(self, order: str, why: str = "", epoch_steps: int | None = None,
                   step: int = 0, rank: int | None = None) -> bool:
        """Say, once per process, whether the batch of step k is a function of k,
        so that a rollback's skip window (skip_steps()) is known to be exact or
        approximate: ``order`` is "step" (wherever the run resumes: a stateful
        loader restored from the checkpoint, a sampler seeded by step),
        "epoch-seeded" (fixed within an epoch of ``epoch_steps`` optimizer steps,
        but a resume restarts the epoch), or "unknown" (an unseeded shuffle);
        ``why`` in a line; ``step``, the step this process starts from. The
        trainwatch.integrations callbacks call it for you. Retried briefly like a
        checkpoint report; never raises. A daemon older than this method counts
        the message as malformed and ignores it."""
        try:
            body: dict[str, object] = {
                "v": 1, "k": "data", "rank": self.rank if rank is None else rank,
                "step": int(step), "order": str(order), "why": str(why)[:_MAX_WHY]}
            if epoch_steps is not None:
                body["epoch_steps"] = int(epoch_steps)
            data = json.dumps(body, separators=(",", ":")).encode()
        except Exception:
            return False
        return self._report(data)

    def _report(self, data: bytes) -> bool:
        """Send a message that must not be lost: retried briefly, then kept for
        a later beat to send (the newest few)."""
        deadline = time.monotonic() + _CHECKPOINT_RETRY_FOR
        while True:
            if self._sock is None:
                self._connect()
            if self._send(data):
                return True
            if time.monotonic() >= deadline:
                self._unsent = [*self._unsent[1 - _UNSENT_KEPT:], data]
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

    def data_order(self, order: str, why: str = "", epoch_steps: int | None = None,
                   step: int = 0, rank: int | None = None) -> bool:
        return False

    def close(self) -> None:
        pass

    def __enter__(self) -> NullHeartbeat:
        return self

    def __exit__(self, *_: object) -> None:
        pass


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0")
    except ValueError:
        return 0


def _slurm_attach() -> None:
    """Attach this Slurm step's rank to the node's daemon, at most once per
    process; on success TRAINWATCH_SOCKET (and the rest) are in os.environ."""
    global _attach_tried, _attached
    env = os.environ
    if env.get("TRAINWATCH_SOCKET") or env.get("TRAINWATCH_ATTACH") == "0" \
            or not all(env.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")):
        return
    with _attach_lock:
        if _attach_tried:
            return
        _attach_tried = True
        try:
            from trainwatch import slurmattach  # stdlib only; only Slurm steps load it

            _attached = slurmattach.attach() is not None
        except Exception:
            _attached = False
        if not _attached:
            # Children (spawned data loader workers) do not try, nor wait, again.
            env["TRAINWATCH_ATTACH"] = "0"


def connect(path: str | None = None, rank: int | None = None) -> Heartbeat | NullHeartbeat:
    """A heartbeat sender for TRAINWATCH_SOCKET (or ``path``); a no-op object
    when neither is set. The rank defaults to $RANK, as torchrun sets it, else
    $SLURM_PROCID. In a Slurm job step, with neither ``path`` nor
    TRAINWATCH_SOCKET, the rank is first attached to the node's daemon
    (trainwatch.slurmattach: once per process, for at most
    TRAINWATCH_ATTACH_TIMEOUT seconds; TRAINWATCH_ATTACH=0: not at all)."""
    if not path:
        _slurm_attach()
    path = path or os.environ.get("TRAINWATCH_SOCKET")
    if not path:
        return NullHeartbeat()
    return Heartbeat(path, _env_rank() if rank is None else rank, os.environ.get(RING_ENV))


def resume_from() -> str | None:
    """The checkpoint to resume from, or None on a fresh start (trainwatch.integrations.resume)."""
    path: str | None = _resume().resume_from()
    return path


def skip_steps() -> tuple[int, int] | None:
    """(start, end) steps whose data to skip after a rollback, or None."""
    window: tuple[int, int] | None = _resume().skip_steps()
    return window


def _resume() -> ModuleType:
    from trainwatch.integrations import resume  # stdlib only; loaded when a rank asks

    return resume
