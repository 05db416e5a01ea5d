"""PyTorch's NCCL flight recorder (FR): the job's environment that turns it
on, the trigger of an on-demand dump through its pipes, and the collection of
the dump files.

Facts from shared/prior-art/stalls-and-log-lines.md section 2 (read in
PyTorch's sources, not run here: there is no GPU, and the FR and its pipe
exist only in ProcessGroupNCCL, not in gloo):

- ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (newer name ``TORCH_FR_BUFFER_SIZE``;
  ``FlightRecorder.hpp`` reads both): entries kept per rank. The default is
  2000 in newer code but 0 (FR off) in some versions (``FlightRecorder.hpp``
  at ``911ce84b``), so it is set explicitly.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT``: dump when the watchdog times out. Default
  true in newer code, "false" in the tutorial for PyTorch >= 2.5: set to 1.
  No ``TORCH_FR_`` name for it is verified in stock PyTorch.
- ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (newer ``TORCH_FR_DUMP_TEMP_FILE``;
  ``DebugInfoWriter::getWriter`` reads both; torchtitan moved to the new name
  in PR #1748): the dump path prefix; each rank writes ``<prefix><global
  rank>``, one pickle file. Without it the dump lands in /tmp or
  ``~/.cache/torch``, outside the incident.
- ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` (``DumpPipe``, read at ``4c2f2809``):
  with a buffer > 0, each rank makes a FIFO ``<prefix><rank>.pipe``; writing
  any bytes to it triggers a dump and training goes on. Only the first
  process group opens it. The reading thread checks the pipe periodically,
  so a dump may take a second or more to appear; a stopped rank never
  dumps. No newer name is verified for stock PyTorch.

Both prefixes are ``<fr_dir>/nccl_trace_rank_``, so the dump of the rank
behind ``nccl_trace_rank_3.pipe`` is ``nccl_trace_rank_3``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.privsep.hand import Blobs
from trainwatch.state.atomic import FILE_MODE, makedirs

PREFIX = "nccl_trace_rank_"
BUFFER_SIZE = 2000
# Root's state_dir takes at most this much of dumps per incident, by apparent size
# (a dump of 2,000 entries is a few MiB): the holes of a sparse dump are kept as
# holes, but a backup or copy that does not keep them writes them out, and eight
# sparse 255 MiB dumps were 2 GiB of an incident. From at most MAX_FILES entries.
MAX_TOTAL = 64 << 20
MAX_FILES = 1024
_PIPE = re.compile(r"(\d+)\.pipe$")
_POLL = 0.05
QUIET = 1.0  # a dump that is no pickle counts as whole once its size held this long


def env(fr_dir: Path) -> dict[str, str]:
    """The settings that turn the flight recorder on and point its dumps and
    pipes at ``fr_dir`` (old and new names: see the module docstring)."""
    prefix = str(Path(fr_dir) / PREFIX)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(BUFFER_SIZE),
        "TORCH_FR_BUFFER_SIZE": str(BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix,
    }


@dataclass
class Trigger:
    """One dump pipe written to (or not), and the dump file it should produce."""

    pipe: Path
    rank: int | None
    before: tuple[int, int] | None  # (mtime_ns, size) of the dump file before the trigger
    error: str | None = None
    outcome: str = "pending"  # "dumped" | "timeout" | "skipped: ..." | "failed: ..."

    @property
    def dump(self) -> Path:
        return self.pipe.with_suffix("")

    def as_dict(self) -> dict[str, object]:
        return {"pipe": self.pipe.name, "rank": self.rank, "dump": self.dump.name,
                "outcome": self.outcome}


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None


def _pipes(fr_dir: Path) -> list[Path]:
    out = []
    for p in sorted(Path(fr_dir).iterdir()):
        with contextlib.suppress(OSError):
            if p.name.endswith(".pipe") and stat.S_ISFIFO(os.lstat(p).st_mode):
                out.append(p)
    return out


def trigger(fr_dir: Path) -> list[Trigger]:
    """Write a byte to every dump pipe in ``fr_dir``. Opened non-blocking: a
    pipe without a reader (its rank is gone) fails with ENXIO and is skipped.
    Raises OSError when ``fr_dir`` cannot be listed."""
    out = []
    for pipe in _pipes(fr_dir):
        m = _PIPE.search(pipe.name)
        t = Trigger(pipe, int(m.group(1)) if m else None, _stat(pipe.with_suffix("")))
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            t.outcome = ("skipped: no reader" if e.errno == errno.ENXIO
                         else f"failed: {e.strerror or e}")
            out.append(t)
            continue
        try:
            os.write(fd, b"1")
        except OSError as e:  # EAGAIN: the pipe is full, a dump is already asked for
            if e.errno != errno.EAGAIN:
                t.outcome = f"failed: {e.strerror or e}"
        finally:
            os.close(fd)
        out.append(t)
    return out


def _complete(path: Path, size: int) -> bool:
    """A pickle ends with its STOP opcode, b"."."""
    try:
        with open(path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) == b"."
    except (OSError, ValueError):
        return False


def wait_dumps(triggers: list[Trigger], silent: Collection[int], deadline: float,
               clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until every triggered pipe's dump file has changed and is whole (it
    ends as a pickle does and kept its size for one poll, or kept it for
    ``QUIET`` seconds), or the deadline. Ranks in ``silent`` (stopped: they
    cannot dump) are not waited for. Returns False when the deadline cut it short."""
    sizes: dict[Path, tuple[int, float]] = {}  # size, and since when
    pending = []
    for t in triggers:
        if t.outcome != "pending":
            continue
        if t.rank is not None and t.rank in silent:
            t.outcome = "skipped: rank stopped"
        else:
            pending.append(t)
    while pending:
        for t in list(pending):
            now = _stat(t.dump)
            if now is None or now == t.before or now[1] == 0:
                continue
            size, since = sizes.get(t.dump, (-1, clock()))
            if size != now[1]:
                sizes[t.dump] = (now[1], clock())
            elif _complete(t.dump, size) or clock() - since >= QUIET:
                t.outcome = "dumped"
                pending.remove(t)
        if not pending:
            break
        if clock() >= deadline:
            for t in pending:
                t.outcome = "timeout"
            return False
        time.sleep(_POLL)
    return True


def dumps(fr_dir: str, silent: list[int], seconds: float,
          max_total: int = MAX_TOTAL) -> Blobs:
    """In the job's hand (privsep), as its user: trigger every dump pipe, wait for
    the dumps (ranks in ``silent`` are not waited for) at most ``seconds``, and
    read the regular files of ``fr_dir``: their data only (holes skipped), at
    most ``max_total`` bytes of apparent size in all, ``MAX_FILES`` files."""
    out: dict[str, Any] = {"pipes": [], "files": [], "errors": [], "deadline_hit": False,
                           "limited": 0}
    try:
        triggers = trigger(Path(fr_dir))
    except OSError as e:
        out["errors"].append(f"{fr_dir}: {e.strerror or e}")
        return Blobs(out, [])
    if not wait_dumps(triggers, set(silent), time.monotonic() + seconds):
        out["deadline_hit"] = True
    out["pipes"] = [t.as_dict() for t in triggers]
    blobs: list[bytes] = []
    total = 0
    names = sorted(os.listdir(fr_dir))
    if len(names) > MAX_FILES:
        out["errors"].append(f"{len(names)} entries: only the first {MAX_FILES} looked at")
        out["limited"] += 1
    for name in names[:MAX_FILES]:
        try:
            fd = os.open(os.path.join(fr_dir, name),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.ELOOP:  # a link is skipped, as a pipe or a folder is
                out["errors"].append(f"{name}: {e.strerror or e}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            if total + st.st_size > max_total:
                out["errors"].append(f"{name}: {st.st_size} bytes would pass the {max_total} "
                                     "bytes copied per incident (holes count): not copied")
                out["limited"] += 1
                continue
            segments = []
            for off, n in _extents(fd, st.st_size):
                chunk = os.pread(fd, n, off)
                segments.append([off, len(chunk), len(blobs)])
                blobs.append(chunk)
            total += st.st_size
            out["files"].append({"name": name, "size": st.st_size, "segments": segments})
        except OSError as e:
            out["errors"].append(f"{name}: {e.strerror or e}")
        finally:
            os.close(fd)
    return Blobs(out, blobs)


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The (offset, length) of the file's data, its holes left out."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here on
                break
            return [(0, size)]  # SEEK_DATA unsupported here: all of it is data
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, min(end, size) - start))
        pos = end
    return out


def write(dest: Path, got: Any, blobs: list[bytes]) -> tuple[list[str], list[str]]:
    """Root's side: the dumps the hand read, written into ``dest`` (root's own
    folder) as sparse files; the names written, and one line per one not. What
    the hand sent is the job user's: names, sizes and segments are checked."""
    copied: list[str] = []
    errors: list[str] = []
    # Root's own bound on what it writes (the hand's may not have held): each
    # blob once, MAX_TOTAL bytes of apparent size in all, MAX_FILES files.
    used: set[int] = set()
    written = 0
    files = got.get("files") if isinstance(got, dict) else None
    for f in files[:MAX_FILES] if isinstance(files, list) else []:
        name, size, segs = (f.get(k) for k in ("name", "size", "segments")) \
            if isinstance(f, dict) else (None, None, None)
        if not (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
                and "\0" not in name and isinstance(size, int) and 0 <= size <= MAX_TOTAL
                and isinstance(segs, list)):
            errors.append("a dump the hand described badly: skipped")
            continue
        if written + size > MAX_TOTAL:
            errors.append(f"{name}: past the {MAX_TOTAL} bytes copied per incident")
            continue
        written += size
        try:
            makedirs(dest)
            fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, FILE_MODE)
            try:
                for off, n, i in segs:
                    if not (off >= 0 and off + n <= size and 0 <= i < len(blobs)
                            and len(blobs[i]) == n and i not in used):
                        raise ValueError("a segment outside the file")
                    used.add(i)
                    os.pwrite(fd, blobs[i], off)
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            copied.append(name)
        except (OSError, ValueError, TypeError) as e:
            errors.append(f"{name}: {getattr(e, 'strerror', None) or e}")
            with contextlib.suppress(OSError):
                os.unlink(dest / name)  # not half a dump
    return copied, errors
