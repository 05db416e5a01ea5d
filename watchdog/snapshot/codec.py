"""zstd for snapshot chunks (the ``zstandard`` package, imported on first use).

A chunk is one zstd frame of its raw bytes, with the content size in the frame
header. Level 3 (zstd's default) and one thread: phase 2 runs beside training
and must not take its cores. A chunk that zstd does not shrink by at least
1/64 is stored raw (fp32 and bf16 weights mostly are): the manifest records
each chunk's codec, so a snapshot may mix both.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["EXTRA", "compress", "decompress_into", "require"]

LEVEL = 3
# The distribution is not on PyPI: the extra is installed from a checkout.
EXTRA = "pip install '/path/to/trainwatch[snapshot]' (the snapshot extra, from a checkout)"
_local = threading.local()  # zstandard contexts are not thread-safe: one per thread


def require() -> Any:
    """The zstandard module, or ValueError with one line naming the extra."""
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"compress='zstd' needs the zstandard package: {EXTRA}") from None
    return zstandard


def _ctx(kind: str) -> Any:
    c = getattr(_local, kind, None)
    if c is None:
        zstd = require()
        c = zstd.ZstdCompressor(level=LEVEL) if kind == "c" else zstd.ZstdDecompressor()
        setattr(_local, kind, c)
    return c


def compress(data: Any) -> tuple[Any, str | None]:
    """(file bytes, codec): the zstd frame, or ``data`` itself when zstd does
    not pay (then codec None)."""
    raw = memoryview(data).nbytes
    frame = _ctx("c").compress(data)
    if len(frame) > raw - (raw >> 6):
        return data, None
    return frame, "zstd"


def decompress_into(frame: bytes, out: memoryview) -> None:
    """Decompress one frame into ``out``, which it must fill exactly."""
    n = out.nbytes
    try:
        raw = _ctx("d").decompress(frame, max_output_size=n)
    except Exception as e:  # zstandard.ZstdError: a corrupt frame
        raise ValueError(f"corrupt zstd frame: {e}") from None
    if len(raw) != n:
        raise ValueError(f"zstd frame holds {len(raw)} bytes, expected {n}")
    out[:] = raw
