"""The evidence kept of a faulted attempt before it is killed (the job's
``evidence`` settings): started as the incident is recorded, for the kinds in
``evidence.kinds`` (a stall, a hang) whose action kills the job; the kill waits
for it at most ``evidence.timeout`` (actions/stop.py). What it found (the
stacks' verdict, the folder) is added to the incident, and the rank it names
fills the incident's rank where the steps and processes named none.

Also the flight recorder: with ``evidence.flight_recorder``, every attempt
gets a folder of its own for PyTorch's dumps, and the variables that turn the
recorder on and point it there (evidence/flightrecorder.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwatch.config import Job
from trainwatch.evidence import flightrecorder, series
from trainwatch.evidence.capture import Capture, Target
from trainwatch.evidence.show import CATALOG, folder
from trainwatch.privsep import credentials
from trainwatch.types import Fault

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

_MAX_TARGETS = 64  # py-spy runs at once, one per process


def fr_dir(r: Runner, number: int) -> Path:
    return Path(r.config.run_dir) / "jobs" / f"{r.job.name}.attempt-{number}.fr"


def job_for_attempt(r: Runner, number: int) -> Job:
    """The job as the attempt is started: with the flight recorder's variables
    when asked (the job's own env wins), in a folder the job's user may write."""
    if not r.job.evidence.flight_recorder:
        return r.job
    d = fr_dir(r, number)
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        ident = credentials.resolve(r.job.user, r.job.group)
        if ident is not None:
            os.chown(d, ident.uid, ident.gid)
    except (OSError, KeyError) as e:
        log.warning("job %s: no flight recorder folder %s: %s", r.job.name, d, e)
        return r.job
    return dataclasses.replace(r.job, env={**flightrecorder.env(d), **r.job.env})


def start(r: Runner, fault: Fault, incident: int | None) -> Capture | None:
    """Begin capturing the attempt's evidence, when its settings ask for this kind."""
    a, ev = r.attempt, r.job.evidence
    if incident is None or incident < 0 or a is None or a.returncode is not None:
        return None
    if fault.kind not in ev.kinds:
        return None
    pids = r.ranks.pids()
    if pids:
        targets = [Target(pid, rank) for rank, pid in sorted(pids.items())]
    else:  # no client: the job's processes, each by the RANK in its environment
        keyed = r.stall.sampler.by_rank(a.tree.scan())
        targets = [Target(pid, key if key >= 0 else None) for key, pid in sorted(keyed.items())]
    try:
        out = folder(r.config.state_dir, r.job.name, incident)
    except ValueError:
        return None
    cap = Capture(out, targets[:_MAX_TARGETS], a.log_path, timeout=ev.timeout,
                  native=ev.native, log_lines=ev.log_lines,
                  fr_dir=fr_dir(r, a.number) if ev.flight_recorder else None, named=fault.rank,
                  hand=r.hands.evidence)
    cap.start()
    return cap


def finish(r: Runner, cap: Capture, incident: int) -> None:
    """Add what the capture found to the incident."""
    s: dict[str, Any] = cap.summary or {}
    verdict: dict[str, Any] = s.get("verdict") or {}
    suspects = list(verdict.get("suspects") or [])
    found: dict[str, Any] = {"evidence_dir": str(cap.out), "capture_s": s.get("seconds")}
    if verdict:
        found["stacks"] = {k: verdict.get(k) for k in ("decided_by", "suspects", "why",
                                                        "agrees")}
    if s.get("errors"):
        found["capture_errors"] = s["errors"][:5]
    rank = suspects[0] if len(suspects) == 1 else None
    r.ledger.amend(incident, found, rank)
    log.info("job %s: evidence of incident %d in %s (%.2fs)%s", r.job.name, incident, cap.out,
             s.get("seconds") or 0.0, f": {verdict.get('why')}" if verdict else "")


def keep_beside(r: Runner, fault: Fault, incident: int) -> None:
    """What the incident's page shows beside it, kept as it was at the incident."""
    if fault.kind in series.LOSS_KINDS:
        _keep_series(r, fault, incident)
    _keep_catalog(r, incident)


def _keep_series(r: Runner, fault: Fault, incident: int) -> None:
    """The lead rank's loss and grad norm around the onset, beside the incident."""
    feed = r.anomalies
    onset = fault.onset_step if fault.onset_step is not None else r.last_step
    if onset is None or feed.lead is None:
        return
    try:
        where = folder(r.config.state_dir, r.job.name, incident)
        series.keep(where, feed.lead, onset, fault.evidence.get("noticed_step"), feed.series)
    except (OSError, ValueError) as e:  # a full state_dir costs the series, not the job
        log.warning("job %s: incident %d: loss series not kept: %s", r.job.name, incident, e)


def _keep_catalog(r: Runner, incident: int) -> None:
    """The job's checkpoints as the catalog judged them at the incident, beside it
    (the incident page's table; the job's catalog.json moves on)."""
    try:
        r.catalog.keep(folder(r.config.state_dir, r.job.name, incident) / CATALOG)
    except (OSError, ValueError, TypeError) as e:  # a full state_dir costs the table only
        log.warning("job %s: incident %d: checkpoints not kept: %s", r.job.name, incident, e)
