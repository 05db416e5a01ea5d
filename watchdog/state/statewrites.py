"""Writes of trainwatch's own files that failed and were survived, counted by
the kind of file: ``ledger``, ``status``, ``catalog``, ``log`` (a job's output
log), ``gpus`` (the GPU exclusions). A full or read-only ``state_dir`` must
degrade supervision, never stop it: every such failure is logged (the first
of a kind at once, then at most once a minute with the count since), counted
here, and exported as ``trainwatch_state_write_errors_total{file}``.

One process-wide set of counters, like prometheus-client's default registry:
every writer reaches it without being handed it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("trainwatch")

KINDS = ("ledger", "status", "catalog", "log", "gpus", "runtime", "rings", "manifest")
_LOG_EVERY = 60.0  # seconds between two log lines of one kind


class WriteErrors:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)
        self._logged_at: dict[str, float] = {}
        self._unlogged = dict.fromkeys(KINDS, 0)
        self._clock = clock

    def failed(self, kind: str, path: str | os.PathLike[str], err: BaseException) -> None:
        """Count one failed write of ``path``; log it unless one was logged lately.
        Never raises (an unknown kind is a programming error: counted as is)."""
        why = getattr(err, "strerror", None) or str(err) or type(err).__name__
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            now = self._clock()
            last = self._logged_at.get(kind)
            if last is not None and now - last < _LOG_EVERY:
                self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                return
            self._logged_at[kind] = now
            more = self._unlogged.get(kind, 0)
            self._unlogged[kind] = 0
        since = f" ({more} more {kind} write failures since the last report)" if more else ""
        log.error("cannot write %s: %s: supervision goes on without it%s", os.fspath(path),
                  why, since)

    def count(self, kind: str, n: int = 1) -> None:
        """Count ``n`` failures a caller has already logged itself."""
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + n

    def counts(self) -> dict[str, int]:
        """Failures so far by kind; every kind present, from 0."""
        with self._lock:
            return dict(self._counts)


ERRORS = WriteErrors()


def failed(kind: str, path: str | os.PathLike[str], err: BaseException) -> None:
    """Count (and log) a failed write of one of trainwatch's files; see ``WriteErrors``."""
    ERRORS.failed(kind, path, err)


def count(kind: str, n: int = 1) -> None:
    """Count failed writes the caller logged itself (attempt.py logs its own)."""
    ERRORS.count(kind, n)


def counts() -> dict[str, int]:
    return ERRORS.counts()
