"""A host whose GPUs failed leaves its group, and joins it again once a
pre-flight of them passes (NVIDIA's launcher's node health check, done by the
host that knows its GPUs).

Leaving: a GPU fault whose action is restart_exclude_gpu leaves this host
fewer healthy GPUs than ``gpus.min``. A job on one host goes FATAL; a host of
a job across hosts records a group restart that ``leaves`` it (records.py),
stops its whole tree (agent and workers: the usual stop) and waits in
BACKOFF. The other hosts follow the restart; their agents meet again without
it (torchrun ``--nnodes MIN:MAX``: once its heartbeats expire, ~15 s, and
``last_call``), or, when MIN cannot be met without it, wait for a host.

A host whose trainwatch restarts meanwhile stays out the same way: its GPUs'
exclusions are on disk, and a launch on fewer healthy GPUs than the job needs
waits for a pre-flight (``stay_out``) instead of going FATAL.

Out of the group: every ``gpus.preflight_every`` a pre-flight of the GPUs it
would use (preflight.py). Once one passes, their exclusion is lifted, a
**join** restart is recorded (never charged) and the agent is launched: it
joins the running group, whose agents restart their workers for it (a
membership change, which torchrun does not count as a failure either). The
other hosts follow the join; the exits of their workers in that change are
the new round's beginning, not crashes (``admitted``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from trainwatch.multihost import group, preflight, records, rounds
from trainwatch.multihost.state import Joining, Out
from trainwatch.privsep import credentials
from trainwatch.types import Action, Fault, FaultKind, JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

_RUNNING_POLL = 0.2  # seconds between two looks at a pre-flight still running
# After a peer's join restart, its agent arrives within this long: the exits of
# this host's workers meanwhile are torchrun restarting them for it.
JOIN_WINDOW = 60.0


def _nodes(r: Runner, host: str) -> str:
    """What the group does without ``host``, as far as this host can tell."""
    lo, hi = r.job.nodes or (1, 1)
    if lo == hi:
        return (f"the job waits for a host: torchrun needs all {lo} (nodes {lo}); "
                f"{host} joins again once its GPUs pass a pre-flight")
    return (f"the others go on without it while at least {lo} remain (nodes {lo}:{hi}); "
            f"below {lo} the job waits for a host")


def note(r: Runner, rec: records.Restart) -> str:
    """A peer's restart, as it changes the group (for its incident's decision)."""
    if rec.leaves is not None:
        return f"; {rec.leaves} left the group ({rec.kind}): {_nodes(r, rec.leaves)}"
    if rec.joins is not None:
        return f"; {rec.joins} joins the group again (its GPUs passed a pre-flight)"
    return ""


def evidence(r: Runner, rec: records.Restart) -> dict[str, object]:
    """A restart that changes the group, as its incidents record it."""
    if rec.leaves is not None:
        return {"leaves": rec.leaves, "group": _nodes(r, rec.leaves)}
    if rec.joins is not None:
        return {"joins": rec.joins}
    return {}


def waiting(r: Runner) -> str | None:
    """This host's BACKOFF reason while it is out of its group."""
    g = r.group
    return g.out.waiting if g is not None and g.out is not None else None


def _gpus(r: Runner) -> tuple[int, ...]:
    devices = r.job.gpus.devices
    if devices is not None:
        return tuple(devices)
    return tuple(r.gpuwatch.indices) if r.gpuwatch is not None else ()


def leave(r: Runner, fault: Fault, incident: int | None) -> str | None:
    """This host leaves its group (recorded for the others), or None: not a job
    across hosts. Returns the reason it waits with, once its tree is stopped."""
    g = r.group
    if g is None:
        return None
    group._baseline(r, g)
    cp = r.catalog.last_good()
    wall = time.time()
    onset = wall - max(0.0, r.clock() - fault.onset)
    decision = {"resume_step": cp.step if cp else None, "resume_path": cp.path if cp else None,
                "skip": list(r.skip[:2]) if r.skip else None, "kind": fault.kind.value,
                "at": wall, "charged": True, "leaves": g.host}
    claim = {"kind": fault.kind.value, "rank": None, "at": onset, "incident": incident,
             "reached": r.last_step}
    raw = records.call(r, records.begin_in_hand, g.root, g.gen + 1, g.host, decision, claim)
    rec = records.parse(raw)
    if rec is None:
        g.gen += 1
        log.error("job %s: group restart %d (%s leaves) not recorded in %s: the other hosts "
                  "learn of it from torchrun alone", r.job.name, g.gen, g.host,
                  records.folder(g.root))
    else:
        g.gen = rec.gen
        won = isinstance(raw, dict) and raw.get("won") is True
        if not rec.charged and r.history.restarts:
            r.history.restarts.pop()  # decide() granted it: the maker did not charge it
        group._amend(r, incident, rec, won)
    out = g.out = _out(r, fault.kind.value, _gpus(r))
    if incident is not None and incident >= 0:
        r.ledger.amend(incident, {"leaves": g.host, "group": _nodes(r, g.host),
                                  "preflight": out.check.kind}, None)  # also when not won
    log.warning("job %s: %s leaves the group (%s on GPU %s; fewer healthy GPUs than the "
                "job's %d): %s; %s", r.job.name, g.host, fault.kind.value, fault.gpu,
                r.job.gpus.min, _nodes(r, g.host), out.waiting)
    return out.waiting


def _out(r: Runner, kind: str, gpus: tuple[int, ...]) -> Out:
    check = preflight.choose(r.config.gpu.backend, python=preflight.python_of(r.job.command))
    why = (f"left the group: waiting for a pre-flight of GPUs {','.join(map(str, gpus))} "
           f"({check.what}), every {r.job.gpus.preflight_every:g}s")
    return Out(kind, gpus, check, why)


def stay_out(r: Runner) -> bool:
    """A launch on fewer healthy GPUs than the job needs (its exclusions outlive
    a restart of trainwatch): a host of a job across hosts stays out of its group
    and waits in BACKOFF for a pre-flight, as when it left, rather than going
    FATAL. True when so; not for an operator's start of an ended job, nor when
    the host has too few GPUs even with none excluded (no pre-flight can help)."""
    g = r.group
    if g is None or r.state not in (None, JobState.BACKOFF) \
            or len(_gpus(r)) < r.job.gpus.min:
        return False
    group._baseline(r, g)
    if g.out is None:
        gpus = _gpus(r)
        whys = [w for d, w in (r.gpuwatch.health.excluded() if r.gpuwatch else {}).items()
                if d in gpus]
        kind = whys[0].split(" ", 1)[0] if whys else FaultKind.GPU_XID.value
        g.out = _out(r, kind if kind in {k.value for k in FaultKind} else "gpu_xid", gpus)
        log.warning("job %s: %s stays out of its group (fewer healthy GPUs than the job's "
                    "%d): %s", r.job.name, g.host, r.job.gpus.min, g.out.waiting)
    if r.state is None:
        r.to(JobState.BACKOFF, g.out.waiting)
    r.relaunch_at = r.clock()  # its pre-flight, at once
    return True


def _run(r: Runner, out: Out) -> preflight.Result | None:
    """The pre-flight's result, or None while it runs (in a thread: a program)."""
    if out.check.kind == "sim":
        if r.gpuwatch is None:
            return preflight.Result(None, "GPU monitoring is off")
        return preflight.sim(r.gpuwatch, out.gpus)
    if out.check.kind == "none":
        return preflight.judge(out.check, 0, "")
    if out.thread is None:
        try:
            ident = credentials.resolve(r.job.user, r.job.group)
        except (KeyError, OSError) as e:
            return preflight.Result(False, f"the job's user: {e}")
        check, gpus, env = out.check, out.gpus, dict(r.job.env)
        out.box.clear()
        out.thread = threading.Thread(
            target=lambda: out.box.append(preflight.run(check, gpus, ident, env)),
            name="trainwatch-preflight", daemon=True)
        out.thread.start()
        return None
    if out.thread.is_alive():
        return None
    out.thread = None
    return out.box[0] if out.box else preflight.Result(False, "the pre-flight died")


def relaunch_due(r: Runner, now: float) -> bool:
    """In BACKOFF: True once the relaunch is due; never while this host is out of
    its group and its pre-flight has not passed (looked at again later)."""
    g = r.group
    if now < r.relaunch_at:
        return False
    if g is None or g.out is None:
        return True
    out = g.out
    res = _run(r, out)
    if res is None:
        r.relaunch_at = now + _RUNNING_POLL
        return False
    passed = res.passed
    if passed is None and r.gpus() is not None:
        healthy = [d for d in out.gpus if d in (r.gpus() or [])]
        passed = len(healthy) >= r.job.gpus.min  # the operator put them back (clear-gpu)
    if not passed:
        if res.detail != out.said:
            out.said = res.detail
            log.warning("job %s: pre-flight of GPUs %s: %s; out of the group, looked at "
                        "again every %gs", r.job.name, ",".join(map(str, out.gpus)),
                        res.detail, r.job.gpus.preflight_every)
        r.relaunch_at = now + r.job.gpus.preflight_every
        return False
    _join(r, out, res)
    return True


def _join(r: Runner, out: Out, res: preflight.Result) -> None:
    """The pre-flight passed: the GPUs back in service, the join recorded."""
    g = r.group
    assert g is not None
    w = r.gpuwatch
    if w is not None:
        for d in out.gpus:
            if d in w.health.excluded():
                w.clear(d)
                log.warning("GPU %d passed its pre-flight (%s): back in service", d, res.detail)
    now = records.call(r, records.current_in_hand, g.root)
    if isinstance(now, int) and now > g.gen:
        g.gen = now  # restarts of the others while this host was out
    cp = r.catalog.last_good()
    wall = time.time()
    decision = {"resume_step": cp.step if cp else None, "resume_path": cp.path if cp else None,
                "skip": list(r.skip[:2]) if r.skip else None, "kind": out.kind,
                "at": wall, "charged": False, "joins": g.host}
    try:
        kind = FaultKind(out.kind)
    except ValueError:
        kind = FaultKind.GPU_XID
    fault = Fault(kind, r.job.name, r.clock(), {"joins": g.host, "preflight": res.detail,
                                                "gpus": list(out.gpus)},
                  onset_step=r.last_step, onset_known=False)
    incident = r.ledger.incident(
        fault, Action.RESTART.value,
        f"group restart {g.gen + 1}: {g.host} joins the group again: its pre-flight "
        f"passed ({res.detail}); not charged", max(r.number, 0), None)
    claim = {"kind": out.kind, "rank": None, "at": wall, "incident": incident,
             "reached": r.last_step}
    raw = records.call(r, records.begin_in_hand, g.root, g.gen + 1, g.host, decision, claim)
    rec = records.parse(raw)
    if rec is None:
        g.gen += 1
    else:
        g.gen = rec.gen
        group._amend(r, incident, rec, isinstance(raw, dict) and raw.get("won") is True)
    log.warning("job %s: %s joins the group again (group restart %d, not charged): its "
                "pre-flight passed (%s); every rank resumes from %s", r.job.name, g.host,
                g.gen, res.detail, "scratch" if cp is None else f"step {cp.step}")
    g.out, g.before, g.exits_seen, g.held_since = None, set(), 0, None
    if incident is not None and incident >= 0 and r.pending_incident is None:
        # The launch records its relaunch: the fault's own incident's where one waits
        # (its outage ends with this launch), else the join's.
        r.pending_incident = incident


def follow_join(r: Runner, rec: records.Restart, now: float) -> None:
    """A peer joins the group again: recorded here, never charged; this host's
    workers go on until its agent restarts them for the newcomer."""
    g = r.group
    assert g is not None
    try:
        kind = FaultKind(rec.kind)
    except ValueError:
        kind = FaultKind.GPU_XID
    fault = Fault(kind, r.job.name, now, {"group_restart": rec.gen, "joins": rec.joins,
                                          "decided_on": rec.host, "followed": True,
                                          "charged": False, "claims": rec.claimed()},
                  onset_step=r.last_step, onset_known=False)
    a = r.attempt
    incident = r.ledger.incident(
        fault, Action.RESTART.value,
        f"group restart {rec.gen}: {rec.joins} joins the group again (its GPUs passed a "
        "pre-flight): not charged; this host's agent restarts its workers to admit it",
        a.number if a is not None else max(r.number, 0), None, observe_only=r.observing)
    g.joining = Joining(rec, incident, now + JOIN_WINDOW)
    log.warning("job %s: group restart %d: %s joins the group again (not charged); "
                "resuming from %s", r.job.name, rec.gen, rec.joins,
                "scratch" if rec.resume_path is None else f"step {rec.resume_step}")


def admitted(r: Runner, a: Attempt, now: float, ended: float) -> bool:
    """This host's workers ended (seen at ``ended``, wall time) while a peer's join
    is due: its agent restarts them to admit the newcomer (torchrun's membership
    change), a new round, not a crash. True when so. The round's workers are those
    started before the join was recorded, or before the end was seen: the agent's
    new round may already run when a loaded loop gets here (3 s late, once), and
    its workers, taken for old ones, were killed: the newcomer's rank crashed with
    them, a third group restart charged to the budget."""
    g = r.group
    if g is None or g.joining is None:
        return False
    j, g.joining = g.joining, None
    if now >= j.until or r.observing:
        return False
    began = j.rec.began_at
    rounds.new_round(r, a, j.rec, j.incident,
                    f"group restart {j.rec.gen}: {j.rec.joins} admitted, a new round",
                    min(ended, began) if began is not None else ended)
    return True
