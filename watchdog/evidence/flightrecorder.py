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
import shutil
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from trainwatch.state.atomic import FILE_MODE, makedirs

PREFIX = "nccl_trace_rank_"
BUFFER_SIZE = 2000
MAX_COPY = 256 << 20  # a dump of 2,000 entries is a few MiB; this skips a runaway file
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


def collect(fr_dir: Path, dest: Path, max_bytes: int = MAX_COPY) -> tuple[list[str], list[str]]:
    """Copy every regular file of ``fr_dir`` (not the pipes, not links, not
    folders) into ``dest``; the names copied, and one line per file not."""
    copied: list[str] = []
    errors: list[str] = []
    for p in sorted(Path(fr_dir).iterdir()):
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size > max_bytes:
                errors.append(f"{p.name}: {st.st_size} bytes, over {max_bytes}: not copied")
                continue
            makedirs(dest)
            src = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(src, "rb") as fin:
                fd = os.open(dest / p.name,
                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                             FILE_MODE)
                with open(fd, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
            copied.append(p.name)
        except OSError as e:
            errors.append(f"{p.name}: {e.strerror or e}")
    return copied, errors
