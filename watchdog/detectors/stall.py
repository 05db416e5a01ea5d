"""nccl_stall: the ranks of a job stop advancing while their processes live.

When one rank of a data-parallel job stops (SIGSTOP, a stuck kernel, a dead
NIC), the others block in the next collective: every rank goes quiet at about
the same step, and PyTorch's own watchdog waits 10 minutes before it says so.
This decides within seconds, from what trainwatch sees of every rank:

- armed once two ranks or more have beaten twice; it fires when no rank has
  advanced its step for the
  stall timeout: ``factor`` x the p99 step time, within ``floor`` and
  ``ceiling`` (the ceiling until the step time is learned). One rank alone
  (the one rank a host has of a job across hosts) is silent for its own
  reasons: only a stopped process ('T') is a hang after that timeout;
- which rank: the one whose process is stopped ('T'); else the one behind the
  others' step; else the one in uninterruptible sleep ('D'); else the one idle
  while the others spin; else none (the stacks may still tell, evidence/capture.py).
  ``decided_by`` says which evidence named it;
- every rank busy on the CPU and none the odd one out is a long synchronous
  phase (an evaluation, a checkpoint save) until the ceiling: only then a stall;
- a GPU fault on the job's GPUs in the same window wins: the incident is
  classed as that fault (``gpu_xid``, ...), with the stall as its evidence;
- a rank whose process has ended is not stalled, it exited (its exit is judged
  as one: watch/exits.py, firstfailure.py): every rank ended is no stall at all
  (a launcher lingering after its workers finished: torchrun's exit barrier, its
  store's shutdown on a loaded host), and while one has, the others are given
  until the ceiling (winding down after it, or waiting on a peer that left).

``detect_silent`` is the fallback for a job without the client: one rank
stopped (T) for the floor; or every process idle for the floor while the stacks,
read twice, keep one rank outside any collective and the others inside one (the
others wait for it); else output silent for ``silence``, and every process idle
(or stopped) at each sample since the sampling began, half of it in. Here and
above, a process in R (running, or runnable and waiting for a core), or moving
``IDLE_IO`` bytes a second, is busy, never idle, whatever its CPU rate says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from trainwatch.types import Fault, FaultKind, RankView

STOPPED = frozenset({"T", "t", "D"})  # stopped, traced, uninterruptible sleep
# Bytes per second of I/O at which a process is working, whatever its CPU: a rank
# writing a checkpoint to a slow file system (measured: 10 minutes of it at 0.01
# cores would have been a stall at the silence). A stuck one moves nothing.
IDLE_IO = 64 * 1024.0


@dataclass(frozen=True)
class StallSettings:
    factor: float = 3.0  # x the p99 step time
    floor: float = 5.0  # never sooner: a checkpoint save or a GC pause is not a stall
    ceiling: float = 30.0  # never later (PyTorch's NCCL timeout is 600 s)
    # Without the client: output silent and every process idle this long. On by
    # default, well inside PyTorch's own 600 s NCCL timeout, and long enough that
    # a save, an evaluation or a slow start is not a stall (they are busy or speak).
    silence: float | None = 300.0  # None: off
    idle_cpu: float = 0.05  # cores: below this a process counts as idle


@dataclass(frozen=True)
class Proc:
    """One rank's process at the instant of judgement."""

    pid: int
    state: str  # /proc's letter: R S D T t Z
    cpu_rate: float | None  # cores used since the previous sample; None: one sample only
    # Bytes read and written (any file, pipe or socket) per second since then; None:
    # not known. A checkpoint written to a slow file system uses little CPU.
    io_rate: float | None = None


@dataclass(frozen=True)
class StallView:
    now: float
    ranks: tuple[RankView, ...]
    p99: float | None  # learned seconds per step, None until enough samples
    procs: Mapping[int, Proc] = field(default_factory=dict)  # by rank
    gpu_faults: tuple[Fault, ...] = ()  # recent faults of the job's GPUs (gpu_*)
    gpus: Mapping[int, int] = field(default_factory=dict)  # rank -> GPU, where known
    ended: frozenset[int] = frozenset()  # ranks whose process is gone (or a zombie)


# A rank's main-thread stack as detectors/stacks.py reduces it: (function, file)
# innermost first, and whether it is inside a collective.
Stack = tuple[tuple[tuple[str, str], ...], bool]


@dataclass(frozen=True)
class StackProbe:
    """The ranks' stacks read at one moment (watch/stackprobe.py), by rank."""

    at: float
    ranks: Mapping[int, Stack]


@dataclass(frozen=True)
class SilentView:
    """A job without the client: its processes and its output."""

    now: float
    silent_for: float | None  # seconds since the job last wrote output; None: unknown
    procs: Mapping[int, Proc]  # by rank (from RANK in its environment), or by pid (-pid)
    attempt_age: float
    quiet_for: float  # every process idle or stopped at each sample this long (stallwatch.py)
    # Seconds each rank's process has been stopped (T) at every sample (stallwatch.py).
    stopped_for: Mapping[int, float] = field(default_factory=dict)
    # The ranks' stacks, oldest first, read in this quiet stretch (stackprobe.py).
    probes: tuple[StackProbe, ...] = ()
    # Ranks whose GPU was busy at its last poll: a kernel runs while the CPU waits.
    gpu_busy: frozenset[int] = frozenset()
    # Other hosts' ranks, as their hosts last read them: inside a collective or not.
    peers: Mapping[int, bool] = field(default_factory=dict)


def stall_timeout(p99: float | None, s: StallSettings) -> float:
    if p99 is None:
        return s.ceiling
    return min(s.ceiling, max(s.floor, s.factor * p99))


def _judges(v: StallView) -> list[RankView]:
    return [r for r in v.ranks if r.beats >= 2]


def next_deadline(v: StallView, s: StallSettings) -> float | None:
    judges = _judges(v)
    if not judges:
        return None
    return max(r.advanced_at for r in judges) + stall_timeout(v.p99, s)


# One in R runs or waits for a core: busy, whatever its rate says. On a loaded
# host that rate reads low (starved, or carried over from a sample it slept
# through: sources/procs.py), and a job starting up or winding down looked stuck.
def _idle(p: Proc | None, idle_cpu: float) -> bool:
    return (p is not None and p.state != "R" and p.cpu_rate is not None
            and p.cpu_rate < idle_cpu and not _moving(p))


def _busy(p: Proc | None, idle_cpu: float) -> bool:
    return p is not None and (p.state == "R" or _moving(p) or (p.cpu_rate is not None
                                                               and p.cpu_rate >= idle_cpu))


def _moving(p: Proc) -> bool:
    return p.io_rate is not None and p.io_rate >= IDLE_IO


def name_rank(steps: Mapping[int, int], procs: Mapping[int, Proc],
              idle_cpu: float) -> tuple[int | None, str]:
    """The rank that stalled the others, and the evidence that named it
    ("step", "process_state", "cpu"), or (None, "none")."""
    ranks = sorted(steps) if steps else sorted(procs)
    halted = [r for r in ranks if (p := procs.get(r)) is not None and p.state in STOPPED]
    # A stopped process is stuck for certain, whatever its last beat said: a rank
    # stopped between its all-reduce and its beat reads one step behind, and the
    # others, blocked in the next collective, may still be descheduled before theirs.
    stopped = [r for r in halted if procs[r].state in ("T", "t")]
    if len(stopped) == 1:
        return stopped[0], "process_state"
    if steps:
        low = min(steps.values())
        behind = [r for r, st in steps.items() if st == low]
        if len(behind) == 1 and len(steps) > 1:
            return behind[0], "step"
    # One in D may only be waiting on a busy disk (rank 0 saving a checkpoint), so
    # it is named after the step, and only when it is the one halted.
    if len(halted) == 1:
        return halted[0], "process_state"
    idle = [r for r in ranks if _idle(procs.get(r), idle_cpu)]
    busy = [r for r in ranks if _busy(procs.get(r), idle_cpu)]
    # Idle while the others spin: there must be others (a rank whose process is not
    # known as a rank, say its environment not yet readable, is no evidence).
    if len(ranks) >= 2 and len(idle) == 1 and len(busy) == len(ranks) - 1:
        return idle[0], "cpu"
    return None, "none"


def _procs_evidence(procs: Mapping[int, Proc]) -> dict[str, object]:
    """By rank; a process with no rank (the launcher, a shell; keyed -pid) by its pid,
    never as a rank of its own (a page listed torchrun's agent as rank -29047)."""
    return {str(r) if r >= 0 else f"pid {p.pid}":
            {"pid": p.pid, "state": p.state,
             "cpu": None if p.cpu_rate is None else round(p.cpu_rate, 3)}
            for r, p in sorted(procs.items())}


def _stopped_alone(job: str, v: StallView, s: StallSettings, r: RankView) -> Fault | None:
    """One rank beating here (a host's one rank of a job across hosts, a job of one
    process): its silence alone says nothing (a long step, an evaluation, its peers
    on other hosts), but a process stopped (T) for the stall timeout is stuck for
    certain. Without this a stopped one waited out the heartbeat timeout (300 s)."""
    p, t, quiet = v.procs.get(r.rank), stall_timeout(v.p99, s), v.now - r.advanced_at
    if p is None or p.state != "T" or quiet < t:
        return None
    evidence: dict[str, object] = {
        "no_progress_for_s": round(quiet, 3), "timeout_s": round(t, 3),
        "learned": v.p99 is not None, "steps": {str(r.rank): r.step},
        "decided_by": "process_state", "processes": _procs_evidence(v.procs)}
    return Fault(FaultKind.HANG, job, r.advanced_at, evidence, rank=r.rank, gpu=v.gpus.get(r.rank),
                 onset_step=r.step)


def detect(job: str, v: StallView, s: StallSettings) -> Fault | None:
    judges = _judges(v)
    if len(judges) == 1:
        return _stopped_alone(job, v, s, judges[0])
    if len(judges) < 2:
        return None
    t = stall_timeout(v.p99, s)
    since = max(r.advanced_at for r in judges)  # the last time any rank advanced
    quiet = v.now - since
    if quiet < t:
        return None
    ended = sorted(r.rank for r in judges if r.rank in v.ended)
    if len(ended) == len(judges) or (ended and quiet < s.ceiling):
        return None
    steps = {r.rank: r.step for r in judges}
    rank, decided_by = name_rank(steps, v.procs, s.idle_cpu)
    procs = [v.procs.get(r.rank) for r in judges]
    if rank is None and quiet < s.ceiling and all(_busy(p, s.idle_cpu) for p in procs):
        return None  # every rank working: an evaluation or a save, until the ceiling
    evidence: dict[str, object] = {
        "no_progress_for_s": round(quiet, 3),
        "timeout_s": round(t, 3),
        "learned": v.p99 is not None,
        "steps": {str(r): st for r, st in sorted(steps.items())},
        "decided_by": decided_by,
    }
    if v.procs:
        evidence["processes"] = _procs_evidence(v.procs)
    if ended:
        evidence["ranks_ended"] = ended
    gpu = v.gpus.get(rank) if rank is not None else None
    onset_step = steps[rank] if rank is not None else min(steps.values())
    window = [f for f in v.gpu_faults if f.onset >= since - t]
    if window:
        # A GPU fault in the same window is the cause, the stall its symptom.
        g = window[-1]
        return Fault(g.kind, job, since, {**g.evidence, "stall": evidence}, rank=rank,
                     gpu=g.gpu if g.gpu is not None else gpu, onset_step=onset_step)
    return Fault(FaultKind.NCCL_STALL, job, since, evidence, rank=rank, gpu=gpu,
                 onset_step=onset_step)


def quiet(procs: Mapping[int, Proc], idle_cpu: float) -> bool | None:
    """Every process stopped or idle: True; one busy: False; else None (a rate not
    known yet). Stopped (T, t) is stuck whatever its CPU said; D is no proof: a
    rank exiting or reading a busy disk is in D a moment while it works."""
    if any(p.state not in ("T", "t") and _busy(p, idle_cpu) for p in procs.values()):
        return False
    if all(p.state in ("T", "t") or _idle(p, idle_cpu) for p in procs.values()):
        return True
    return None


def _stopped_silent(job: str, v: SilentView, s: StallSettings) -> Fault | None:
    """One rank's process stopped (T) at every sample for the stall floor, the
    others not, and the output silent as long: stuck for certain, the others
    waiting in its collective (on this host or on others: a host's one rank of a
    job across hosts, its launcher running). A whole job stopped is someone's
    pause (the silence rule judges it); a job of one process stopped is stuck, as
    it is with the client (a hang)."""
    held = [r for r, t in v.stopped_for.items() if r >= 0 and t >= s.floor]
    if len(held) != 1 or v.silent_for is None or v.silent_for < s.floor:
        return None
    if len(v.procs) > 1 and all(p.state in ("T", "t") for p in v.procs.values()):
        return None
    evidence: dict[str, object] = {
        "silent_for_s": round(v.silent_for, 3),
        "stopped_for_s": round(v.stopped_for[held[0]], 3),
        "decided_by": "process_state",
        "processes": _procs_evidence(v.procs),
        "client": False,
    }
    # From when it was first seen stopped: the silence may have begun before the
    # workers did (a job that never printed), and a group's round ends only the
    # workers started before the onset (multihost/rounds.py).
    return Fault(FaultKind.NCCL_STALL, job, v.now - v.stopped_for[held[0]], evidence,
                 rank=held[0])


PROBES_APART = 1.0  # seconds at least between the two probes that name a wedged rank


def _wedged_silent(job: str, v: SilentView, s: StallSettings) -> Fault | None:
    """Every process idle (no CPU, no I/O) for the stall floor, the output silent
    as long, and two probes of the stacks a second apart or more in which one
    rank stays outside any collective, its stack the same, while every other
    rank, here or on the other hosts (``peers``), stays inside one: the others
    wait for it, and it does nothing (a
    deadlock, a wait on a data loader that died). A rank that works (an
    evaluation, a checkpoint write) is busy: the quiet stretch keeps it out; so
    does its GPU's utilisation, where trainwatch polls it."""
    if len(v.probes) < 2 or v.silent_for is None or min(v.silent_for, v.quiet_for) < s.floor:
        return None
    a, b = v.probes[-2], v.probes[-1]
    if b.at - a.at < PROBES_APART or set(a.ranks) != set(b.ranks) \
            or len(b.ranks) + len(v.peers) < 2 or not all(v.peers.values()):
        return None
    out = [r for r in sorted(b.ranks) if not b.ranks[r][1]]
    if len(out) != 1 or [r for r in sorted(a.ranks) if not a.ranks[r][1]] != out \
            or a.ranks[out[0]][0] != b.ranks[out[0]][0]:
        return None
    rank = out[0]
    if rank in v.gpu_busy:  # its GPU works (an evaluation waiting on its kernels)
        return None
    evidence: dict[str, object] = {
        "silent_for_s": round(v.silent_for, 3),
        "quiet_for_s": round(v.quiet_for, 3),
        "decided_by": "stacks",
        "stack": [f"{fn} ({where})"[:200] for fn, where in b.ranks[rank][0][:8]],
        "probes_s": round(b.at - a.at, 3),
        **({"peers_inside": sorted(v.peers)} if v.peers else {}),
        "processes": _procs_evidence(v.procs),
        "client": False,
    }
    return Fault(FaultKind.NCCL_STALL, job, v.now - min(v.silent_for, v.quiet_for), evidence,
                 rank=rank)


def detect_silent(job: str, v: SilentView, s: StallSettings) -> Fault | None:
    """No output for ``silence`` and no CPU from any process at every sample since
    the sampling began, half of it in (stallwatch.py): stuck. The client's absence
    is never enough on its own, nor is one idle moment (every rank of a busy,
    silent start-up waiting on a stalled disk)."""
    if s.silence is None or v.silent_for is None:
        return None
    if (stopped := _stopped_silent(job, v, s) or _wedged_silent(job, v, s)) is not None:
        return stopped
    if v.silent_for < s.silence or v.attempt_age < s.silence or not v.procs:
        return None
    if not quiet(v.procs, s.idle_cpu) or v.quiet_for < s.silence / 2:
        return None
    ranks = {r: p for r, p in v.procs.items() if r >= 0}
    rank, decided_by = name_rank({}, ranks, s.idle_cpu)
    evidence: dict[str, object] = {
        "silent_for_s": round(v.silent_for, 3),
        "silence_s": s.silence,
        "decided_by": decided_by if rank is not None else "none",
        "processes": _procs_evidence(v.procs),
        "client": False,
    }
    # Idle at every sample since quiet_for: a worker starts busy (its imports), so
    # this is no earlier than the newest worker's start; the silence may be.
    return Fault(FaultKind.NCCL_STALL, job, v.now - min(v.silent_for, v.quiet_for), evidence,
                 rank=rank)
