"""The operator's commands, as the daemon answers them on the control socket
(``trainwatch status``, ``incidents``, ``checkpoints``, ``rollback``, ``pause``,
``resume``, ``stop``, ``start``, ``reload``; commands.py is the client side).
Each takes the request's args and returns the reply's payload; a ValueError
is the one line the client prints. ``answer`` also hands faultinject's
requests to drillrequests.py.

Who asks is checked first, before any work (access.py): a non-admin sees only
the jobs that run as them (``status``, ``incidents``), reads and acts only on
those (``access.Refused`` otherwise), and never reloads the config."""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from trainwatch import __version__
from trainwatch.actions import prune, rollback
from trainwatch.actions.launch import launch
from trainwatch.host import drillrequests
from trainwatch.host.deferred import Later
from trainwatch.lifecycle.policy import RestartHistory
from trainwatch.privsep import access
from trainwatch.privsep.access import Peer
from trainwatch.slurm.command import NO_SLURM
from trainwatch.state import checkpointlist
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.host.supervisor import Supervisor
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

OPS = frozenset({"status", "incidents", "checkpoints", "rollback", "pause", "resume", "stop",
                 "start", "reload"})
READS = frozenset({"status", "incidents", "checkpoints"})  # change nothing
QUIET = READS | {"attach"}  # not logged one by one (a rank asks again every 0.2 s)
_INCIDENTS_MAX = 200  # rows in one reply (a datagram of at most 64 KiB)


def answer(sup: Supervisor, op: str, args: dict[str, Any], peer: Peer
           ) -> dict[str, Any] | Later:
    """The reply to one request from ``peer`` (a Later when it waits for a job's
    hand: deferred.py); raises access.Refused before any work when the request
    is not theirs to make."""
    if op == "attach":  # a Slurm rank's; the daemon answers it (daemon.py) where it can
        raise ValueError(NO_SLURM)
    if op not in OPS:
        return drillrequests.answer(sup, op, args, peer)
    if op == "status":
        return status(sup, peer)
    if op == "incidents":
        return incidents(sup, args, peer)
    if op == "reload":
        access.admin_only(peer, "reload", sup.config.admin_group)
        return sup.reload()
    r = _runner(sup, args, peer)
    access.check(peer, r.job.name, r.job.user, act=op not in READS)
    if op == "checkpoints":
        return retention_plan(r) if args.get("plan") else checkpoints(r)
    if op == "rollback":
        step = args.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"expected a step number, got {step!r}")
        work = rollback.listing(r, step)
        if work is not None:  # the remote's listing waits in a hand, off the loop
            return Later(work, lambda held: roll_back(sup, r, step, held))
        return roll_back(sup, r, step, None)
    if op == "pause":
        pause(r, True)
    elif op == "resume":
        pause(r, False)
    elif op == "stop":
        r.stop("operator: trainwatch stop")
    elif op == "start":
        start(r)
    return {"job": r.job.name, "state": r.state.value if r.state else None, "paused": r.paused}


def roll_back(sup: Supervisor, r: Runner, step: int, held: list[int] | None
              ) -> dict[str, Any]:
    """Roll ``r`` back to ``step`` (``held``: the remote's steps, listed off the loop)."""
    if r not in sup.runners:  # removed by a reload while the remote was listed
        raise ValueError(f"job {r.job.name} is no longer supervised here")
    path = rollback.to_step(r, step, f"operator: rollback to step {step}", held)
    return {"job": r.job.name, "checkpoint": path, "step": step}


def pause(r: Runner, paused: bool) -> None:
    """Keep watching the job, stop acting on its faults (or act again)."""
    if paused != r.paused:
        r.paused = paused
        log.warning("job %s: %s by the operator", r.job.name,
                    "paused (watching, not acting)" if paused else "resumed")
        r.save()
        r.publish()


def start(r: Runner) -> None:
    """Start a job that ended (stopped, finished, given up), with a fresh budget."""
    if r.state not in (JobState.EXITED, JobState.FATAL, JobState.PAUSED, None):
        raise ValueError(f"job {r.job.name} is {r.state.value}: stop it first")
    r.history = RestartHistory()
    launch(r, "operator: trainwatch start")


def _runner(sup: Supervisor, args: dict[str, Any], peer: Peer) -> Runner:
    name = args.get("job")
    for r in sup.runners:
        if r.job.name == name:
            return r
    known = ", ".join(_visible(sup, peer)) or "none"
    raise ValueError(f"no job named {name!r} here (jobs: {known})")


def _visible(sup: Supervisor, peer: Peer) -> list[str]:
    """The names of the jobs this sender may see."""
    return access.mine(peer, ((r.job.name, r.job.user) for r in sup.runners))


def status(sup: Supervisor, peer: Peer) -> dict[str, Any]:
    now, wall = time.monotonic(), time.time()
    jobs = []
    last = {}
    runners = sup.runners if peer.admin else [r for r in sup.runners
                                              if access.may(peer, r.job.user)]
    # Another user's request reads the ledger of its own jobs only (or not at all).
    for row in (sup.ledger.incidents() if peer.admin else
                [row for r in runners for row in sup.ledger.incidents(r.job.name)[-1:]]):
        last[row["job"]] = row
    for r in runners:
        a = r.attempt
        beats = [v.last_beat for v in r.ranks.snapshot(now, 1 << 30).ranks]
        intervals = list(r.ranks.intervals)[-64:]
        per_step = statistics.median(intervals) if intervals else None
        inc = last.get(r.job.name)
        jobs.append({
            "job": r.job.name,
            "state": r.state.value if r.state else None,
            "paused": r.paused,
            "attempt": r.number,
            "pid": a.pid if a is not None and not a.closed else None,
            "step": r.last_step,
            "steps_per_second": 1.0 / per_step if per_step else None,
            "last_beat_age": now - max(beats) if beats else None,
            "restarts": r.restarts,
            "gpus": a.gpus if a is not None else None,
            "last_incident": {"id": inc["id"], "kind": inc["kind"], "action": inc["action"],
                              "time": inc["time"]} if inc else None,
        })
    return {"jobs": jobs, "daemon": {"pid": os.getpid(), "version": __version__,
                                     "uptime": wall - sup.started_wall,
                                     "config": sup.config.source}}


def incidents(sup: Supervisor, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    job, limit = args.get("job"), args.get("limit", 50)
    if job is not None and not isinstance(job, str):
        raise ValueError(f"expected a job name, got {job!r}")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"expected a positive limit, got {limit!r}")
    limit = min(limit, _INCIDENTS_MAX)
    if peer.admin:
        rows = sup.ledger.incidents(job)[-limit:]
    elif job is not None:
        # Another user reads the incidents of a job of this config that runs as them;
        # a job removed from it has no owner to check against.
        r = _runner(sup, {"job": job}, peer)
        access.check(peer, r.job.name, r.job.user, act=False)
        rows = sup.ledger.incidents(job)[-limit:]
    else:
        rows = sorted((row for name in _visible(sup, peer)
                       for row in sup.ledger.incidents(name)[-limit:]),
                      key=lambda row: int(row["id"]))[-limit:]
    for row in rows:  # evidence can be long: the reply must fit one datagram
        row["evidence"] = {k: str(v)[:200] for k, v in list(row["evidence"].items())[:16]}
    return {"incidents": rows}


def retention_plan(r: Runner) -> dict[str, Any]:
    """What retention would delete now (checkpoints.keep), and why the rest stays."""
    p = prune.plan(r)
    return {"job": r.job.name, "rules": r.job.checkpoints.keep.deletes,
            "delete": [{"step": c.step, "path": c.path, "size": c.size} for c in p.delete],
            "kept": [{"step": s, "why": why} for s, why in p.kept[-200:]],
            "free_bytes": prune.free_space(r)}


def checkpoints(r: Runner) -> dict[str, Any]:
    return checkpointlist.listing(r.job.name, r.catalog, hand=r.hands.quick)
