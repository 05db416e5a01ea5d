"""Phase 2 of a save, run in the Snapshotter's background thread: flatten
the staged state, hash and cut each leaf into chunks, write the chunks the
store lacks (zstd when asked), write the manifest last and publish.

The staged state is the Snapshotter's own copy, so nothing here races the
training loop. A failure or a crash leaves a ``.staging-*`` folder, never a
``snapshot-*`` one; GC removes it once its process is gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainwatch.snapshot import blobs, codec, crashpoint, tree
from trainwatch.snapshot.format import CHUNK, Leaf, Manifest

__all__ = ["Written", "write"]


@dataclass(frozen=True)
class Written:
    folder: str
    published: bool  # False: a snapshot of this step existed already (it won)
    manifest: Manifest


def _producer(piece: memoryview, compress: str | None) -> Callable[[], tuple[Any, str | None]]:
    if compress == "zstd":
        return lambda: codec.compress(piece)
    return lambda: (piece, None)


def write(root: str, step: int, staged: Any, *, compress: str | None = None,
          incremental: bool = True, keep: int | None = None,
          meta: dict[str, Any] | None = None, stage_s: float = 0.0,
          chunk: int = CHUNK, replace: bool = False) -> Written:
    """Write the staged state as ``root/snapshot-<step>`` (see format);
    ``replace``: an existing snapshot of that step gives way (blobs.publish)."""
    t0 = time.monotonic()
    crashpoint.at("write.begin")
    skeleton, leaves = tree.flatten(staged)
    staging = blobs.Staging(root, step)
    try:
        out: list[Leaf] = []
        total = refs = 0
        for leaf in leaves:
            chunks = []
            for off in range(0, leaf.nbytes, chunk):
                piece = leaf.data[off:off + chunk]
                crashpoint.at("chunk.begin")
                c = staging.add(blobs.digest(piece), piece.nbytes,
                                _producer(piece, compress), dedup=incremental)
                chunks.append(c)
                total += c.size
                refs += 1
            out.append(Leaf(leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes, chunks))
        stats = {"bytes": total, "new_bytes": staging.new_raw, "stored_new": staging.written,
                 "chunks": refs, "new_chunks": staging.new_chunks, "stage_s": round(stage_s, 6),
                 "write_s": round(time.monotonic() - t0, 6)}
        m = Manifest(int(step), time.time(), skeleton, out, keep, stats, dict(meta or {}))
        crashpoint.at("manifest.begin")
        folder, published = blobs.publish(staging, m.dumps(), replace)
    except BaseException:
        staging.abandon()
        raise
    return Written(folder, published, m)
