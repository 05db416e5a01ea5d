"""Which process of a job is rank R, for a job that does not beat through the
client (so its status names no rank pids).

torchrun (and the launchers built on it) start each worker with ``RANK`` and
``LOCAL_RANK`` in its environment; the launcher itself has no ``RANK``. The
environment read is the one the process was exec'd with (``/proc/<pid>/environ``),
which is what a launcher sets. Its children (DataLoader workers, forked or
spawned) inherit it, so a rank is the topmost process carrying its ``RANK``.
A ``RANK`` the leader inherited from outside (the job itself run per rank by a
scheduler) names no rank when other processes of the job carry other ranks:
the leader is then a launcher.

Candidates only: the drill still proves the process the job's (identity.py)
and reads its ``RANK`` again once it holds a pidfd on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
from trainwatch.sources.procstat import proc_stat


class Unreadable(Exception):
    """The process's environment is not ours to read (another user's, and we
    are not root)."""


def rank_of(pid: int) -> int | None:
    """The process's ``RANK``; None when it is gone or has none (or a bad one).
    Raises Unreadable when its environment may not be read."""
    try:
        value = psutil.Process(pid).environ().get("RANK")
    except psutil.AccessDenied:
        raise Unreadable(pid) from None
    except psutil.Error:
        return None
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n >= 0 else None


@dataclass
class Found:
    """The ranks found in the environments of a job's processes."""

    pids: dict[int, list[int]] = field(default_factory=dict)  # rank -> its topmost process(es)
    unreadable: int = 0  # processes whose environment we may not read


def by_environment(candidates: Iterable[int], leader: int) -> Found:
    """Each rank's process among ``candidates`` (see the module's docstring)."""
    found = Found()
    ranked: dict[int, int] = {}
    for pid in candidates:
        try:
            r = rank_of(pid)
        except Unreadable:
            found.unreadable += 1
            continue
        if r is not None:
            ranked[pid] = r
    if leader in ranked and any(r != ranked[leader] for r in ranked.values()):
        del ranked[leader]  # a launcher that inherited a RANK: its workers carry the ranks
    for pid, r in sorted(ranked.items()):
        st = proc_stat(pid)
        if st is not None and ranked.get(st[1]) == r:
            continue  # a child of the rank (a DataLoader worker), not the rank
        found.pids.setdefault(r, []).append(pid)
    return found
