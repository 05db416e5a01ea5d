"""An attempt's own cgroup (v2): membership that no process can leave or forge.

Where trainwatch may create cgroups below its own (root, or a delegated
subtree such as systemd's ``Delegate=yes``), each attempt runs in a child
cgroup ``<ours>/trainwatch-<job>-<attempt>.<our pid>`` (membership only: no
controllers are enabled, so no limits are imposed). Its leader joins it
between fork and exec, before it can fork, and every descendant is born in it;
leaving takes write access to another cgroup's ``cgroup.procs``, which a job
that is not root lacks. The cgroup's members are then one file read, and
"is this pid one of ours" is one read of ``/proc/<pid>/cgroup``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass

from trainwatch.sources.procstat import read_small

_PROC = "/proc"
_SWEEP_AFTER = 60.0  # seconds
_leftover: set[str] = set()  # our cgroups closed while processes remained (observe_only)


def mount(mounts: str = "/proc/mounts") -> str | None:
    """Where cgroup2 is mounted (the first one), from /proc/mounts."""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "cgroup2":
                    return fields[1].replace("\\040", " ")
    except OSError:
        return None
    return None


def _own(proc_cgroup: str) -> str | None:
    """Our own cgroup v2 path ("0::/path") from /proc/self/cgroup."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def of(pid: int) -> str | None:
    """The cgroup v2 path of a process ("/a/b"); None when it is gone."""
    data = read_small(f"{_PROC}/{pid}/cgroup")
    if data is None:
        return None
    for line in data.split(b"\n"):
        if line.startswith(b"0::"):
            return line[3:].decode(errors="replace")
    return None


def base(mounts: str = "/proc/mounts", self_cgroup: str = "/proc/self/cgroup"
         ) -> tuple[str, str] | None:
    """(mount point, our cgroup path) when we can create cgroups below our own."""
    mnt, own = mount(mounts), _own(self_cgroup)
    if mnt is None or own is None or own.endswith(" (deleted)"):
        return None
    path = os.path.join(mnt, own.lstrip("/"))
    if not os.access(path, os.W_OK) or not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        return None
    return mnt, own


def _sweep(parent: str) -> None:
    """Remove the empty cgroups of attempts whose trainwatch is gone (it was
    SIGKILLed); one that still holds processes is left alone, and so is a new
    one (a trainwatch in another PID namespace may be about to use it)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        owner = name.rpartition(".")[2]
        if not (name.startswith("trainwatch-") and owner.isdigit()) or os.path.exists(
                f"{_PROC}/{owner}"):
            continue
        path = os.path.join(parent, name)
        with contextlib.suppress(OSError):
            if time.time() - os.stat(path).st_ctime > _SWEEP_AFTER:
                os.rmdir(path)


def procs_below(path: str) -> set[int]:
    """Every live process in the cgroup folder ``path`` and below it."""
    out: set[int] = set()
    for d, _, _ in os.walk(path):
        try:
            with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                out.update(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class Usage:
    """One reading of an attempt cgroup's accounting. None: the kernel keeps no such
    figure for it: the memory controller is not enabled for it (trainwatch enables
    none; only a parent's cgroup.subtree_control could), or memory.peak (5.19+)."""

    cpu_usec: int  # cpu.stat usage_usec: user + system of every member, living or gone
    resident_bytes: int  # sum of the living members' RSS (a page shared is counted per process)
    memory_bytes: int | None  # memory.current: what is charged to it, page cache included
    memory_peak_bytes: int | None  # memory.peak: the most charged since it was created
    oom_kills: int | None  # memory.events oom_kill: members killed by any OOM killer


def _field(data: bytes | None, key: bytes) -> int | None:
    """The value of ``key`` in a flat-keyed file ("key value" lines)."""
    for line in (data or b"").split(b"\n"):
        k, _, v = line.partition(b" ")
        if k == key:
            with contextlib.suppress(ValueError):
                return int(v)
            return None
    return None


def _number(data: bytes | None) -> int | None:
    try:
        return int(data) if data is not None else None
    except ValueError:
        return None


def _resident(pids: set[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        fields = (read_small(f"{_PROC}/{pid}/statm") or b"").split()
        if len(fields) > 1 and fields[1].isdigit():
            total += int(fields[1]) * page
    return total


def read_usage(path: str) -> Usage | None:
    """What the cgroup folder ``path`` has used; None once it is gone (never raises)."""
    cpu = _field(read_small(os.path.join(path, "cpu.stat")), b"usage_usec")
    if cpu is None:
        return None
    return Usage(
        cpu_usec=cpu,
        resident_bytes=_resident(procs_below(path)),
        memory_bytes=_number(read_small(os.path.join(path, "memory.current"))),
        memory_peak_bytes=_number(read_small(os.path.join(path, "memory.peak"))),
        oom_kills=_field(read_small(os.path.join(path, "memory.events")), b"oom_kill"),
    )


class AttemptCgroup:
    """One attempt's cgroup. ``procs_fd`` (write "0" to it) moves the writer in.
    ``final``: its last usage, read by ``close()`` just before removing it, so
    that what the attempt used after the last scrape is not lost."""

    final: Usage | None = None

    def __init__(self, mount: str, parent: str, name: str) -> None:
        self.rel = f"{parent.rstrip('/')}/{name}"  # as /proc/<pid>/cgroup names it
        self.path = os.path.join(mount, self.rel.lstrip("/"))
        try:
            os.mkdir(self.path, 0o755)
        except FileExistsError:
            os.rmdir(self.path)  # stale and empty (a trainwatch that died), or EBUSY: in use
            os.mkdir(self.path, 0o755)
        try:
            self.procs_fd: int | None = os.open(os.path.join(self.path, "cgroup.procs"),
                                                os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            raise
        self._prefix = self.rel + "/"

    @classmethod
    def create(cls, job: str, attempt: int) -> AttemptCgroup | None:
        """The attempt's cgroup, or None where cgroup v2 is not ours to write."""
        b = base()
        if b is None:
            return None
        _sweep(os.path.join(b[0], b[1].lstrip("/")))
        for path in list(_leftover):
            with contextlib.suppress(OSError):
                os.rmdir(path)
                _leftover.discard(path)
        try:
            return cls(b[0], b[1], f"trainwatch-{job}-{attempt}.{os.getpid()}")
        except OSError:
            return None

    @classmethod
    def existing(cls, path: str) -> AttemptCgroup | None:
        """An attempt's cgroup made by a trainwatch before us (adoption); None when gone."""
        mnt = mount()
        if mnt is None or not os.path.isdir(path) or not path.startswith(mnt.rstrip("/") + "/"):
            return None
        self = cls.__new__(cls)
        self.rel = "/" + os.path.relpath(path, mnt)
        self.path, self.procs_fd, self._prefix = path, None, self.rel + "/"
        return self

    def holds(self, pid: int) -> bool:
        """Is pid in this cgroup (or one below it)? One small file read."""
        c = of(pid)
        return c is not None and (c == self.rel or c.startswith(self._prefix))

    def procs(self) -> set[int]:
        """Every live process in it and below (zombies are not listed)."""
        return procs_below(self.path)

    def usage(self) -> Usage | None:
        """What it has used so far; None once it is gone (then see ``final``)."""
        return read_usage(self.path)

    def populated(self) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.events"), "rb") as f:
                return b"populated 1" in f.read()
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: assume something still runs

    def kill(self) -> bool:
        """SIGKILL every member at once (cgroup.kill, Linux 5.14+); False when absent."""
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "wb") as f:
                f.write(b"1")
            return True
        except OSError:
            return False

    def close(self) -> bool:
        """Remove the cgroup once it is empty; False while something still runs in it."""
        if self.procs_fd is not None:
            os.close(self.procs_fd)
            self.procs_fd = None
        self.final = self.usage() or self.final  # before it vanishes (a repeat keeps it)
        for d, _, _ in sorted(os.walk(self.path), key=lambda w: -len(w[0])):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno in (errno.EBUSY, errno.ENOTEMPTY):
                    _leftover.add(self.path)  # removed at a later create()
                    return False
                raise
        return True
