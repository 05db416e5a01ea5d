"""One chunk file checked, or fetched from a remote, in bounded memory.

A chunk is checked by streaming: its file's size first (``stored``), then its
raw bytes (decompressed piece by piece for zstd) counted and hashed, never
more than the declared ``size`` plus one piece held. A download compares the
object's real size with the declared one before reading a byte, then copies it
in PIECE-sized ranged reads straight into the staging file, hashing raw chunks
as they pass, and stops at the declared size plus one byte: neither a chunk
declared large but stored small, nor one declared small but stored large, makes
the puller allocate or read more than the caps (limits.py) allow.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from trainwatch.snapshot import crashpoint
from trainwatch.snapshot.format import Chunk
from trainwatch.snapshot.limits import Damaged

__all__ = ["PIECE", "check", "download"]

PIECE = 8 * 1024 * 1024  # bytes per read or write call (the crash tables' "mid transfer")


def _hasher() -> Any:
    import xxhash  # a dependency; imported here so that format users never load it

    return xxhash.xxh3_128()


def _raw_stream(f: BinaryIO, c: Chunk) -> Any:
    """A reader of the chunk's raw bytes: the file itself, or a zstd stream over it."""
    if c.codec is None:
        return f
    from trainwatch.snapshot import codec

    try:
        zstd = codec.require()
    except ValueError as e:
        raise Damaged(str(e)) from None
    return zstd.ZstdDecompressor().stream_reader(f, read_size=PIECE, closefd=False)


def _why(f: BinaryIO, c: Chunk) -> str | None:
    """Why the open chunk file ``f`` is not chunk ``c``; None when it is."""
    n = os.fstat(f.fileno()).st_size
    if n != c.stored:
        return f"{n} bytes, expected {c.stored}"
    h, got = _hasher(), 0
    try:
        src = _raw_stream(f, c)
        while True:
            piece = src.read(min(PIECE, c.size + 1 - got))  # at most one byte past size
            if not piece:
                break
            got += len(piece)
            if got > c.size:
                return f"holds more than {c.size} raw bytes"
            h.update(piece)
    except Damaged as e:
        return str(e)
    except Exception as e:  # zstandard.ZstdError: a corrupt frame
        if isinstance(e, OSError):
            raise
        return f"corrupt zstd frame: {e}"
    if got != c.size:
        return f"holds {got} raw bytes, expected {c.size}"
    if h.hexdigest() != c.hash:
        return "content does not match its hash"
    return None


def check(path: str, c: Chunk) -> str | None:
    """Why the file at ``path`` is not chunk ``c`` (missing, size, codec, hash);
    None when it is intact."""
    try:
        with open(path, "rb") as f:
            return _why(f, c)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return e.strerror or str(e)


def download(fs: Any, rpath: str, path: str, c: Chunk) -> None:
    """Fetch the remote object ``rpath`` (chunk ``c``) into the new file ``path``,
    written, fsynced and checked; Damaged (one line) when the object is missing, of
    another size than the manifest declares, or not the chunk."""
    try:
        real = int(fs.size(rpath))
    except FileNotFoundError:
        raise Damaged(f"chunk {c.name} is missing from the remote") from None
    if real != c.stored:
        raise Damaged(f"chunk {c.name} is {real} bytes on the remote, its manifest declares "
                      f"{c.stored}")
    h = _hasher() if c.codec is None else None  # a raw chunk: hashed as it passes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    n = 0
    try:
        try:
            # Ranged reads of exactly what is asked (no read-ahead cache): memory is
            # bounded by PIECE whatever the object holds.
            f = fs.open(rpath, "rb", block_size=PIECE, cache_type="none")
        except FileNotFoundError:
            raise Damaged(f"chunk {c.name} is missing from the remote") from None
        with f:
            while True:
                piece = f.read(min(PIECE, c.stored + 1 - n))  # one byte past: "longer"
                if not piece:
                    break
                n += len(piece)
                if n > c.stored:
                    raise Damaged(f"chunk {c.name} on the remote is longer than its "
                                  f"manifest declares ({c.stored} bytes)")
                if h is not None:
                    h.update(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view):]
                crashpoint.at("pull.blob.partial")
        crashpoint.at("chunk.tmp_written")  # as a save's chunk: whole under its temp name
        os.fsync(fd)
    finally:
        os.close(fd)
    if n != c.stored:
        raise Damaged(f"chunk {c.name} on the remote ended at {n} bytes, its manifest "
                      f"declares {c.stored}")
    if h is not None:
        why = None if h.hexdigest() == c.hash else "content does not match its hash"
    else:
        why = check(path, c)
    if why is not None:
        raise Damaged(f"chunk {c.name} is damaged on the remote ({why})")
