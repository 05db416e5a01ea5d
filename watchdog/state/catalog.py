"""The checkpoint catalog: which checkpoints exist, which are complete and
valid, and which is the last good one (before a given step).

Generic layout: entries (files or directories) under ``checkpoints.dir`` whose
names match ``pattern`` with one ``{step}``. An entry is complete when the job
reported it with ``client.checkpoint()``, or its completion marker exists, or
(if ``quiet_for`` is set) nothing in it changed for that long. A checkpoint
from which the job dies before its first heartbeat ``bad_after`` times in a
row is marked bad and passed over. The catalog never deletes or writes a
checkpoint; its own state is one JSON file written atomically.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainwatch.config import Checkpoints
from trainwatch.state import atomic, statewrites

log = logging.getLogger("trainwatch")


@dataclass(frozen=True)
class Entry:
    step: int
    path: str
    complete: bool
    bad: bool
    why: str  # how completeness was established, or why it is not usable

    @property
    def good(self) -> bool:
        return self.complete and not self.bad


@dataclass(frozen=True)
class Summary:
    """What the exporter shows of the catalog."""

    last_good: Entry | None = None
    last_good_mtime: float | None = None  # Unix seconds
    counts: dict[str, int] = field(default_factory=dict)  # good / incomplete / bad


def _newest_mtime(path: Path) -> float:
    try:
        newest = path.stat().st_mtime
    except OSError:
        return time.time()
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for name in files:
                try:
                    newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
                except OSError:
                    continue  # removed while we looked: treat as changing
    return newest


def _nonempty(path: Path) -> bool:
    try:
        if path.is_dir():
            return any(path.iterdir())
        return path.stat().st_size > 0
    except OSError:
        return False


# A job's reports are bounded: the newest this many steps are kept, a path is at
# most PATH_MAX, and the state file is rewritten at most once per SAVE_EVERY
# seconds however fast reports come (a job flooding reports must not turn into
# one fsynced write per datagram in the loop that supervises every job).
MAX_REPORTS = 256
MAX_PATH = 4096
SAVE_EVERY = 1.0


QUARANTINED = "quarantined: "


class Catalog:
    def __init__(
        self,
        spec: Checkpoints,
        state_file: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        owner: str = "",
    ) -> None:
        """``owner`` names what the saved state belongs to (the checkpoint dir, or
        the command when there is none): state saved for another owner (a job of
        the same name in another project) is set aside, not trusted."""
        # Absolute, so that the path handed to the job means the same from its workdir.
        self.spec = replace(spec, dir=os.path.abspath(spec.dir) if spec.dir else None)
        self.state_file = Path(state_file)
        self.clock = clock
        head, _, tail = spec.pattern.partition("{step}")
        self._regex = re.compile(rf"^{re.escape(head)}(\d+){re.escape(tail)}$")
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

    def _save(self) -> None:
        try:
            self._write()
        except (OSError, ValueError, TypeError) as e:
            # Counted and survived: the catalog also finds checkpoints on disk.
            statewrites.failed("catalog", self.state_file, e)

    def _write(self) -> None:
        atomic.write_json(
            self.state_file,
            {"owner": self.owner, "reported": self.reported, "bad": self.bad,
             "failed_starts": self.failed_starts, "health": self.health,
             "fence": list(self.fence) if self.fence else None},
        )

    def step_of(self, path: str) -> int | None:
        m = self._regex.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None

    def entries(self) -> list[Entry]:
        """Every checkpoint on disk, oldest first, with its verdict."""
        found: dict[int, Path] = {}
        if self.spec.dir is not None:
            try:
                names = os.listdir(self.spec.dir)
            except OSError:
                names = []
            for name in names:
                m = self._regex.match(name)
                if m:
                    found[int(m.group(1))] = Path(self.spec.dir, name)
        for step, reported in self.reported.items():
            inside = self.spec.dir is None or os.path.dirname(reported) == self.spec.dir
            if step not in found and inside and os.path.exists(reported):
                found[step] = Path(reported)
        now = self.clock()
        out = []
        for step in sorted(found):
            path = found[step]
            complete, why = self._complete(step, path, now)
            verdict: str = why
            if self.fence is not None and step > self.fence[0] and step not in self.bad:
                self.bad[step] = f"{QUARANTINED}{self.fence[1]}"
                self._dirty = True
            bad = step in self.bad
            if bad:
                verdict = f"bad: {self.bad[step]}"
            elif complete and not _nonempty(path):
                complete, verdict = False, "empty"
            out.append(Entry(step, str(path), complete, bad, verdict))
        return out

    def _complete(self, step: int, path: Path, now: float) -> tuple[bool, str]:
        if self.reported.get(step) == str(path):
            return True, "reported by the job"
        marker = self.spec.marker
        if marker is not None:
            where = path / marker if path.is_dir() else Path(f"{path}{marker}")
            if where.exists():
                return True, f"marker {where.name}"
        quiet = self.spec.quiet_for
        if quiet is not None and now - _newest_mtime(path) >= quiet:
            return True, f"unchanged for {quiet:g}s"
        return False, "incomplete"

    def last_good(self, before_step: int | None = None) -> Entry | None:
        """The newest good checkpoint, strictly before ``before_step`` if given."""
        for e in reversed(self.entries()):
            if e.good and (before_step is None or e.step < before_step):
                return e
        return None

    def summary(self) -> Summary:
        entries = self.entries()
        counts = {"good": 0, "incomplete": 0, "bad": 0}
        for e in entries:
            counts["bad" if e.bad else "good" if e.good else "incomplete"] += 1
        good = [e for e in entries if e.good]
        if not good:
            return Summary(counts=counts)
        try:
            mtime: float | None = os.stat(good[-1].path).st_mtime
        except OSError:
            mtime = None
        return Summary(good[-1], mtime, counts)

    # --- what the supervisor tells us ---------------------------------------

    def report(self, step: int, path: str, replaces_quarantined: bool = False,
               health: dict[str, Any] | None = None) -> bool:
        """The job said this checkpoint is complete (``health``: the training's
        statistics at its step, recorded with it). False when the report is
        refused: a path outside ``checkpoints.dir`` (or too long), or a step in
        quarantine unless ``replaces_quarantined`` (written anew after a rollback)."""
        if len(path) > MAX_PATH or (self.spec.dir is not None
                                    and os.path.dirname(path) != self.spec.dir):
            return False
        if self.bad.get(step, "").startswith(QUARANTINED):
            if not replaces_quarantined:
                return False
            del self.bad[step]
            self._dirty = True
        if health is not None:
            self.health[step] = health
            while len(self.health) > MAX_REPORTS:
                del self.health[min(self.health)]
            self._dirty = True
        if self.reported.get(step) != path:
            self.reported[step] = path
            while len(self.reported) > MAX_REPORTS:
                del self.reported[min(self.reported)]
            self._dirty = True
            self.flush()  # at once: a new checkpoint (health alone waits for the next)
        return True

    def flush(self, force: bool = False) -> None:
        """Write pending reports, at most once per SAVE_EVERY unless forced."""
        now = time.monotonic()
        if self._dirty and (force or now - self._saved_at >= SAVE_EVERY):
            self._dirty, self._saved_at = False, now
            self._save()

    def quarantine_after(self, step: int, why: str) -> None:
        """Checkpoints newer than ``step`` are never resumed from again (a rollback
        past them); kept on disk, never deleted."""
        self.fence = (step, why)
        self.entries()  # marks those on disk now
        self._save()

    def seal_quarantine(self) -> None:
        """The next attempt has started (the one quarantined is gone): what it
        writes from now on is its own, judged afresh."""
        if self.fence is not None:
            self.entries()
            self.fence = None
            self._save()

    def start_failed(self, step: int) -> bool:
        """The job died before its first beat after resuming from ``step``.
        Returns True when that makes the checkpoint bad."""
        n = self.failed_starts.get(step, 0) + 1
        self.failed_starts[step] = n
        newly_bad = n >= self.spec.bad_after and step not in self.bad
        if newly_bad:
            self.bad[step] = f"the job died before its first heartbeat {n} times in a row"
        self._save()
        return newly_bad

    def start_succeeded(self, step: int) -> None:
        if self.failed_starts.pop(step, None) is not None:
            self._save()
