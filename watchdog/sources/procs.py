"""The job's processes as the stall detector sees them: each one's state letter,
the CPU it used since the previous sample (utime + stime from /proc/<pid>/stat
through psutil) and the bytes it read and wrote (/proc/<pid>/io's rchar and
wchar: a rank writing a checkpoint to a slow file system is working at little
CPU), and, for a job without the client, which
rank each process is (torchrun puts ``RANK`` in every worker's environment)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import psutil
from trainwatch.detectors.stall import Proc

_LETTER = {
    psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X", psutil.STATUS_IDLE: "I",
}


_BASE_MIN = 0.5  # a rate over less than this is noise (CPU time counts in 10 ms ticks)
_BASE_MAX = 5.0  # a rate over more than this says little of the stall
_RANK_AGAIN = 1.0  # a process with no RANK yet is asked again after this
_RANK_TRIES = 5  # and at most this often: the launcher's, a shell's, never has one


class Sampler:
    """Samples pids; a pid's CPU rate is over the time since an earlier sample
    taken between ``_BASE_MIN`` and ``_BASE_MAX`` seconds before (None: none)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # pid -> (at, cpu s, cpu rate, I/O bytes, I/O rate)
        self.prev: dict[int, tuple[float, float, float | None, int | None, float | None]] = {}
        self.ranks: dict[int, int] = {}  # pid -> RANK from its environment, once found
        self.no_rank: dict[int, tuple[float, int]] = {}  # pid -> (ask again at, asked)

    def sample(self, pids: Mapping[int, int]) -> dict[int, Proc]:
        """``pids``: key (a rank, or a negated pid) -> pid. A process that is gone
        is left out. Where ranks are sampled, the I/O of a process that is neither
        one nor a rank's child (a data loader's worker) is left unknown: torchrun's
        agent reads 66 KB/s of /proc and its store while its workers are stuck,
        and it never saves a checkpoint."""
        now = self.clock()
        out: dict[int, Proc] = {}
        ranks = {pid for k, pid in pids.items() if k >= 0}
        seen: dict[int, tuple[float, float, float | None, int | None, float | None]] = {}
        for key, pid in pids.items():
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    state = _LETTER.get(p.status(), "?")
                    t = p.cpu_times()
                    asked = key >= 0 or not ranks or p.ppid() in ranks
            except psutil.Error:
                continue
            cpu, moved = t.user + t.system, _io_bytes(p) if asked else None
            before = self.prev.get(pid)
            rate = io_rate = None
            if before is not None and now - before[0] < _BASE_MIN:
                seen[pid] = before  # too soon for a rate of its own
                rate, io_rate = before[2], before[4]
            else:
                if before is not None and now - before[0] <= _BASE_MAX:
                    rate = max(0.0, cpu - before[1]) / (now - before[0])
                    if moved is not None and before[3] is not None:
                        io_rate = max(0, moved - before[3]) / (now - before[0])
                seen[pid] = (now, cpu, rate, moved, io_rate)
            out[key] = Proc(pid, state, rate, io_rate)
        self.prev = seen
        return out

    def rank_of(self, pid: int) -> int | None:
        """The RANK in the process's environment; None: none. A rank found is kept
        for the pid; none found is asked again a few times, seconds apart: a worker
        seen between fork and exec still shows its launcher's environment."""
        if pid in self.ranks:
            return self.ranks[pid]
        now = self.clock()
        ask_at, tries = self.no_rank.get(pid, (now, 0))
        if now < ask_at or tries >= _RANK_TRIES:
            return None
        try:
            raw = psutil.Process(pid).environ().get("RANK")
        except (psutil.Error, OSError, ValueError):
            raw = None
        rank = int(raw) if raw is not None and raw.isdigit() else None
        if rank is None:
            self.no_rank[pid] = (now + _RANK_AGAIN, tries + 1)
        else:
            self.ranks[pid] = rank
        return rank

    def by_rank(self, pids: Iterable[int]) -> dict[int, int]:
        """Key -> pid for a job without the client: a worker by its RANK, any
        other process by its negated pid (the launcher, a shell)."""
        keyed: dict[int, int] = {}
        for pid in pids:
            rank = self.rank_of(pid)
            key = rank if rank is not None and rank not in keyed else -pid
            keyed[key] = pid
        return keyed


def _io_bytes(p: psutil.Process) -> int | None:
    """Bytes the process has read and written through any file, pipe or socket
    (/proc/<pid>/io's rchar + wchar); None where it cannot be read."""
    try:
        io = p.io_counters()
    except (psutil.Error, AttributeError, OSError):
        return None
    chars = getattr(io, "read_chars", None), getattr(io, "write_chars", None)
    return None if None in chars else int(chars[0]) + int(chars[1])  # type: ignore[arg-type]
