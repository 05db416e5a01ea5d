"""Remote copies of snapshots through fsspec (s3fs for ``s3://``).

    <url>/blobs/<h[:2]>/<name>     the chunks, named as in the local store
    <url>/snapshot-<step>.json     the manifest, uploaded LAST

A manifest is listed only once every chunk it names is up, so a reader never
sees a snapshot whose blobs are missing. On S3 each PUT (and a completed
multipart upload) appears whole or not at all; on ``file://`` every file is
written to a temp name, fsynced and renamed (fsspec's mv: os.rename). The
endpoint and credentials come only from the standard AWS environment and files
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws/...), read by botocore.

A pull lands like a save: manifest first, then each chunk linked from the local
store when present or downloaded into a staging folder, every chunk checked
against its hash, then published by rename (``blobs.publish``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from trainwatch.snapshot import blobs, crashpoint
from trainwatch.snapshot.format import (
    MANIFEST,
    STAGING_RE,
    Chunk,
    folder_name,
    judge,
    loads,
    read,
)

__all__ = ["Remote", "RemoteError", "pull", "steps", "upload"]

log = logging.getLogger("trainwatch.snapshot")

PIECE = 8 * 1024 * 1024  # bytes per write/read call: the crash tables' "mid transfer"
DOWNLOADS = 8  # chunks a pull fetches at once (at most this many held in memory)
_BLOB_RE = re.compile(r"^[0-9a-f]{32}(\.zst)?$")
_REMOTE_MANIFEST_RE = re.compile(r"^snapshot-(\d+)\.json$")
_EXTRA = "pip install 'trainwatchd[snapshot]'"
T = TypeVar("T")


class RemoteError(Exception):
    """One line for the operator: what is wrong with the remote or what it holds."""


def _open_fs(url: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # no stubs
    except ImportError:
        raise RemoteError(f"remote snapshots need fsspec: {_EXTRA}") from None
    try:
        fs, root = url_to_fs(url)
    except ImportError as e:  # fsspec's "Install s3fs to access S3"
        raise RemoteError(f"{url}: {e} (the snapshot extra: {_EXTRA})") from None
    except ValueError as e:
        raise RemoteError(f"{url}: {e}") from None
    return fs, str(root).rstrip("/")


def remote_manifest(step: int) -> str:
    return f"{folder_name(step)}.json"


class Remote:
    """One remote URL: its filesystem, and the names (and sizes) of the blobs it
    holds, listed once and kept up to date as this process uploads."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = _open_fs(url)
        protocol = self.fs.protocol
        self._local = "file" in (protocol if isinstance(protocol, tuple) else (protocol,))
        self._index: dict[str, int] | None = None

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts)) if self.root else "/".join(parts)

    def _blob(self, name: str) -> str:
        return self._path(blobs.STORE, name[:2], name)

    def forget(self) -> None:
        """Drop the blob index (after a failure: list again next time)."""
        self._index = None

    def index(self) -> dict[str, int]:
        """{blob name: size} of the remote store, listed once."""
        if self._index is None:
            top = self._path(blobs.STORE)
            self.fs.invalidate_cache(top)  # another process may have uploaded since
            try:
                found = self.fs.find(top, detail=True)
            except FileNotFoundError:
                found = {}
            index: dict[str, int] = {}
            for path, info in found.items():
                name = path.rsplit("/", 1)[-1]
                if _BLOB_RE.match(name):  # not a temp name left by a killed upload
                    index[name] = int(info.get("size") or 0)
            self._index = index
        return self._index

    def _put(self, rpath: str, pieces: Iterable[bytes], point: str) -> None:
        """Write the byte pieces to ``rpath``, whole or not at all."""
        target = rpath
        if self._local:  # a local filesystem shows a partial file: temp name, then rename
            self.fs.makedirs(rpath.rsplit("/", 1)[0], exist_ok=True)
            target = f"{rpath}.tmp-{socket.gethostname()}-{os.getpid()}"
        f = self.fs.open(target, "wb")
        try:
            for i, piece in enumerate(pieces):
                f.write(piece)
                if i == 0:
                    crashpoint.at(point)
        except BaseException:
            if self._local:
                f.close()
                self.fs.rm_file(target)
            else:
                # Closing would commit what was written: abort the upload, and mark
                # the file closed so that its finalizer does not commit it either.
                discard = getattr(f, "discard", None)
                if discard is not None:
                    discard()
                    f.closed = True
            raise
        f.close()
        if self._local:  # durable before it is named, as a local save is
            _fsync(target)
            self.fs.mv(target, rpath)
            _fsync(os.path.dirname(rpath))

    def upload(self, folder: str) -> dict[str, int]:
        """Upload the published snapshot ``folder``: the blobs the remote lacks,
        then its manifest. bytes_uploaded, blobs_uploaded, blobs_present."""
        pinned = STAGING_RE.match(os.path.basename(folder))  # blobs.pin's copy of one
        try:
            if pinned is None:
                m = read(folder)
            with open(os.path.join(folder, MANIFEST), "rb") as f:
                manifest = f.read()
            if pinned is not None:
                m = loads(manifest, int(pinned.group(1)))
        except (OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise RemoteError(f"{folder}: {e}") from None
        have = self.index()
        out = {"bytes_uploaded": 0, "blobs_uploaded": 0, "blobs_present": 0}
        for name, c in m.chunks().items():
            if have.get(name) == c.stored:
                out["blobs_present"] += 1
                continue
            path = os.path.join(folder, name)
            self._put(self._blob(name), _file_pieces(path, c.stored), "upload.blob.partial")
            have[name] = c.stored
            out["blobs_uploaded"] += 1
            out["bytes_uploaded"] += c.stored
            crashpoint.at("upload.blob.done")
        crashpoint.at("upload.blobs.done")
        self._put(self._path(remote_manifest(m.step)), _halves(manifest),
                  "upload.manifest.partial")
        crashpoint.at("upload.manifest.done")
        out["bytes_uploaded"] += len(manifest)
        return out

    def steps(self) -> list[int]:
        """The steps of the remote's manifests, oldest first."""
        self.fs.invalidate_cache(self.root)
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for p in names:
            m = _REMOTE_MANIFEST_RE.match(str(p).rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def retire_after(self, step: int) -> list[int]:
        """Rename the manifests of steps after ``step`` to ``snapshot-<s>.json.retired``
        (no longer listed, still there to read): a run resumed from ``step`` abandoned
        them (a rollback past a loss anomaly, an operator's point in time), and a
        relaunch on a fresh host must not pull one as the newest. Their chunks stay.
        A kill between the copy and the delete leaves the manifest listed: retried."""
        retired = [s for s in self.steps() if s > step]
        for s in retired:
            name = self._path(remote_manifest(s))
            self.fs.mv(name, f"{name}.retired")
        return retired

    def pull(self, root: str, step: int | None = None) -> str | None:
        """The local folder of the remote snapshot ``step`` (default: the newest),
        pulled into ``root`` unless there already; None when the remote has none."""
        have = self.steps()
        if step is None:
            if not have:
                return None
            step = have[-1]
        elif step not in have:
            return None
        root = os.path.abspath(root)
        local = os.path.join(root, folder_name(step))
        if os.path.isdir(local) and _whole(local):
            return local
        # Not here, or here but damaged (a chunk cut short, or rotted: its hash):
        # pulled anew, the local store's intact chunks linked, and put in its place.
        rpath = self._path(remote_manifest(step))
        try:
            data = self.fs.cat_file(rpath)
            m = loads(data, step)
        except FileNotFoundError:
            return None  # deleted since the listing
        except ValueError as e:
            raise RemoteError(f"{self.url}/{remote_manifest(step)}: {e}") from None
        staging = blobs.Staging(root, step)
        try:
            todo = []
            for name, c in m.chunks().items():
                if self._linked(staging, name, c):
                    crashpoint.at("pull.blob.done")
                else:
                    todo.append((name, c))
            # Downloads in parallel (an object store's latency is per request), each
            # added to staging here, in order, as it arrives: at most DOWNLOADS held.
            with ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="trainwatch-pull") as pool:
                window: deque[Future[bytearray]] = deque()
                for i, (name, c) in enumerate(todo):
                    while len(window) < DOWNLOADS and i + len(window) < len(todo):
                        window.append(pool.submit(self._download, todo[i + len(window)]))
                    buf = window.popleft().result()
                    got = staging.add(c.hash, c.size, _given(buf, c.codec), dedup=False)
                    del buf
                    if got.name != name:  # the manifest names one hash under both codecs
                        raise RemoteError(f"{self.url}: chunk {c.hash} is named twice in "
                                          "the manifest")
                    crashpoint.at("pull.blob.done")
            crashpoint.at("pull.publish.before")
            folder, _ = blobs.publish(staging, bytes(data), replace=os.path.isdir(local))
        except BaseException:
            staging.abandon()
            raise
        return _complete(folder)  # published, or the one published meanwhile (it wins)

    def _linked(self, staging: blobs.Staging, name: str, c: Chunk) -> bool:
        """Chunk ``name`` linked into staging from the local store, when that copy is intact."""
        if staging.link(name) is None:
            return False
        path = os.path.join(staging.path, name)
        with open(path, "rb") as f:
            if _intact(f.read(), c):
                return True
        os.unlink(path)  # a damaged local copy: take the remote's (the store keeps its own)
        log.warning("snapshot: local store copy of chunk %s is damaged; downloading it", name)
        return False

    def _download(self, item: tuple[str, Chunk]) -> bytearray:
        """The remote's chunk, its hash checked."""
        name, c = item
        buf = bytearray()
        try:
            with self.fs.open(self._blob(name), "rb") as f:
                while piece := f.read(PIECE):
                    buf += piece
                    crashpoint.at("pull.blob.partial")
        except FileNotFoundError:
            raise RemoteError(f"{self.url}: chunk {name} is missing from the remote") from None
        if not _intact(buf, c):
            raise RemoteError(f"{self.url}: chunk {name} is damaged on the remote "
                              f"({len(buf)} bytes; hash does not match); nothing was restored")
        return buf


def _given(buf: bytearray, codec: str | None) -> Callable[[], tuple[Any, str | None]]:
    return lambda: (buf, codec)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(folder: str) -> str:
    ok, why = judge(folder)
    if not ok:
        raise RemoteError(f"{folder}: exists but is not a complete snapshot ({why})")
    return folder


def _whole(folder: str) -> bool:
    """Every chunk of the local snapshot ``folder`` there and matching its hash."""
    try:
        m = read(folder)
        for name, c in m.chunks().items():
            with open(os.path.join(folder, name), "rb") as f:
                if not _intact(f.read(), c):
                    return False
    except (OSError, ValueError):
        return False
    return True


def _intact(data: Any, c: Chunk) -> bool:
    """The file bytes decode to the chunk's raw bytes (size and xxh3)."""
    if memoryview(data).nbytes != c.stored:
        return False
    raw = data
    if c.codec == "zstd":
        from trainwatch.snapshot import codec

        raw = bytearray(c.size)
        try:
            codec.decompress_into(data, memoryview(raw))
        except ValueError:
            return False
    return memoryview(raw).nbytes == c.size and blobs.digest(raw) == c.hash


def _file_pieces(path: str, size: int) -> Iterator[bytes]:
    """The bytes of the local file in PIECE-sized pieces; a size other than the
    manifest's is refused (nothing half-written goes up)."""
    n = 0
    with open(path, "rb") as f:
        while piece := f.read(PIECE):
            n += len(piece)
            if n > size:
                break
            yield piece
    if n != size:
        raise RemoteError(f"{path}: {n} bytes, the manifest says {size}")


def _halves(data: bytes) -> list[bytes]:
    half = len(data) // 2
    return [data[:half], data[half:]]


def _wrapped(url: str, do: Callable[[Remote], T]) -> T:
    """do(Remote(url)); whatever the filesystem raises (OSError, botocore's
    errors, ...) becomes a RemoteError of one line."""
    try:
        return do(Remote(url))
    except RemoteError:
        raise
    except Exception as e:
        text = " ".join(str(e).split()) or "no detail"
        raise RemoteError(f"{url}: {type(e).__name__}: {text}") from e


def upload(url: str, folder: str) -> dict[str, int]:
    """Upload one published snapshot folder (only the blobs the remote lacks)."""
    return _wrapped(url, lambda r: r.upload(folder))


def steps(url: str) -> list[int]:
    """The steps the remote holds complete snapshots of, oldest first."""
    return _wrapped(url, Remote.steps)


def pull(url: str, root: str, step: int | None = None) -> str | None:
    """The local folder of the remote snapshot ``step`` (the newest by default),
    pulled into ``root``; None when the remote has none (of that step)."""
    return _wrapped(url, lambda r: r.pull(root, step))

