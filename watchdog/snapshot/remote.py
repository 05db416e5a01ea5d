"""Remote copies of snapshots through fsspec (s3fs for ``s3://``).

    <url>/blobs/<h[:2]>/<name>     the chunks, named as in the local store
    <url>/snapshot-<step>.json     the manifest, uploaded LAST

A manifest is listed only once every chunk it names is up, so a reader never
sees a snapshot whose blobs are missing. On S3 each PUT (and a completed
multipart upload) appears whole or not at all; on ``file://`` every file is
written to a temp name, fsynced and renamed (fsspec's mv: os.rename). The
endpoint and credentials come only from the standard AWS environment and files
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws/...): this process's, read by
botocore, or those of the mapping ``env`` given (fsoptions.py: the job's).

A pull (fetch.py) lands like a save, through staging, every chunk checked
against its hash. What the remote holds is outside input: the manifest's claims
are checked against caps, and each chunk's declared size against its object's,
before anything is allocated or read (limits.py, chunkfile.py). A damaged newest
snapshot is skipped for the next older intact one, each skipped one said.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from trainwatch.snapshot import blobs, crashpoint
from trainwatch.snapshot.format import MANIFEST, STAGING_RE, folder_name, loads, read
from trainwatch.snapshot.fsoptions import storage_options

__all__ = ["Damaged", "Pulled", "Remote", "RemoteError", "pull", "retire", "steps", "upload"]

log = logging.getLogger("trainwatch.snapshot")

PIECE = 8 * 1024 * 1024  # bytes per write call of an upload: the crash tables' "mid transfer"
_BLOB_RE = re.compile(r"^[0-9a-f]{32}(\.zst)?$")
_REMOTE_MANIFEST_RE = re.compile(r"^snapshot-(\d{1,18})\.json$")
_EXTRA = "pip install '/path/to/trainwatch[snapshot]' (the snapshot extra, from a checkout)"
T = TypeVar("T")


class RemoteError(Exception):
    """One line for the operator: what is wrong with the remote or what it holds."""


class Damaged(RemoteError):
    """One remote snapshot cannot be trusted (an older one may be)."""


@dataclass(frozen=True)
class Pulled:
    """A pull's outcome: the local folder of the snapshot pulled (None: the
    remote holds none) and its step, and the newer ones skipped as damaged
    (step, why), newest first."""

    folder: str | None
    step: int | None = None
    skipped: tuple[tuple[int, str], ...] = ()


def _open_fs(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # no stubs
    except ImportError:
        raise RemoteError(f"remote snapshots need fsspec: {_EXTRA}") from None
    try:
        fs, root = url_to_fs(url, **options)
    except ImportError as e:  # fsspec's "Install s3fs to access S3"
        raise RemoteError(f"{url}: {e} ({_EXTRA})") from None
    except ValueError as e:
        raise RemoteError(f"{url}: {e}") from None
    return fs, str(root).rstrip("/")


def remote_manifest(step: int) -> str:
    return f"{folder_name(step)}.json"


class Remote:
    """One remote URL: its filesystem, and the names (and sizes) of the blobs it
    holds, listed once and kept up to date as this process uploads. ``env``: the
    environment whose credentials and endpoint to use (fsoptions.py); None: this
    process's."""

    def __init__(self, url: str, env: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.fs, self.root = _open_fs(url, storage_options(url, env))
        protocol = self.fs.protocol
        self._local = "file" in (protocol if isinstance(protocol, tuple) else (protocol,))
        self._index: dict[str, int] | None = None

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts)) if self.root else "/".join(parts)

    def blob(self, name: str) -> str:
        return self.path(blobs.STORE, name[:2], name)

    def forget(self) -> None:
        """Drop the blob index (after a failure: list again next time)."""
        self._index = None

    def index(self) -> dict[str, int]:
        """{blob name: size} of the remote store, listed once."""
        if self._index is None:
            top = self.path(blobs.STORE)
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
            self._put(self.blob(name), _file_pieces(path, c.stored), "upload.blob.partial")
            have[name] = c.stored
            out["blobs_uploaded"] += 1
            out["bytes_uploaded"] += c.stored
            crashpoint.at("upload.blob.done")
        crashpoint.at("upload.blobs.done")
        self._put(self.path(remote_manifest(m.step)), _halves(manifest),
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
            name = self.path(remote_manifest(s))
            self.fs.mv(name, f"{name}.retired")
        return retired

    def pull(self, root: str, step: int | None = None) -> Pulled:
        """The remote snapshot ``step`` (the newest intact one by default) pulled
        into ``root`` (fetch.py)."""
        from trainwatch.snapshot import fetch

        return fetch.pull(self, root, step)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _wrapped(url: str, do: Callable[[Remote], T], env: Mapping[str, str] | None = None) -> T:
    """do(Remote(url, env)); whatever the filesystem raises (OSError, botocore's
    errors, ...) becomes a RemoteError of one line."""
    try:
        return do(Remote(url, env))
    except RemoteError:
        raise
    except Exception as e:
        text = " ".join(str(e).split()) or "no detail"
        raise RemoteError(f"{url}: {type(e).__name__}: {text}") from e


def upload(url: str, folder: str) -> dict[str, int]:
    """Upload one published snapshot folder (only the blobs the remote lacks)."""
    return _wrapped(url, lambda r: r.upload(folder))


def steps(url: str, env: Mapping[str, str] | None = None) -> list[int]:
    """The steps the remote holds complete snapshots of, oldest first."""
    return _wrapped(url, Remote.steps, env)


def pull(url: str, root: str, step: int | None = None,
         env: Mapping[str, str] | None = None) -> Pulled:
    """The remote snapshot ``step`` (the newest intact one by default) pulled into
    ``root``, reaching the remote with ``env``'s credentials (None: this
    process's). A plain function of its arguments: no state of the caller's."""
    return _wrapped(url, lambda r: r.pull(root, step), env)


def retire(url: str, env: Mapping[str, str] | None = None) -> list[int]:
    """Retire every manifest of the remote (Remote.retire_after): a run that
    starts fresh over it must not mix its snapshots with an older run's. The
    steps retired."""
    return _wrapped(url, lambda r: r.retire_after(-1), env)
