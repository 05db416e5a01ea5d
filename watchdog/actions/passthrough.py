"""The job's output, copied through to our own stdout and stderr without ever
blocking the supervisor's loop.

One writer thread per stream takes bounded queued chunks and writes them
with ordinary blocking writes; the loop only appends to the queue, and what
does not fit (a reader that stopped reading: ``| sleep``, a paused
terminal, ``| less``) is dropped and counted. The stream's own mode is left
alone: setting O_NONBLOCK on a terminal or pipe we share with a shell would
change it for every other process writing to it.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
from collections import deque

LIMIT = 1 << 20  # bytes queued per stream before output is dropped
_EXIT_FLUSH = 2.0  # seconds the writers get at exit


class Passthrough:
    """A non-blocking writer to one file descriptor of ours."""

    def __init__(self, fd: int, limit: int = LIMIT) -> None:
        self.fd = fd
        self.limit = limit
        self.dropped = 0  # bytes that were not written (queue full, or the stream broke)
        self.broken: OSError | None = None  # the error that ended writing, if any
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._writing = 0  # bytes the thread holds and is writing now
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def write(self, data: bytes) -> int:
        """Queue data; returns how many bytes of it were dropped. Never blocks
        beyond taking a lock the writer thread holds only briefly."""
        with self._cond:
            if self.broken is not None or self._queued + len(data) > self.limit:
                self.dropped += len(data)
                return len(data)
            self._queue.append(data)
            self._queued += len(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"trainwatch-passthrough-{self.fd}")
                self._thread.start()
            self._cond.notify()
        return 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                data = self._queue.popleft()
                self._queued -= len(data)
                self._writing = len(data)
            try:
                self._write_all(data)
            except OSError as e:  # EPIPE: the reader went away; EIO: the terminal did
                with self._cond:
                    self.broken = e
                    self.dropped += self._writing + self._queued
                    self._queue.clear()
                    self._queued = self._writing = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = 0
                self._cond.notify_all()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except BlockingIOError:  # someone else made the stream non-blocking
                select.select([], [self.fd], [], 1.0)
                continue
            view = view[n:]
            with self._cond:
                self._writing -= n

    def pending(self) -> int:
        with self._cond:
            return self._queued + self._writing

    def flush(self, timeout: float) -> bool:
        """Wait up to timeout for the queue to empty (at exit); True when it did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queued or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True


_streams: dict[int, Passthrough] = {}
_lock = threading.Lock()


def to(fd: int) -> Passthrough:
    """The process-wide writer for one of our fds (1 or 2), shared by every attempt."""
    with _lock:
        p = _streams.get(fd)
        if p is None:
            if not _streams:
                # What the job wrote last must reach the terminal before we exit,
                # but a reader that stopped reading may delay the exit only so long.
                atexit.register(flush_all, _EXIT_FLUSH)
            p = _streams[fd] = Passthrough(fd)
        return p


def flush_all(timeout: float) -> bool:
    """Give the writers up to timeout to write what is queued (call before exiting)."""
    deadline = time.monotonic() + timeout
    with _lock:
        streams = list(_streams.values())
    return all(p.flush(max(0.0, deadline - time.monotonic())) for p in streams)


class LogHandler(logging.Handler):
    """trainwatch's own log lines, through the same non-blocking writer as the
    job's output on that stream: a reader that stopped reading (``2>&1 |
    sleep``, a paused terminal) costs dropped lines, never a stalled loop."""

    def __init__(self, fd: int = 2) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            to(self.fd).write((self.format(record) + "\n").encode(errors="replace"))
        except Exception:  # a log line must never raise into the loop
            self.handleError(record)
