"""Whether a pid named in a job's status is still the job's, before a drill signals it.

A status file is a snapshot, and it outlives the trainwatch that wrote it (a
SIGKILL leaves it saying ``running``): its pids may have died and been given
to strangers since. So a drill first asks whether anybody supervises the job
(``supervised``: the supervisor holds an exclusive ``flock`` on
``jobs/<job>/lock`` for its whole life), then opens a pidfd on each pid and
only then proves, from that moment on, that the process is the job's
(``Owner.why_not``): in the attempt's cgroup when the status names one, else
in the session or process group of the leader, or descended from it, while
the leader is alive and leads its own session. A pid reused before the pidfd
was opened fails the proof; one reused after it leaves the pidfd on the dead
process, and ``pidfd_send_signal`` then reaches nobody.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Any

import psutil
from trainwatch.actions import cgroup
from trainwatch.sources.procstat import proc_stat
from trainwatch.state.joblock import lock_path


def supervised(state_dir: str, job: str) -> bool | None:
    """True while some process holds the job's lock, False when none does (or
    there is no lock file), None when we cannot tell (the 0600 lock file is
    not ours to open: a job's user who is not root). The lock is taken with
    LOCK_NB and dropped at once: a trainwatch starting in that instant is
    refused as "already supervised" and may simply be started again."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(lock_path(state_dir, job), flags)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return True if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # also releases the lock when we took it
    return False


class Owner:
    """Proves that a process is one of the job's, as its status describes it."""

    def __init__(self, s: dict[str, Any]) -> None:
        self.job = str(s.get("job"))
        self.leader = int(s["pid"])
        cg = s.get("cgroup")
        self.cgroup = os.path.normpath(cg) if isinstance(cg, str) and cg else None

    def why_not(self, pid: int) -> str | None:
        """None when pid is the job's now; else why it is not (or cannot be
        proven so). Call it with a pidfd already open on pid."""
        if self.cgroup is not None:
            return self._outside_cgroup(pid)
        try:
            ids = (os.getsid(pid), os.getpgid(pid))
        except OSError:
            return "it is gone"
        # The leader's pid is its session and group id: while it is alive no
        # other process can be given that pid, so those ids are still the job's.
        st = proc_stat(self.leader)
        if st is None or st[0] in ("Z", "X"):
            return f"the job's leader {self.leader} is gone, so its session may be a stranger's"
        try:
            if os.getsid(self.leader) != self.leader:
                return f"process {self.leader}, named the leader, leads no session of its own"
        except OSError:
            return f"the job's leader {self.leader} is gone"
        if self.leader in ids:
            return None
        with contextlib.suppress(psutil.Error):
            if any(p.pid == self.leader for p in psutil.Process(pid).parents()):
                return None
        return (f"neither in the session or process group of the job's leader {self.leader} "
                "nor descended from it")

    def _outside_cgroup(self, pid: int) -> str | None:
        assert self.cgroup is not None
        rel = cgroup.of(pid)
        if rel is None:
            return "it is gone"
        mount = cgroup.mount()
        if mount is not None:
            root = os.path.normpath(mount)
            # Never the hierarchy's root itself: every process would be "in" it.
            if self.cgroup.startswith(root.rstrip("/") + "/"):
                where = os.path.normpath(os.path.join(root, rel.lstrip("/")))
                if where == self.cgroup or where.startswith(self.cgroup + "/"):
                    return None
        return f"not in the job's cgroup {self.cgroup}"
