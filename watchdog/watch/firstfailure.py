"""The rank that failed first, named in the incident of a crash (or an OOM).

Two sources. First, the ranks' own exits as they happen (sources/rankexits.py):
which rank's process ended first and how (a signal, an exit code), whatever
launched it, no text needed. Second, torchrun's summary in the job's output
(detectors/torchrun.py: "Root Cause (first observed failure)"), read from the
end of the attempt's log when the incident is recorded and, if it was not
printed yet (a log rule may fire on the first lines of it), once more when the
attempt is gone; it is kept beside the first, and names the rank only where
the exits did not. A rank's exit reaped by its launcher before we read it (the
loop late on a busy host; torchrun reaps every 0.1 s) takes how it ended from
the Root Cause when that names the same rank and pid.

Rank processes are looked for in the job's tree every second until some are
found (for at most a minute: torchrun's workers appear after its rendezvous),
then at doubling intervals up to every 30 s (a scan lists the host's processes
where the attempt has no cgroup); and every tick among the pids its ranks beat
from.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainwatch.detectors.torchrun import root_cause
from trainwatch.evidence.logtail import read_tail
from trainwatch.sources.rankexits import RankExit, rank_processes
from trainwatch.types import Fault, FaultKind, JobState

if TYPE_CHECKING:
    from pathlib import Path

    from trainwatch.actions.attempt import Attempt
    from trainwatch.lifecycle.runner import Runner

_TAIL_BYTES = 64 * 1024  # torchrun's summary is the last thing it prints
_KINDS = (FaultKind.CRASH, FaultKind.OOM)


def tick(r: Runner, now: float) -> None:
    """Watch the attempt's rank processes found since the last tick."""
    a = r.attempt
    if a is None or a.closed or r.state not in (JobState.STARTING, JobState.RUNNING):
        return
    ff = r.first_failure
    pids = a.tree.scan() if ff.scan_due(now) else set()
    for pid, rank in rank_processes(pids, r.stall.sampler.rank_of, r.ranks.pids()).items():
        ff.exits.watch(rank, pid)


def _torchrun(log: Path) -> dict[str, object] | None:
    try:
        return root_cause(read_tail(log, _TAIL_BYTES))
    except OSError:
        return None


def _first_failure(first: RankExit, said: dict[str, object] | None) -> dict[str, object]:
    """The first failure's evidence, how it ended from torchrun's Root Cause where
    its status was reaped before we read it and both name the same process."""
    out: dict[str, object] = first.evidence()
    if first.returncode is not None or said is None or said.get("rank") != first.rank:
        return out
    if said.get("pid", first.pid) != first.pid:
        return out
    how: dict[str, object] = {k: said[k] for k in ("signal", "exit_code") if k in said}
    if how:
        out.pop("status", None)
        out.update(how)
    return out


def explain(r: Runner, fault: Fault) -> Fault:
    """The fault with the rank that failed first and how, where it is known."""
    a = r.attempt
    if fault.kind not in _KINDS or a is None:
        return fault
    w = r.first_failure
    evidence, rank = dict(fault.evidence), fault.rank
    first = w.exits.first_failure()
    said = _torchrun(a.log_path)
    if first is not None:
        evidence["first_failure"] = _first_failure(first, said)
        rank = first.rank if rank is None else rank
    if said is not None:
        evidence["torchrun_root_cause"] = said
        named = said.get("rank")
        rank = named if rank is None and isinstance(named, int) else rank
    w.pending = said is None
    return dataclasses.replace(fault, rank=rank, evidence=evidence)


def after_stop(r: Runner, a: Attempt | None, incident: int) -> None:
    """The attempt is gone and its output complete: torchrun's summary, if the
    incident was recorded before it was printed. Then stop watching its ranks."""
    w = r.first_failure
    if w.pending and a is not None and incident >= 0:
        said = _torchrun(a.log_path)
        if said is not None:
            named = said.get("rank")
            late: dict[str, object] = {"torchrun_root_cause": said}
            first = w.exits.first_failure()
            if first is not None and first.returncode is None:
                late["first_failure"] = _first_failure(first, said)
            r.ledger.amend(incident, late, named if isinstance(named, int) else None)
    w.new_attempt(r.clock())
