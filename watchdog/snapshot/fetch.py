"""A remote snapshot pulled into a local folder (see trainwatch.snapshot.remote).

A pull lands like a save: the manifest first (its size capped before it is
read, its claims checked: limits.py), then each chunk linked from the local
store when that copy is intact, or downloaded into a staging folder (its
object's real size compared with the declared one first, then streamed in
bounded pieces: chunkfile.py), every chunk checked against its hash, then
published by rename (``blobs.publish``).

By default the newest intact snapshot is pulled: a damaged newer one (a bad
manifest, a chunk missing, of another size, or not matching its hash) is
skipped and said, and the next older one tried, up to FALLBACKS of them.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from trainwatch.snapshot import blobs, chunkfile, crashpoint, limits
from trainwatch.snapshot.format import Chunk, Manifest, folder_name, judge, loads, read
from trainwatch.snapshot.remote import Damaged, Pulled, Remote, RemoteError, remote_manifest

__all__ = ["DOWNLOADS", "FALLBACKS", "pull"]

log = logging.getLogger("trainwatch.snapshot")

DOWNLOADS = 8  # chunks a pull fetches at once (each streamed to its file, PIECE at a time)
# Older snapshots tried after a damaged newest one: a rot shared by many (a chunk
# every snapshot links) is said after this many, not after a download of each.
FALLBACKS = 16


def pull(r: Remote, root: str, step: int | None = None) -> Pulled:
    """The remote snapshot ``step`` pulled into ``root`` (unless there already);
    by default the newest intact one: a damaged newer one is skipped, said, for
    the next older. Pulled(None) when the remote has none (of that step);
    RemoteError when every one tried is damaged, or Damaged for the ``step`` asked."""
    have = r.steps()
    if step is not None:
        if step not in have:
            return Pulled(None)
        return Pulled(_pull_one(r, root, step), step)
    skipped: list[tuple[int, str]] = []
    for s in reversed(have):
        if len(skipped) >= FALLBACKS:
            break
        try:
            folder = _pull_one(r, root, s)
        except Damaged as e:
            log.warning("snapshot: %s/%s is damaged (%s): trying the one before it",
                        r.url, remote_manifest(s), e)
            skipped.append((s, str(e)))
            continue
        if folder is not None:  # else deleted since the listing
            return Pulled(folder, s, tuple(skipped))
    if skipped:
        s, why = skipped[0]
        raise RemoteError(f"{r.url}: no intact snapshot among the newest {len(skipped)} "
                          f"(step {s}: {why})")
    return Pulled(None)


def _manifest(r: Remote, step: int) -> tuple[bytes, Manifest] | None:
    """The remote manifest of ``step``, its size capped before it is read and its
    claims checked; None when it is gone (deleted since the listing)."""
    name = remote_manifest(step)
    rpath = r.path(name)
    try:
        size = int(r.fs.size(rpath))
        limits.manifest_size(size)
        data = bytes(r.fs.cat_file(rpath, start=0, end=size + 1))
    except FileNotFoundError:
        return None
    except limits.Damaged as e:
        raise Damaged(f"{name}: {e}") from None
    if len(data) != size:
        raise RemoteError(f"{r.url}/{name} changed while it was read")
    try:
        m = loads(data, step)
        limits.check(m)
    except ValueError as e:  # limits.Damaged is one
        raise Damaged(f"{name}: {e}") from None
    return data, m


def _pull_one(r: Remote, root: str, step: int) -> str | None:
    """The local folder of the remote snapshot ``step``, pulled into ``root``
    unless there and whole; None when its manifest is gone."""
    root = os.path.abspath(root)
    local = os.path.join(root, folder_name(step))
    if os.path.isdir(local) and _whole(local):
        return local
    # Not here, or here but damaged (a chunk cut short, or rotted: its hash):
    # pulled anew, the local store's intact chunks linked, and put in its place.
    got = _manifest(r, step)
    if got is None:
        return None
    data, m = got
    staging = blobs.Staging(root, step)
    try:
        todo = []
        for name, c in m.chunks().items():
            if _linked(staging, name, c):
                crashpoint.at("pull.blob.done")
            else:
                todo.append(c)
        _fits(root, todo)
        # Downloads in parallel (an object store's latency is per request), each
        # streamed to a file of its own in staging and adopted here, in order.
        with ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="trainwatch-pull") as pool:
            window: deque[Future[str]] = deque()
            for i, c in enumerate(todo):
                while len(window) < DOWNLOADS and i + len(window) < len(todo):
                    window.append(pool.submit(_download, r, staging, todo[i + len(window)]))
                try:
                    part = window.popleft().result()
                except limits.Damaged as e:
                    for f in window:  # not started: not downloaded for nothing
                        f.cancel()
                    raise Damaged(f"{e}; nothing was restored") from None
                staging.adopt(part, c)
                crashpoint.at("pull.blob.done")
        crashpoint.at("pull.publish.before")
        folder, _ = blobs.publish(staging, data, replace=os.path.isdir(local))
    except BaseException:
        staging.abandon()
        raise
    return _complete(folder)  # published, or the one published meanwhile (it wins)


def _linked(staging: blobs.Staging, name: str, c: Chunk) -> bool:
    """Chunk ``name`` linked into staging from the local store, when that copy is intact."""
    if staging.link(name) is None:
        return False
    path = os.path.join(staging.path, name)
    if chunkfile.check(path, c) is None:
        return True
    os.unlink(path)  # a damaged local copy: take the remote's (the store keeps its own)
    log.warning("snapshot: local store copy of chunk %s is damaged; downloading it", name)
    return False


def _download(r: Remote, staging: blobs.Staging, c: Chunk) -> str:
    """The remote's chunk ``c`` in a file of staging's, size and hash checked."""
    part = os.path.join(staging.path, f"{c.name}.part")
    chunkfile.download(r.fs, r.blob(c.name), part, c)
    return part


def _fits(root: str, todo: list[Chunk]) -> None:
    """Refuse before downloading what the local disk cannot hold."""
    need = sum(c.stored for c in todo)
    free = shutil.disk_usage(root).free
    if need > free:
        raise RemoteError(f"{root}: the snapshot needs {need} more bytes, {free} are free")


def _complete(folder: str) -> str:
    ok, why = judge(folder)
    if not ok:
        raise RemoteError(f"{folder}: exists but is not a complete snapshot ({why})")
    return folder


def _whole(folder: str) -> bool:
    """Every chunk of the local snapshot ``folder`` there and matching its hash."""
    try:
        m = read(folder)
    except ValueError:
        return False
    return all(chunkfile.check(os.path.join(folder, name), c) is None
               for name, c in m.chunks().items())
