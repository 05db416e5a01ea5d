"""What a remote snapshot may claim, checked before anything is allocated or
downloaded for it: a remote store is outside input (another host, another
run, anyone with write access to the bucket), and a pull may run as root.

A manifest's sizes are claims: a chunk declared 3 GiB but stored as 16 bytes
must not make the puller allocate 3 GiB to decompress it, and a chunk declared
16 bytes must not be read whole when its object holds 400 MiB. The caps follow
from what the writer produces (trainwatch.snapshot.writer, codec): chunks of at
most ``format.CHUNK`` raw bytes, each stored raw (stored == size) or as one
zstd frame that zstd made smaller. Stdlib only.
"""

from __future__ import annotations

from trainwatch.snapshot.format import CHUNK, MAX_MANIFEST, Chunk, Manifest

__all__ = ["MAX_CHUNKS", "MAX_MANIFEST", "Damaged", "check", "manifest_size", "stored_bound"]

# Distinct chunks one snapshot may name: 64 TiB of 64 MiB chunks, far beyond
# any state_dict; a manifest naming more is not one of ours.
MAX_CHUNKS = 1 << 20


class Damaged(ValueError):
    """One remote snapshot cannot be trusted (its manifest, or a chunk missing,
    of another size than declared, or not matching its hash): an older one may be."""


def stored_bound(size: int) -> int:
    """The most bytes a chunk of ``size`` raw bytes may be stored as: zstd's own
    bound on a frame (ZSTD_compressBound, rounded up), so that any frame zstd
    writes is accepted, and nothing larger."""
    return size + (size >> 8) + 1024


def check(m: Manifest) -> None:
    """Refuse a manifest whose claims exceed the caps: a chunk larger than the
    writer's, a stored size the codec cannot produce, one hash under two names or
    sizes, too many chunks. Damaged with one line. (The bytes to download are
    checked against the local disk's free space by the pull.)"""
    seen: dict[str, Chunk] = {}
    for leaf in m.leaves:
        for c in leaf.chunks:
            if c.size > CHUNK:
                raise Damaged(f"chunk {c.name} claims {c.size} bytes, more than a chunk "
                              f"holds ({CHUNK})")
            if c.codec is None and c.stored != c.size:
                raise Damaged(f"chunk {c.name} is stored raw as {c.stored} bytes but claims "
                              f"{c.size}")
            if c.codec is not None and not 0 < c.stored <= stored_bound(c.size):
                raise Damaged(f"chunk {c.name} claims {c.stored} stored bytes for {c.size} "
                              "raw bytes: not a zstd frame of them")
            other = seen.get(c.hash)
            if other is not None:
                if other != c:  # one content, two names or sizes: one of them lies
                    raise Damaged(f"chunk {c.hash} is named twice with different sizes "
                                  "or codecs")
                continue
            seen[c.hash] = c
            if len(seen) > MAX_CHUNKS:
                raise Damaged(f"more than {MAX_CHUNKS} distinct chunks")


def manifest_size(size: int) -> None:
    """Refuse a remote manifest object larger than any manifest the writer makes."""
    if size > MAX_MANIFEST:
        raise Damaged(f"the manifest is {size} bytes, more than {MAX_MANIFEST}")
