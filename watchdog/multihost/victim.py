"""A rank that failed because a peer did: its own line in the round's output says
so (multihost/group.py records it as the victim, not where the fault began)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a rank prints when it fails because another one did (gloo's pair.cc; NCCL's
# ncclRemoteError and its socket): prior-art/stalls-and-log-lines.md.
PEER_FAILURE = ("Connection closed by peer", "remote worker crashing",
                "Connection reset by peer", "Connection closed by remote peer",
                "remote process exiting", "ncclRemoteError")
_BLAME_BYTES = 64 * 1024


# torchrun's agent on a worker it reaped that failed (multiprocessing/api.py, at
# level E, shown by default): "failed (exitcode: 1) local_rank: 0 (pid: 18343) of
# binary: ...". A worker that ended well gets no line.
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")


def _round_tail(log_path: Path, start: int) -> str | None:
    """The last _BLAME_BYTES of this round's output (from ``start``)."""
    try:
        with open(log_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(start, size - _BLAME_BYTES))
            return f.read(_BLAME_BYTES).decode(errors="replace")
    except OSError:
        return None


def peer_blamed(log_path: Path, start: int, rank: int) -> str | None:
    """The line of this round's output (from ``start``) in which ``rank`` says it
    failed because a peer did (torch prefixes a rank's lines with ``[rankN]:``)."""
    head = f"[rank{rank}]:"
    for line in (_round_tail(log_path, start) or "").splitlines():
        if line.startswith(head) and any(m in line for m in PEER_FAILURE):
            return line[:300]
    return None


def agent_failed(log_path: Path, start: int) -> dict[int, int]:
    """The workers this round's agent said failed: pid -> exit code (negative: the
    signal), where it reaped them before trainwatch read how they ended."""
    return {int(m.group(2)): int(m.group(1))
            for m in _AGENT_FAILED.finditer(_round_tail(log_path, start) or "")}
