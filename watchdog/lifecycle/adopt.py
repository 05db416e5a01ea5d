"""Re-adoption: a daemon that starts (after a crash, an upgrade, ``systemctl
restart``) takes each job back from the runtime state its predecessor wrote
(state/runtime.py), without a relaunch and without a second copy:

- a running attempt is adopted only if its keeper is the very process
  recorded (pid and start time: a recycled pid is never adopted or
  signalled); its exit, should it come, is read from the keeper's exit file;
- an attempt that ended while no daemon watched is handled by policy from its
  real exit status, as if it had just ended;
- budgets, backoff deadlines and the incident in flight carry over (the
  excluded GPUs are in gpus.json, the checkpoint verdicts in catalog.json);
- the ledger records the adoption as a transition: no incident, no restart.
"""

from __future__ import annotations

import logging
import selectors
import time
from typing import TYPE_CHECKING

from trainwatch.actions import kept
from trainwatch.actions.attempt import Attempt
from trainwatch.lifecycle import respond
from trainwatch.lifecycle.policy import RestartHistory
from trainwatch.sources.ranks import Ranks
from trainwatch.state import runtime
from trainwatch.types import JobState
from trainwatch.watch import exits
from trainwatch.watch.state import follow_log

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

_LIVE = (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
_RELAUNCHING = ("restart", "rollback", "restart_exclude_gpu")


def adopt_or_start(r: Runner) -> None:
    rt = runtime.load(r.dir, r.job.name)
    try:
        state = JobState(rt.state) if rt is not None and rt.state else None
    except ValueError:
        state = None
    if rt is None or state is None:
        r.start()
        return
    now, wall = r.clock(), time.time()
    r.number = rt.attempt
    r.history = RestartHistory.from_json(rt.restarts, now, wall)
    r.pending_incident = rt.pending_incident
    r.last_step = rt.last_step
    r.ever_beaten = rt.ever_beaten
    r.paused = rt.paused
    r.restarts = rt.restart_count
    r.last_incident = rt.last_incident if isinstance(rt.last_incident, int) else 0
    sk = rt.skip
    if isinstance(sk, list) and len(sk) == 3 and all(isinstance(x, int) for x in sk):
        r.skip = (sk[0], sk[1], sk[2])
    r.xids_seen.extend((g, now - (wall - t)) for g, t in rt.xids)
    if state in _LIVE:
        if rt.launched is None or not _adopt_attempt(r, rt):
            log.warning("job %s: the attempt recorded as %s is gone without a trace: "
                        "starting afresh", r.job.name, state.value)
            r.start()
            return
        a = r.attempt
        assert a is not None
        stop = rt.stop or {}
        if state is JobState.STOPPING and stop:
            r.to(JobState.RUNNING, f"adopted: attempt {a.number}, pid {a.pid}, being stopped")
            try:
                outcome = JobState(stop.get("outcome"))
            except ValueError:
                outcome = JobState.PAUSED
            r.begin_stop(outcome, str(stop.get("reason", "adopted while stopping")),
                         float(stop.get("delay", 0.0)))
            return
        r.to(JobState.RUNNING, f"adopted: attempt {a.number}, pid {a.pid}")
        done = _recorded(r, a.number)
        if done is not None and a.poll_exit() is not None:
            # Its predecessor recorded this exit's incident and died before it saved
            # the stop: carry that out, do not record (and count) the fault twice.
            r.pending_incident = done
            r.mark_exit_handled(a.number)
            r.begin_stop(JobState.BACKOFF, f"adopted: incident {done} already recorded")
            return
        respond.act_on(r, exits.check(r))  # it may have ended while no daemon watched
    elif state is JobState.BACKOFF:
        r.relaunch_at = now + max(0.0, (rt.relaunch_at or wall) - wall)
        r.to(JobState.BACKOFF, f"adopted: relaunch in {r.relaunch_at - now:.2f}s")
    else:
        r.to(state, "adopted: ended before this daemon started")


def _recorded(r: Runner, attempt: int) -> int | None:
    """The id of an incident already recorded for this attempt, if any; the
    restart it granted is put back into the budget if the state file missed it."""
    # Only an incident that stopped the attempt: an alert left it running.
    rows = [i for i in r.ledger.incidents(r.job.name) if i["attempt"] == attempt
            and i["action"] != "alert" and not i["observe_only"]]
    if not rows:
        return None
    row = rows[-1]
    if row["action"] in _RELAUNCHING and int(row["id"]) > r.last_incident:
        # Recorded after the state file was last written: its grant is not in the
        # history read back (a time window cannot tell, restarts may be close).
        r.history.restarts.append(r.clock() - max(0.0, time.time() - float(row["time"])))
        r.history.consecutive += 1
        r.last_incident = int(row["id"])
    return int(row["id"])


def _adopt_attempt(r: Runner, rt: runtime.Runtime) -> bool:
    """Take back the recorded attempt; False when there is nothing to take back
    (no keeper of that identity and no exit status recorded)."""
    try:
        rec = kept.Launched.from_dict(rt.launched)
    except ValueError as e:
        log.error("job %s: %s: %s", r.job.name, runtime.path(r.dir), e)
        return False
    found = kept.adopt(rec)
    pidfd = found if isinstance(found, int) else None
    if found == "gone" and kept.read_exit(rec) is None:
        return False
    launched = rt.launched or {}
    cg = launched.get("cgroup_path")
    lp = launched.get("log")
    a = Attempt.adopt(r.job, rt.attempt, rec, pidfd, cg if isinstance(cg, str) else None,
                      lp if isinstance(lp, str) else None, rt.resume_from, rt.resumed_step,
                      rt.gpus, rt.started_at or time.time())
    r.attempt = a
    r.outages.started(a.started)
    r.ranks = Ranks(started=a.started, max_ranks=r.job.heartbeat.max_ranks)
    r.first_failure.new_attempt(a.started)
    # One that ended unwatched: its rings still hold the steps it reached (its
    # last_step saved here is from the last state change, often step 1).
    r.intake.new_attempt(a.ring_dir, ended=a.poll_exit() is not None)
    r.logwatch = follow_log(r.logwatch, str(a.log_path), r.job.logs, from_end=True)
    if a.pidfd is not None:
        r.sel.register(a.pidfd, selectors.EVENT_READ, r.on_exit_ready)
    return True
