"""Verification before a relaunch resumes (``checkpoints.verify``): the last
good checkpoint is checked against the manifest made when it was first judged
complete (state/manifest.py, in the catalog's background worker); a mismatch
(bit rot, a truncated copy, a file rewritten in place) marks it bad and the
previous good one is checked in its turn. The check starts as the job enters
its backoff and runs in a thread of its own, so the supervisor's loop (and
every other job) never waits on it: a relaunch waits only for the checkpoint
it is about to use, at most ``verify_timeout``; past that it resumes from it
unverified, and says so."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainwatch.state.entry import Entry
from trainwatch.state.verifier import Verdict, Verifier

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts

log = logging.getLogger("trainwatch")


@dataclass
class Check:
    step: int
    path: str
    result: Verdict | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, verifier: Verifier, timeout: float) -> None:
        def run() -> None:
            self.result = verifier.verify(self.step, self.path, timeout)

        self.thread = threading.Thread(target=run, name="trainwatch-verify-wait", daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


def prefetch(r: JobParts) -> None:
    """Entering the backoff: check the checkpoint the relaunch will resume from."""
    cat = r.catalog
    if cat.verifier is None:
        return
    # As last judged, without listing the folder: the relaunch lists it anyway,
    # and starts another check should a newer one have come meanwhile.
    cp = cat.last_good(fresh=False)
    if cp is not None:
        _check(r, cp)


def _check(r: JobParts, cp: Entry) -> Check:
    cat = r.catalog
    c = cat.checking if isinstance(cat.checking, Check) else None
    if c is None or (c.step, c.path) != (cp.step, cp.path):
        assert cat.verifier is not None
        c = Check(cp.step, cp.path)
        c.start(cat.verifier, r.job.checkpoints.verify_timeout)
        cat.checking = c
    return c


def checkpoint_now(r: JobParts, within: float) -> Entry | None:
    """The checkpoint to resume from, decided now (a group's restart: its ranks wait
    for the decision): verified if its check ends ``within`` seconds (a small one's
    does), else the newest good as judged, its check going on (a death loading it
    then counts against it, and the next decision has the verdict). ``within`` is
    the loop's whole wait, however many checkpoints fail their check in it."""
    deadline = time.monotonic() + within
    while True:  # each turn marks one bad and checks the one before
        ready, cp = checkpoint_to_use(r, wait=False)
        if ready:
            return cp
        c = r.catalog.checking
        left = deadline - time.monotonic()
        if not isinstance(c, Check) or c.thread is None or c.done or left <= 0:
            break
        c.thread.join(left)
        if not c.done:
            break
    return r.catalog.last_good()


def checkpoint_to_use(r: JobParts, wait: bool) -> tuple[bool, Entry | None]:
    """(ready, the checkpoint to resume from). Not ready: its check is still
    running (only when not ``wait``); try again shortly."""
    cat = r.catalog
    while True:
        cp = cat.last_good()
        if not wait and cat.unjudged is not None:
            # A relaunch from what was judged before would go back further than it
            # must, or start from scratch: it waits for the hand (handdisk.py says so).
            return False, None
        if cp is None or cat.verifier is None:
            return True, cp
        c = _check(r, cp)
        if wait and c.thread is not None:
            c.thread.join()
        if not c.done:
            return False, None
        cat.checking = None
        ok, why = c.result if c.result is not None else (None, "no verdict")
        if ok is False:
            log.error("job %s: checkpoint step %d failed verification (%s): marked bad, "
                      "trying the one before", r.job.name, cp.step, why)
            cat.mark_bad(cp.step, f"verification failed: {why}")
            continue
        if ok is None:
            log.warning("job %s: checkpoint step %d not verified (%s): resuming from it",
                        r.job.name, cp.step, why)
        return True, cp
