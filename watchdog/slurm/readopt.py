"""Attached Slurm ranks outlive a restart of their node's daemon.

Each rank proven and joined is kept in ``state_dir/jobs/slurm-<J>/attached.json``
(root's folder, written atomically): the rank's claim as it sent it, and the pid,
uid and start time the proof established. A daemon that starts asks its Registry
to prove each again, as if the rank had asked, only while that pid still has its
saved start time (a pid reused since is never taken), and joins those that hold
(attach.py). The client needs nothing: its datagrams go to the job's socket path,
made anew. A claim that no longer holds (the job ended, was requeued, the task
is gone) is dropped with one line; the run's next ranks attach as ever.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainwatch.actions import tree
from trainwatch.privsep.access import Peer, Refused
from trainwatch.slurm.proof import Proven
from trainwatch.state import atomic, jobdir

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.slurm.attach import Hosting

log = logging.getLogger("trainwatch")

FILE = "attached.json"
MAX_RANKS = 1024  # kept per job and node
MAX_JOBS = 4096  # folders looked at when the daemon starts
GIVE_UP = 120.0  # seconds a rank's proof may stay pending after a start


@dataclass
class Rank:
    """One rank to take back: its claim, and the peer the proof found."""

    job: str
    claim: dict[str, Any]
    pid: int
    uid: int
    start: int


def remember(r: Runner, claim: dict[str, Any], proven: Proven) -> None:
    """Keep a joined rank for the next daemon (only its run's: a requeue's ranks
    replace the run before)."""
    path = r.dir / FILE
    kept = atomic.read_json(path)
    ranks = kept.get("ranks") if isinstance(kept, dict) and kept.get("run") == proven.restarts \
        else None
    ranks = dict(ranks) if isinstance(ranks, dict) else {}
    key = str(proven.pid)
    if key not in ranks and len(ranks) >= MAX_RANKS:
        return
    ranks[key] = {"claim": claim, "uid": proven.uid, "start": proven.start}
    try:
        atomic.write_json(path, {"run": proven.restarts, "ranks": ranks}, durable=False)
    except (OSError, ValueError, TypeError) as e:
        log.warning("job %s: rank %d not kept for a restart of the daemon: %s", r.job.name,
                    proven.rank, e)


def forget(state_dir: str, job: str) -> None:
    try:
        os.unlink(jobdir.job_dir(state_dir, job) / FILE)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("job %s: %s", job, e)


def kept(state_dir: str) -> list[Rank]:
    """The ranks the daemon before this one had joined, whose pid still runs."""
    jobs = jobdir.job_dir(state_dir, "x").parent
    try:
        names = sorted(n for n in os.listdir(jobs) if n.startswith("slurm-"))[:MAX_JOBS]
    except OSError:
        return []
    out: list[Rank] = []
    for name in names:
        data = atomic.read_json(jobs / name / FILE)
        ranks = data.get("ranks") if isinstance(data, dict) else None
        if not isinstance(ranks, dict):
            continue
        for pid, v in list(ranks.items())[:MAX_RANKS]:
            if not (pid.isdigit() and isinstance(v, dict) and isinstance(v.get("claim"), dict)
                    and isinstance(v.get("uid"), int) and isinstance(v.get("start"), int)):
                continue
            if tree.start_time(int(pid)) == v["start"]:
                out.append(Rank(name, v["claim"], int(pid), v["uid"], v["start"]))
    return out


class Readopt:
    """The ranks still to take back, asked again at each round until each is
    proven, refused, gone, or GIVE_UP seconds have passed."""

    def __init__(self, state_dir: str, clock: Any = time.monotonic) -> None:
        self.todo = kept(state_dir)
        self.clock = clock
        self.until = clock() + GIVE_UP
        self.taken = 0
        if self.todo:
            log.info("%d attached rank(s) of %d Slurm job(s) to take back", len(self.todo),
                     len({x.job for x in self.todo}))

    def tick(self, sup: Hosting) -> None:
        from trainwatch.slurm import attach

        if not self.todo:
            return
        late = self.clock() >= self.until
        left: list[Rank] = []
        for x in self.todo:
            if tree.start_time(x.pid) != x.start:
                log.info("job %s: pid %d is gone: not taken back", x.job, x.pid)
                continue
            gid = _gid(x.pid)
            try:
                reply = attach.answer(sup, x.claim, Peer(x.pid, x.uid, gid, None, False))
            except (Refused, ValueError) as e:
                log.warning("job %s: pid %d not taken back: %s", x.job, x.pid, e)
                continue
            if reply.get("name"):
                self.taken += 1
                log.info("job %s: pid %d (rank %s) taken back after a restart of the daemon",
                         x.job, x.pid, reply.get("rank"))
            elif late:
                log.warning("job %s: pid %d not taken back: its proof gave no answer in "
                            "%.0fs", x.job, x.pid, GIVE_UP)
            else:
                left.append(x)
        self.todo = left


def _gid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_gid
    except OSError:
        return -1
