"""Retention carried out (``checkpoints.keep``, state/retention.py): after a
catalog refresh that found a new last good checkpoint, or while free space is
below ``min_free_bytes``, the plan is made from the catalog's verdicts and its
deletions done one by one, each a ledger row and a count. Never while the job
is observed only or paused by the operator, never without a rule.

trainwatch snapshots (``snapshot-N`` folders, under layout trainwatch or
auto): with no rule in the job's config,
the newest good snapshot's ``keep`` (the Snapshotter's, which never deletes
under trainwatch: only the daemon knows the last good one) is the rule, as
``keep.last``; after deleting snapshot folders the content store's chunks that
no folder links any more are collected (trainwatch.snapshot.blobs).

The loop waits only for the quick part of a deletion (a file's unlink, a
folder renamed to its tombstone: the checkpoint is gone under its name at
once); removing the tombstone (many files, a network file system) and the GC
run in the job's removal hand from a thread (background.py), and the next pass
waits until they are done, so that it sees the space they freed."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from trainwatch.actions import background
from trainwatch.config.schema import Keep
from trainwatch.privsep.hand import Hand, HandError
from trainwatch.snapshot import blobs
from trainwatch.snapshot import format as snapshot_format
from trainwatch.state import retention
from trainwatch.state.retention import Plan
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.state.entry import Summary

log = logging.getLogger("trainwatch")

# Retention's work in the job's folder is done in its hand, as its user (privsep):
# what the loop waits for (sizes, a file's unlink, a folder renamed to its
# tombstone) is given up after this, and the next refresh tries again.
HAND_TIMEOUT = 30.0
# What takes the time (a folder of many files removed, on a network file system,
# and the store's GC) runs in the job's removal hand from a thread, given this long.
CLEAR_TIMEOUT = 3600.0
SIZES_BUDGET = 5.0  # the sizes a pass under min_free_bytes reads, in all
KEEP_TIMEOUT = 10.0  # reading the Snapshotter's keep from a manifest (megabytes of JSON)
_CLEARING = "trainwatch-retention"


def _in_hand(r: Runner, fn: Callable[[str], int | None], path: str) -> int | None:
    """A size or free space, read as the job's user; None when it cannot be."""
    try:
        got = r.hands.quick.call(fn, path, timeout=HAND_TIMEOUT)
    except HandError:
        return None
    return got if isinstance(got, int) else None


def _sizes(r: Runner, paths: list[str]) -> list[int]:
    """Each checkpoint's size, oldest first, read as the job's user in one call of
    at most SIZES_BUDGET seconds (-1: not known); one call per checkpoint, each
    with its own deadline, held the loop for as long as a folder of many."""
    try:
        got = r.hands.quick.call(retention.sizes, paths, SIZES_BUDGET,
                                 timeout=SIZES_BUDGET + 5.0)
    except HandError:
        got = None
    if not isinstance(got, list) or len(got) != len(paths):
        return [-1] * len(paths)
    return [s if isinstance(s, int) and s >= 0 else -1 for s in got]


def free_space(r: Runner) -> int | None:
    """Free space under the job's folder, read as its user (a path of theirs)."""
    root = r.catalog.spec.dir
    return _in_hand(r, retention.free_bytes, root) if root else None


def collect_in_hand(root: str) -> dict[str, int] | None:
    """In the hand: the store's GC, when ``root/blobs`` is a folder (not a link)."""
    try:
        st = os.lstat(os.path.join(root, blobs.STORE))
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return blobs.collect(root)


def snapshot_keep(path: str) -> int | None:
    """In the hand: the Snapshotter's ``keep`` written in the snapshot at ``path``."""
    return snapshot_format.read(path).keep


# job -> (the newest good snapshot's path, its keep): read once per snapshot, not
# at every refresh (a manifest of many tensors is megabytes of JSON).
_snapshot_keep: dict[str, tuple[str, int | None]] = {}
# job -> the deletions that failed (a link, a folder not ours): a retention pass
# runs at every refresh while space is low, and each would say it again.
_refused: dict[str, set[tuple[int, str]]] = {}
_REFUSED_MAX = 1024


def keep_rule(r: Runner, judged: Summary | None = None) -> Keep:
    """The job's ``checkpoints.keep``; without a rule, for trainwatch snapshots,
    the newest good snapshot's ``keep`` as ``last`` (pinned steps still hold).
    ``judged``: the summary the loop's refresh has just made, whose newest good
    checkpoint is taken as it is (not one more call to the job's hand)."""
    keep = r.job.checkpoints.keep
    if keep.deletes:
        return keep
    good = judged.last_good if judged is not None else r.catalog.last_good(fresh=False)
    # By the folder, not the layout's name: under ``auto`` a first run's reports
    # of snapshot-N are taken by a learned generic pattern until a listing
    # recognises the layout (up to a minute), and keep must hold from the first.
    if good is None or snapshot_format.step_of(good.path) is None:
        return keep
    seen = _snapshot_keep.get(r.job.name)
    if seen is None or seen[0] != good.path:
        try:
            got = r.hands.quick.call(snapshot_keep, good.path, timeout=KEEP_TIMEOUT)
            last = got if isinstance(got, int) and got > 0 else None
        except HandError:
            return keep  # good a moment ago, unreadable now: the next refresh judges it
        if last is not None and (seen is None or seen[1] != last):
            log.info("job %s: no checkpoints.keep rule: keeping the newest %d good snapshots "
                     "(the job's Snapshotter keep)", r.job.name, last)
        seen = _snapshot_keep[r.job.name] = (good.path, last)
    return keep if seen[1] is None else replace(keep, last=seen[1])


def plan(r: Runner, listed: bool = True, keep: Keep | None = None) -> Plan:
    """What retention would delete now, and why each other checkpoint stays."""
    keep = keep_rule(r) if keep is None else keep
    entries = r.catalog.entries() if listed else r.catalog.known()
    free = free_space(r)
    sized = keep.min_free_bytes is not None and free is not None and free < keep.min_free_bytes
    known = _sizes(r, [e.path for e in entries]) if sized else [0] * len(entries)
    cands = [retention.candidate(e, size) for e, size in zip(entries, known, strict=True)]
    a = r.attempt
    live = a is not None and r.state in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
    return retention.plan(cands, keep, resumed_from=a.resumed_step if live and a else None,
                          free_bytes=free)


def after_refresh(r: Runner) -> None:
    """Delete what the plan says, when something changed that could free one."""
    keep, root = keep_rule(r, r.checkpoints), r.catalog.spec.dir
    if not keep.deletes or root is None or r.observing:
        return
    good = r.checkpoints.last_good
    low = keep.min_free_bytes is not None and (
        (free := free_space(r)) is not None
        and free < keep.min_free_bytes)
    step = good.step if good is not None else None
    if step == r.catalog.pruned_at and not low:
        return
    if background.busy(r, _CLEARING):
        return  # the last pass's folders are still being removed: the space too
    r.catalog.pruned_at = step
    p = plan(r, listed=False, keep=keep)
    snapshots = 0
    graves: list[str] = []
    refused = _refused.setdefault(r.job.name, set())
    for c in p.delete:
        if (c.step, c.path) in refused:
            continue  # said once, in the ledger and the log; retried only if it changes
        try:
            why = r.hands.quick.call(retention.delete, c, root=root, bury_only=True,
                                     timeout=HAND_TIMEOUT)
        except HandError as e:
            why = f"{c.path}: no answer as the job's user: {e}"
        r.ledger.deletion(r.job.name, max(r.number, 0), c.step, c.path, c.size or None, why)
        r.events.deletions.labels(r.job.name, "deleted" if why is None else "failed").inc()
        if why is None:
            graves.append(retention.grave_of(c.path))  # none for a file: nothing to do
            r.catalog.forget(c.step)
            snapshots += snapshot_format.step_of(c.path) == c.step
            log.info("job %s: retention deleted checkpoint step %d (%s)", r.job.name, c.step,
                     c.path)
        else:
            refused.add((c.step, c.path))
            while len(refused) > _REFUSED_MAX:
                refused.pop()
            log.warning("job %s: retention could not delete checkpoint step %d: %s (not "
                        "tried again while it stays)", r.job.name, c.step, why)
    if graves:
        hand, name = r.hands.removal, r.job.name
        background.start(r, lambda: _clear(hand, name, root, graves, snapshots > 0),
                         _CLEARING)


def at_end(r: Runner) -> None:
    """The job has ended: one last pass, once the removals under way are done (a
    pass that came while they ran was skipped, and no refresh follows now) and the
    checkpoints written last are judged; what it removes is waited for on close."""
    if r.state not in (JobState.EXITED, JobState.FATAL) or r.observing \
            or r.catalog.spec.dir is None or not keep_rule(r).deletes:
        return
    background.wait(r)
    try:
        r.refresh_checkpoints()
    except Exception:  # closing goes on: the next daemon's catalog sees the same folder
        log.exception("job %s: the last retention pass failed", r.job.name)


def _clear(hand: Hand, job: str, root: str, graves: list[str], collect: bool) -> None:
    """In a thread: the deleted folders' tombstones removed, then the store's GC."""
    for g in graves:
        try:
            why = hand.call(retention.remove_grave, g, timeout=CLEAR_TIMEOUT)
        except HandError as e:
            why = f"{g}: no answer as the job's user: {e}"
        if why is not None:
            log.warning("job %s: retention: %s", job, str(why)[:1000])
    if collect:
        _collect(hand, job, root)


def _collect(hand: Hand, job: str, root: str) -> None:
    """The store's chunks that no snapshot (or live save) links any more."""
    try:
        got = hand.call(collect_in_hand, root, timeout=CLEAR_TIMEOUT)
    except HandError as e:  # survived: the next deletion collects again
        log.warning("job %s: collecting unreferenced snapshot chunks in %s failed: %s",
                    job, root, e)
        return
    if not isinstance(got, dict):
        return  # no store there (or not a folder of its own: a link is never followed)
    n = {k: v if isinstance(v, int) else 0 for k, v in got.items()}
    if n.get("blobs") or n.get("folders"):
        log.info("job %s: collected %d unreferenced snapshot chunks (%d bytes) and %d "
                 "leftover folders", job, n.get("blobs", 0), n.get("bytes", 0),
                 n.get("folders", 0))
