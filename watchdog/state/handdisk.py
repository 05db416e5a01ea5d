"""What is on disk, listed and judged in the job's hand (privsep): ondisk.OnDisk
runs there, as the job's user, and root keeps a mirror of its answers.

Root's side has OnDisk's surface (``paths``, ``steps``, ``verdicts``, ``add``,
``drop``, ``rejudge``, ``refresh``), so the catalog does not know where the
folder is read. A refresh is one call: the changes root made since the last
(reports, retention's deletions, rejudgements) and, when the layout's state
changed (a report it learned from), the layout itself; the answer is the
verdicts that changed, and the whole listing when it changed. A hand that does
not answer in time costs this refresh (the verdicts stay as they were, and a
relaunch finds no new checkpoint); a new hand starts from a full listing.

Bounds, in the hand: a listing reads at most ``ondisk.MAX_NAMES`` names and keeps the
newest ``MAX_CHECKPOINTS`` checkpoints; both are said in one line, once, when
hit (a folder of 800,000 ``step_N`` files).
"""

from __future__ import annotations

import bisect
import logging
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainwatch.layouts import base
from trainwatch.privsep import child
from trainwatch.privsep.hand import Hand, HandError
from trainwatch.state import heap, ondisk
from trainwatch.state.ondisk import Layout, OnDisk

log = logging.getLogger("trainwatch")

REFRESH_TIMEOUT = 5.0  # one listing and the judgements it needs
# Whether a reported checkpoint is there: the loop waits for it, once per report.
EXISTS_TIMEOUT = 2.0
# The newest this many are kept track of (root mirrors them: each costs ~0.3 KB, and
# Python keeps the arenas a larger listing spread over after it is gone).
MAX_CHECKPOINTS = 2_000


def _layout(data: bytes) -> Layout:
    """Root's layout, its listing bounded to the newest MAX_CHECKPOINTS."""
    layout: Layout = pickle.loads(data)  # root's own bytes
    candidates = layout.candidates

    def bounded(root: Path) -> dict[int, str]:
        found = candidates(root)
        if len(found) > MAX_CHECKPOINTS:
            child.kept["truncated"] = len(found)
            found = {s: found[s] for s in sorted(found)[-MAX_CHECKPOINTS:]}
        return found

    layout.candidates = bounded  # type: ignore[method-assign]
    return layout


def refresh_in_hand(key: str, layout: bytes | None, root: str | None,
                    changes: list[tuple[str, int, str | None]], force: bool) -> dict[str, Any]:
    """The hand's side: apply root's changes, refresh, answer what changed."""
    disk = child.kept.get(key)
    fresh = not isinstance(disk, OnDisk)
    if not isinstance(disk, OnDisk):
        if layout is None:  # a new hand (the last one died, or grew and left)
            return {"need_layout": True}
        disk = child.kept[key] = OnDisk(_layout(layout), root)
    elif layout is not None:
        disk.layout = _layout(layout)
    for what, step, path in changes:
        if what == "add" and path is not None:
            disk.add(step, path)
        elif what == "drop":
            disk.drop(step)
        elif what == "rejudge":
            disk.rejudge(step)
    before = dict(disk.paths)
    listings = disk.listings
    child.kept.pop("truncated", None)
    cut = ondisk.names_cut + base.entries_cut
    changed = disk.refresh(force or fresh)
    names_cut = ondisk.names_cut + base.entries_cut != cut
    if names_cut:
        child.kept["truncated"] = f"over {ondisk.MAX_NAMES} names (the rest unread)"
    recognised = getattr(disk.layout, "found", None)
    return {
        "fresh": fresh,
        "paths": ({str(s): p for s, p in disk.paths.items()}
                  if fresh or disk.paths != before else None),
        "verdicts": {str(s): list(disk.verdicts[s]) for s in changed if s in disk.verdicts},
        "mtimes": {str(s): disk.mtimes[s] for s in changed if s in disk.mtimes},
        "dropped": [s for s in changed if s not in disk.paths],
        "listed": disk.listings - listings,
        "truncated": child.kept.pop("truncated", None),
        "names_cut": names_cut,
        "recognised": getattr(recognised, "name", None),
    }


class HandDisk:
    """OnDisk's surface over a hand (see the module's docstring)."""

    def __init__(self, layout: Layout, root: str | None, hand: Hand, key: str,
                 timeout: float = REFRESH_TIMEOUT,
                 on_recognised: Callable[[str], None] | None = None) -> None:
        self.layout = layout
        self.root = Path(root) if root else None
        self.hand = hand
        self.key = key
        self.timeout = timeout
        self.on_recognised = on_recognised
        self.paths: dict[int, str] = {}
        self.steps: list[int] = []
        self.verdicts: dict[int, tuple[str, bool, str]] = {}
        self.mtimes: dict[int, float] = {}
        self.listings = 0
        self.unanswered = 0  # refreshes the hand did not answer (counted, logged)
        self.shrunk = False  # many entries forgotten at once: the catalog rebuilds too
        self.names_cut = 0  # listings that read only the first ondisk.MAX_NAMES names
        self.truncated = 0  # listings that kept only the newest MAX_CHECKPOINTS
        self.why_unanswered: str | None = None
        # Root's changes not yet applied in the hand, by step, at most a drop, an add
        # and a rejudge each (a hand that stays down must not grow this by a report).
        self._changes: dict[int, list[tuple[str, int, str | None]]] = {}
        self._shipped: bytes | None = None
        self._truncated_said = False

    def add(self, step: int, path: str) -> None:
        if self.paths.get(step) != path:
            if step not in self.paths:
                bisect.insort(self.steps, step)
            self.paths[step] = path
            self.verdicts.pop(step, None)
        ops = self._changes.get(step, [])
        self._changes[step] = ([o for o in ops if o[0] == "drop"] + [("add", step, path)]
                               + [o for o in ops if o[0] == "rejudge"])

    def drop(self, step: int) -> None:
        if self.paths.pop(step, None) is not None:
            self.steps.remove(step)
        self.verdicts.pop(step, None)
        self.mtimes.pop(step, None)
        self._changes[step] = [("drop", step, None)]  # whatever came before is moot

    def rejudge(self, step: int) -> None:
        self.verdicts.pop(step, None)
        ops = self._changes.setdefault(step, [])
        if ("rejudge", step, None) not in ops:
            ops.append(("rejudge", step, None))

    def mtime(self, step: int) -> float | None:
        return self.mtimes.get(step)

    def exists(self, path: str) -> bool | None:
        """Is there a file or folder at ``path``, looked for as the job's user (a link
        not followed)? None: the hand did not answer in EXISTS_TIMEOUT."""
        try:
            got = self.hand.call(os.path.lexists, path, timeout=EXISTS_TIMEOUT)
        except HandError:
            return None
        return got if isinstance(got, bool) else None

    def refresh(self, force: bool = False) -> set[int]:
        layout = pickle.dumps(self.layout, pickle.HIGHEST_PROTOCOL)
        ship = layout if layout != self._shipped else None
        t0 = time.monotonic()
        root = str(self.root) if self.root else None
        changes = [op for ops in self._changes.values() for op in ops]
        try:
            reply = self.hand.call(refresh_in_hand, self.key, ship, root, changes, force,
                                   timeout=self.timeout)
            if isinstance(reply, dict) and reply.get("need_layout"):
                reply = self.hand.call(refresh_in_hand, self.key, layout, root, changes,
                                       True, timeout=max(0.1, self.timeout
                                                         - (time.monotonic() - t0)))
            if not isinstance(reply, dict):
                raise HandError("a reply that is not a mapping")
        except HandError as e:
            self.unanswered += 1
            if self.why_unanswered is None:
                log.error("%s: checkpoints in %s not judged: %s (judged again later; a "
                          "relaunch waits for it)", self.key, self.root, e)
            self.why_unanswered = str(e)
            if not self.hand.down:
                self._shipped = None  # whatever the hand kept may be gone
            return set()
        if self.why_unanswered is not None:
            log.info("%s: checkpoints in %s judged again", self.key, self.root)
            self.why_unanswered = None
        self._shipped = layout
        self._changes = {}
        return self._apply(reply)

    def _own(self, step: int) -> int:
        """The mirror's own int for ``step`` where it has one (``steps`` holds the
        keys of ``paths``), else ``step``."""
        i = bisect.bisect_left(self.steps, step)
        return self.steps[i] if i < len(self.steps) and self.steps[i] == step else step

    def _apply(self, reply: dict[str, Any]) -> set[int]:
        # The mirror keeps its own objects where the reply says the same (a listing
        # sent again, a new hand's) and one copy of each reason: a listing of 10,000
        # steps leaves small objects in the interpreter's arenas, each given back
        # only once wholly empty (what stays after the listing is forgotten), so as
        # few of them, made as seldom, as can be.
        changed: set[int] = set()
        self.listings += int(reply.get("listed") or 0)
        had = self.verdicts
        if reply.get("fresh"):
            changed |= set(self.paths)
            self.verdicts, self.mtimes = {}, {}
        paths = reply.get("paths")
        if isinstance(paths, dict):
            new: dict[int, str] = {}
            for s, p in paths.items():
                step, path = self._own(int(s)), str(p)
                kept = self.paths.get(step)
                new[step] = kept if kept == path else path
            gone = set(self.paths) - set(new)
            for step in gone:
                self.verdicts.pop(step, None)
                self.mtimes.pop(step, None)
                changed.add(step)
            self.paths = new
            self.steps = sorted(new)
            if len(gone) >= heap.SHRINK:  # dictionaries never shrink their tables
                self.verdicts, self.mtimes = dict(self.verdicts), dict(self.mtimes)
                self.shrunk = True
        reasons: dict[str, str] = {}
        for s, v in (reply.get("verdicts") or {}).items():
            step = self._own(int(s))
            listed = self.paths.get(step)
            if listed is not None and isinstance(v, list) and len(v) == 3:
                why = str(v[2])
                verdict = (listed if listed == v[0] else str(v[0]), bool(v[1]),
                           reasons.setdefault(why, why))
                kept_verdict = had.get(step)
                self.verdicts[step] = kept_verdict if kept_verdict == verdict else verdict
                changed.add(step)
        for s, m in (reply.get("mtimes") or {}).items():
            if isinstance(m, (int, float)):
                self.mtimes[int(s)] = float(m)
        changed.update(int(s) for s in reply.get("dropped") or [] if isinstance(s, int))
        truncated = reply.get("truncated")
        if reply.get("names_cut"):
            self.names_cut += 1
        elif truncated:
            self.truncated += 1
        if truncated and not self._truncated_said:
            self._truncated_said = True
            log.error("%s: %s holds %s: only the newest %d checkpoints are kept track "
                      "of", self.key, self.root,
                      truncated if isinstance(truncated, str) else f"{truncated} checkpoints",
                      MAX_CHECKPOINTS)
        found = reply.get("recognised")
        if isinstance(found, str) and self.on_recognised is not None:
            self.on_recognised(found)
        return changed

