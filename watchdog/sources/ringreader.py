"""The daemon's end of a heartbeat ring (ring.py has the format and the
writer, which the job's client imports): a ring file read at the daemon's pace,
never raising, its lapped and bad records counted."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from trainwatch.sources.ring import (
    HEAD_OFFSET,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_SLOTS,
    MISSING_RAW,
    ORDERED,
    SEQ_AT,
    SLOT,
    SLOT_SIZE,
    SLOTS,
    U64,
    VERSION,
    Fence,
)


class Record(NamedTuple):
    """One beat as its writer put it (in trainwatch.types.Beat's order: the daemon
    reads its rings straight into Beats, ``read_as``)."""

    rank: int
    step: int
    t: float  # the writer's time.monotonic() when it wrote the beat
    pid: int
    loss: float | None
    grad_norm: float | None


_T = TypeVar("_T")


# What a read makes of each record: (rank, step, time, pid, loss, grad_norm).
Make = Callable[[int, int, float, int, "float | None", "float | None"], _T]


class RingError(ValueError):
    """The file is not a usable ring (one line, naming the file)."""


class RingReader:
    """The daemon's end for one ring file. ``uid`` is the file's owner (check it
    is the job's user); ``rank`` and ``pid`` are what the writer put in the
    header. ``read()`` never raises: a file that shrinks or turns to garbage
    after open is counted in ``bad``; records overwritten before they were
    read (or caught mid-write) are counted in ``lapped``."""

    def __init__(self, path: str, skip_existing: bool = False, fence: bool | None = None) -> None:
        self.path = path
        self.lapped = 0
        self.bad = 0
        # O_NONBLOCK: a FIFO put here must not block the daemon in open().
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as e:
            raise RingError(f"{path}: cannot open ring: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{path}: not a regular file")
            raw = os.pread(fd, HEADER_SIZE, 0)
            if len(raw) < HEADER_SIZE:
                raise RingError(f"{path}: not a ring: {len(raw)} bytes, shorter than its header")
            magic, version, hsize, ssize, slots, pid, rank = HEADER.unpack_from(raw)
            if magic != MAGIC:
                raise RingError(f"{path}: not a ring (magic {magic!r}, expected {MAGIC!r})")
            if (version, hsize, ssize) != (VERSION, HEADER_SIZE, SLOT_SIZE):
                raise RingError(f"{path}: ring version {version} (header {hsize}, slot {ssize}"
                                f" bytes); this trainwatch reads version {VERSION}")
            if slots < 2 or slots > MAX_SLOTS or slots & (slots - 1) or pid <= 0 or rank < 0:
                raise RingError(f"{path}: ring header out of range (slots {slots}, pid {pid},"
                                f" rank {rank})")
            if st.st_size != HEADER_SIZE + slots * SLOT_SIZE:
                raise RingError(f"{path}: ring of {slots} slots must be "
                                f"{HEADER_SIZE + slots * SLOT_SIZE} bytes, is {st.st_size}")
        except OSError as e:
            os.close(fd)
            raise RingError(f"{path}: cannot read ring: {e.strerror or e}") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.uid: int = st.st_uid
        self.rank: int = rank
        self.pid: int = pid
        self.slots: int = slots
        self._fence = Fence() if ((not ORDERED) if fence is None else fence) else None
        self._last = 0
        if skip_existing:
            self._last = self._head() or 0

    def _head(self) -> int | None:
        raw = os.pread(self._fd, 8, HEAD_OFFSET)
        return U64.unpack(raw)[0] if len(raw) == 8 else None

    def read(self, limit: int = SLOTS) -> list[Record]:
        """Every record written since the last read that was not overwritten, at most
        the newest ``limit`` of them (the rest counted as lapped): the file and its
        header are the writer's, and a ring of 2^20 slots, kept full, would
        otherwise cost the daemon a second of its loop at every read."""
        return self.read_as(Record, limit)

    def read_as(self, make: Make[_T], limit: int = SLOTS,
                now: float = float("inf")) -> list[_T]:
        """``read``, each record made by ``make`` (no second tuple per beat), its
        time never later than ``now``: the writer's word only."""
        if self._fd < 0:
            return []
        try:
            return self._read(make, max(1, limit), now)
        except (OSError, ValueError, struct.error):
            self.bad += 1
            return []

    def _snapshot(self, limit: int) -> tuple[int, int, bytes, int] | None:
        """(start, head, slots' bytes for [start, head), first record not
        overwritten), or None if this read raced the writer or the file is bad.
        Changes nothing: a failed snapshot can be taken again."""
        head = self._head()
        last, slots = self._last, self.slots
        if head is None or head < last:  # truncated, or a head caught mid-change
            return None
        start = max(last, head - min(slots, limit))
        n = head - start
        if n == 0:
            return start, head, b"", start
        fence = self._fence
        if fence is not None:
            fence()  # head before the slots
        a = start & (slots - 1)
        first = min(n, slots - a)
        data = os.pread(self._fd, first * SLOT_SIZE, HEADER_SIZE + a * SLOT_SIZE)
        if first < n:
            data += os.pread(self._fd, (n - first) * SLOT_SIZE, HEADER_SIZE)
        if len(data) != n * SLOT_SIZE:
            return None  # truncated
        if fence is not None:
            fence()  # the slots before the second head
        after = self._head()
        if after is None or after < head:
            return None
        newest = U64.unpack_from(data, (n - 1) * SLOT_SIZE + SEQ_AT)[0]
        if newest != head and head > after - slots:
            return None  # the newest record is not head's, and not overwritten: a torn head
        # Record j's slot is reused by record j + slots, whose stores all come
        # after head = j + slots: accept only records with j + slots > after.
        safe_from = after - slots + 1
        return start, head, data, safe_from

    def _read(self, make: Make[_T], limit: int, now: float) -> list[_T]:
        snap = self._snapshot(limit)
        if snap is None:  # a head below the last, or a newest record not complete:
            snap = self._snapshot(limit)  # a read that raced the writer; once more
        if snap is None:
            self.bad += 1  # twice: the file, not the race
            return []
        start, head, data, safe_from = snap
        last = self._last
        self.lapped += start - last
        self._last = head
        out: list[_T] = []
        rank, pid = self.rank, self.pid
        j = start
        for step, t, loss, gn, seq in SLOT.iter_unpack(data):  # the hot path: 1 read a second
            j += 1
            if j <= safe_from:
                self.lapped += 1
                continue
            if seq != j:
                # Below head yet not this record: garbage, or (a weakly ordered
                # CPU) a store not visible yet. Read it again next time; if it
                # never shows, it is lapped like any other.
                self._last = j - 1
                break
            if step < 0:
                self.bad += 1
                continue
            if loss != loss or gn != gn:  # NaN: the job's, or "not given"
                off = (j - 1 - start) * SLOT_SIZE
                if loss != loss and data[off + 16:off + 24] == MISSING_RAW:
                    loss = None
                if gn != gn and data[off + 24:off + 32] == MISSING_RAW:
                    gn = None
            out.append(make(rank, step, t if t < now else now, pid, loss, gn))
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
