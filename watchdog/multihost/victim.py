"""A rank that failed because a peer did: its own line in the round's output says
so (multihost/group.py records it as the victim, not where the fault began)."""

from __future__ import annotations

import os
from pathlib import Path

# What a rank prints when it fails because another one did (gloo's pair.cc; NCCL's
# ncclRemoteError and its socket): prior-art/stalls-and-log-lines.md.
PEER_FAILURE = ("Connection closed by peer", "remote worker crashing",
                "Connection reset by peer", "Connection closed by remote peer",
                "remote process exiting", "ncclRemoteError")
_BLAME_BYTES = 64 * 1024


def peer_blamed(log_path: Path, start: int, rank: int) -> str | None:
    """The line of this round's output (from ``start``) in which ``rank`` says it
    failed because a peer did (torch prefixes a rank's lines with ``[rankN]:``)."""
    try:
        with open(log_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(start, size - _BLAME_BYTES))
            data = f.read(_BLAME_BYTES)
    except OSError:
        return None
    head = f"[rank{rank}]:"
    for line in data.decode(errors="replace").splitlines():
        if line.startswith(head) and any(m in line for m in PEER_FAILURE):
            return line[:300]
    return None
