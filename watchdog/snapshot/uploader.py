"""The background upload of published snapshots to a remote (see
trainwatch.snapshot.remote): one thread, newest wins, never raises into the
training loop."""

from __future__ import annotations

import logging
import os
import threading

from trainwatch.snapshot import blobs
from trainwatch.snapshot.remote import Remote, RemoteError

__all__ = ["Uploader"]

log = logging.getLogger("trainwatch.snapshot")


class Uploader:
    """Uploads published snapshots in one background thread, newest wins: a
    folder submitted while another waits replaces it (counted in
    ``superseded``). Failures are logged once per kind, counted, and retried
    with backoff until a newer folder arrives; nothing is raised to the caller."""

    def __init__(self, url: str, backoff: float = 1.0, max_backoff: float = 60.0) -> None:
        self.url = url
        self.uploaded = 0
        self.superseded = 0
        self.failures = 0
        self.failures_by_kind: dict[str, int] = {}
        self.last_error: str | None = None
        self.last: dict[str, int] | None = None  # upload()'s figures for the last success
        self.bytes_uploaded = 0
        self._backoff = (backoff, max_backoff)
        self._remote: Remote | None = None
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._retire: int | None = None  # retire_after's step, done before any upload
        self.in_flight: str | None = None  # the folder being uploaded now
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="trainwatch-upload", daemon=True)
        self._thread.start()

    def submit(self, folder: str) -> None:
        """Upload ``folder`` (a published snapshot) after the one in flight. Its
        files are hard-linked at once into a folder of the upload's own
        (blobs.pin), so keep or the daemon's retention deleting the snapshot
        before its upload ends takes nothing from it."""
        try:
            pinned = blobs.pin(folder)
        except (OSError, ValueError) as e:
            self._failed("vanished" if isinstance(e, FileNotFoundError) else type(e).__name__,
                         folder, e)
            return
        with self._cond:
            old, closing = self._pending, self._closing
            if not closing:
                if old is not None:
                    self.superseded += 1
                self._pending = pinned
                self._cond.notify_all()
        if closing:
            blobs.unpin(pinned)
        elif old is not None:
            blobs.unpin(old)

    def retire_after(self, step: int) -> None:
        """Before the next upload: retire the remote's manifests of steps after
        ``step`` (Remote.retire_after), once. A failure is logged, not retried: a
        later try could retire this run's own new snapshots."""
        with self._cond:
            self._retire = step
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._pending is None and self._retire is None and self.in_flight is None

    def close(self, timeout: float | None = None) -> bool:
        """Finish the upload in flight and the one waiting (one try each), then
        stop. True when done within ``timeout``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        wait = self._backoff[0]
        while True:
            with self._cond:
                while self._pending is None and self._retire is None and not self._closing:
                    self._cond.wait()
                retire, self._retire = self._retire, None
                if retire is not None:
                    self.in_flight = f"retiring snapshots after step {retire}"
            if retire is not None:
                self._retire_after(retire)
            with self._cond:
                self.in_flight = None
                folder = self._pending
                if folder is None:
                    if self._closing:
                        return
                    continue  # it was a retirement only
                self._pending = None
                self.in_flight = folder
            ok, retry = self._one(folder)
            with self._cond:
                self.in_flight = None
                if ok:
                    wait = self._backoff[0]
                elif retry and self._pending is None and not self._closing:
                    self._cond.wait(wait)  # a submit or close ends the wait early
                    wait = min(wait * 2, self._backoff[1])
                    if self._pending is None and not self._closing:
                        self._pending, folder = folder, None  # tried again, still pinned
            if folder is not None:
                blobs.unpin(folder)

    def _retire_after(self, step: int) -> None:
        try:
            if self._remote is None:
                self._remote = Remote(self.url)
            gone = self._remote.retire_after(step)
        except Exception as e:
            self._failed("retire", f"snapshots after step {step}", e)
            return
        if gone:
            log.info("snapshot: resumed from step %d: retired %s's snapshots of steps %s "
                     "(an abandoned run's)", step, self.url, gone)

    def _one(self, folder: str) -> tuple[bool, bool]:
        """Upload one folder: (succeeded, worth retrying)."""
        try:
            if self._remote is None:
                self._remote = Remote(self.url)
            out = self._remote.upload(folder)
        except Exception as e:
            if self._remote is not None:
                self._remote.forget()
            vanished = isinstance(e, (FileNotFoundError, RemoteError)) and not os.path.isdir(folder)
            self._failed("vanished" if vanished else type(e).__name__, folder, e)
            return False, not vanished and not isinstance(e, RemoteError)
        self.uploaded += 1
        self.last = out
        self.bytes_uploaded += out["bytes_uploaded"]
        return True, False

    def _failed(self, kind: str, folder: str, e: BaseException) -> None:
        self.failures += 1
        n = self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1
        self.last_error = f"{folder}: {e}"
        (log.warning if n == 1 else log.debug)(
            "snapshot upload to %s failed (%s): %s: %s", self.url, kind, folder, e)
