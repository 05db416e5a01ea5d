"""A group's round on this host (multihost/group.py): its workers of before the
restart end (SIGCONT first: a stopped one must act on it) and its agent restarts
them; what a launch resets, without starting a process. When the fault's
evidence is being taken, the workers are kept until it is (at most
evidence.timeout) and what it found of their stacks is shared with the other
hosts (stackshare.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

from trainwatch.actions import rollback
from trainwatch.actions.tree import start_time
from trainwatch.multihost import records, stackshare
from trainwatch.multihost.state import Pending
from trainwatch.sources.rankexits import rank_processes
from trainwatch.sources.ranks import Ranks
from trainwatch.state.ledger import Relaunch, steps_lost
from trainwatch.types import JobState
from trainwatch.watch.state import LossFeed

_LOOK_EVERY = 0.25  # seconds between two looks for the other hosts' stacks
# While the evidence is taken, look this often whether it is done: the workers are
# killed (and the agent restarts them) only then, and the job's own grid is 1 s.
_EVIDENCE_POLL = 0.05

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.multihost.state import Group


def evidence_then_round(r: Runner, g: Group, a: Attempt, capture: Capture | None,
                        rec: records.Restart | None, incident: int | None, why: str,
                        onset: float, peers: bool = False) -> None:
    """The new round, once this host's evidence of the fault is taken (the stacks
    as they were: at most evidence.timeout) and shared with the other hosts; the
    host that acted also waits (as long again, at most) for the stacks of as many
    hosts as the group has at least (``nodes``' MIN): the others' ranks wait in
    their collectives only while this host's have not ended."""
    if capture is None:
        new_round(r, a, rec, incident, why, onset)
        return
    g.pending = Pending(capture, rec, incident, why, onset, r.clock() + capture.timeout + 1.0,
                        peers)
    r.hang_latched = True
    after_evidence(r, g, a, r.clock())


def _share(r: Runner, g: Group, capture: Capture, incident: int | None) -> None:
    if incident is None or incident < 0:
        return
    from trainwatch.actions import evidence  # it imports the lifecycle: at run time

    evidence.finish(r, capture, incident)
    shared = stackshare.lines(capture.summary, capture.out)
    if shared:
        records.call(r, records.stacks_in_hand, g.root, g.gen, g.host, shared)
        # The other hosts' lines come within their own capture's time.
        g.settle = (g.gen, incident, g.settle[2] if g.settle else None,
                    r.clock() + r.job.evidence.timeout + records.SETTLE)


def _peers_missing(r: Runner, g: Group, p: Pending, now: float) -> bool:
    """Fewer hosts' stacks in the restart's folder than the group has at least."""
    if now < p.look_at:
        return True
    p.look_at = now + _LOOK_EVERY
    least = r.job.nodes[0] if r.job.nodes else 1
    rec = records.parse(records.call(r, records.newest_in_hand, g.root, g.gen - 1))
    have = {h for h, _ in rec.stacks} if rec is not None and rec.gen == g.gen else set()
    return len(have | {g.host}) < least


def wake(g: Group, now: float) -> float | None:
    """When the loop must look again at a round waiting for its evidence."""
    return None if g.pending is None else now + _EVIDENCE_POLL


def after_evidence(r: Runner, g: Group, a: Attempt, now: float) -> bool:
    p = g.pending
    assert p is not None
    if not p.capture.done and now < p.deadline:
        return True
    if not p.shared:
        p.shared = True
        _share(r, g, p.capture, p.incident)
    if p.peers and now < p.deadline + r.job.evidence.timeout + 1.0 \
            and _peers_missing(r, g, p, now):
        return True
    g.pending = None
    new_round(r, a, p.rec, p.incident, p.reason, p.onset)
    return True


_HZ = os.sysconf("SC_CLK_TCK")


def _older(pids: set[int], than: float) -> set[int]:
    """Those of ``pids`` started before ``than`` (wall time): not the workers the
    agent started since, for the new round. Compared on the boot clock their start
    is kept on (/proc starttime, in ticks): psutil's create_time() adds the boot's
    epoch time, which /proc/stat truncates to the second, so it reads up to 1 s
    early, and a worker the agent had just started (a decision slower than its
    restart) was taken for an old one and killed, costing the group a round."""
    boot = than - (time.time() - time.clock_gettime(time.CLOCK_BOOTTIME))
    out = set()
    for pid in pids:
        started = start_time(pid)
        if started is not None and started / _HZ <= boot:
            out.add(pid)
    return out


def new_round(r: Runner, a: Attempt, rec: records.Restart | None, incident: int | None,
              reason: str, onset: float) -> None:
    """This host's workers of before ``onset`` (wall time) end (SIGCONT first: a
    stopped one must act on it); its agent restarts them in the group's new
    round. What a launch resets, without starting a process."""
    g = r.group
    assert g is not None
    now = r.clock()
    workers = set(r.ranks.pids().values())
    workers |= set(rank_processes(a.tree.scan(), r.stall.sampler.rank_of, r.ranks.pids()))
    workers.discard(a.pid)
    workers = _older(workers, onset + 0.05)  # start times are kept in ticks of 10 ms
    g.before, g.held_since = workers, None
    a.tree.signal_each(signal.SIGCONT, workers)
    a.tree.signal_each(signal.SIGKILL, workers)
    r.over_cap_before += r.ranks.over_cap
    r.ranks = Ranks(started=now, max_ranks=r.job.heartbeat.max_ranks)
    r.intake.new_attempt(a.ring_dir)
    r.first_failure.new_attempt(now)
    g.exits_seen = 0
    with contextlib.suppress(OSError):
        g.log_from = os.stat(a.log_path).st_size  # this round's output begins here
    r.anomalies = LossFeed(r.job.anomalies.detect)
    r.stall.new_attempt(r.job.stall)
    r.hang_latched = False
    rollback.sealed(r, incident, r.catalog.seal_quarantine())
    step = rec.resume_step if rec is not None else None
    g.rounds, g.resumed = g.rounds + 1, step  # a death before its first beat counts on it
    reached, r.last_step = r.last_step, step
    r.outages.started(now)
    r.to(JobState.STARTING, reason)
    if incident is not None and incident >= 0:
        lost = steps_lost(step, reached, rec.reached if rec else None)
        r.ledger.relaunched(incident, Relaunch(time.time(), rec.resume_path if rec else None,
                                               step, lost))
