"""The checkpoint catalog: which checkpoints exist, which are complete and
valid, and which is the last good one (before a given step).

What is on disk and what its layout says of each checkpoint is ondisk.py's
(kept incrementally: the cost does not grow with the number of checkpoints).
Generic layout: entries (files or directories) under ``checkpoints.dir`` whose
names match ``pattern`` with one ``{step}``; complete when the job reported it
with ``client.checkpoint()``, or its completion marker exists, or (if
``quiet_for`` is set) nothing in it changed for that long. A framework's layout
(trainwatch.layouts) is complete only when the framework itself would load it,
reported or not. A checkpoint from which the job dies before its first
heartbeat ``bad_after`` times in a row is marked bad and passed over. The
catalog never deletes or writes a checkpoint; its own state is one JSON file
written atomically, bounded (``MAX_REPORTS``) and at most once a second.

A write that only adds reports (a new checkpoint, its health) is not fsynced:
still old-or-new for a reader, but a power loss may lose the last reports. That
costs little: the checkpoints are on disk and are learned again from the
folder (a marker, a framework's layout, ``quiet_for``); one whose completeness
only its report said counts as incomplete, so a relaunch resumes from the good
one before it. What must survive (bad, quarantined, failed starts, which
attempts resumed from which step) is written durably, file and folder fsynced.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainwatch.config import Checkpoints
from trainwatch.privsep.hand import Hand
from trainwatch.state import atomic, heap, statewrites
from trainwatch.state.checkpointlayout import make_layout, recognise
from trainwatch.state.entry import Entry, Summary
from trainwatch.state.handdisk import HandDisk
from trainwatch.state.ondisk import Layout, OnDisk
from trainwatch.state.verifier import Verifier

log = logging.getLogger("trainwatch")


# A job's reports are bounded: the newest this many steps are kept, a path is at
# most PATH_MAX, and the state file is rewritten at most once per SAVE_EVERY
# seconds however fast reports come (a job flooding reports must not turn into
# one fsynced write per datagram in the loop that supervises every job).
MAX_REPORTS = 256
MAX_PATH = 4096
SAVE_EVERY = 1.0


QUARANTINED = "quarantined: "
# Why a report is refused (a metric's label values: bounded).
REFUSALS = ("outside_dir", "not_named", "quarantined", "path_too_long", "missing",
            "too_many")
# A report is looked for (as the job's user: a call to its hand, ~1 ms) at most this
# often, LOOKS_BURST at once: a job reports a checkpoint every few minutes, and a
# flood of reports must not hold the loop. One past it is refused, and the folder's
# listing finds the checkpoint all the same.
LOOKS_PER_S = 100.0
LOOKS_BURST = 200.0


def _kind(e: Entry) -> str:
    return "bad" if e.bad else "good" if e.good else "incomplete"


class Catalog:
    def __init__(
        self,
        spec: Checkpoints,
        state_file: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        owner: str = "",
        layout: Layout | None = None,
        verifier: Verifier | None = None,
        hand: Hand | None = None,
    ) -> None:
        """``owner`` names what the saved state belongs to (the checkpoint dir, or
        the command when there is none): state saved for another owner (a job of
        the same name in another project) is set aside, not trusted. ``hand``:
        the job's hand (privsep), where its folder is listed and judged; without
        one, in this process."""
        # Absolute, so that the path handed to the job means the same from its workdir.
        self.spec = replace(spec, dir=os.path.abspath(spec.dir) if spec.dir else None)
        self.state_file = Path(state_file)
        self.clock = clock
        self.owner = owner or f"{self.spec.dir}|{spec.pattern}"
        state = atomic.read_json(self.state_file) or {}
        if state and state.get("owner") != self.owner:
            log.warning("%s: saved for %r, not %r: starting it afresh", self.state_file,
                        state.get("owner"), self.owner)
            state = {}
        self.reported: dict[int, str] = {int(k): v for k, v in state.get("reported", {}).items()}
        self.bad: dict[int, str] = {int(k): v for k, v in state.get("bad", {}).items()}
        # Set by a rollback until the next attempt starts: every checkpoint after
        # this step is quarantined, also one the stopped attempt writes meanwhile.
        fence = state.get("fence")
        self.fence: tuple[int, str] | None = (
            (int(fence[0]), str(fence[1])) if isinstance(fence, list) and len(fence) == 2
            and isinstance(fence[0], int) else None)
        self._dirty = False
        self._durable = False  # a pending change that must survive a power loss
        self._saved_at = -SAVE_EVERY
        self.failed_starts: dict[int, int] = {
            int(k): int(v) for k, v in state.get("failed_starts", {}).items()
        }
        # The training's health when each checkpoint was reported (loss, grad norm
        # and their recent statistics): "good" also means taken while it was healthy.
        raw_health = state.get("health", {})
        self.health: dict[int, dict[str, Any]] = {
            int(k): v for k, v in raw_health.items() if isinstance(v, dict)
        } if isinstance(raw_health, dict) else {}
        raw_used = state.get("used", {})
        self.used: dict[int, list[int]] = {  # step -> the attempts that resumed from it
            int(k): [int(x) for x in v][-16:] for k, v in raw_used.items()
            if isinstance(v, list)} if isinstance(raw_used, dict) else {}
        raw_versions = state.get("versions", {})
        self.versions: dict[int, tuple[int, int, int]] = {
            int(k): (int(v[0]), int(v[1]), int(v[2])) for k, v in raw_versions.items()
            if isinstance(v, list) and len(v) == 3
        } if isinstance(raw_versions, dict) else {}
        self.layout = layout or make_layout(self.spec, self.reported, self.versions, clock)
        layout_ = self.layout
        self.disk: OnDisk | HandDisk = (
            OnDisk(self.layout, self.spec.dir) if hand is None else
            HandDisk(self.layout, self.spec.dir, hand, f"checkpoints of {self.owner}",
                     on_recognised=lambda name: recognise(layout_, name)))
        self._entries: dict[int, Entry] = {}  # by step, as last judged
        self._stale: set[int] = set()  # steps whose entry must be rebuilt
        self._counts = {"good": 0, "incomplete": 0, "bad": 0}  # of _entries, kept as it changes
        self._all_stale = True
        self.pruned_at: int | None = -1  # the last good step at the last retention pass
        # Manifests of good checkpoints, made in the background (state/verifier.py),
        # and the check a relaunch waits for (actions/verify.py).
        self.verifier = verifier
        self.checking: object = None  # an actions.verify.Check
        self.settling_since: float | None = None  # a relaunch waits for a verdict (settle.py)
        self.refusal: str | None = None  # why the last report was refused (REFUSALS)
        self._looks, self._looked_at = LOOKS_BURST, self.clock()  # a token bucket

    def _save(self, durable: bool = True) -> None:
        if durable:
            self._durable = False
        try:
            self._write(durable)
        except (OSError, ValueError, TypeError) as e:
            # Counted and survived: the catalog also finds checkpoints on disk.
            statewrites.failed("catalog", self.state_file, e)

    def _write(self, durable: bool = True) -> None:
        atomic.write_json(self.state_file, self._state(), durable=durable)

    def _state(self) -> dict[str, Any]:
        return {"owner": self.owner, "reported": self.reported, "bad": self.bad,
                "failed_starts": self.failed_starts, "health": self.health,
                "versions": {k: list(v) for k, v in self.versions.items()},
                "used": self.used, "fence": list(self.fence) if self.fence else None}

    def keep(self, path: Path) -> None:
        """The catalog as it stands, written to ``path`` (an incident's folder: the
        checkpoints as of the incident), with each one on disk as judged (a job
        without reports has only those). Raises OSError, as write_json."""
        judged = {str(e.step): {"path": e.path, "good": e.good, "why": e.why}
                  for e in self.known()[-MAX_REPORTS:]}
        atomic.write_json(path, {**self._state(), "judged": judged}, durable=False)

    def step_of(self, path: str) -> int | None:
        return self.layout.step_of(path)

    def _update(self, force: bool) -> None:
        """Bring the entries up to date with the disk (listing it when ``force``)."""
        changed = self.disk.refresh(force)
        if self._all_stale:
            changed |= set(self._entries) | set(self.disk.steps)
            self._all_stale = False
        changed |= self._stale
        self._stale = set()
        first = not self._entries
        for step in changed:
            v = self.disk.verdicts.get(step)
            old = self._entries.pop(step, None)
            if old is not None:
                self._counts[_kind(old)] -= 1
            if v is None:
                continue
            e = self._entries[step] = self._entry(step, *v)
            self._counts[_kind(e)] += 1
            if e.good and not first and (old is None or not old.good) and self.verifier:
                self.verifier.submit(step, e.path)  # newly complete: its manifest now
        if getattr(self.disk, "shrunk", False):  # a large listing forgotten (handdisk.py)
            self.disk.shrunk = False  # type: ignore[union-attr]
            self._entries = dict(self._entries)
            heap.give_back()
        if first and self.verifier is not None:
            good = self._newest_good()
            if good is not None:  # at start: the one a relaunch would use, not all history
                self.verifier.submit(good.step, good.path)

    def _entry(self, step: int, path: str, complete: bool, why: str) -> Entry:
        if self.fence is not None and step > self.fence[0] and step not in self.bad:
            self.bad[step] = f"{QUARANTINED}{self.fence[1]}"
            self._dirty = self._durable = True
        if step in self.bad:
            return Entry(step, path, complete, True, f"bad: {self.bad[step]}")
        return Entry(step, path, complete, False, why)

    def entries(self) -> list[Entry]:
        """Every checkpoint on disk, oldest first, with its verdict (the folder is
        listed now: for a relaunch, a rollback and the operator's commands)."""
        self._update(force=True)
        return [self._entries[s] for s in self.disk.steps if s in self._entries]

    def known(self) -> list[Entry]:
        """The entries as last judged, brought up to date without listing the folder."""
        self._update(force=False)
        return [self._entries[s] for s in self.disk.steps if s in self._entries]

    def forget(self, step: int) -> None:
        """Retention deleted it."""
        self.disk.drop(step)
        old = self._entries.pop(step, None)
        if old is not None:
            self._counts[_kind(old)] -= 1
        if self.verifier is not None:
            self.verifier.forget(step)

    def used_by(self, step: int, attempt: int) -> None:
        """Attempt ``attempt`` resumed from this checkpoint (``trainwatch checkpoints``)."""
        self.used.setdefault(step, []).append(attempt)
        self.used[step] = self.used[step][-16:]
        while len(self.used) > MAX_REPORTS:
            del self.used[min(self.used)]
        self._dirty = self._durable = True

    def mark_bad(self, step: int, why: str) -> None:
        """Verification found it changed since its manifest: never resumed from."""
        self.bad[step] = why
        self._stale.add(step)
        self._save()

    def close(self) -> None:
        self.flush(force=True)
        if self.verifier is not None:
            self.verifier.close(timeout=5.0)

    def last_good(self, before_step: int | None = None, fresh: bool = True) -> Entry | None:
        """The newest good checkpoint, strictly before ``before_step`` if given
        (``fresh``: list the folder first, as a relaunch must)."""
        self._update(force=fresh)
        return self._newest_good(before_step)

    @property
    def unjudged(self) -> str | None:
        """Why the folder is not judged as it stands (the job's hand did not
        answer: what it holds now has no verdict yet), or None."""
        why = getattr(self.disk, "why_unanswered", None)
        return why if isinstance(why, str) else None

    def _newest_good(self, before_step: int | None = None) -> Entry | None:
        for step in reversed(self.disk.steps):
            e = self._entries.get(step)
            if e is not None and e.good and (before_step is None or e.step < before_step):
                return e
        return None

    def summary(self) -> Summary:
        """For the exporter, at every refresh: incremental, the folder listed only
        when it changed (ondisk.py)."""
        self._update(force=False)
        counts = dict(self._counts)
        good = self._newest_good()
        if good is None:
            return Summary(counts=counts)
        return Summary(good, self.disk.mtime(good.step), counts)

    # --- what the supervisor tells us ---------------------------------------

    def report(self, step: int, path: str, replaces_quarantined: bool = False,
               health: dict[str, Any] | None = None) -> bool:
        """The job said this checkpoint is complete (``health``: the training's
        statistics at its step, recorded with it). False when the report is
        refused: a path outside ``checkpoints.dir`` (or too long), one the layout
        does not name with this step (a report cannot make a file a checkpoint
        twice over), a step in quarantine unless ``replaces_quarantined``
        (written anew after a rollback), a path with nothing there (looked for as
        the job's user; a hand that does not answer says nothing, and the next
        refresh judges it), or one past LOOKS_PER_S; ``refusal`` then says which
        (REFUSALS)."""
        self.refusal = None
        if len(path) > MAX_PATH:
            self.refusal = "path_too_long"
        elif self.spec.dir is not None and os.path.dirname(path) != self.spec.dir:
            self.refusal = "outside_dir"
        elif not self.layout.accepts(step, path):
            self.refusal = "not_named"
        elif self.bad.get(step, "").startswith(QUARANTINED) and not replaces_quarantined:
            self.refusal = "quarantined"
        elif not self._look():
            self.refusal = "too_many"
        elif self.disk.exists(path) is False:
            self.refusal = "missing"
        if self.refusal is not None:
            return False
        if self.bad.get(step, "").startswith(QUARANTINED):
            del self.bad[step]
            self._dirty = self._durable = True
            self._stale.add(step)
            if self.verifier is not None:
                self.verifier.forget(step)  # written anew: its old manifest is not its
        if health is not None:
            self.health[step] = health
            while len(self.health) > MAX_REPORTS:
                del self.health[min(self.health)]
            self._dirty = True
        versions = (len(self.versions), max(self.versions, default=None))
        self.layout.reported(step, path)  # a fixed path's new version, if it is one
        if (len(self.versions), max(self.versions, default=None)) != versions:
            self._dirty = True
        if self.reported.get(step) != path:
            self.reported[step] = path
            while len(self.reported) > MAX_REPORTS:
                del self.reported[min(self.reported)]
            self._dirty = True
            self.flush()  # at once: a new checkpoint (health alone waits for the next)
        self.disk.add(step, path)  # known now, without listing the folder
        self._stale.add(step)
        return True

    def _look(self) -> bool:
        now = self.clock()
        self._looks = min(LOOKS_BURST, self._looks + max(0.0, now - self._looked_at)
                          * LOOKS_PER_S)
        self._looked_at = now
        if self._looks < 1.0:
            return False
        self._looks -= 1.0
        return True

    def flush(self, force: bool = False) -> None:
        """Write pending reports, at most once per SAVE_EVERY unless forced; fsynced
        only when forced (at close) or a pending change must be durable."""
        now = time.monotonic()
        if self._dirty and (force or now - self._saved_at >= SAVE_EVERY):
            self._dirty, self._saved_at = False, now
            self._save(durable=force or self._durable)

    def quarantine_after(self, step: int, why: str) -> None:
        """Checkpoints newer than ``step`` are never resumed from again (a rollback
        past them); kept on disk, never deleted."""
        self.fence = (step, why)
        self._all_stale = True
        self.entries()  # marks those on disk now
        self._save()

    def seal_quarantine(self) -> list[int] | None:
        """The next attempt has started (the one quarantined is gone): what it
        writes from now on is its own, judged afresh. Returns every step the
        fence quarantined, those the stopped attempt saved late included (None:
        no fence)."""
        if self.fence is None:
            return None
        self.entries()
        step, why = self.fence
        fenced = sorted(s for s, bad in self.bad.items()
                        if s > step and bad == f"{QUARANTINED}{why}")
        self.fence = None
        self._all_stale = True
        self._save()
        return fenced

    def start_failed(self, step: int) -> bool:
        """The job died before its first beat after resuming from ``step``.
        Returns True when that makes the checkpoint bad."""
        n = self.failed_starts.get(step, 0) + 1
        self.failed_starts[step] = n
        newly_bad = n >= self.spec.bad_after and step not in self.bad
        if newly_bad:
            self.bad[step] = f"the job died before its first heartbeat {n} times in a row"
            self._stale.add(step)
        self._save()
        return newly_bad

    def start_succeeded(self, step: int) -> None:
        if self.failed_starts.pop(step, None) is not None:
            self._save()
