"""Checkpoint manifests: the size and content hash of every regular file of one
checkpoint (a file or a folder), made when it is first judged complete and
checked before a relaunch resumes from it, so that bit rot, a truncated copy
or a file rewritten in place is caught and the previous good one is used.

What a manifest covers, and what a check calls a mismatch:
- every regular file under the checkpoint, found without following any
  symlink (the root path itself may be a link: the caller named it). Links,
  FIFOs, sockets and devices inside are neither listed nor followed, so
  nothing outside the checkpoint is ever read;
- a listed file that is missing, not a regular file any more, of another size
  or with other content is a mismatch;
- a file that is not in the manifest is *not* a mismatch unless
  ``strict=True``: loaders read the files the checkpoint's own index names,
  and files appear beside them that change nothing (NFS's ``.nfs*`` files of
  an open deleted file, an operator's notes). A rewrite of the checkpoint
  also changes a listed file, which is caught.

The hash is xxHash's XXH3-128 when the ``xxhash`` package is importable, else
SHA-256 (hashlib); a manifest names its algorithm and is checked with it.
One JSON file per checkpoint (``<state_dir>/jobs/<job>/manifests/<step>.json``),
so a new checkpoint never rewrites the others. ``Verifier`` (verifier.py) does
the hashing in one background thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainwatch.state import atomic

log = logging.getLogger("trainwatch")

CHUNK = 4 << 20  # bytes per read: large enough that a syscall per chunk costs nothing
MAX_DEPTH = 64  # folders inside folders; deeper is refused (ELOOP), never recursed
VERSION = 1


class _Hash(Protocol):
    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def _factories() -> dict[str, Callable[[], _Hash]]:
    algos: dict[str, Callable[[], _Hash]] = {}
    try:
        import xxhash  # type: ignore[import-not-found, unused-ignore]  # optional

        algos["xxh3_128"] = xxhash.xxh3_128
    except ImportError:
        pass
    algos["sha256"] = hashlib.sha256
    return algos


ALGOS = _factories()
DEFAULT_ALGO = next(iter(ALGOS))  # the fastest available: xxh3_128, else sha256


class Stopped(Exception):
    """``should_stop`` said to give up before the hashing was done."""


class ChangedWhileHashed(OSError):
    """A file's size or mtime changed while it was read: the checkpoint is still
    being written (or rewritten), so no manifest of it can be trusted."""


@dataclass(frozen=True)
class Manifest:
    step: int
    path: str
    algo: str
    files: tuple[tuple[str, int, str], ...]  # (path relative to ``path``, size, hex digest)
    made: float  # Unix seconds

    @property
    def size(self) -> int:
        return sum(f[1] for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "step": self.step, "path": self.path, "algo": self.algo,
                "made": self.made, "files": [list(f) for f in self.files]}

    @classmethod
    def from_json(cls, obj: Any) -> Manifest | None:
        """None when ``obj`` is not a manifest this version wrote."""
        if not isinstance(obj, dict) or obj.get("version") != VERSION:
            return None
        step, path, algo, made, files = (obj.get(k) for k in
                                         ("step", "path", "algo", "made", "files"))
        if not (isinstance(step, int) and isinstance(path, str) and isinstance(algo, str)
                and isinstance(made, (int, float)) and isinstance(files, list)):
            return None
        out = []
        for f in files:
            if not (isinstance(f, list) and len(f) == 3 and isinstance(f[0], str)
                    and isinstance(f[1], int) and isinstance(f[2], str)):
                return None
            out.append((f[0], f[1], f[2]))
        return cls(step, path, algo, tuple(out), float(made))


# --- walking a checkpoint without following links ---------------------------------


@contextlib.contextmanager
def _open_root(path: str) -> Iterator[tuple[int, os.stat_result]]:
    # The checkpoint itself is never a link either: one to a file elsewhere would
    # put that file's size and digest in a manifest, and judge it complete.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        yield fd, os.fstat(fd)
    finally:
        os.close(fd)


def _walk(dfd: int, prefix: str, depth: int = 0) -> Iterator[tuple[str, int, str]]:
    """(relative path, folder fd, name) of each regular file under the folder ``dfd``,
    sorted; sub-folders are opened with O_NOFOLLOW relative to their parent, so a
    folder swapped for a link while we walk is refused, not followed."""
    if depth > MAX_DEPTH:
        raise OSError(40, "folders nested too deep", prefix)  # ELOOP
    with os.scandir(dfd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        mode = e.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
            try:
                yield from _walk(sub, f"{prefix}{e.name}/", depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(mode):
            yield f"{prefix}{e.name}", dfd, e.name


def _files(path: str) -> Iterator[tuple[str, Callable[[], int]]]:
    """(relative path, opener) of every regular file of the checkpoint ``path``; a
    file checkpoint is one entry named "". The opener returns a read-only fd of a
    regular file (OSError otherwise), opened without following a link."""
    with _open_root(path) as (fd, st):
        if stat.S_ISREG(st.st_mode):
            yield "", lambda: os.dup(fd)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(21, "not a regular file or a folder", path)  # EISDIR-like
        for rel, dfd, name in _walk(fd, ""):
            yield rel, lambda dfd=dfd, name=name: _open_regular(name, dfd)  # type: ignore[misc]


def _open_regular(name: str, dfd: int) -> int:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(21, "not a regular file", name)
    return fd


def _buffer(size: int) -> mmap.mmap:
    """The read buffer: anonymous memory of its own, returned to the system when
    closed (a bytearray this large, freed, raises malloc's threshold and stays
    resident in every verifier thread's arena)."""
    return mmap.mmap(-1, max(size, 1))


def _release(buf: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still held by a traceback: freed with it
        buf.close()


def _hash_fd(fd: int, algo: str, buf: mmap.mmap,
             should_stop: Callable[[], bool] | None) -> tuple[int, str]:
    """(bytes read, hex digest) of the file ``fd`` from its start."""
    h = ALGOS[algo]()
    view = memoryview(buf)
    os.lseek(fd, 0, os.SEEK_SET)  # a file checkpoint's fd is a dup: its offset is shared
    before = os.fstat(fd)
    with contextlib.suppress(OSError):  # a hint only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    n = 0
    while True:
        if should_stop is not None and should_stop():
            raise Stopped
        got = os.readv(fd, [view])
        if not got:
            break
        h.update(view[:got])
        n += got
    after = os.fstat(fd)
    if n != before.st_size or (after.st_size, after.st_mtime_ns) != (before.st_size,
                                                                        before.st_mtime_ns):
        raise ChangedWhileHashed(11, "changed while it was read")  # EAGAIN
    return n, h.hexdigest()


def _name(m: Manifest, rel: str) -> str:
    return rel or os.path.basename(os.path.normpath(m.path))


# --- the API --------------------------------------------------------------------------


# The digests of hard-linked files already hashed, by (device, inode, size, mtime,
# algorithm): a chunk that trainwatch.snapshot links into every snapshot holding it
# is read once, not once per snapshot. Only for making a manifest: a check before a
# relaunch reads every byte again.
Known = MutableMapping[tuple[int, int, int, int, str], str]


def make(step: int, path: str, *, chunk: int = CHUNK,
         should_stop: Callable[[], bool] | None = None, algo: str | None = None,
         known: Known | None = None) -> Manifest:
    """Hash every regular file of the checkpoint at ``path`` (``algo``: a key of
    ALGOS, the fastest by default; ``known``: digests of hard-linked files, used
    and filled). Raises OSError when it cannot be read or is changing
    (ChangedWhileHashed), Stopped when ``should_stop()`` turned true."""
    algo = algo or DEFAULT_ALGO
    buf = _buffer(chunk)
    try:
        return _make(step, path, algo, buf, should_stop, known)
    finally:
        _release(buf)


def _make(step: int, path: str, algo: str, buf: mmap.mmap,
          should_stop: Callable[[], bool] | None, known: Known | None) -> Manifest:
    made = time.time()
    files = []
    for rel, opener in _files(path):
        fd = opener()
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, algo)
            linked = known is not None and st.st_nlink > 1
            digest = known.get(key) if known is not None and linked else None
            if digest is not None:
                size = st.st_size
            else:
                size, digest = _hash_fd(fd, algo, buf, should_stop)
                if known is not None and linked:
                    known[key] = digest
        except ChangedWhileHashed as e:
            raise ChangedWhileHashed(e.errno, e.strerror, os.path.join(path, rel)) from None
        finally:
            os.close(fd)
        files.append((rel, size, digest))
    return Manifest(step, path, algo, tuple(sorted(files)), made)


def check_sizes(m: Manifest, *, strict: bool = False) -> str | None:
    """The cheap check (a stat per file): None when every listed file is there with
    its size; else why not, e.g. "weights.bin: size 10 != 20" or "config.json:
    missing". ``strict``: a file not in the manifest is a mismatch too."""
    return _check(m, strict, hash_it=False)


def check(m: Manifest, *, strict: bool = False, chunk: int = CHUNK,
          should_stop: Callable[[], bool] | None = None) -> str | None:
    """Sizes first (cheap), then every listed file's content. None when all match;
    else one phrase why not ("optimizer.pt: content changed"). Raises ValueError
    when the manifest's hash algorithm is not available here, Stopped as make()."""
    if m.algo not in ALGOS:
        raise ValueError(f"cannot check: hash {m.algo} is not available (pip install xxhash)")
    return _check(m, strict, hash_it=False) or _check(
        m, strict, hash_it=True, chunk=chunk, should_stop=should_stop)


def _check(m: Manifest, strict: bool, hash_it: bool, chunk: int = CHUNK,
           should_stop: Callable[[], bool] | None = None) -> str | None:
    buf = _buffer(chunk if hash_it else 0)
    try:
        return _check_with(m, strict, hash_it, buf, should_stop)
    finally:
        _release(buf)


def _check_with(m: Manifest, strict: bool, hash_it: bool, buf: mmap.mmap,
                should_stop: Callable[[], bool] | None) -> str | None:
    want = {rel: (size, digest) for rel, size, digest in m.files}
    seen = set()
    try:
        for rel, opener in _files(m.path):
            if rel not in want:
                if strict:
                    return f"{rel}: not in the manifest"
                continue
            seen.add(rel)
            size, digest = want[rel]
            try:
                fd = opener()
            except FileNotFoundError:
                return f"{_name(m, rel)}: missing"
            except OSError as e:
                return f"{_name(m, rel)}: {e.strerror or e}"
            try:
                if not hash_it:
                    got = os.fstat(fd).st_size
                    if got != size:
                        return f"{_name(m, rel)}: size {got} != {size}"
                    continue
                try:
                    got, got_digest = _hash_fd(fd, m.algo, buf, should_stop)
                except ChangedWhileHashed:
                    return f"{_name(m, rel)}: changed while it was read"
                if got != size:
                    return f"{_name(m, rel)}: size {got} != {size}"
                if got_digest != digest:
                    return f"{_name(m, rel)}: content changed"
            finally:
                os.close(fd)
    except OSError as e:  # the checkpoint (or a folder in it) went or became unreadable
        where = _name(m, "") if e.filename in (None, m.path) else e.filename
        return f"{where}: {'missing' if isinstance(e, FileNotFoundError) else e.strerror or e}"
    for rel, _size, _digest in m.files:
        if rel not in seen:
            return f"{_name(m, rel)}: missing"
    return None


class Store:
    """The per-job folder of manifests, one file per step, written atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def _file(self, step: int) -> Path:
        return self.folder / f"{int(step)}.json"

    def get(self, step: int) -> Manifest | None:
        """None when there is none (or it is unreadable or not a manifest: logged)."""
        f = self._file(step)
        obj = atomic.read_json(f)
        if obj is None:
            return None
        m = Manifest.from_json(obj)
        if m is None or m.step != step:
            log.warning("%s: not a manifest of step %d: ignored", f, step)
            return None
        return m

    def put(self, m: Manifest) -> None:
        """Raises OSError (disk full, read-only state_dir)."""
        # Not fsynced: a manifest lost to a power cut is made again at the next
        # verification (then trusted as a first judgement); two fsyncs per
        # checkpoint are not worth that.
        atomic.write_json(self._file(m.step), m.to_json(), durable=False)

    def drop(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(step))
