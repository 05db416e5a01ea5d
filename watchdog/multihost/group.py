"""A multi-host job's side of its group (``jobs[].nodes``): every host's daemon
runs the same job, a torchrun agent of its own, and torchrun's rendezvous
restarts the group: when one host's workers end, every agent restarts its own
(the others learn of it through the rendezvous, or their collectives fail).

So a fault anywhere is one **group restart** (records.py): the host that acts
on it first records it with the decision every rank resumes from (the
client reads it: ``resume_from()``, ``skip_steps()``); each host records one
incident of it, charges it once to its budget, and ends only its own
workers: its agent lives on and restarts them in the new round. A host whose
agent itself ended relaunches it (the usual way), into the same restart.

Here: the rank that ends by itself while its agent lives (a crash the agent
restarts, never seen as the agent's exit), a peer's restart (looked for every
``POLL`` seconds; followed in follow.py), and the round that begins after either."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from trainwatch.actions.tree import stopped_ranks
from trainwatch.multihost import decision, records, rounds, stackshare, victim
from trainwatch.multihost.state import Group, Waiting
from trainwatch.types import Fault, FaultKind

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Config, Job
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.sources.rankexits import RankExit

log = logging.getLogger("trainwatch")

POLL = 0.5  # seconds between two looks for a peer's restart
UNKNOWN_GRACE = 2.0  # a rank's exit of unknown status, while another rank runs: a failure
# A hang or stall with none of this host's ranks stopped waits this long for the
# host whose rank is (its ranks wait for it in a collective) to restart the group.
HOLD = 5.0
ABSORB = 2  # failures before the first beat after a restart taken as part of it
# Restarts another host made first whose checkpoint this host does not take, in a
# row, before it goes on without a record of its own (decision.unbelieved).
_OTHERS_MAX = 3


def for_job(config: Config, job: Job) -> Group | None:
    if job.nodes is None or job.checkpoints.dir is None:
        return None
    return Group(job.checkpoints.dir, config.host)


def _baseline(r: Runner, g: Group) -> None:
    if g.base is None:
        got = records.call(r, records.current_in_hand, g.root)
        g.base = g.gen = got if isinstance(got, int) and got >= 0 else 0


def env(r: Runner) -> dict[str, str]:
    """What the job's ranks read the group's decisions by (client.resume_from())."""
    g = r.group
    if g is None:
        return {}
    _baseline(r, g)
    return {"TRAINWATCH_GROUP_DIR": records.folder(g.root),
            "TRAINWATCH_GROUP_GEN": str(g.base or 0)}


def job_for_attempt(r: Runner, job: Job) -> Job:
    if r.group is not None:
        r.group.log_from = 0  # a new attempt's log
        r.group.rounds = 0
        r.group.waiting = None  # a new agent: its launch judged its checkpoints
    extra = env(r)
    return dataclasses.replace(job, env={**job.env, **extra}) if extra else job


def resumed_step(r: Runner) -> int | None:
    """The step the ranks running now resumed from: the newest round's, once the
    agent has begun one (its workers load the group's decision), else the launch's."""
    g, a = r.group, r.attempt
    if g is not None and g.rounds:
        return g.resumed
    return a.resumed_step if a is not None else None


def of_rounds_before(r: Runner, pid: int) -> bool:
    """A worker of the group's rounds before this one: its late beats (queued, or
    still in its ring, which a new reader would replay) are not this round's."""
    return r.group is not None and pid in r.group.before


def _leader_alive(a: Attempt) -> bool:
    return a.returncode is None and not a.closed


def check(r: Runner, a: Attempt, now: float) -> bool:
    """A live attempt's tick: a rank that ended by itself, or a peer's restart.
    True while this host's part of a restart waits for its evidence: nothing
    else is judged meanwhile."""
    g = r.group
    if g is None:
        return False
    _baseline(r, g)
    if g.waiting is not None:
        if now >= g.waiting.retry_at:
            w = g.waiting
            act(r, w.fault, w.incident, w.reason, w.charged, w.capture, waiting=w)
        return True
    if g.pending is not None:
        return rounds.after_evidence(r, g, a, now)
    if r.ranks.beaten:
        g.absorbed = 0  # the group's last restart is done here
    exits = r.first_failure.exits.exits
    new = [e for e in exits[g.exits_seen:] if e.pid not in g.before]
    judged = _judged(r, g, a, new, now)
    g.exits_seen += len(judged) if len(judged) == len(new) else 0
    failed = [e for e in judged if e.returncode != 0]
    if failed and len(judged) == len(new) and _leader_alive(a):
        from trainwatch.multihost import leave  # it calls rounds.new_round(): at run time

        ended = time.time() - (now - min(e.at for e in failed))
        if leave.admitted(r, a, now, ended):  # torchrun restarts them for a joiner
            return False
        first = r.first_failure.exits.first_failure() or failed[0]
        ev: dict[str, object] = {"rank_exit": first.evidence()}
        blamed = victim.peer_blamed(a.log_path, g.log_from, first.rank)
        if blamed is not None:  # a victim of another host's rank: not where it began
            ev["peer_failure"] = blamed
        fault = Fault(FaultKind.CRASH, r.job.name, first.at, ev,
                      rank=first.rank, onset_step=r.last_step, onset_known=False)
        if (drill := r.take_drill("crash")) is not None:  # faultinject crash --rank
            fault = drill.mark(fault)
        from trainwatch.lifecycle import respond  # respond calls act(): one circle, at run time

        respond.handle(r, fault)
        return False
    if g.settle is not None and now >= g.settle[3]:
        _settle(r, g)
    if now >= g.poll_at:
        g.poll_at = now + POLL
        rec = records.parse(records.call(r, records.newest_in_hand, g.root, g.gen))
        if rec is not None and rec.gen > g.gen:
            from trainwatch.multihost import follow  # it calls act(): at run time

            follow.follow(r, a, rec, now)
    return False


def _judged(r: Runner, g: Group, a: Attempt, new: list[RankExit],
            now: float) -> list[RankExit]:
    """This round's rank exits that are judged, each with how it ended. An exit 0 is
    the run's end (the agent ends next). One reaped by the agent before we read it
    failed when the agent says so (its "failed (exitcode: N) ... (pid: P)" line), or
    when a rank of the round still runs UNKNOWN_GRACE after it; with every rank
    gone and no such line it is not judged: the agent lingers after a run that ended
    well (its exit barrier, a loaded host), and ends next. Judged a failure after
    UNKNOWN_GRACE whatever, a finished run was restarted from its last checkpoint."""
    if all(e.returncode is not None for e in new):
        return new
    said = victim.agent_failed(a.log_path, g.log_from)
    running = r.first_failure.exits.running
    out = []
    for e in new:
        if e.returncode is None and e.pid in said:
            e = dataclasses.replace(e, returncode=said[e.pid])
        if e.returncode is not None or (running and now - e.at >= UNKNOWN_GRACE):
            out.append(e)
    return out


def wake(r: Runner, now: float) -> float | None:
    """The loop's next look at this host's part of a restart, when one is under way."""
    if r.group is not None and r.group.waiting is not None:
        return r.group.waiting.retry_at
    return None if r.group is None else rounds.wake(r.group, now)


def exit_unjudged(r: Runner, g: Group) -> bool:
    """A rank of this round has exited, its status unknown (torchrun's agent reaped it
    before we read it) and not judged yet: the others then go quiet with it, and a hang
    timeout shorter than UNKNOWN_GRACE would name that crash a hang."""
    return any(e.pid not in g.before for e in r.first_failure.exits.exits[g.exits_seen:])


def held(r: Runner, fault: Fault, now: float) -> bool:
    """A hang or stall in which no rank of this host is stopped: its ranks wait
    in a collective for another host's, whose daemon names it (multinode: the
    victims must not be named). Held for HOLD seconds, following a peer's
    restart meanwhile (check()); then acted on here all the same. Also held while a
    rank's exit of this round is unjudged: a hang in a round where a rank exited is
    that exit's crash."""
    g = r.group
    if g is None or fault.kind not in (FaultKind.HANG, FaultKind.NCCL_STALL):
        return False
    if exit_unjudged(r, g):
        return True  # that exit's crash, judged within UNKNOWN_GRACE (check()), not a hang
    if r.job.nodes is not None and r.job.nodes[1] <= 1:
        return False  # nodes: 1, a torchrun job on one host: no other host to wait for
    # Without the client, the ranks are the processes found by their RANK (stallwatch).
    if stopped_ranks(r.ranks.pids()) or stopped_ranks({p: p for p in r.stall.sampler.ranks}):
        return False
    if g.held_since is None:
        g.held_since = now
        log.info("job %s: %s with none of this host's ranks stopped: waiting %gs for the "
                 "host whose rank is to restart the group", r.job.name, fault.kind.value, HOLD)
    return now - g.held_since < HOLD


def act(r: Runner, fault: Fault, incident: int | None, reason: str, charged: bool,
        capture: Capture | None = None, keep_agent: bool = True,
        waiting: Waiting | None = None) -> bool:
    """This host acts on ``fault`` (a restart or rollback, decided; ``charged``:
    it spent one of the budget): the group restarts. True when done here (the
    agent lives: its workers end and it restarts them); False when the agent is
    gone, or must go (``keep_agent`` False: its workers' GPUs change, and only a
    new agent gets new ones), and is relaunched as usual. A restart another host
    made first is charged here as that host charged it: once, or not at all.
    ``waiting``: decided again, the job's hand not having answered before
    (decision.py); the workers are kept until it does."""
    g, a = r.group, r.attempt
    if g is None or a is None:
        return False
    _baseline(r, g)
    wall = time.time()
    onset = wall - max(0.0, r.clock() - fault.onset)
    if waiting is None and g.gen > (g.base or 0) and not r.ranks.beaten \
            and g.absorbed < ABSORB:
        last = records.parse(records.call(r, records.newest_in_hand, g.root, g.gen - 1))
        last = last if last is not None and last.gen == g.gen else None
        if last is None or decision.unbelieved(r, last) is None:  # else not one to be part of
            return _part_of_last(r, g, a, fault, incident, charged, onset, last)
    g.waiting = None
    kept = keep_agent and _leader_alive(a)
    made = decision.make(r, g, fault, incident, charged, wall, onset)
    if isinstance(made, str):
        if kept:  # else the relaunch waits for its checkpoints itself (actions/launch.py)
            now = r.clock()
            decision.wait(r, g, Waiting(
                fault, incident, reason, charged, capture,
                waiting.since if waiting is not None else now, now + decision.RETRY, made),
                waiting is not None)
            return True
        made = decision.Made(None, False)
    rec, won = made.rec, made.won
    for _ in range(_OTHERS_MAX):
        refused = decision.unbelieved(r, rec) if rec is not None and not won else None
        if refused is None or rec is None:
            break
        log.error("job %s: group restart %d, made by %s, resumes from %s: %s; this host "
                  "decides it itself, in restart %d", r.job.name, rec.gen, rec.host,
                  where(rec), refused, rec.gen + 1)
        g.gen = rec.gen
        again = decision.make(r, g, fault, incident, charged, wall, onset)
        rec, won = (again.rec, again.won) if isinstance(again, decision.Made) else (None, False)
    if waiting is not None:
        onset = decision.waited(r, waiting, rec)
    if rec is None:
        log.error("job %s: group restart %d not recorded in %s: the other hosts' ranks "
                  "resume from what they judge themselves", r.job.name, g.gen + 1,
                  records.folder(g.root))
        g.gen += 1
    else:
        g.gen, g.skip = rec.gen, rec.skip  # charged as this host's own view said (decide())
        _amend(r, incident, rec, won)
        log.warning("job %s: group restart %d (%s, began on %s): every rank resumes from %s",
                    r.job.name, rec.gen, "decided here" if won else f"decided by {rec.host}",
                    rec.began, where(rec))
    if not kept:
        return False
    if incident is not None and incident >= 0:
        r.ledger.backoff_applied(incident, 0.0)  # the agent starts the new round at once
    rounds.evidence_then_round(r, g, a, capture, rec, incident,
                               f"group restart {g.gen}: {reason}", onset, peers=True)
    return True


def _part_of_last(r: Runner, g: Group, a: Attempt, fault: Fault, incident: int | None,
                  charged: bool, onset: float, rec: records.Restart | None) -> bool:
    """A failure before this host's ranks beat again since the group's last
    restart (its agent lost the rendezvous store that ended with another host's
    agent; a worker's collective failed while the round formed): part of that
    restart, claimed in it and not charged again; at most ABSORB times, so that
    a start that always fails still spends the budget."""
    g.absorbed += 1
    records.call(r, records.claim_in_hand, g.root, g.gen, g.host,
          {"kind": fault.kind.value, "rank": fault.rank, "at": onset, "incident": incident,
           "reached": r.last_step})
    if charged and r.history.restarts:
        r.history.restarts.pop()  # decide() granted it last
    if incident is not None and incident >= 0:
        r.ledger.amend(incident, {"group_restart": g.gen, "part_of_restart": True,
                                  "charged": False}, None)
    log.warning("job %s: %s before this host's ranks beat again: part of group restart %d, "
                "not charged again (%d of %d)", r.job.name, fault.kind.value, g.gen,
                g.absorbed, ABSORB)
    if not _leader_alive(a):
        return False
    rounds.new_round(r, a, rec, incident, f"part of group restart {g.gen}", onset)
    return True


def where(rec: records.Restart) -> str:
    if rec.resume_path is None:
        return "scratch"
    return f"step {rec.resume_step} ({rec.resume_path})"


def _amend(r: Runner, incident: int | None, rec: records.Restart, won: bool) -> None:
    if incident is not None and incident >= 0:
        from trainwatch.multihost import leave

        r.ledger.amend(incident, {"group_restart": rec.gen, "began": rec.began,
                                  "decided_on": rec.host, "decided_here": won,
                                  "charged": rec.charged, "claims": rec.claimed(),
                                  **leave.evidence(r, rec)}, None)
        assert r.group is not None
        r.group.settle = (rec.gen, incident, rec.began, r.clock() + records.SETTLE)


def _settle(r: Runner, g: Group) -> None:
    """Where the restart began, once every host's claim is in."""
    assert g.settle is not None
    gen, incident, began, _ = g.settle
    g.settle = None
    raw = records.call(r, records.newest_in_hand, g.root, gen - 1)
    rec = records.parse(raw)
    if rec is None or rec.gen != gen:
        return
    found: dict[str, object] = {"began": rec.began, "claims": rec.claimed()}
    across = stackshare.judge(list(rec.stacks))
    if across is not None:
        found["stacks_across_hosts"] = across
    r.ledger.amend(incident, found, None)
    if began is None or rec.began == began:
        return
    log.info("job %s: group restart %d began on %s (every host's claim read; first "
             "thought %s)", r.job.name, gen, rec.began, began)


