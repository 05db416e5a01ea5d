"""Which checkpoints are on disk and what their layout says of each, kept up to
date incrementally, so that a report, a scan and a verdict cost the same with
10 or 10,000 checkpoints in the folder (the catalog adds the job's reports,
bad marks and quarantine on top, state/catalog.py).

- The folder is listed again only when it changed (its mtime: an entry added,
  removed or renamed), at most every ``RELIST_MIN`` seconds, and at least
  every ``RELIST_MAX``; a checkpoint the job reports is added at once, without
  a listing, and while reports come the folder waits for ``RELIST_MAX``.
  ``refresh(force=True)`` lists now (a relaunch must not miss one).
- A verdict of complete is final (a rewrite is verification's to catch,
  state/manifest.py); only the entries not yet complete are judged again.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

RELIST_MIN = 10.0  # a changed folder is listed again at most this often
RELIST_MAX = 60.0  # and an unchanged one at least this often (a change its mtime missed)
PENDING_EVERY = 1.0  # entries being written (newer than every complete one) judged again
PENDING_MAX = 64  # ... the newest this many of them; older ones at the next listing
# A listing reads at most this many names (a job's folder is its user's to fill):
# past it the rest are not seen, and names_cut says so.
MAX_NAMES = 200_000
names_cut = 0


class Layout(Protocol):
    """How one framework names its checkpoints and says one is complete."""

    @property
    def name(self) -> str:
        """generic, fixed, or a framework's (a recognised one, for auto)."""

    @property
    def volatile(self) -> bool:
        """Rewritten in place (fixed): listed and judged at every refresh."""

    def candidates(self, root: Path) -> dict[int, str]:
        """Every checkpoint under ``root``, by step (one listing, no judgement)."""

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        """Would the framework load it: (complete, what said so or what is missing).
        ``newer``: the next newer checkpoint on disk, if any (see moved_past)."""

    def step_of(self, path: str) -> int | None:
        """The step of a path as this layout names it (for the job's reports)."""

    def accepts(self, step: int, path: str) -> bool:
        """A report of ``path`` at ``step`` names a checkpoint of this layout."""

    def reported(self, step: int, path: str) -> None:
        """The job reported it (a fixed path's new version)."""


def listed(root: Path, step_of: Callable[[str], int | None]) -> dict[int, str]:
    """Every entry of ``root`` that ``step_of`` names, by step (one listing)."""
    global names_cut
    found: dict[int, str] = {}
    try:
        with os.scandir(root) as it:
            for n, entry in enumerate(it):
                if n >= MAX_NAMES:
                    names_cut += 1
                    break
                step = step_of(entry.path)
                if step is not None:
                    found[step] = entry.path
    except OSError:
        return found
    return found


def names_of(root: Path | str) -> list[str]:
    """The first ``MAX_NAMES`` names of ``root``, in the folder's order (past it
    the rest are not seen, and names_cut says so). Raises OSError."""
    global names_cut
    with os.scandir(root) as it:
        out = [e.name for e in itertools.islice(it, MAX_NAMES + 1)]
    if len(out) > MAX_NAMES:
        names_cut += 1
        del out[MAX_NAMES:]
    return out


def newest_mtime(path: Path) -> float:
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


def oldest_mtime(path: Path) -> float | None:
    """When the writing of ``path`` began, as far as its files say: the oldest
    mtime among them (a folder's own, while it holds no file)."""
    try:
        oldest = path.stat().st_mtime
    except OSError:
        return None
    if path.is_dir():
        times = []
        for root, _dirs, files in os.walk(path):
            for name in files:
                try:
                    times.append(os.stat(os.path.join(root, name)).st_mtime)
                except OSError:
                    continue
        if times:
            oldest = min(times)
    return oldest


_SETTLING = "changed within "


def settling(quiet_for: float, more: str = "complete once unchanged that long") -> str:
    """A verdict's why saying that only time is missing: the checkpoint is complete
    once unchanged for the quiet time. Words, as verdicts cross from the job's
    hand as text; is_settling() reads them back."""
    return f"{_SETTLING}{quiet_for:g}s ({more})"


def is_settling(why: str) -> bool:
    """A relaunch that finds no good checkpoint but such a one waits for its verdict
    rather than start over (actions/settle.py)."""
    return why.startswith(_SETTLING)


def moved_past(path: Path, newer: str | None) -> str | None:
    """Why ``path`` is complete without waiting out the quiet time: the job moved
    past it, beginning the next newer checkpoint after its last change (a job
    writes one checkpoint after another; one still being written when the next
    began is not moved past). None when it has not."""
    if newer is None:
        return None
    begun = oldest_mtime(Path(newer))
    if begun is None or not newest_mtime(path) < begun:
        return None
    return f"moved past (the job began {os.path.basename(newer)} after its last change)"


def nonempty(path: Path) -> bool:
    try:
        if path.is_dir():
            return any(path.iterdir())
        return path.stat().st_size > 0
    except OSError:
        return False


@dataclass
class Generic:
    """Names matching ``pattern`` (one ``{step}``); complete by a marker file or
    ``quiet_for`` seconds unchanged (the job's report is the catalog's to add)."""

    pattern: str = "step_{step}"
    marker: str | None = None
    quiet_for: float | None = None
    clock: Callable[[], float] = time.time
    name: str = "generic"

    def __post_init__(self) -> None:
        head, _, tail = self.pattern.partition("{step}")
        self._regex = re.compile(rf"^{re.escape(head)}(\d+){re.escape(tail)}$")

    def step_of(self, path: str) -> int | None:
        m = self._regex.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None

    def candidates(self, root: Path) -> dict[int, str]:
        return listed(root, self.step_of)

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        p = Path(path)
        if self.marker is not None:
            where = p / self.marker if p.is_dir() else Path(f"{path}{self.marker}")
            if where.exists():
                return (True, f"marker {where.name}") if nonempty(p) else (False, "empty")
        if self.quiet_for is None:
            return False, "incomplete"
        said = f"unchanged for {self.quiet_for:g}s"
        if self.clock() - newest_mtime(p) < self.quiet_for:
            past = moved_past(p, newer)
            if past is None:
                return False, settling(self.quiet_for)
            said = past
        return (True, said) if nonempty(p) else (False, "empty")


class OnDisk:
    def __init__(self, layout: Layout, root: str | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.root = Path(root) if root else None
        self.clock = clock
        self.paths: dict[int, str] = {}  # step -> path, of what is on disk
        self.steps: list[int] = []  # sorted
        self.verdicts: dict[int, tuple[str, bool, str]] = {}  # step -> (path, complete, why)
        self.mtimes: dict[int, float] = {}  # step -> mtime, of the complete ones when judged
        self._key: tuple[int, int] | None = None
        self._unjudged: set[int] = set()  # steps added or relisted without a verdict
        self._dropped: set[int] = set()  # steps gone since the last refresh
        self._newest_complete = -1
        self._pending_at = -PENDING_EVERY
        self._reports = False  # a checkpoint was reported since the last listing
        self._listed_at = -RELIST_MAX
        self.listings = 0  # how many times the folder was listed (for tests and benchmarks)

    def _folder_key(self) -> tuple[int, int] | None:
        if self.root is None:
            return None
        try:
            st = os.stat(self.root)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def _relist(self, now: float, force: bool) -> bool:
        """List the folder when it is due; True when the set of checkpoints changed."""
        key = self._folder_key()
        since = now - self._listed_at
        # A job that reports its checkpoints says what is new: its folder's changes
        # wait for RELIST_MAX; without reports, a change is listed after RELIST_MIN.
        changed = key != self._key and since >= RELIST_MIN and not self._reports
        due = force or since >= RELIST_MAX or changed
        if not due:
            return False
        self._key, self._listed_at, self._reports = key, now, False
        self.listings += 1
        if self.root is not None:
            found = self.layout.candidates(self.root)
        else:  # no folder: what the job reported is all there is, while it exists
            found = {s: p for s, p in self.paths.items() if os.path.exists(p)}
        if found == self.paths:
            return False
        for step in set(self.paths) - set(found):
            self.verdicts.pop(step, None)
            self.mtimes.pop(step, None)
            self._dropped.add(step)
        self._unjudged.update(s for s, p in found.items() if self.paths.get(s) != p)
        self.paths = found
        self.steps = sorted(found)
        self._newest_complete = max((s for s in self.steps if self._final(s)), default=-1)
        return True

    def add(self, step: int, path: str) -> None:
        """A checkpoint the job reported: known at once, without a listing."""
        self._reports = True
        if self.paths.get(step) != path:
            if step not in self.paths:
                bisect.insort(self.steps, step)
            self.paths[step] = path
            self.verdicts.pop(step, None)
            self._unjudged.add(step)

    def drop(self, step: int) -> None:
        """A checkpoint deleted (retention) or found gone."""
        if self.paths.pop(step, None) is not None:
            self.steps.remove(step)
        self.verdicts.pop(step, None)
        self._dropped.add(step)
        if step == self._newest_complete:
            self._newest_complete = max((s for s in self.steps if self._final(s)), default=-1)

    def rejudge(self, step: int) -> None:
        """Judge this one again at the next refresh (verification found it changed)."""
        self.verdicts.pop(step, None)
        if step in self.paths:
            self._unjudged.add(step)

    def refresh(self, force: bool = False) -> set[int]:
        """Bring the verdicts up to date; the steps whose verdict changed. Judged:
        every entry without a verdict; once a second, the newest ``PENDING_MAX``
        not yet complete that are newer than every complete one (being written);
        and, at a listing, every one not yet complete (one a framework refused
        stays refused until the folder changes)."""
        force = force or self.layout.volatile
        now = self.clock()
        relisted = self._relist(now, force) or force
        todo = set(self._unjudged)
        newest = self._newest_complete
        if self.layout.volatile:
            todo.update(self.steps)
        elif relisted:
            todo.update(s for s in self.steps if not self._final(s))
        elif now - self._pending_at >= PENDING_EVERY:
            self._pending_at = now
            for step in itertools.islice(reversed(self.steps), PENDING_MAX):
                if step <= newest:
                    break
                todo.add(step)
        self._unjudged.clear()
        root = self.root or Path("/")
        changed: set[int] = set()
        for step in todo:
            path = self.paths.get(step)
            if path is None:
                continue
            complete, why = self.layout.judge(root, step, path, self._newer(step))
            if complete:
                try:
                    self.mtimes[step] = os.stat(path).st_mtime
                except OSError:
                    self.mtimes.pop(step, None)
            new = (path, complete, why)
            if new != self.verdicts.get(step):
                self.verdicts[step] = new
                changed.add(step)
            if complete and step > self._newest_complete:
                self._newest_complete = step
        return changed | self._dropped_since()

    def _newer(self, step: int) -> str | None:
        """The path of the next newer checkpoint on disk."""
        i = bisect.bisect_right(self.steps, step)
        return self.paths.get(self.steps[i]) if i < len(self.steps) else None

    def exists(self, path: str) -> bool | None:
        """Is there a file or folder at ``path`` (a link not followed)?"""
        return os.path.lexists(path)

    def mtime(self, step: int) -> float | None:
        """When the checkpoint of ``step`` was last written, as of its verdict."""
        return self.mtimes.get(step)

    def _final(self, step: int) -> bool:
        v = self.verdicts.get(step)
        return v is not None and v[1] and v[0] == self.paths.get(step)

    def _dropped_since(self) -> set[int]:
        dropped, self._dropped = self._dropped, set()
        return dropped
