"""A job's checkpoints as ``trainwatch checkpoints JOB`` lists them: each with its
verdict and why, the loss at its step, size, time and the attempts that resumed
from it, and which one is the last good.

From a live daemon's catalog (``listing``, operations.py), or post-mortem from
what a stopped daemon or ``trainwatch run`` left in ``state_dir/jobs/<job>/``
(``from_state_dir``): its catalog state (``catalog.json``: the job's reports,
bad marks, quarantine, health, attempts) over a fresh listing of its checkpoint
folder, and each good checkpoint's sizes checked against its manifest
(``manifests/``; the hashes are the daemon's to check, before a relaunch).

Post-mortem, the folder is listed in this process, with the rights of whoever
runs the command (the daemon lists it, and reads sizes and times there, in
the job's hand, as the job's user, for at most ``FACTS_BUDGET`` seconds: that
is root's caution, not the operator's). Nothing is written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.config import Checkpoints, ConfigError, Job
from trainwatch.privsep.hand import Hand, HandError
from trainwatch.state import atomic, manifest, retention
from trainwatch.state.catalog import Catalog
from trainwatch.state.entry import Entry

LIMIT = 200  # the newest this many: a daemon's reply must fit one datagram


def _verdict(e: Entry) -> str:
    if e.bad:
        return "quarantined" if e.why.startswith("bad: quarantined") else "bad"
    return "good" if e.good else "incomplete"


# Sizes and times of one listing: read for at most this long (a checkpoint folder of
# a million files is the job's to fill); those left are shown as unknown.
FACTS_BUDGET = 2.0


def facts(paths: list[str], budget: float = FACTS_BUDGET) -> list[list[Any]]:
    """[size, mtime] of each of ``paths`` (None where unknown, and for all past
    ``budget`` seconds). A daemon's listing runs it in the job's hand, as its
    user (the folder is theirs); a post-mortem one in this process."""
    until = time.monotonic() + budget
    out: list[list[Any]] = []
    for p in paths:
        try:
            mtime: float | None = os.stat(p).st_mtime if time.monotonic() < until else None
        except OSError:
            mtime = None
        out.append([retention.size_within(p, until) if mtime is not None else None, mtime])
    return out


def _in_hand(hand: Hand, paths: list[str]) -> list[tuple[int | None, float | None]]:
    """facts() in the job's hand; its answer checked (the hand is the job user's)."""
    try:
        got = hand.call(facts, paths, timeout=FACTS_BUDGET + 5.0)
    except HandError:
        got = None
    if not isinstance(got, list) or len(got) != len(paths):
        return [(None, None)] * len(paths)
    out: list[tuple[int | None, float | None]] = []
    for f in got:
        size, mtime = f if isinstance(f, list) and len(f) == 2 else (None, None)
        out.append((size if isinstance(size, int) and size >= 0 else None,
                    float(mtime) if isinstance(mtime, (int, float)) else None))
    return out


def listing(job: str, catalog: Catalog, entries: list[Entry] | None = None,
            hand: Hand | None = None) -> dict[str, Any]:
    """The reply of ``checkpoints``: the catalog's entries (listed now unless given);
    their sizes and times read in ``hand`` (the job's, as its user) when given."""
    entries = catalog.entries() if entries is None else entries
    good = [e for e in entries if e.good]
    shown = entries[-LIMIT:]
    paths = [e.path for e in shown]
    known = (_in_hand(hand, paths) if hand is not None
             else [(f[0], f[1]) for f in facts(paths)])
    out = []
    for e, (size, mtime) in zip(shown, known, strict=True):
        out.append({"step": e.step, "path": e.path, "verdict": _verdict(e),
                    "why": e.why, "last_good": bool(good) and e is good[-1],
                    "health": catalog.health.get(e.step), "size": size, "time": mtime,
                    "attempts": catalog.used.get(e.step, [])})
    return {"job": job, "checkpoints": out}


@dataclass(frozen=True)
class Source:
    """Where a post-mortem listing's settings came from, for the line that says so."""

    state_dir: str
    settings: str  # "the config FILE" or "catalog.json (layout auto, ...)"


def _from_catalog_state(path: Path, owner: object) -> Checkpoints:
    """The job's folder and pattern as its catalog state names them
    (``owner``: "<dir>|<pattern>", job.py); auto layout, or fixed for a pattern
    without {step} (the one layout auto cannot take for a pattern)."""
    if owner is None:
        raise ConfigError(f"{path}: absent or unreadable: the job's checkpoint folder is"
                          " unknown (pass --config with the job)")
    folder, _, pattern = owner.rpartition("|") if isinstance(owner, str) else ("", "", "")
    if not folder or not pattern:
        raise ConfigError(f"{path}: owner: expected \"<dir>|<pattern>\", got {owner!r}"
                          " (pass --config with the job)")
    if not os.path.isabs(folder):  # the job had no folder: job.py names its command
        return Checkpoints(dir=None, pattern=pattern)
    layout = "auto" if "{step}" in pattern else "fixed"
    return Checkpoints(dir=folder, layout=layout, pattern=pattern)


def _reported_folder(state: object) -> str | None:
    """The folder of the newest checkpoint the job reported, per its catalog state."""
    reported = state.get("reported") if isinstance(state, dict) else None
    steps = [(int(k), v) for k, v in (reported.items() if isinstance(reported, dict) else ())
             if isinstance(k, str) and k.isdigit() and isinstance(v, str) and os.path.isabs(v)]
    return os.path.dirname(max(steps)[1]) if steps else None


def from_state_dir(state_dir: str, job: str, configured: Job | None) -> tuple[
        dict[str, Any], Source]:
    """The listing of ``job``'s checkpoints from ``state_dir`` with no daemon;
    raises ConfigError (one line, exit 2) for a state dir or job that is not there.
    ``configured``: the job of a config (its checkpoint settings), else the
    folder and pattern its catalog state names."""
    if not os.path.isdir(state_dir):
        raise ConfigError(f"--state-dir: {state_dir}: no such directory")
    job_dir = Path(state_dir) / "jobs" / job
    if not job_dir.is_dir():
        jobs = Path(state_dir) / "jobs"
        known = sorted(p.name for p in jobs.iterdir() if p.is_dir()) if jobs.is_dir() else []
        raise ConfigError(f"no job {job!r} in {state_dir} (expected {job_dir}/; jobs there:"
                          f" {', '.join(known) or 'none'})")
    path = job_dir / "catalog.json"
    state = atomic.read_json(path)
    saved_for = state.get("owner") if isinstance(state, dict) else None
    if configured is not None:
        spec = configured.checkpoints
        owner = f"{spec.dir or ' '.join(configured.command)}|{spec.pattern}"
        settings = "the config"
        if saved_for is not None and saved_for != owner:
            # Set aside, as a daemon would (saved for another folder or pattern): said
            # in the listing's line rather than the catalog's log line.
            settings += f"; its catalog state, saved for {saved_for!r}, is not used"
            path = Path(os.devnull)
    else:
        spec = _from_catalog_state(path, saved_for)
        owner = str(saved_for)
        settings = (f"catalog.json (layout {spec.layout}, pattern {spec.pattern}; --config"
                    " for the job's own)")
    if spec.dir is None and (folder := _reported_folder(state)) is not None:
        # No folder configured: the one its checkpoints were reported in (a Hugging
        # Face Trainer's output_dir), as the live catalog took them.
        spec = Checkpoints(dir=folder, layout=spec.layout, pattern=spec.pattern,
                           marker=spec.marker, quiet_for=spec.quiet_for)
        settings += f"; the folder its checkpoints were reported in, {folder}"
    if spec.dir is None:
        return {"job": job, "checkpoints": []}, Source(state_dir, settings)
    catalog = Catalog(spec, path, owner=owner)
    store = manifest.Store(job_dir / "manifests")
    entries = [_checked(e, store) for e in catalog.entries()]
    return listing(job, catalog, entries), Source(state_dir, settings)


def _checked(e: Entry, store: manifest.Store) -> Entry:
    """A good entry whose files no longer have its manifest's sizes is bad."""
    if not e.good:
        return e
    m = store.get(e.step)
    if m is None or m.path != e.path:
        return e
    why = manifest.check_sizes(m)
    if why is None:
        return e
    return Entry(e.step, e.path, e.complete, True, f"bad: differs from its manifest: {why}")
