"""The on-disk contract of trainwatch snapshots (layout ``trainwatch``).

Standard library only: the daemon imports this module to list, judge and
delete snapshots, and must not pull in torch, numpy, zstandard or fsspec.

    D/blobs/<h[:2]>/<h>[.zst]     the content-addressed store (h: xxh3_128 of the raw chunk)
    D/snapshot-<step>/            a published snapshot: snapshot.json + one hard link per chunk
    D/.staging-<step>-<host>-<pid>-<n>/   a save in progress (never a snapshot)
    D/.deleting-<step>-<n>/       a snapshot being removed

A snapshot folder is self-contained: its chunks are regular files in it, so
the daemon's verifier (which hashes every file) and retention (rmtree) work on
it alone. ``snapshot.json`` is written last, and the folder appears under its
final name only by one rename: a folder named ``snapshot-<step>`` is complete
unless something outside removed or cut its files, which ``judge`` sees.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHUNK", "CODECS", "FORMAT", "MANIFEST", "SNAPSHOT_RE", "VERSION", "Chunk", "Leaf",
    "Manifest", "blob_name", "folder_name", "judge", "loads", "published", "read", "step_of",
]

FORMAT = "trainwatch.snapshot"
VERSION = 1
MANIFEST = "snapshot.json"
CHUNK = 64 * 1024 * 1024  # each leaf's bytes are cut into chunks of this size
CODECS = (None, "zstd")
KINDS = ("torch", "numpy", "bytes", "pickle")
SNAPSHOT_RE = re.compile(r"^snapshot-(\d+)$")
STAGING_RE = re.compile(r"^\.staging-(\d+)-(.+)-(\d+)-(\d+)$")  # step, host, pid, n
DELETING_RE = re.compile(r"^\.deleting-(\d+)-(\d+)$")
# The daemon's retention (state/retention.py TOMBSTONE) renames a folder so before removing it.
TOMBSTONE_RE = re.compile(r"^\.snapshot-\d+\.trainwatch-deleting$")
_HASH_RE = re.compile(r"^[0-9a-f]{32}$")
# A manifest larger than this is not one of ours (a leaf list of a million
# tensors is ~200 MB; far beyond any state_dict).
MAX_MANIFEST = 512 * 1024 * 1024


def folder_name(step: int) -> str:
    return f"snapshot-{int(step)}"


def blob_name(h: str, codec: str | None) -> str:
    """The file name of a chunk: its hash, plus ``.zst`` for a zstd frame."""
    return h + ".zst" if codec == "zstd" else h


@dataclass(frozen=True)
class Chunk:
    hash: str  # xxh3_128 hexdigest of the raw bytes
    size: int  # raw bytes
    stored: int  # bytes of the file
    codec: str | None  # None or "zstd"

    @property
    def name(self) -> str:
        return blob_name(self.hash, self.codec)

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "size": self.size, "stored": self.stored, "codec": self.codec}


@dataclass(frozen=True)
class Leaf:
    kind: str  # torch | numpy | bytes | pickle
    dtype: str | None
    shape: list[int] | None
    nbytes: int
    chunks: list[Chunk]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": self.shape,
                "nbytes": self.nbytes, "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float
    tree: Any  # the skeleton (see trainwatch.snapshot.tree)
    leaves: list[Leaf]
    keep: int | None = None  # the Snapshotter's keep: the daemon's default retention
    stats: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def chunks(self) -> dict[str, Chunk]:
        """Every distinct chunk, by file name."""
        return {c.name: c for leaf in self.leaves for c in leaf.chunks}

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "created": self.created,
                "tree": self.tree, "leaves": [leaf.to_json() for leaf in self.leaves],
                "keep": self.keep, "stats": self.stats, "meta": self.meta}

    def dumps(self) -> bytes:
        # allow_nan=False: a nan in stats or meta would make a file other JSON readers refuse.
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()


def _int(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"{what}: expected a non-negative integer, got {v!r}")
    return v


def _chunk(obj: Any) -> Chunk:
    if not isinstance(obj, dict):
        raise ValueError("chunk: expected an object")
    h = obj.get("hash")
    if not isinstance(h, str) or not _HASH_RE.match(h):
        raise ValueError(f"chunk hash: expected 32 hex digits, got {h!r}")
    codec = obj.get("codec")
    if codec not in CODECS:
        raise ValueError(f"chunk codec: expected null or 'zstd', got {codec!r}")
    return Chunk(h, _int(obj.get("size"), "chunk size"), _int(obj.get("stored"), "chunk stored"),
                 codec)


def _leaf(obj: Any) -> Leaf:
    if not isinstance(obj, dict):
        raise ValueError("leaf: expected an object")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ValueError(f"leaf kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    dtype = obj.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"leaf dtype: expected a string or null, got {dtype!r}")
    shape = obj.get("shape")
    if shape is not None and not (isinstance(shape, list)
                                  and all(type(n) is int and n >= 0 for n in shape)):
        raise ValueError(f"leaf shape: expected a list of sizes or null, got {shape!r}")
    chunks = obj.get("chunks")
    if not isinstance(chunks, list):
        raise ValueError("leaf chunks: expected a list")
    leaf = Leaf(kind, dtype, shape, _int(obj.get("nbytes"), "leaf nbytes"),
                [_chunk(c) for c in chunks])
    if sum(c.size for c in leaf.chunks) != leaf.nbytes:
        raise ValueError(f"leaf: chunk sizes do not add up to nbytes {leaf.nbytes}")
    return leaf


def loads(data: bytes | str, step: int | None = None) -> Manifest:
    """Parse and validate a manifest; ``step``, when given, must match. ValueError
    with one line on anything wrong."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{MANIFEST} is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{MANIFEST}: expected an object")
    if obj.get("format") != FORMAT:
        raise ValueError(f"{MANIFEST}: format is {obj.get('format')!r}, expected {FORMAT!r}")
    if obj.get("version") != VERSION:
        raise ValueError(f"{MANIFEST}: version {obj.get('version')!r} is not {VERSION}")
    s = _int(obj.get("step"), f"{MANIFEST} step")
    if step is not None and s != step:
        raise ValueError(f"{MANIFEST}: step {s} does not match the folder's step {step}")
    created = obj.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise ValueError(f"{MANIFEST}: created is not a number")
    leaves = obj.get("leaves")
    if not isinstance(leaves, list):
        raise ValueError(f"{MANIFEST}: leaves is not a list")
    keep = obj.get("keep")
    if keep is not None and (type(keep) is not int or keep < 1):
        raise ValueError(f"{MANIFEST}: keep {keep!r} is not a positive integer or null")
    stats, meta = obj.get("stats", {}), obj.get("meta", {})
    if not isinstance(stats, dict) or not isinstance(meta, dict):
        raise ValueError(f"{MANIFEST}: stats and meta must be objects")
    return Manifest(s, float(created), obj.get("tree"), [_leaf(x) for x in leaves], keep,
                    stats, meta)


def step_of(folder: str | os.PathLike[str]) -> int | None:
    m = SNAPSHOT_RE.match(os.path.basename(os.path.normpath(os.fspath(folder))))
    return int(m.group(1)) if m else None


def read(folder: str | os.PathLike[str]) -> Manifest:
    """The manifest of the snapshot ``folder``; ValueError with one line on
    anything wrong (name, file, JSON, format, version, step)."""
    folder = os.fspath(folder)
    step = step_of(folder)
    if step is None:
        raise ValueError(f"{folder}: not a snapshot folder (snapshot-<step>)")
    path = os.path.join(folder, MANIFEST)
    try:
        # Never through a link, never a FIFO's open or read that waits for a writer:
        # the daemon reads a job's snapshots (in its hand, with a deadline, too).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{path}: not a regular file")
            data = f.read(MAX_MANIFEST + 1)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    if len(data) > MAX_MANIFEST:
        raise ValueError(f"{path}: larger than {MAX_MANIFEST} bytes")
    try:
        return loads(data, step)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def judge(folder: str | os.PathLike[str]) -> tuple[bool, str]:
    """(complete, why): the name matches, snapshot.json parses with the right
    format, version and step, and every chunk it names is a regular file in the
    folder with its ``stored`` size. Stats only: nothing is hashed."""
    folder = os.fspath(folder)
    try:
        m = read(folder)
    except ValueError as e:
        return False, str(e)
    chunks = m.chunks()
    for name, c in chunks.items():
        try:
            st = os.stat(os.path.join(folder, name), follow_symlinks=False)
        except OSError:
            return False, f"chunk {name} missing"
        if not stat.S_ISREG(st.st_mode):
            return False, f"chunk {name} is not a regular file"
        if st.st_size != c.stored:
            return False, f"chunk {name} has {st.st_size} bytes, expected {c.stored}"
    return True, f"{MANIFEST} and {len(chunks)} chunks present"


def published(root: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(step, absolute folder) of every folder named ``snapshot-<step>`` in
    ``root``, oldest first; not judged. [] when ``root`` is missing."""
    root = os.path.abspath(os.fspath(root))
    out: list[tuple[int, str]] = []
    try:
        with os.scandir(root) as it:
            for e in it:
                m = SNAPSHOT_RE.match(e.name)
                if m and e.is_dir(follow_symlinks=False):
                    out.append((int(m.group(1)), os.path.join(root, e.name)))
    except OSError:
        return []
    out.sort()
    return out
