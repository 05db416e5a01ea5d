"""Restore a published snapshot folder: each leaf is allocated once (a CPU
tensor, a numpy array, a bytearray) and its chunks are read straight into it
(zstd frames decompressed into it), every chunk checked against its xxh3_128.
The result is bit-identical to what was saved, or a ValueError of one line.
"""

from __future__ import annotations

import os
from typing import Any

from trainwatch.snapshot import blobs, codec, format, tree

__all__ = ["load"]


def _read_chunk(path: str, c: format.Chunk, out: memoryview) -> None:
    try:
        with open(path, "rb", buffering=0) as f:
            if c.codec is None:
                got = 0
                while got < c.size:
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
                if got != c.size or f.read(1):
                    raise ValueError(f"{path}: not {c.size} bytes long (truncated or replaced)")
            else:
                codec.decompress_into(f.read(), out)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if blobs.digest(out) != c.hash:
        raise ValueError(f"{path}: content does not match its hash (corrupt chunk)")


def load(folder: str) -> tuple[int, Any]:
    """(step, state) from the snapshot ``folder``; tensors on CPU."""
    folder = os.path.abspath(folder)
    m = format.read(folder)
    objs: list[Any] = []
    for leaf in m.leaves:
        holder, view = tree.allocate(leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes)
        off = 0
        for c in leaf.chunks:
            _read_chunk(os.path.join(folder, c.name), c, view[off:off + c.size])
            off += c.size
        objs.append(tree.finish(leaf.kind, holder))
    return m.step, tree.unflatten(m.tree, objs)
