"""The training side's snapshot helper: two phases (CheckFreq's design).

Phase 1, the only part ``maybe_save`` blocks on, copies the state to host
memory with torch's own DCP staging: ``torch.distributed.checkpoint.staging.
DefaultStager`` over ``StateDictStager``, synchronous, whose storage cache
keeps one host buffer per source storage and refills it in place on every
later save (pinned and with non-blocking copies only when CUDA is present;
no shared memory: nothing crosses a process). Non-tensor leaves are deep
copied by the same pass. Without torch imported (numpy or bytes state) a
``copy.deepcopy`` does the same.

Phase 2 runs in one background thread (trainwatch.snapshot.writer). DCP's
writer and ``async_save`` are not used for it: a DCP checkpoint is a folder
of ``.distcp`` files per rank written anew each time, while dedup needs each
chunk named by its hash in a shared store, linked into every snapshot that
holds it, and a manifest of those hashes published last by one rename.

A save due while one is in flight is coalesced: skipped and counted, never
queued (its staging buffers are the ones being written). After each publish:
the report to trainwatch, then (standalone only) keep, then GC, then the
upload when ``remote`` is set.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from trainwatch.snapshot import blobs, codec, crashpoint, format, reader, writer

__all__ = ["Snapshotter"]

log = logging.getLogger("trainwatch.snapshot")


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _positive(name: str, v: object, kind: type | tuple[type, ...]) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, kind) or v <= 0):  # type: ignore[operator]
        raise ValueError(f"Snapshotter: {name} must be a positive number, got {v!r}")


def _make_stager() -> Any:
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=cuda))


def _closer(ref: weakref.ref[Snapshotter]) -> Callable[[], None]:
    """close() at exit, without the exit hook keeping the Snapshotter alive."""
    def close() -> None:
        s = ref()
        if s is not None:
            s.close()
    return close


class Snapshotter:
    """Snapshots of a training state in ``dir`` every N steps or seconds."""

    def __init__(self, dir: str | os.PathLike[str], every_steps: int | None = None,
                 every_seconds: float | None = None, keep: int | None = 3,
                 incremental: bool = True, compress: str | None = None,
                 remote: str | None = None, rank: int | None = None) -> None:
        if (every_steps is None) == (every_seconds is None):
            raise ValueError("Snapshotter: give exactly one of every_steps and every_seconds")
        _positive("every_steps", every_steps, int)
        _positive("every_seconds", every_seconds, (int, float))
        _positive("keep", keep, int)
        if compress not in (None, "zstd"):
            raise ValueError(f"Snapshotter: compress must be None or 'zstd', got {compress!r}")
        if compress == "zstd":
            codec.require()
        if remote is not None and (not isinstance(remote, str) or "://" not in remote):
            raise ValueError(f"Snapshotter: remote must be a URL such as s3://bucket/prefix, "
                             f"got {remote!r}")
        self.dir = os.path.abspath(os.fspath(dir))
        self.rank = _env_rank() if rank is None else int(rank)
        self.every_steps, self.keep = every_steps, keep
        self.every_seconds = None if every_seconds is None else float(every_seconds)
        self.incremental, self.compress, self.remote = bool(incremental), compress, remote
        self.under_trainwatch = bool(os.environ.get("TRAINWATCH_JOB"))
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ValueError(f"Snapshotter: {self.dir} exists and is not a directory")
        if self.rank == 0:
            try:
                os.makedirs(self.dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"Snapshotter: cannot create {self.dir}: "
                                 f"{e.strerror or e}") from None
        self.saves = 0  # published
        self.coalesced = 0  # due while one was in flight: skipped
        self.failures = 0
        self.last_error: str | None = None
        self.last: writer.Written | None = None
        self.restored_from: str | None = None
        self._next_step = every_steps or 0
        self._next_time = time.monotonic() + (self.every_seconds or 0.0)
        self._last_step: int | None = None
        self._cond = threading.Condition()
        self._job: tuple[int, Any, float] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stager: Any = None
        self._uploader: Any = None
        self._client: Any = None
        if self.rank == 0 and "torch" in sys.modules:
            self._stager = _make_stager()  # its import (~0.7 s) here, not in the first save
        self._atexit = _closer(weakref.ref(self))
        atexit.register(self._atexit)

    # -- saving ---------------------------------------------------------------

    def _due(self, step: int) -> bool:
        if self._last_step is not None and step <= self._last_step:
            return False
        if self.every_steps is not None:
            return step >= self._next_step
        return time.monotonic() >= self._next_time

    def _advance(self, step: int) -> None:
        if self.every_steps is not None:
            self._next_step = (step // self.every_steps + 1) * self.every_steps
        else:
            self._next_time = time.monotonic() + (self.every_seconds or 0.0)

    def maybe_save(self, step: int, state: Any) -> bool:
        """Save ``state`` as step ``step`` if one is due (rank 0 only). Blocks
        only while the state is copied to host memory; True when a save began."""
        if self.rank != 0 or self._closed or not self._due(step):
            return False
        with self._cond:
            busy = self._busy
        if busy:
            self.coalesced += 1
            self._advance(step)
            return False
        crashpoint.at("stage.begin")
        t0 = time.monotonic()
        staged = self._stage(state)
        stage_s = time.monotonic() - t0
        crashpoint.at("stage.done")
        self._advance(step)
        self._last_step = step
        with self._cond:
            self._job, self._busy = (int(step), staged, stage_s), True
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="trainwatch-snapshot",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def _stage(self, state: Any) -> Any:
        if "torch" not in sys.modules:  # no tensor can exist: no need to load torch
            return copy.deepcopy(state)
        if self._stager is None:
            self._stager = _make_stager()
        return self._stager.stage(state)

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                job, self._job = self._job, None
            if job is None:
                return
            try:
                self._save(*job)
            except Exception as e:
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.error("snapshot of step %d failed: %s", job[0], self.last_error)
            finally:
                job = None  # the staged copy: not held while waiting for the next save
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _save(self, step: int, staged: Any, stage_s: float) -> None:
        # A snapshot of this step already on disk is newer than the one this run
        # resumed from: an abandoned timeline (quarantined by a rollback, or judged
        # bad). It gives way, or its content would be reported as this run's. On a
        # standalone fresh start the earlier run's snapshots are kept.
        replace = self.under_trainwatch or self.restored_from is not None
        w = writer.write(self.dir, step, staged, compress=self.compress,
                         incremental=self.incremental, keep=self.keep, stage_s=stage_s,
                         replace=replace)
        del staged
        self.last = w
        if not w.published:
            log.warning("snapshot of step %d not saved: %s is an earlier run's (kept)",
                        step, w.folder)
            return
        self.saves += 1
        self._report(step, w.folder)
        crashpoint.at("report.sent")
        if not self.under_trainwatch:
            self._apply_keep()
        blobs.collect(self.dir)
        crashpoint.at("gc.done")
        if self.remote is not None:
            self._upload().submit(w.folder)

    def _upload(self) -> Any:
        if self._uploader is None:
            from trainwatch.snapshot.uploader import Uploader

            assert self.remote is not None
            self._uploader = Uploader(self.remote)
        return self._uploader

    def _report(self, step: int, folder: str) -> None:
        if self._client is None:
            from trainwatch import client

            self._client = client.connect()
        self._client.checkpoint(step, folder)

    def _apply_keep(self) -> None:
        """Standalone retention: the newest ``keep``; never the newest nor the
        one restored from (under trainwatch the daemon's retention decides)."""
        if self.keep is None:
            return
        snaps = format.published(self.dir)
        spare = {f for _, f in snaps[-self.keep:]}
        if self.restored_from is not None:
            spare.add(self.restored_from)
        for _, folder in snaps:
            if folder not in spare:
                blobs.delete(self.dir, folder, gc=False)
                crashpoint.at("keep.deleted")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the save (and the upload) in flight, then stop."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._uploader is not None:
            self._uploader.close(timeout)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._client is not None:
            self._client.close()
        atexit.unregister(self._atexit)

    # -- restoring ------------------------------------------------------------

    def restore(self) -> tuple[int, Any] | None:
        """(step, state) to resume from, tensors on CPU, every chunk checked
        against its hash; None for a fresh start. Under trainwatch: the
        snapshot TRAINWATCH_RESUME_FROM names (unset: None, the daemon chose
        a fresh start). Standalone: the newest complete local snapshot, else
        (``remote`` set) the newest remote one, pulled first."""
        if self.under_trainwatch:
            folder = os.environ.get("TRAINWATCH_RESUME_FROM") or None
        else:
            folder = self._newest_local()
            if folder is None and self.remote is not None:
                from trainwatch.snapshot import remote

                folder = remote.pull(self.remote, self.dir).folder
        if folder is None:
            return None
        step, state = reader.load(folder)
        self.restored_from = os.path.abspath(folder)
        self._last_step = step
        self._advance(step)
        if self.under_trainwatch and self.remote is not None and self.rank == 0:
            # Newer snapshots on the remote belong to the run trainwatch did not
            # resume (rolled back, or not good): a fresh host must not pull them.
            self._upload().retire_after(step)
        return step, state

    def _newest_local(self) -> str | None:
        for _, folder in reversed(format.published(self.dir)):
            if format.judge(folder)[0]:
                return folder
        return None

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
