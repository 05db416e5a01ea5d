"""Atomic state files: write a temp file, fsync it, rename it over the old one,
fsync the directory. A reader sees the old file or the new one, never half.

State files are not world-readable (they name jobs, paths and pids): 0640 by
default, set on the temp file's descriptor, so no path (and no symlink) is
ever followed to set it; the rename replaces a symlink rather than follow it.
Files rewritten every second and not fsynced are exchanged in rather than renamed
over the old one (see ``_swap_in``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

FILE_MODE = 0o640
DIR_MODE = 0o750

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any
try:  # glibc >= 2.28; elsewhere every swap is a plain rename
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
except AttributeError:
    _renameat2 = None


def _swap_in(tmp: str, path: Path) -> None:
    """Put ``tmp`` at ``path``, leaving ``tmp`` gone. ext4 flushes a file renamed
    over another (auto_da_alloc: 1-3 ms of the loop's time, twice the CPU of the
    write itself); an exchange is not a replace, so it skips that, and the old
    file, now at ``tmp``, is unlinked. Falls back to a rename where the file
    system cannot exchange, or when ``path`` is not there yet."""
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        regular = False
    # Only a regular file is swapped: a folder or a link there fails or is replaced, as
    # by a rename, and is never moved to ``tmp``.
    if regular and _renameat2 is not None and _renameat2(
            _AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) == 0:
        with contextlib.suppress(OSError):  # the new file is in place: a stale tmp is harmless
            os.unlink(tmp)
        return
    err = ctypes.get_errno() if regular and _renameat2 is not None else errno.ENOSYS
    if err not in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):
        raise OSError(err, os.strerror(err), tmp)
    os.replace(tmp, path)


def makedirs(path: str | os.PathLike[str], mode: int = DIR_MODE) -> None:
    """Create ``path`` and every missing folder above it with ``mode`` (the
    umask may only tighten it); unlike ``os.makedirs``, which gives the
    folders above the default mode (0755 under the usual umask)."""
    p = Path(path)
    missing = []
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode)


def write_json(path: str | os.PathLike[str], obj: Any, durable: bool = True,
               mode: int = FILE_MODE) -> None:
    """``durable=False`` skips the fsyncs: still old-or-new for readers, but a
    power loss may leave the old file. For snapshots rewritten every second,
    by one writer at a time (their temp file has a fixed name). Raises OSError
    (disk full, read-only) or ValueError/TypeError (``obj`` is not JSON); the
    old file is then untouched and no temp file is left."""
    p = Path(path)
    # Compact: the C encoder (indent= takes the pure-Python one, ~10x slower on the
    # catalog and status files rewritten as a job runs). Before any file is made.
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    makedirs(p.parent)
    if durable:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    else:
        tmp = str(p.parent / f".{p.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            os.replace(tmp, p)
        else:
            _swap_in(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):  # the first error is the one to report
            os.unlink(tmp)
        raise
    if not durable:
        return
    dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed file, or None when it is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
