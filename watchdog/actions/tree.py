"""A job's process tree: who belongs to it, how to signal all of it, how to
reap it, and never a stranger.

Membership. Where cgroup v2 is ours to write, an attempt runs in its own
cgroup (see cgroup.py): its members are what that cgroup lists, and a
process is ours when /proc/<pid>/cgroup names it; a job that is not root
cannot leave it, and no environment variable enters into it. Without
cgroup v2 (or write access to it), membership is the session and process
group of the leader, every descendant of a member, and every member found
once and remembered; a process that escapes by setsid and a double fork
before any scan saw it is then lost (its exit is still reaped: we are a
child subreaper).

Identity. A pid alone names whoever holds it now. Every remembered process
is (pid, start time); one whose start time changed is a stranger and is
forgotten. A signal goes through a pidfd opened first and then checked
(start time, or cgroup), so it reaches the process that was proven ours or
nobody. The leader's own pid (its process group and session id) stays
reserved while it is an unreaped zombie: the attempt reaps it only in
close(), and killpg is used only before then.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal as _signal
from collections.abc import Iterable

import psutil
from trainwatch.actions.cgroup import AttemptCgroup
from trainwatch.sources.procstat import proc_stat

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants re-parent to us instead of to init, so a
    double-forked process stays findable. Returns whether the kernel agreed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def start_time(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else st[2]


def is_gone(pid: int) -> bool:
    """True when the process no longer runs (absent, or a zombie awaiting reaping)."""
    st = proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


def _parent_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid is not None:
            out[p.pid] = ppid
    return out


class JobTree:
    """The processes of one attempt of one job."""

    def __init__(self, job: str, leader: int, cgroup: AttemptCgroup | None = None,
                 leader_start: int | None = None) -> None:
        """``leader_start``: the start time the leader was recorded with (an adopted
        attempt): a leader that no longer has it is not ours."""
        self.job = job
        self.leader = leader
        self.sid = leader  # started with start_new_session: leader is session and group leader
        self.cgroup = cgroup
        self.known: dict[int, int] = {}  # pid -> start time: every member seen
        self._believed: dict[int, int] = {}  # fallback owns(): pid -> start time
        self._me = os.getpid()
        self._leader_start = start_time(leader)
        if self._leader_start is not None:
            self.known[leader] = self._leader_start
        # Set once the leader has been reaped (by close(), or by someone else):
        # from then on its pid, process group and session id may be a stranger's.
        self.leader_reaped = False
        if leader_start is not None and self._leader_start != leader_start:
            self.known.pop(leader, None)
            self._leader_start, self.leader_reaped = leader_start, True
        self.closed = False
        self.unproven = 0  # signals not sent: the pid's identity could not be proven

    # --- who is ours ----------------------------------------------------------

    def _remember(self, pids: Iterable[int]) -> None:
        for pid in pids:
            if pid not in self.known:
                st = start_time(pid)
                if st is not None:
                    self.known[pid] = st

    def _still(self, pid: int) -> bool:
        """Is the remembered pid still the process we saw? Forgets it if not."""
        want = self.known.get(pid)
        if want is None:
            return False
        if start_time(pid) == want:
            return True
        del self.known[pid]  # gone, or a stranger now holds the pid
        return False

    def _leader_held(self) -> bool:
        """Is the leader's pid still the leader's (alive, or a zombie not yet
        reaped)? Only then are its process group and session id ours."""
        if not self.leader_reaped and start_time(self.leader) != self._leader_start:
            self.leader_reaped = True  # reaped behind our back: never trust the ids again
        return not self.leader_reaped

    def _in_session(self, pid: int, held: bool | None = None) -> bool:
        if not (self._leader_held() if held is None else held):
            return False  # the session id may now be a stranger's
        try:
            return os.getsid(pid) == self.sid or os.getpgid(pid) == self.sid
        except OSError:
            return False

    def scan(self) -> set[int]:
        """Find every live member now; remembers them (with their start times)."""
        if self.closed:
            return set()
        if self.cgroup is not None:
            listed = self.cgroup.procs()
            # A root job can leave its cgroup: what was seen in it stays ours.
            listed |= {p for p in list(self.known) if p not in listed and self._still(p)}
            listed.discard(self._me)
            self._remember(listed)
            return listed
        parents = _parent_map()
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            children.setdefault(ppid, []).append(pid)
        held = self._leader_held()
        roots = {pid for pid in parents if pid != self._me and self._in_session(pid, held)}
        roots |= {pid for pid in list(self.known) if pid in parents and self._still(pid)}
        members: set[int] = set()
        stack = list(roots)
        while stack:
            pid = stack.pop()
            if pid in members or pid == self._me:
                continue
            members.add(pid)
            stack.extend(children.get(pid, ()))
        self._remember(members)
        return members

    def owns(self, pid: int, uid: int) -> bool:
        """Is a datagram from (pid, uid) one of this job's? Root is believed."""
        if uid == 0:
            return True
        if self.closed:
            return False
        if self.cgroup is not None:
            return self.cgroup.holds(pid) or (pid in self.known and self._still(pid))
        want = self._believed.get(pid)
        if want is not None:
            if start_time(pid) == want:
                return True
            del self._believed[pid]
        ok = self._in_session(pid)
        if not ok:
            try:
                ancestors = [p.pid for p in psutil.Process(pid).parents()]
            except psutil.Error:
                return False
            ok = ((self.leader in ancestors and self._leader_held())
                  or any(a in self.known and self._still(a) for a in ancestors))
        st = start_time(pid) if ok else None
        if st is not None:
            self._believed[pid] = st
        return ok

    # --- acting on it ---------------------------------------------------------

    def _proven(self, pid: int) -> bool:
        """With a pidfd open on pid: is the process it holds ours? (Checked after
        opening it: a pid reused before then fails the check, one reused after
        leaves the pidfd on the dead process.)"""
        if self.cgroup is not None and self.cgroup.holds(pid):
            return True
        return self._still(pid)

    def _send(self, pid: int, sig: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except OSError:
            self.unproven += 1  # no pidfd (kernel < 5.3): no proof, no signal
            return
        try:
            if self._proven(pid):
                with contextlib.suppress(ProcessLookupError):
                    _signal.pidfd_send_signal(fd, sig)
            else:
                self.unproven += 1
        finally:
            os.close(fd)

    def signal_each(self, sig: int, pids: Iterable[int]) -> None:
        """Send sig to each of ``pids`` proven a member, and to nothing else (a
        multi-host job's workers, whose launcher lives on and restarts them)."""
        if not self.closed:
            for pid in set(pids) - {self._me}:
                self._send(pid, sig)

    def signal(self, sig: int, pids: Iterable[int]) -> None:
        """Send sig to every member (and to each of pids that is proven ours).
        Nothing once closed: the pids it knew may be strangers' now."""
        if self.closed:
            return
        targets = set(pids)
        if self.cgroup is not None:
            if sig == _signal.SIGKILL:
                self.cgroup.kill()  # atomic: also what was forked a moment ago
            targets |= self.cgroup.procs()  # what was forked since the caller's scan
        elif self._leader_held():
            # The unreaped leader keeps its pid, so the process group id, reserved.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.sid, sig)
        for pid in targets:
            if pid != self._me:
                self._send(pid, sig)

    def reap(self) -> dict[int, int]:
        """Reap those members that are our exited children, except the leader
        (whose status the attempt collects); returns pid -> wait status."""
        done: dict[int, int] = {}
        for pid, started in list(self.known.items()):
            if pid == self.leader:
                continue
            st = proc_stat(pid)
            # Only the zombie we remember: the pid may be another job's child now.
            if st is None or st[0] != "Z" or st[1] != self._me or st[2] != started:
                continue
            with contextlib.suppress(ChildProcessError):
                rpid, status = os.waitpid(pid, os.WNOHANG)
                if rpid:
                    done[rpid] = status
                    del self.known[pid]
        return done

    def alive(self) -> set[int]:
        return {pid for pid in self.scan() if not is_gone(pid)}

    def close(self) -> bool:
        """Forget every member; remove the cgroup. False while it still holds processes."""
        self.closed = True
        self.known.clear()
        self._believed.clear()
        return self.cgroup.close() if self.cgroup is not None else True


def stopped_ranks(pids: dict[int, int]) -> frozenset[int]:
    """Ranks (of rank -> pid) whose process is stopped (T) or in uninterruptible sleep (D)."""
    out = set()
    for rank, pid in pids.items():
        try:
            st = psutil.Process(pid).status()
        except psutil.Error:
            continue
        if st in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP):
            out.add(rank)
    return frozenset(out)
