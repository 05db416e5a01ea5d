"""What a run was worth, from the trainer's progress log and the processes watched.

Effective steps: the steps of the final model's lineage (the last attempt, the attempt
that wrote the checkpoint it resumed from, and so back to the start) trained on good
data before the weights went non-finite. Steps redone after a rollback or a restart
are counted once, in the attempt whose work the final model keeps; skipped steps and
steps trained on a NaN batch count nothing, nor does any step after one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from goodput_drill.runner import Result


@dataclass
class Attempt:
    pid: int
    started: float
    start_from: int
    skip: tuple[int, int] | None
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    ckpts: dict[int, tuple[float, str]] = field(default_factory=dict)

    @property
    def first_step_at(self) -> float | None:
        return min((float(r["t"]) for r in self.steps.values()), default=None)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=self.start_from)


def attempts(progress: list[dict[str, Any]]) -> list[Attempt]:
    out: list[Attempt] = []
    by_pid: dict[int, Attempt] = {}
    for r in progress:
        pid = int(r["pid"])
        if r.get("start"):
            a = Attempt(pid, float(r["t"]), int(r["from"]),
                        tuple(r["skip"]) if r.get("skip") else None)  # type: ignore[arg-type]
            out.append(a)
            by_pid[pid] = a
        elif pid in by_pid and "step" in r:
            by_pid[pid].steps[int(r["step"])] = r
        elif pid in by_pid and "ckpt" in r:
            by_pid[pid].ckpts[int(r["ckpt"])] = (float(r["t"]), str(r["digest"]))
    return out


def lineage(runs: list[Attempt]) -> list[tuple[Attempt, int, int]]:
    """(attempt, from, to] segments of the final model, oldest first."""
    done = [a for a in runs if a.steps]
    if not done:
        return []
    cur = done[-1]
    segs = [(cur, cur.start_from, cur.last_step)]
    while cur.start_from > 0:
        k = cur.start_from
        before = [a for a in runs[:runs.index(cur)] if k in a.ckpts]
        if not before:
            break  # resumed from a checkpoint no attempt logged: the chain ends here
        prev = before[-1]
        segs.append((prev, prev.start_from, k))
        cur = prev
    return segs[::-1]


@dataclass
class Worth:
    effective: int
    curve: list[tuple[float, int]]  # (wall time, effective steps so far)
    final_step: int
    final_ckpt: int | None
    final_digest: str | None
    poisoned_at: int | None
    skip: tuple[int, int] | None  # the skip window of the final lineage


def worth(res: Result) -> Worth:
    runs = attempts(res.progress)
    segs = lineage(runs)
    eff, curve, poisoned, skip = 0, [], None, None
    final_ckpt, digest = None, None
    for a, lo, hi in segs:
        skip = a.skip or skip
        for s in range(lo + 1, hi + 1):
            r = a.steps.get(s)
            if r is None:
                continue
            if s in a.ckpts:
                final_ckpt, digest = s, a.ckpts[s][1]
            if poisoned is not None or r.get("skip"):
                continue
            if not math.isfinite(float(r["loss"])):
                poisoned = s
                continue
            eff += 1
            curve.append((float(r["t"]), eff))
    final = segs[-1][2] if segs else 0
    return Worth(eff, curve, final, final_ckpt, digest, poisoned, skip)


@dataclass
class Handling:
    kind: str
    at: float
    detected_s: float | None  # the faulted attempt's processes all gone
    recovered_s: float | None  # the next attempt's first step
    steps_lost: int | None
    note: str = ""


def _clean(a: Attempt) -> bool:
    """Did the attempt train without meeting a non-finite loss?"""
    return all(r.get("skip") or math.isfinite(float(r["loss"])) for r in a.steps.values())


def handling(res: Result, next_at: list[float]) -> list[Handling]:
    """Per fault played (and the NaN window, when met): ``next_at`` holds the time each
    was followed by another fault, or the end: acting later does not count as acting."""
    runs = attempts(res.progress)
    events: list[tuple[str, float, set[int], str]] = []
    for p in res.played:
        events.append((p.kind, p.at, set(p.pids.values()), p.note))
    bad = next(((a, s, r) for a in runs for s, r in sorted(a.steps.items())
                if not r.get("skip") and not math.isfinite(float(r["loss"]))), None)
    if bad is not None:
        a, s, r = bad
        events.append(("nan", float(r["t"]), {a.pid}, f"first bad step {s}"))
    events.sort(key=lambda e: e[1])
    out = []
    for i, (kind, at, pids, note) in enumerate(events):
        limit = events[i + 1][1] if i + 1 < len(events) else res.stopped
        # The ranks of the faulted attempt: those alive at the fault (rank 0's pid is in
        # the progress log; the other ranks' from the pid files at the time).
        deaths = [res.deaths.get(p) for p in pids]
        detected = (max(deaths) - at  # type: ignore[type-var]
                    if deaths and all(t is not None and t <= limit for t in deaths) else None)
        # Recovered: the next attempt's first step; from bad data, the first attempt
        # that trains clear of it (a rollback whose window was too narrow meets it
        # again, and only a wider one's relaunch is the recovery).
        nxt = next((a for a in runs if a.started > at and a.first_step_at is not None
                    and (kind != "nan" or _clean(a))), None)
        recovered = None
        lost = None
        if nxt is not None and nxt.first_step_at is not None and nxt.first_step_at <= limit:
            recovered = nxt.first_step_at - at
            before = [a for a in runs if a.started <= at]
            reached = max((max((s for s, r in a.steps.items() if float(r["t"]) <= at),
                               default=a.start_from) for a in before[-1:]), default=0)
            lost = max(0, reached - nxt.start_from)
        out.append(Handling(kind, at, detected, recovered, lost, note))
    return out
