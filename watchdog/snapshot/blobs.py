"""The content-addressed chunk store of a snapshot folder D, crash-safe
without locks (stdlib + xxhash; see trainwatch.snapshot.format for the layout).

Invariant: while a store file ``D/blobs/xx/<name>`` is in use it is also
hard-linked from a staging or snapshot folder, so its link count is >= 2.
GC unlinks store files whose link count is 1 and nothing else: a snapshot
folder holds its own links, so no GC, at any instant, can take a byte a
manifest names. A race between a writer and GC can only cost dedup:

- writer links store -> staging, GC unlinked it first: ENOENT, the writer
  writes the chunk instead;
- writer writes staging/name then links it into the store; GC sees 2 links.

Where hard links are refused (EXDEV, EPERM, ENOTSUP: some FUSE or network
mounts) chunks are written into every snapshot (no dedup), said once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
from collections.abc import Callable
from typing import Any

from trainwatch.snapshot import crashpoint
from trainwatch.snapshot.format import (
    DELETING_RE,
    MANIFEST,
    STAGING_RE,
    TOMBSTONE_RE,
    Chunk,
    blob_name,
    folder_name,
    step_of,
)

__all__ = ["STORE", "Staging", "collect", "delete", "digest", "pin", "publish", "store_path",
           "unpin"]

log = logging.getLogger("trainwatch.snapshot")

STORE = "blobs"
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK)
_links_refused_said = False
_counter = 0


def digest(data: Any) -> str:
    """xxh3_128 hexdigest (32 hex digits) of a bytes-like object."""
    import xxhash  # a dependency; imported here so that format users never load it

    return str(xxhash.xxh3_128_hexdigest(data))


def store_path(root: str, name: str) -> str:
    return os.path.join(root, STORE, name[:2], name)


def _host() -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"


def _unique() -> int:
    global _counter
    _counter += 1
    return _counter


def _links_refused(e: OSError, what: str) -> None:
    global _links_refused_said
    if not _links_refused_said:
        _links_refused_said = True
        log.warning("snapshot: hard links refused (%s: %s): chunks are copied, "
                    "snapshots share no bytes", what, e.strerror or e)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: Any, what: str) -> None:
    """Write ``data`` to ``path.tmp``, fsync, rename to ``path`` (``what``: the
    crash points' prefix, chunk or manifest)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        crashpoint.at(f"{what}.tmp_written")
        os.fsync(fd)
    finally:
        os.close(fd)
    crashpoint.at(f"{what}.fsynced")
    os.rename(tmp, path)


class Staging:
    """One save in progress: ``D/.staging-<step>-<host>-<pid>-<n>/``."""

    def __init__(self, root: str, step: int) -> None:
        self.root = os.path.abspath(root)
        self.step = int(step)
        os.makedirs(os.path.join(self.root, STORE), exist_ok=True)
        while True:
            name = f".staging-{self.step}-{_host()}-{os.getpid()}-{_unique()}"
            self.path = os.path.join(self.root, name)
            try:
                os.mkdir(self.path)
                break
            except FileExistsError:
                continue
        self.written = 0  # file bytes written (not linked)
        self.new_raw = 0  # raw bytes of the chunks written
        self.new_chunks = 0

    def _have(self, name: str) -> int | None:
        """The size of ``name`` in this staging folder, None if absent."""
        try:
            return os.stat(os.path.join(self.path, name)).st_size
        except FileNotFoundError:
            return None

    def link(self, name: str) -> int | None:
        """Link the store's ``name`` here; its size, or None if the store lacks it."""
        dst = os.path.join(self.path, name)
        try:
            os.link(store_path(self.root, name), dst)
        except FileNotFoundError:
            return None  # not stored (or GC raced): write it
        except FileExistsError:
            pass  # the same chunk twice in this snapshot
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            _links_refused(e, name)
            return None
        crashpoint.at("chunk.linked")
        return os.stat(dst).st_size

    def add(self, h: str, size: int, produce: Callable[[], tuple[Any, str | None]],
            dedup: bool = True) -> Chunk:
        """Put the chunk of raw hash ``h`` (``size`` raw bytes) in this save.
        A copy already in this save is used; with ``dedup`` a stored one under
        either codec is linked; else ``produce()`` gives (file bytes, codec),
        written here and then linked into the store."""
        for c in (None, "zstd"):
            name = blob_name(h, c)
            n = self._have(name)
            if n is None and dedup:
                n = self.link(name)
            if n is not None:
                return Chunk(h, size, n, c)
        data, codec = produce()
        name = blob_name(h, codec)
        path = os.path.join(self.path, name)
        _write_file(path, data, "chunk")
        n = memoryview(data).nbytes
        self.written += n
        self.new_raw += size
        self.new_chunks += 1
        self._store(name, path)
        return Chunk(h, size, n, codec)

    def adopt(self, part: str, c: Chunk) -> None:
        """Put the chunk file ``part`` (in this folder, written, fsynced and checked
        by its maker: a pull's download) in this save under its name, and in the store."""
        path = os.path.join(self.path, c.name)
        os.rename(part, path)
        self.written += c.stored
        self.new_raw += c.size
        self.new_chunks += 1
        self._store(c.name, path)

    def _store(self, name: str, path: str) -> None:
        sp = store_path(self.root, name)
        for _ in range(2):  # a GC may remove the empty blobs/xx between mkdir and link
            with contextlib.suppress(FileExistsError):
                os.makedirs(os.path.dirname(sp), exist_ok=True)
            try:
                os.link(path, sp)
            except FileExistsError:
                pass  # stored already (a full save, or another writer): fine
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
                _links_refused(e, name)
            crashpoint.at("chunk.stored")
            return

    def abandon(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def publish(staging: Staging, manifest: bytes, replace: bool = False) -> tuple[str, bool]:
    """Write the manifest last and rename the staging folder to
    ``snapshot-<step>``. (folder, True) when published; (folder, False) when a
    snapshot of that step exists already: it wins, this staging is removed.
    With ``replace`` the existing one is first renamed aside (a snapshot of an
    abandoned timeline: the caller resumed from an older step), so a crash
    in between leaves neither under the name, never a mix."""
    _write_file(os.path.join(staging.path, MANIFEST), manifest, "manifest")
    crashpoint.at("manifest.renamed")
    _fsync_dir(staging.path)
    crashpoint.at("staging.fsynced")
    final = os.path.join(staging.root, folder_name(staging.step))
    aside = _set_aside(staging.root, final, staging.step) if replace else None
    try:
        os.rename(staging.path, final)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        staging.abandon()
        return final, False
    crashpoint.at("publish.renamed")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)  # what is left, GC removes
    _fsync_dir(staging.root)
    crashpoint.at("publish.fsynced")
    return final, True


def pin(folder: str) -> str:
    """A staging folder of this process holding hard links to every file of the
    snapshot ``folder``: what an upload reads, whatever keep or the daemon's
    retention deletes meanwhile (GC spares it while this process lives). Where
    links are refused, ``folder`` itself. FileNotFoundError: it is gone."""
    root, step = os.path.dirname(os.path.abspath(folder)), step_of(folder)
    if step is None:
        raise ValueError(f"{folder}: not a snapshot folder (snapshot-<step>)")
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "snapshot folder gone", folder)
    s = Staging(root, step)
    try:
        for name in os.listdir(folder):
            os.link(os.path.join(folder, name), os.path.join(s.path, name))
    except OSError as e:
        s.abandon()
        if e.errno in _NO_LINK:
            return folder
        raise
    return s.path


def unpin(path: str) -> None:
    """Remove a folder ``pin`` made (never a snapshot folder)."""
    if STAGING_RE.match(os.path.basename(path)):
        shutil.rmtree(path, ignore_errors=True)


def _set_aside(root: str, folder: str, step: int) -> str | None:
    """Rename ``folder`` to a ``.deleting-*`` name; None when it is not there."""
    while True:
        dead = os.path.join(root, f".deleting-{step}-{os.getpid()}{_unique()}")
        try:
            os.rename(folder, dead)
            return dead
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise


def delete(root: str, folder: str, gc: bool = True) -> bool:
    """Remove the snapshot ``folder`` of ``root``: renamed to a dot-name first
    (so it stops being a snapshot at once), then removed, then (``gc``) the
    store's unreferenced chunks. False when it was not there."""
    root = os.path.abspath(root)
    step = step_of(folder)
    if step is None or os.path.dirname(os.path.abspath(folder)) != root:
        raise ValueError(f"{folder}: not a snapshot folder of {root}")
    dead = _set_aside(root, folder, step)
    if dead is None:
        return False
    crashpoint.at("delete.renamed")
    _fsync_dir(root)
    shutil.rmtree(dead, ignore_errors=True)
    crashpoint.at("delete.removed")
    if gc:
        collect(root)
    return True


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie is dead too (killed, not yet reaped by its parent)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def collect(root: str) -> dict[str, int]:
    """Garbage collection: remove this host's staging folders whose process is
    gone, every ``.deleting-*`` folder, the store files no folder links (link
    count 1), and empty store subfolders. Interrupted at any instant it loses
    nothing a snapshot or a live save holds; run again, it finishes the job."""
    root = os.path.abspath(root)
    out = {"folders": 0, "blobs": 0, "bytes": 0}
    host = _host()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        m = STAGING_RE.match(name)
        gone = DELETING_RE.match(name) is not None or TOMBSTONE_RE.match(name) is not None or (
            m is not None and m.group(2) == host and _dead(int(m.group(3))))
        if gone:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            crashpoint.at("gc.folder_removed")
            out["folders"] += 1
    store = os.path.join(root, STORE)
    try:
        subs = os.listdir(store)
    except FileNotFoundError:
        return out
    for sub in subs:
        d = os.path.join(store, sub)
        try:
            files = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in files:
            p = os.path.join(d, f)
            try:
                st = os.stat(p, follow_symlinks=False)
                if st.st_nlink == 1:
                    os.unlink(p)
                    crashpoint.at("gc.blob_unlinked")
                    out["blobs"] += 1
                    out["bytes"] += st.st_size
            except FileNotFoundError:
                continue
        with contextlib.suppress(OSError):
            os.rmdir(d)  # only when empty
    return out
