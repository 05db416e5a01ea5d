"""The last lines of a job's output, in all and per rank.

Only the end of the file is read (``TAIL_BYTES``, 1 MiB), never the whole:
a job's log may be gigabytes. Lines are decoded as UTF-8, bad bytes replaced.

Per rank: PyTorch prefixes what a rank prints with ``[rank<N>]:`` (the global
rank), torchrun's ``--tee`` with ``[<role><N>]:``, ``[default<N>]:`` for the
default role (the local rank: the global rank on one node; a log file is
per node anyway). A line is counted for the rank of its first prefix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TAIL_BYTES = 1 << 20
_PREFIX = re.compile(r"\[(?:rank|default)(\d+)\]:")


def read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The complete lines in the last ``max_bytes`` of ``path``. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        chunks = []
        left = size - start
        while left > 0:
            b = os.pread(fd, min(left, 1 << 20), start + (size - start - left))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    finally:
        os.close(fd)
    lines = b"".join(chunks).decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # began mid-line
    return lines


def by_rank(lines: list[str], n: int) -> dict[int, list[str]]:
    """The last ``n`` lines of each rank that has prefixed lines."""
    out: dict[int, list[str]] = {}
    for line in lines:
        m = _PREFIX.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(line)
    return {r: v[-n:] for r, v in sorted(out.items())}
