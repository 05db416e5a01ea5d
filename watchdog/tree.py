"""A job's process tree: who belongs to it, how to signal all of it, how to
reap it.

A job is started in its own session (so its process group and session id are
the leader's pid). Processes can leave both with setsid() and can outlive their
parents, so membership is the union of: the session and process group, every
descendant of a member, and every orphan re-parented to trainwatch (we make
ourselves a child subreaper) whose environment names this job. Everything that
is found once is remembered for the attempt, so a process that escapes later
is still signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants re-parent to us instead of to init, so a
    double-forked process stays findable. Returns whether the kernel agreed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parent_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid is not None:
            out[p.pid] = ppid
    return out


def _environ_job(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get("TRAINWATCH_JOB")
    except (psutil.Error, OSError):
        return None


def is_gone(pid: int) -> bool:
    """True when the process no longer runs (absent, or a zombie awaiting reaping)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


class JobTree:
    """The processes of one attempt of one job."""

    def __init__(self, job: str, leader: int) -> None:
        self.job = job
        self.leader = leader
        self.sid = leader  # started with start_new_session: leader is session and group leader
        self.known: set[int] = {leader}
        self._believed: set[int] = {leader}
        self._me = os.getpid()

    def _in_session(self, pid: int) -> bool:
        try:
            return os.getsid(pid) == self.sid or os.getpgid(pid) == self.sid
        except OSError:
            return False

    def scan(self) -> set[int]:
        """Find every live member now; remembers them. Cost: one pass over /proc."""
        parents = _parent_map()
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            children.setdefault(ppid, []).append(pid)
        roots = {pid for pid in parents if pid != self._me and self._in_session(pid)}
        roots |= {pid for pid in self.known if pid in parents}
        roots |= {
            pid
            for pid in children.get(self._me, ())
            if pid not in roots and _environ_job(pid) == self.job
        }
        members: set[int] = set()
        stack = list(roots)
        while stack:
            pid = stack.pop()
            if pid in members or pid == self._me:
                continue
            members.add(pid)
            stack.extend(children.get(pid, ()))
        self.known |= members
        return members

    def owns(self, pid: int, uid: int) -> bool:
        """Is a datagram from (pid, uid) one of this job's? Root is believed."""
        if uid == 0 or pid in self._believed:
            return True
        if self._in_session(pid):
            self._believed.add(pid)
            return True
        try:
            ancestors = {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            return False
        if self.leader in ancestors or ancestors & self.known:
            self._believed.add(pid)
            return True
        if self._me in ancestors and _environ_job(pid) == self.job:
            self._believed.add(pid)  # an orphan re-parented to us
            return True
        return False

    def signal(self, sig: int, pids: Iterable[int]) -> None:
        """Send sig to the process group and to each pid; vanished ones are fine."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.sid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def reap(self) -> dict[int, int]:
        """Reap those members that are our children, except the leader (whose
        status the attempt collects); returns pid -> wait status."""
        done: dict[int, int] = {}
        for pid in self.known - {self.leader}:
            try:
                rpid, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not our child (its parent reaps it) or already reaped
            if rpid:
                done[rpid] = status
        return done

    def alive(self) -> set[int]:
        return {pid for pid in self.scan() if not is_gone(pid)}
