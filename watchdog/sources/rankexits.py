"""Which of a job's ranks ended first, and how.

When one rank of a torchrun job dies, the agent SIGTERMs the others and exits
1: the job's own exit says nothing of the rank, and the last failures printed
are the victims'. A rank's process is its launcher's child, not ours, so its
exit status is the launcher's to reap. We hold a pidfd of each rank's process
in the loop's selector: it is readable the moment the process exits, so the
order of wake-ups is the order of deaths, and while the process is a zombie
(torchrun's agent reaps its workers every 0.1 s) ``/proc/<pid>/stat`` still
holds its wait status (field 52, ``exit_code``; root and the process's own
user may read it). A rank reaped before we read it ended "unknown".

Ranks are found in the job's tree by ``RANK`` in their environment (torchrun
sets it; the topmost process of each rank, not its DataLoader workers, which
inherit it), and by the pid their beats come from.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainwatch.sources.procstat import proc_stat, read_small

_EXIT_CODE = 49  # /proc/<pid>/stat field 52, counted from field 3 (after the name)
_TOGETHER = 0.2  # exits seen this close were seen in one wake-up: order unknown
# A launcher's teardown signals (and "unknown"): the victims', not the cause's.
_TEARDOWN = (-int(signal.SIGTERM), -int(signal.SIGINT), None)


@dataclass(frozen=True)
class RankExit:
    rank: int
    pid: int
    at: float  # when we saw it (monotonic)
    returncode: int | None  # negative: killed by that signal; None: reaped before we read it

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "pid": self.pid}
        rc = self.returncode
        if rc is None:
            out["status"] = "unknown (reaped by its launcher before trainwatch read it)"
        elif rc < 0:
            try:
                out["signal"] = signal.Signals(-rc).name
            except ValueError:
                out["signal"] = str(-rc)
        else:
            out["exit_code"] = rc
        return out


def wait_status(pid: int, start: int) -> int | None:
    """The returncode of a zombie ``pid`` that started at ``start`` (clock ticks);
    None once it is reaped (or the pid is another process's)."""
    data = read_small(f"/proc/{pid}/stat")
    if data is None:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    try:
        if fields[0] != b"Z" or int(fields[19]) != start:
            return None
        status = int(fields[_EXIT_CODE])
    except (IndexError, ValueError):
        return None
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class RankExits:
    """The rank processes of one attempt, watched until each exits."""

    def __init__(self, sel: selectors.BaseSelector, clock: Callable[[], float],
                 max_watched: int = 1024) -> None:
        self.sel, self.clock, self.max_watched = sel, clock, max_watched
        self._fds: dict[int, tuple[int, int, int]] = {}  # fd -> (rank, pid, start ticks)
        self._seen: set[int] = set()  # pids watched or passed over (asked again each tick)
        self.exits: list[RankExit] = []

    def watch(self, rank: int, pid: int) -> None:
        """Watch ``pid`` (proven the job's by the caller) as rank ``rank``."""
        if pid in self._seen or len(self._seen) >= 4 * self.max_watched:
            return
        self._seen.add(pid)
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X") or len(self._fds) >= self.max_watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone, or no pidfds (kernel < 5.3): its exit is not observed
        again = proc_stat(pid)  # opened, then checked: a pid reused meanwhile fails here
        if again is None or again[2] != st[2]:
            os.close(fd)
            return
        self._fds[fd] = (rank, pid, st[2])
        self.sel.register(fd, selectors.EVENT_READ, self._ready)

    @property
    def running(self) -> int:
        """Rank processes watched in this attempt that have not exited."""
        return len(self._fds)

    @property
    def watched(self) -> int:
        """Rank processes watched in this attempt, exited or not."""
        return len(self._fds) + len(self.exits)

    def _ready(self, fd: int) -> None:
        rank, pid, start = self._fds.pop(fd)
        self.sel.unregister(fd)
        os.close(fd)
        self.exits.append(RankExit(rank, pid, self.clock(), wait_status(pid, start)))

    def first_failure(self) -> RankExit | None:
        """The rank that failed first: the first exit not 0, unless it is a teardown
        signal (or unknown) and another failure, seen with it, is not."""
        failed = [e for e in self.exits if e.returncode != 0]
        if not failed:
            return None
        first = failed[0]
        if first.returncode in _TEARDOWN:
            for e in failed[1:]:
                if e.at - first.at > _TOGETHER:
                    break
                if e.returncode not in _TEARDOWN:
                    return e
        return first

    def close(self) -> None:
        """The attempt is over (or a new one begins): stop watching, forget it all."""
        for fd in self._fds:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(fd)
            os.close(fd)
        self._fds.clear()
        self._seen.clear()
        self.exits.clear()


def rank_processes(pids: Iterable[int], rank_of: Callable[[int], int | None],
                   beating: Mapping[int, int]) -> dict[int, int]:
    """pid -> rank of each rank's process among ``pids`` (a job's tree): one with a
    RANK whose parent has another (or none), and each pid a rank beats from."""
    out = {pid: rank for rank, pid in beating.items()}
    for pid in pids:
        rank = rank_of(pid)
        if rank is None or pid in out:
            continue
        st = proc_stat(pid)
        if st is not None and rank_of(st[1]) != rank:
            out[pid] = rank
    return out
