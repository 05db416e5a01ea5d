"""Stacks across the hosts of a group restart: each host that took its ranks'
evidence before ending them shares one line per rank (its global rank, the
digest of its main thread's signature, the innermost frame, whether it waits
in a collective, its process state) in the restart's folder, and every host
judges them together, as ByteRobust groups the stacks of every rank of a job:
the dominant group against the odd ones out (detectors/stacks.py, whose
verdict is reused as it is: a shared line stands for its rank's stack)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainwatch.detectors import stacks

MAX_RANKS = 64  # shared per host (a record is at most records.MAX_BYTES)
_COLLECTIVE_FRAME = {"name": "collective", "filename": "torch/distributed/collective",
                     "short_filename": "collective"}


def lines(summary: dict[str, Any] | None, out: Path) -> list[dict[str, Any]]:
    """One line per rank of a capture (evidence.json's targets, its stacks/*.json:
    root's own files): what is shared of it."""
    shared: list[dict[str, Any]] = []
    for row in (summary or {}).get("targets") or []:
        rank = row.get("rank")
        if not isinstance(rank, int) or len(shared) >= MAX_RANKS:
            continue
        entry: dict[str, Any] = {"rank": rank, "state": row.get("state")}
        if (row.get("py_spy") or {}).get("ok"):
            try:
                threads = json.loads((out / "stacks" / f"{row['file']}.json").read_text())
            except (OSError, ValueError, KeyError):
                threads = None
            if isinstance(threads, list) and threads:
                sig = stacks.signature(threads)
                entry["sig"] = hashlib.sha1(repr(sig).encode()).hexdigest()[:16]
                entry["top"] = f"{sig[0][0]} ({sig[0][1]})" if sig else "?"
                entry["collective"] = stacks.in_collective(threads)
        shared.append(entry)
    return shared


def judge(shared: list[tuple[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """Every host's lines, (host, line): the verdict over all ranks of all hosts
    (None with fewer than two ranks). Suspects and groups are named host:rank."""
    by_rank: dict[int, list[dict[str, Any]] | None] = {}
    states: dict[int, str] = {}
    where: dict[int, str] = {}
    tops: dict[int, str] = {}
    for host, e in shared:
        rank = e.get("rank")
        if not isinstance(rank, int) or rank in where:
            continue
        where[rank] = f"{host}:{rank}"
        sig = e.get("sig")
        # The rank's stack, as detectors/stacks.py sees one: one frame that is its
        # signature's digest, and a frame inside a collective where it waits in one.
        frames = [{"name": f"sig {sig}", "short_filename": "sig"}] if isinstance(sig, str) else []
        if frames and e.get("collective") is True:
            frames.append(_COLLECTIVE_FRAME)
        by_rank[rank] = [{"thread_name": "MainThread", "frames": frames}] if frames else None
        if isinstance(e.get("state"), str):
            states[rank] = e["state"]
        if isinstance(e.get("top"), str):
            tops[rank] = e["top"]
    if len(by_rank) < 2:
        return None
    v = stacks.verdict(by_rank, states)
    return {
        "decided_by": v.decided_by,
        "suspects": [where[r] for r in v.suspects],
        "groups": [{"ranks": [where[r] for r in g], "top": tops.get(g[0], "?")}
                   for g in v.groups],
        "ranks": len(by_rank),
        "hosts": len({h for h, _ in shared}),
    }
