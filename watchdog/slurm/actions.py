"""What the daemon asks of Slurm. Each call checks its inputs before anything
runs (refused, with nothing run), runs Slurm's commands through ``command.run``
(each under ``slurm.timeout``) and returns one ``Result``; none raises on what
Slurm says or prints.

Requeue works only on a batch job submitted as requeueable (``JobRequeue=1``
or ``--requeue``); requeueing someone else's job needs Slurm's Operator (or
Admin, Coordinator), drain and resume need Admin (``man scontrol``,
AUTHORIZATION). The daemon runs as root."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from trainwatch.slurm.command import Outcome, Result, Slurm, run
from trainwatch.slurm.parse import (
    JobInfo,
    ListedPid,
    NodeInfo,
    Parsed,
    after_requeue,
    bad_delay,
    bad_job,
    bad_node,
    drain_reason,
    judge_drain,
    judge_resume,
    parse_job,
    parse_job_owner,
    parse_listpids,
    parse_node,
    start_not_before,
)

T = TypeVar("T")

DEFAULT = Slurm()
# Only these job states are requeued (`scontrol requeue Incomplete`): a job that
# has ended (one its user cancelled, too) is never brought back.
INCOMPLETE = ("CONFIGURING", "RUNNING", "STOPPED", "SUSPENDED")
# Seconds a requeued job may take to finish completing before trainwatch gives up
# starting it at once: its tasks get KillWait (30 s by default) to end after
# SIGTERM, then the epilogs run.
SETTLE = 300.0
POLL = 0.5  # seconds between reads of a completing job


def _refused(problem: str) -> Result[T]:
    return Result(Outcome.REFUSED, f"not run: {problem}")


def _read(r: Result[str], what: str, parse: Callable[[str], Parsed[T]]) -> Result[T]:
    """The parsed stdout of a command that reads; its failure as it was."""
    if not r.ok:
        return Result(r.outcome, r.message)
    try:
        p = parse(r.value or "")
    except Exception as e:  # a parser's bug on odd output must not reach the daemon
        p = Parsed(None, f"{type(e).__name__}: {e}")
    if p.value is None:
        return Result(Outcome.FAILED, f"{what}: unexpected output: {p.why}")
    return Result(Outcome.OK, value=p.value)


def job_info(job: int, *, slurm: Slurm = DEFAULT) -> Result[JobInfo]:
    """The job's state and restart count (``scontrol show job -o``)."""
    if problem := bad_job(job):
        return _refused(problem)
    return _read(run(slurm, ["scontrol", "show", "job", "-o", str(job)]),
                 "scontrol show job", lambda text: parse_job(text, job))


def job_owner(job: int, *, slurm: Slurm = DEFAULT) -> Result[tuple[JobInfo, int]]:
    """job_info and the uid of the job's owner (``UserId=name(uid)``), from one
    ``scontrol show job -o``."""
    if problem := bad_job(job):
        return _refused(problem)
    return _read(run(slurm, ["scontrol", "show", "job", "-o", str(job)]),
                 "scontrol show job", lambda text: parse_job_owner(text, job))


def restart_count(job: int, *, slurm: Slurm = DEFAULT) -> Result[int]:
    """How often the job was requeued (``Restarts=``; SLURM_RESTART_COUNT of its
    current run, or 0 on its first): the restart counter every host agrees on."""
    r = job_info(job, slurm=slurm)
    return Result(r.outcome, r.message,
                  value=r.value.restarts if r.value is not None else None)


def requeue(job: int, *, slurm: Slurm = DEFAULT, start_delay: float = 0.0,
            settle_timeout: float = SETTLE, expect: int | None = None) -> Result[int]:
    """Requeue a running batch job on every node and start it again at once; its
    restart count after the requeue as ``value``.

    ``scontrol requeue Incomplete``, then ``scontrol update JobId= StartTime=now``;
    without that the job waits for a BeginTime of cred_expire + 1 s (121 s by
    default). Slurm's ``requeue`` exits 0 without acting on a job that is not
    incomplete (and plain ``requeue`` brings back an ended one), so the restart
    count is read before and after: a job it did not requeue is refused with its
    state. The start waits (``after_requeue``) for the job to finish completing,
    at most `settle_timeout` seconds, then `start_delay` seconds after the
    requeue, and never in the requeue's whole second (``start_not_before``)."""
    if problem := bad_job(job) or bad_delay(start_delay) or bad_delay(settle_timeout):
        return _refused(problem)
    before = job_info(job, slurm=slurm)
    if before.value is None:
        return Result(before.outcome, before.message)
    if expect is not None and before.value.restarts > expect:  # another node was first
        return Result(Outcome.OK, f"job {job} was requeued already (restart "
                      f"{before.value.restarts}): not again", (), before.value.restarts)
    asked = run(slurm, ["scontrol", "requeue", "Incomplete", str(job)])
    requeued_at = time.time()
    if not asked.ok:
        return Result(asked.outcome, asked.message)
    after = job_info(job, slurm=slurm)
    if after.value is None:
        return Result(Outcome.FAILED, f"job {job}: requeue sent, but the job could not be "
                      f"read back: {after.message}")
    if after.value.restarts <= before.value.restarts:
        return Result(Outcome.REFUSED, f"job {job} was not requeued: it was "
                      f"{before.value.state} (Slurm requeues only a job that is "
                      f"{', '.join(INCOMPLETE)})")
    return _start(job, after.value.restarts, requeued_at, slurm, start_delay, settle_timeout)


def _start(job: int, restarts: int, requeued_at: float, slurm: Slurm, delay: float,
           settle_timeout: float) -> Result[int]:
    """Start a job requeued at `requeued_at` (wall clock) once it is pending again."""
    said, done = f"job {job} requeued (restart {restarts})", ("requeue",)
    deadline = time.monotonic() + settle_timeout
    while True:
        seen = job_info(job, slurm=slurm)
        if seen.value is None:
            return Result(seen.outcome, f"{said}, not started at once: {seen.message}",
                          done, restarts)
        step = after_requeue(seen.value.state)
        if step == "start":
            break
        if step == "leave":
            return Result(Outcome.OK, f"{said}; not started by trainwatch: it is "
                          f"{seen.value.state}", done, restarts)
        if time.monotonic() > deadline:
            return Result(Outcome.FAILED, f"{said}, but still {seen.value.state} after "
                          f"{settle_timeout:g}s: not started at once (it starts at its "
                          "BeginTime)", done, restarts)
        time.sleep(POLL)
    time.sleep(max(0.0, start_not_before(requeued_at, delay) - time.time()))
    started = run(slurm, ["scontrol", "update", f"JobId={job}", "StartTime=now"])
    if started.ok:
        return Result(Outcome.OK, f"{said} and started", (*done, "start"), restarts)
    if "no longer pending" in started.message:  # it started (or ended) meanwhile
        return Result(Outcome.OK, f"{said}; it was no longer pending when started: "
                      f"{started.message}", done, restarts)
    return Result(started.outcome, f"{said}, not started at once (it starts at its "
                  f"BeginTime): {started.message}", done, restarts)


def node_info(node: str, *, slurm: Slurm = DEFAULT) -> Result[NodeInfo]:
    """The node's state and drain reason (``sinfo``: its free-text reason comes
    last there, unlike in ``scontrol show node -o``, where a reason that holds
    `` State=IDLE`` reads as a second State)."""
    if problem := bad_node(node):
        return _refused(problem)
    r = run(slurm, ["sinfo", "--noheader", "--Node", "--all", f"--nodes={node}",
                    "--Format=NodeList:|,StateComplete:|,Reason:"])
    if r.ok and not (r.value or "").strip():
        return Result(Outcome.REFUSED, f"sinfo lists no node {node} (not a node of this "
                      "cluster, or in no partition)")
    return _read(r, "sinfo", lambda text: parse_node(text, node))


def drain(node: str, why: str, *, slurm: Slurm = DEFAULT) -> Result[None]:
    """Drain the node (its running jobs go on; it takes no new ones) with the
    reason ``trainwatch: <why>``, unless it is already out of service with a
    reason not trainwatch's: that is left as it is (ok, nothing done)."""
    if problem := bad_node(node):
        return _refused(problem)
    reason = drain_reason(why)
    seen = node_info(node, slurm=slurm)
    if seen.value is None:
        return Result(seen.outcome, seen.message)
    go, because = judge_drain(seen.value)
    if not go:
        return Result(Outcome.OK, because)
    r = run(slurm, ["scontrol", "update", f"NodeName={node}", "State=DRAIN",
                    f"Reason={reason}"])
    if not r.ok:
        return Result(r.outcome, r.message)
    return Result(Outcome.OK, f"{node} drained: {reason}", ("drain",))


def resume_if_ours(node: str, *, slurm: Slurm = DEFAULT) -> Result[None]:
    """Resume the node only if it is drained (or draining) and its reason still
    starts with ``trainwatch:``; otherwise leave it (ok, nothing done). The
    message says what was found."""
    if problem := bad_node(node):
        return _refused(problem)
    seen = node_info(node, slurm=slurm)
    if seen.value is None:
        return Result(seen.outcome, seen.message)
    go, because = judge_resume(seen.value)
    if not go:
        return Result(Outcome.OK, because)
    r = run(slurm, ["scontrol", "update", f"NodeName={node}", "State=RESUME"])
    if not r.ok:
        return Result(r.outcome, f"{because}; resume: {r.message}")
    return Result(Outcome.OK, f"{because}: resumed", ("resume",))


def listpids(job: int, node: str, *, slurm: Slurm = DEFAULT) -> Result[tuple[ListedPid, ...]]:
    """The processes the slurmstepds of `node` track for the job (``scontrol
    listpids``: it asks them through that node's spool dir, so it answers on the
    node itself, without slurmctld). A job with no step there: ok, ()."""
    if problem := bad_job(job) or bad_node(node):
        return _refused(problem)
    r = run(slurm, ["scontrol", "listpids", str(job), node])
    if r.outcome is Outcome.REFUSED and "does not exist on node" in r.message:
        return Result(Outcome.OK, r.message, value=())
    return _read(r, "scontrol listpids", lambda text: parse_listpids(text, job))
