"""A launch from scratch, never in silence. When no good checkpoint is found:

- checkpoints on disk but none good: one ERROR line naming each reason given, with
  the steps it was given for,
  counted (``trainwatch_job_fresh_starts_with_checkpoints_total``, the alert
  ``TrainwatchNoGoodCheckpoint``);
- a relaunch of a job that has reported checkpoints (taken or refused) or
  resumed from one before, with none in its folder now: one ERROR line naming
  the configured ``checkpoints.dir`` and what the job reported, counted the same
  way, every time (a mistyped folder refuses every report: each relaunch would
  otherwise start over quietly);
- the folder missing: a warning, at the first launch and at every relaunch;
- the folder holding entries none of which its layout names as a checkpoint
  (``model.pt`` overwritten in place): one line saying trainwatch cannot tell.

The folder is the job's user's: it is looked at in the job's hand where it has
one (privsep), bounded, and only on a launch from scratch.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.state.entry import Entry

log = logging.getLogger("trainwatch")

_GLANCE_MAX = 10_000  # entries a glance reads
_SAMPLE = 5  # names it brings back
_GLANCE_TIMEOUT = 2.0
_REASONS = 8  # distinct reasons said in the line


def glance(folder: str) -> dict[str, Any]:
    """Whether ``folder`` exists, and its visible entries (a count and a few names).
    Runs as the job's user; JSON only."""
    try:
        with os.scandir(folder) as it:
            names = [e.name for e in itertools.islice(it, _GLANCE_MAX)
                     if not e.name.startswith(".")]
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return {"exists": False, "why": "is not a folder" if e.errno == errno.ENOTDIR
                    else "does not exist"}
        return {"exists": True, "entries": 0, "sample": [], "why": e.strerror or str(e)}
    return {"exists": True, "entries": len(names), "sample": sorted(names)[:_SAMPLE]}


def _glance(r: Runner, folder: str) -> dict[str, Any]:
    hands = getattr(r, "hands", None)  # the job's hand (privsep), where it has one
    if hands is None:
        return glance(folder)
    try:
        said: dict[str, Any] = hands.quick.call(glance, folder, timeout=_GLANCE_TIMEOUT)
        return said
    except Exception as e:  # the hand's errors (down, timed out, failed): this line only
        return {"exists": True, "entries": 0, "sample": [], "why": f"not read ({e})"}


def _none_good(r: Runner, entries: list[Entry]) -> None:
    r.events.fresh_starts.labels(r.job.name).inc()
    log.error("job %s: %d checkpoint(s) in %s, none good (%s): starting from scratch",
              r.job.name, len(entries), r.catalog.spec.dir, reasons(entries))


def reasons(entries: list[Entry]) -> str:
    """Each reason given, newest first, with the steps it was given for."""
    by: dict[str, list[int]] = {}
    for e in reversed(entries):
        by.setdefault(e.why, []).append(e.step)
    said = []
    for why, steps in itertools.islice(by.items(), _REASONS):
        more = f" and {len(steps) - _SAMPLE} more" if len(steps) > _SAMPLE else ""
        listed = ", ".join(map(str, steps[:_SAMPLE]))
        said.append(f"step{'s' if len(steps) > 1 else ''} {listed}{more}: {why}")
    if len(by) > _REASONS:
        said.append(f"{len(by) - _REASONS} more reasons")
    return "; ".join(said)


def _had(r: Runner) -> str | None:
    """What says the job has written checkpoints, in words; None when nothing does."""
    said = []
    if r.refused.count:
        said.append(f"it reported checkpoints trainwatch refused: {r.refused.said()}")
    cat = r.catalog
    if cat.reported:
        step = max(cat.reported)
        said.append(f"it reported {len(cat.reported)} checkpoint(s), the newest step {step}: "
                    f"{cat.reported[step]:.200}")
    if cat.used:
        said.append(f"attempts resumed from checkpoints before (the newest step "
                    f"{max(cat.used)})")
    return "; ".join(said) or None


def said(r: Runner) -> None:
    """No good checkpoint to resume from: say why, loudly where the job had one."""
    entries = r.catalog.known()
    if entries:
        _none_good(r, entries)
        return
    folder = r.catalog.spec.dir
    relaunch = r.number >= 0
    had = _had(r) if relaunch else None
    look = _glance(r, folder) if folder is not None else {"exists": False, "why": "is not set"}
    where = f"checkpoints.dir {folder}" if folder is not None else "checkpoints.dir"
    if had is not None:
        state = (look.get("why", "does not exist") if not look["exists"] else
                 f"holds no checkpoint its layout names ({_entries(look)})")
        r.events.fresh_starts.labels(r.job.name).inc()
        log.error("job %s: relaunching from scratch although %s; %s %s (mistyped?)",
                  r.job.name, had, where, state)
    elif folder is None:
        return
    elif not look["exists"]:
        log.warning("job %s: %s %s%s", r.job.name, where, look.get("why", "does not exist"),
                    ": relaunching from scratch (mistyped?)" if relaunch else
                    " yet: the job must write its checkpoints there, or every relaunch "
                    "starts from scratch")
    elif look.get("entries"):
        (log.error if relaunch else log.warning)(
            "job %s: %s holds %s but none is a checkpoint its layout (%s) names, so "
            "trainwatch cannot tell what to resume from: %s from scratch (name "
            "checkpoints with their step, e.g. step_N.pt, or set --checkpoint-pattern or "
            "--layout)", r.job.name, where, _entries(look), r.catalog.spec.layout,
            "relaunching" if relaunch else "starting")


def _entries(look: dict[str, Any]) -> str:
    n = int(look.get("entries", 0))
    sample = ", ".join(str(x) for x in look.get("sample", []))
    more = ", ..." if n > len(look.get("sample", [])) else ""
    why = f"; {look['why']}" if look.get("why") else ""
    return f"{n} entr{'y' if n == 1 else 'ies'}: {sample}{more}{why}" if n else f"empty{why}"
