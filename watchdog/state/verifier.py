"""The background worker that makes and checks checkpoint manifests (manifest.py),
so that hashing never runs in the supervisor's thread and a relaunch waits only
for the checkpoint it is about to resume from.

Semantics:
- ``submit(step, path)``: a checkpoint was judged complete; its manifest is made
  in the background unless one exists for that path. Idempotent, O(1), no I/O.
  Pending submissions are bounded: past ``max_pending`` the oldest is dropped
  (counted); a later ``verify`` of it still makes its manifest.
- ``verify(step, path, timeout)``: before a relaunch resumes from it. With a
  manifest for that path, every file is checked: (True, "verified") or
  (False, why) for bit rot, a truncated copy, a file rewritten in place or
  removed. Without one (a checkpoint never submitted, or whose submission was
  dropped, or a manifest made for another path at that step), this is the first
  judgement: the manifest is made now and trusted, (True, "manifest made now").
  An unreadable or still-changing checkpoint is (False, why): not safe to
  resume from. (None, why) means no verdict: not done within ``timeout``, the
  verifier closed, or the manifest's hash is not installed here.
- A verify goes before every pending submission and pre-empts one being hashed
  (which is requeued first in line); a verify that finds the manifest of its
  checkpoint being hashed waits for it instead (once hashed, before it is
  stored, a verify queues a check against it: the files may have changed
  since). When its caller stops waiting, a check nobody waits for is
  abandoned; a manifest being made is finished.
- The worker survives anything (an OSError when a checkpoint is deleted while
  hashed is counted in ``errors``), holds one read buffer, and is one thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainwatch.config import Checkpoints
from trainwatch.privsep.hand import Hand, HandError
from trainwatch.state import handhash, statewrites
from trainwatch.state.manifest import CHUNK, Stopped, Store, check, make

log = logging.getLogger("trainwatch")

Verdict = tuple[bool | None, str]
MAX_PENDING = 256
# Hard-linked files whose digest a verifier remembers (about 200 bytes each).
KNOWN_MAX = 16384


@dataclass(eq=False)
class _Job:
    step: int
    path: str
    urgent: bool  # a verify() call asked for it
    waiters: int = 0
    making: bool = False  # its manifest is being made (a verify may wait for that)
    cancelled: bool = False
    result: Verdict = (None, "not verified in time")
    done: threading.Event = field(default_factory=threading.Event)


class Verifier:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic, *,
                 max_pending: int = MAX_PENDING, chunk: int = CHUNK,
                 hand: Hand | None = None) -> None:
        """``hand``: the job's (privsep), where its files are read; without one,
        in this process."""
        self.store = store
        self.hand = hand
        self.clock = clock
        self.max_pending = max_pending
        self.chunk = chunk
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, _Job] = OrderedDict()  # submissions, oldest first
        self._urgent: OrderedDict[tuple[int, str], _Job] = OrderedDict()  # verify() calls
        self._current: _Job | None = None
        self._closed = False
        self._counts = dict.fromkeys(
            ("made", "checked", "mismatches", "errors", "dropped", "preempted"), 0)
        self.last_seconds = 0.0  # how long the last manifest or check took
        # Digests of hard-linked files (manifest.Known), the newest KNOWN_MAX kept:
        # snapshot chunks shared by many snapshots are hashed once. Only this
        # verifier's thread touches it.
        self.known: OrderedDict[tuple[int, int, int, int, str], str] = OrderedDict()
        self._thread = threading.Thread(target=self._run, name="trainwatch-verify", daemon=True)
        self._thread.start()

    # --- callers' side (never blocks on I/O, except verify on its own job) ---------

    def submit(self, step: int, path: str) -> None:
        with self._cond:
            if self._closed:
                return
            cur = self._current
            if cur is not None and (cur.step, cur.path) == (step, path):
                return
            if (step, path) in self._urgent:
                return
            old = self._pending.get(step)
            if old is not None and old.path == path:
                return
            self._pending[step] = _Job(step, path, urgent=False)
            self._pending.move_to_end(step)
            self._bound()
            self._cond.notify_all()

    def _bound(self) -> None:
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
            self._counts["dropped"] += 1

    def verify(self, step: int, path: str, timeout: float) -> Verdict:
        with self._cond:
            if self._closed:
                return None, "verifier closed"
            cur = self._current
            job = self._urgent.get((step, path))
            if job is None and cur is not None and cur.making and (cur.step, cur.path) == (
                    step, path):
                job = cur  # its manifest is being made: that is the verdict we wait for
                job.urgent = True
            if job is None:
                job = _Job(step, path, urgent=True)
                self._urgent[(step, path)] = job
                old = self._pending.get(step)
                if old is not None and old.path == path:
                    del self._pending[step]  # this job makes it if it is missing
            job.waiters += 1
            self._cond.notify_all()
        done = job.done.wait(max(0.0, timeout))
        with self._cond:
            job.waiters -= 1
            if not done and job.waiters == 0 and self._urgent.get((step, path)) is job:
                # Not started and nobody waits: a plain submission again.
                del self._urgent[(step, path)]
                job.urgent = False
                self._pending.setdefault(step, job)
                self._bound()
        return job.result if done else (None, "not verified in time")

    def forget(self, step: int) -> None:
        """The checkpoint of ``step`` is gone or replaced (retention deleted it, a
        rollback's replacement is written at its path): its manifest is dropped
        and no pending or running work will write one for the old content."""
        with self._cond:
            self._pending.pop(step, None)
            if self._current is not None and self._current.step == step:
                self._current.cancelled = True
        self.store.drop(step)

    def counts(self) -> dict[str, int]:
        """made, checked, mismatches, errors, dropped (submissions over the bound),
        preempted (submissions set aside for a verify), pending and busy (now)."""
        with self._cond:
            return {**self._counts, "pending": len(self._pending) + len(self._urgent),
                    "busy": int(self._current is not None)}

    def close(self, timeout: float = 30.0) -> None:
        """Stop: pending work is dropped, waiting verifies answer (None, "verifier
        closed"), the file being hashed is given up at its next chunk; joins."""
        with self._cond:
            self._closed = True
            waiting = [*self._urgent.values(), *self._pending.values()]
            self._urgent.clear()
            self._pending.clear()
            self._cond.notify_all()
        for job in waiting:
            job.result = (None, "verifier closed")
            job.done.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("manifest worker still busy %gs after close (a read blocked?)", timeout)

    # --- the worker ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._urgent or self._pending):
                    self._cond.wait()
                if self._closed:
                    return
                if self._urgent:
                    job = self._urgent.popitem(last=False)[1]
                else:
                    job = self._pending.popitem(last=False)[1]
                self._current = job
            result: Verdict | None = None
            try:
                result = self._one(job)
            except Stopped:
                result = self._stopped(job)
            except HandError as e:  # no answer (a read that blocked): no verdict
                self._count("errors")
                log.warning("checkpoint %s (step %d): no manifest: %s", job.path, job.step, e)
                result = (None, f"no verdict: {e}")
            except OSError as e:  # deleted, unreadable, still being written
                self._count("errors")
                log.warning("checkpoint %s (step %d): cannot make its manifest: %s",
                            job.path, job.step, e)
                result = (False, f"cannot read: {e.strerror or e}")
            except Exception as e:  # a bug must not end verification for the job's life
                self._count("errors")
                log.exception("manifest of %s (step %d) failed", job.path, job.step)
                result = (None, f"verification failed: {e}")
            finally:
                with self._cond:
                    self._current = None
                    if result is not None:
                        job.result = result
                        job.done.set()

    def _count(self, what: str) -> None:
        with self._cond:
            self._counts[what] += 1

    def _stopped(self, job: _Job) -> Verdict | None:
        with self._cond:
            if self._closed:
                return None, "verifier closed"
            if job.cancelled:
                return None, "forgotten"
            if not job.urgent:  # pre-empted by a verify: first in line again
                self._counts["preempted"] += 1
                self._pending.setdefault(job.step, job)
                self._pending.move_to_end(job.step, last=False)
                return None
            return None, "not verified in time"  # a check nobody waits for any more

    def _should_stop(self, job: _Job) -> bool:
        # Read without the lock, once per chunk: a stale answer costs one chunk.
        if self._closed or job.cancelled:
            return True
        if job.making:
            return not job.urgent and bool(self._urgent)
        return job.waiters == 0  # a check: only worth finishing for someone

    def _one(self, job: _Job) -> Verdict:
        t0 = self.clock()
        m = self.store.get(job.step)
        if m is not None and m.path == job.path:
            if not job.urgent:
                return True, "manifest exists"
            try:
                why = (check(m, chunk=self.chunk, should_stop=lambda: self._should_stop(job))
                       if self.hand is None else
                       handhash.check(self.hand, m, self.chunk, lambda: self._should_stop(job)))
            except ValueError as e:  # its hash algorithm is not installed here
                return None, str(e)
            self.last_seconds = self.clock() - t0
            self._count("checked")
            if why is not None:
                self._count("mismatches")
                log.warning("checkpoint %s (step %d) fails its manifest: %s", job.path,
                            job.step, why)
                return False, why
            return True, "verified"
        with self._cond:
            job.making = True
        if self.hand is None:
            m = make(job.step, job.path, chunk=self.chunk,
                     should_stop=lambda: self._should_stop(job), known=self.known)
        else:
            m = handhash.make(self.hand, job.step, job.path, self.chunk,
                              lambda: self._should_stop(job))
        while len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)
        self.last_seconds = self.clock() - t0
        with self._cond:
            # Hashed: a verify from now on (it may see the manifest stored) checks the
            # files against it, not take this verdict from bytes read before it asked.
            job.making = False
        try:
            self.store.put(m)
        except OSError as e:
            statewrites.failed("manifest", self.store.folder / f"{job.step}.json", e)
        if job.cancelled:  # forgotten while we hashed (after put: whichever ran last)
            self.store.drop(job.step)
            return None, "forgotten"
        self._count("made")
        return True, "manifest made now"


def for_job(spec: Checkpoints, job_dir: Path, hand: Hand | None = None) -> Verifier | None:
    """The verifier of a job's checkpoints (``checkpoints.verify``), its manifests
    in ``<job_dir>/manifests``, its files read in ``hand``; None when off or
    without a checkpoint folder."""
    if not spec.verify or spec.dir is None:
        return None
    return Verifier(Store(job_dir / "manifests"), hand=hand)
