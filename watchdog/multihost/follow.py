"""A peer's group restart, followed on this host (multihost/group.py polls for it):
recorded and charged here once, this host's own failures of the round claimed in
it, and this host's workers ended too, so that every agent enters the new round
together."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from trainwatch.multihost import decision, group, records, rounds, victim
from trainwatch.types import Action, Fault, FaultKind, JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.multihost.state import Group

log = logging.getLogger("trainwatch")


def _claim_own_exits(r: Runner, g: Group, a: Attempt, gen: int) -> None:
    """A rank of ours that failed in this round, not judged yet (its status reaped by
    its agent before we read it waits UNKNOWN_GRACE): claimed in the peer's restart,
    which may well have begun here."""
    own = [e for e in r.first_failure.exits.exits if e.pid not in g.before and e.returncode != 0]
    if not own:
        return
    first = r.first_failure.exits.first_failure() or own[0]
    claim = {"kind": FaultKind.CRASH.value, "rank": first.rank,
             "at": time.time() - max(0.0, r.clock() - first.at),
             "victim": victim.peer_blamed(a.log_path, g.log_from, first.rank) is not None,
             "reached": r.last_step}
    records.call(r, records.claim_in_hand, g.root, gen, g.host, claim)


def follow(r: Runner, a: Attempt, rec: records.Restart, now: float) -> None:
    """A peer's restart: recorded and charged here once; our workers end too, so
    that every agent enters the new round together."""
    g = r.group
    assert g is not None
    g.gen = rec.gen
    from trainwatch.multihost import leave  # it calls rounds.new_round(): at run time

    if rec.joins is not None:  # a host back from its pre-flight: not a fault here
        leave.follow_join(r, rec, now)
        return
    _claim_own_exits(r, g, a, rec.gen)
    try:
        kind = FaultKind(rec.kind)
    except ValueError:
        kind = FaultKind.CRASH
    from trainwatch.lifecycle import respond  # respond calls act(): one circle, at run time
    from trainwatch.lifecycle.policy import decide

    refused = decision.unbelieved(r, rec)
    if refused is not None and not r.observing:
        # A claim, never an order: the fault it says is this host's to decide.
        log.error("job %s: group restart %d, made by %s, resumes from %s: %s; this host "
                  "decides it itself", r.job.name, rec.gen, rec.host, group.where(rec),
                  refused)
        respond.handle(r, Fault(kind, r.job.name, now, {
            "group_restart_refused": rec.gen, "recorded_by": rec.host, "refused": refused},
            onset_step=r.last_step, onset_known=False))
        return
    fault = Fault(kind, r.job.name, now, {"group_restart": rec.gen, "began": rec.began,
                                          "decided_on": rec.host, "followed": True,
                                          "claims": rec.claimed(), **leave.evidence(r, rec)},
                  onset_step=r.last_step, onset_known=False)
    if r.observing:
        why, fatal = "observe_only" if r.config.observe_only else "paused", False
        reason = f"{why}: a peer's group restart, recorded only"
    else:
        d = decide(r.policy, fault, r.history, now, now - a.started, r.rng, Action.RESTART,
                   charged=decision.followed_charged(r, g, rec),
                   progressed=respond.progressed(r))
        reason, fatal = d.reason, d.fatal
    reason += leave.note(r, rec)  # a host left the group: does it go on without it?
    r.events.faults.labels(r.job.name, kind.value).inc()
    incident = r.ledger.incident(fault, Action.RESTART.value,
                                 f"group restart {rec.gen} (began on {rec.began}): {reason}",
                                 a.number, None, observe_only=r.observing)
    log.warning("job %s: group restart %d began on %s (%s): %s; resuming from %s",
                r.job.name, rec.gen, rec.began, rec.kind, reason, group.where(rec))
    if incident is not None and incident >= 0:
        g.settle = (rec.gen, incident, rec.began, now + records.SETTLE)
    if r.observing:
        return
    if fatal:
        r.begin_stop(JobState.FATAL, f"group restart {rec.gen}: {reason}")
        return
    r.outages.fault(kind.value, now, now)
    if incident is not None and incident >= 0:
        r.ledger.backoff_applied(incident, 0.0)  # the agent starts the new round at once
    from trainwatch.actions import evidence  # this host's ranks as they waited, too

    capture = evidence.start(r, fault, incident)
    rounds.evidence_then_round(r, g, a, capture, rec, incident,
                               f"group restart {rec.gen} from {rec.began}",
                               rec.began_at if rec.began_at is not None else time.time())
