"""Proving a rank's claim to be a task of a Slurm job before the daemon believes it
(DESIGN.md "Jobs across hosts"; prior-art/multinode.md 3.4-3.5).

A rank registers with its node's daemon over a unix socket (the client, an
integration, or ``trainwatch attach`` in the batch script) and says which job,
step and rank it is: a ``Claim``, read from its SLURM_* environment, which any
process can set. The kernel vouches for the peer's pid and uid (SO_PEERCRED,
``peer_cred``); Slurm vouches for the rest. ``prove`` believes the claim only if
all of these hold:

- the job is RUNNING;
- its owner's uid (``scontrol show job``, ``UserId=``) is the peer's uid; root
  gets no exception (a root peer proves only a job of root's);
- ``scontrol listpids <job> <node>`` on this node lists the peer or one of its
  ancestors (``/proc/<pid>/stat``, at most MAX_DEPTH levels, never pid 1); the
  nearest listed one is in a numbered step equal to the claim's (never ``batch``
  or ``extern``: the batch script is listed as ``batch 0 0`` and must not prove
  rank 0), and so is every listed one up to the nearest that has a global id,
  the task;
- the task's global id is the claim's rank;
- the peer and its ancestors are the same processes after these checks as
  before (pid, parent, start time): a peer that exited, or a pid taken by a new
  process meanwhile, is refused.

What a claim's rank means: the task's SLURM_PROCID, the global id Slurm gives
the task that srun started (the peer, or its nearest listed ancestor). A
process that torchrun (or any launcher) starts under an srun task shares its
task's rank: with one torchrun per node, that is the node's task index, not the
torch RANK, which Slurm never sees. A torch rank a peer reports is its own
word: the caller keeps it apart, as unproven.

Not covered: a peer that exits between its connect() and ``prove``'s first look
while a new process of the same uid in the same job takes its pid (that process
is then judged, with its own task's rank); a daemon in another pid namespace
than slurmd's.

A refusal's message starts with the check that failed (one of CHECKS) and
``: ``; so does a failure's (Slurm gave no usable answer: not proven).
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainwatch.slurm import actions
from trainwatch.slurm.command import Outcome, Result, Slurm
from trainwatch.slurm.parse import MAX_JOB, MAX_UID, JobInfo, ListedPid, bad_job, bad_node

MAX_DEPTH = 64  # processes read up from a peer (a torchrun worker is its task's child)
MAX_STEP = 0xFFFFFFEF  # numbered step ids; above are batch, extern, interactive, pending
CHECKS = ("claim", "peer", "job", "state", "owner", "process", "step", "rank")
_CRED = struct.Struct("iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid
_NUM = re.compile(r"[0-9]{1,20}")
_ENDED = frozenset("ZXx")  # /proc/<pid>/stat states of a process that has exited


@dataclass(frozen=True)
class Claim:
    """What a rank says it is: its SLURM_JOB_ID, SLURM_STEP_ID and SLURM_PROCID."""

    job: int
    step: int
    rank: int


@dataclass(frozen=True)
class Proven:
    """A claim that held: ``pid`` (uid ``uid``) is, or descends from, the task of
    global id ``rank`` (pid ``task_pid``, local id ``local_id``) of the job's step
    ``step`` on ``node``. ``restarts`` is the job's ``Restarts=`` as the proof read
    it: how many times Slurm had requeued it (the run the peer belongs to, counted
    from 0, which every node agrees on). ``start`` and ``task_start`` are the peer's
    and the task's start times as the proof saw them (``/proc/<pid>/stat`` field
    22): whoever acts on the proof later takes these pids only with these start
    times, never from a fresh read (a pid may be a stranger's by then)."""

    job: int
    step: int
    rank: int
    node: str
    pid: int
    uid: int
    task_pid: int
    local_id: int | None
    restarts: int
    start: int
    task_start: int


@dataclass(frozen=True)
class Refusal:
    """Which check failed (one of CHECKS) and why."""

    check: str
    why: str

    def __str__(self) -> str:
        return f"{self.check}: {self.why}"


@dataclass(frozen=True)
class PeerCred:
    """The credentials the kernel gives for a unix socket's peer (SO_PEERCRED): of
    the process that connected (or made the socketpair), as they were then."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Stat:
    """Of ``/proc/<pid>/stat``: the pid, its parent and its start time (field 22,
    clock ticks after boot), which tell a process from a later one of its pid."""

    pid: int
    ppid: int
    start: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The SO_PEERCRED of a connected unix socket (pid 0 when it has no peer)."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _CRED.size))
    return PeerCred(pid, uid, gid)


def parse_stat(text: str) -> Stat | None:
    """A ``/proc/<pid>/stat`` line, ``pid (comm) state ppid ...``; its comm may hold
    spaces and parentheses, so the fields start after the last ``)``. None for a
    process that has exited (a zombie) or text that is not such a line."""
    head, paren, tail = text.rpartition(")")
    pid, _, _ = head.partition(" (")
    fields = tail.split()
    if not paren or not _NUM.fullmatch(pid) or len(fields) < 20 or fields[0] in _ENDED:
        return None
    if not (_NUM.fullmatch(fields[1]) and _NUM.fullmatch(fields[19])):
        return None
    return Stat(int(pid), int(fields[1]), int(fields[19]))


def read_stat(pid: int, proc: str = "/proc") -> Stat | None:
    """The Stat of a live process; None once it has exited (or never was)."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = parse_stat(f.read(4096))
    except OSError:
        return None
    return stat if stat is not None and stat.pid == pid else None


def lineage(pid: int, stat: Callable[[int], Stat | None],
            depth: int = MAX_DEPTH) -> tuple[Stat, ...]:
    """The process and its ancestors, nearest first: at most `depth` of them, never
    pid 1 or 0, ending early at one that cannot be read (it exited)."""
    chain: list[Stat] = []
    seen: set[int] = set()
    while pid > 1 and pid not in seen and len(chain) < depth:
        s = stat(pid)
        if s is None:
            break
        chain.append(s)
        seen.add(pid)
        pid = s.ppid
    return tuple(chain)


def bad_claim(claim: object) -> str | None:
    """Why `claim` is not a claim to check; None when it is one."""
    if not isinstance(claim, Claim):
        return f"a claim is a Claim, got {type(claim).__name__}"
    if problem := bad_job(claim.job):
        return problem
    for name, value, top in (("step", claim.step, MAX_STEP), ("rank", claim.rank, MAX_JOB)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            return f"a {name} is an int between 0 and {top}, got {value!r:.40}"
    return None


def judge_job(claim: Claim, info: JobInfo, owner: int, peer_uid: int) -> Refusal | None:
    """Whether the job may be claimed by a peer of `peer_uid`: it is the peer's own
    (root's peer too), and runs. The owner first, and a stranger is told neither
    the owner nor the state: root's scontrol must not read other users' jobs for
    them (Slurm's PrivateData=jobs)."""
    if owner != peer_uid:
        return Refusal("owner", f"job {claim.job} is not uid {peer_uid}'s (a peer proves "
                       "only its own uid's jobs, root's too)")
    if info.state != "RUNNING":
        return Refusal("state", f"job {claim.job} is {info.state}, not RUNNING")
    return None


def match_task(claim: Claim, chain: tuple[Stat, ...],
               rows: Iterable[ListedPid]) -> ListedPid | Refusal:
    """The task (a ``listpids`` row with a global id) that the peer (``chain[0]``)
    is or descends from, if it proves the claim's step and rank; else why not."""
    listed_by_pid = {row.pid: row for row in rows}
    listed = [listed_by_pid[s.pid] for s in chain if s.pid in listed_by_pid]
    peer = chain[0].pid if chain else 0
    if not listed:
        return Refusal("process", f"neither pid {peer} nor its {max(len(chain) - 1, 0)} "
                       f"ancestors are processes of job {claim.job} on this node "
                       "(scontrol listpids)")
    step = listed[0].step
    if not _NUM.fullmatch(step):
        via = "" if listed[0].pid == peer else f" (as its ancestor {listed[0].pid} is)"
        return Refusal("step", f"pid {peer} is in the {step} step of job {claim.job}{via}, "
                       "not a numbered step of srun's")
    task = next((row for row in listed if row.global_id is not None), None)
    if task is None:
        return Refusal("process", f"pid {peer} is in step {step} of job {claim.job} "
                       "but under no task of it")
    if any(row.step != step for row in listed[:listed.index(task) + 1]):
        return Refusal("step", f"pid {peer}'s listed ancestors are in more than one step "
                       f"of job {claim.job}")
    if int(step) != claim.step:
        return Refusal("step", f"pid {peer} is in step {step} of job {claim.job}, "
                       f"the claim says step {claim.step}")
    if task.global_id != claim.rank:
        return Refusal("rank", f"pid {peer}'s task (pid {task.pid}) is global id "
                       f"{task.global_id} of step {step} (SLURM_PROCID), the claim "
                       f"says rank {claim.rank}")
    return task


def _no(check: str, why: str, outcome: Outcome = Outcome.REFUSED) -> Result[Proven]:
    return Result(outcome, str(Refusal(check, why)))


def prove(claim: Claim, peer_pid: int, peer_uid: int, node: str, *,
          slurm: Slurm = actions.DEFAULT, proc: str = "/proc") -> Result[Proven]:
    """Ok with a Proven when the claim of the peer (pid and uid from SO_PEERCRED)
    holds on `node` (this node, Slurm's name for it); refused naming the first
    check that failed; failed when Slurm gave no usable answer. Runs ``scontrol
    show job`` and ``scontrol listpids``, each under ``slurm.timeout``."""
    if problem := (bad_claim(claim) or bad_node(node)
                   or _bad_id("peer pid", peer_pid, 2) or _bad_id("peer uid", peer_uid, 0)):
        return _no("claim", f"not run: {problem}")
    before = lineage(peer_pid, lambda pid: read_stat(pid, proc))
    if not before:
        return _no("peer", f"pid {peer_pid} has exited")
    seen = actions.job_owner(claim.job, slurm=slurm)
    if seen.value is None:
        return _no("job", seen.message, seen.outcome)
    info, owner = seen.value
    if refusal := judge_job(claim, info, owner, peer_uid):
        return _no(refusal.check, refusal.why)
    listed = actions.listpids(claim.job, node, slurm=slurm)
    if listed.value is None:
        return _no("process", listed.message, listed.outcome)
    if lineage(peer_pid, lambda pid: read_stat(pid, proc)) != before:
        return _no("peer", f"pid {peer_pid}, or one of its ancestors, exited or was "
                   "replaced while it was checked")
    task = match_task(claim, before, listed.value)
    if isinstance(task, Refusal):
        return _no(task.check, task.why)
    return Result(Outcome.OK, f"pid {peer_pid} is rank {task.global_id} of job "
                  f"{claim.job} step {claim.step} on {node}",
                  value=Proven(claim.job, claim.step, claim.rank, node, peer_pid, peer_uid,
                               task.pid, task.local_id, info.restarts, before[0].start,
                               next(s.start for s in before if s.pid == task.pid)))


def _bad_id(name: str, value: object, least: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_UID:
        return f"a {name} is an int between {least} and {MAX_UID}, got {value!r:.40}"
    return None
