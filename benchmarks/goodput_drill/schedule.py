"""The seeded schedule of faults: the same times, kinds and ranks for every system.

Times are seconds after the job's first step, drawn from the seed in equal slots over
the run (one fault per slot, at a random point in its middle half), so faults never
pile up on one restart. The NaN window is data: steps, not a time, so every system
meets it at the same step. A lost GPU (Xid 79) goes last: a system that cannot leave
a GPU out never trains again after it, which would hide how it handles the rest.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("crash", "hang", "stall", "corrupt", "nan", "xid")


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # seconds after the first step (for nan: when its first bad step is due)
    rank: int
    steps: tuple[int, int] | None = None  # nan: the bad batches, inclusive


def draw(seed: int, seconds: float, ranks: int, step_time: float) -> list[Fault]:
    rng = random.Random(seed)
    kinds = list(KINDS[:-1])
    rng.shuffle(kinds)
    kinds.append("xid")
    slot = seconds / (len(kinds) + 1)  # the last slot is left for the recovery after the xid
    out = []
    for i, kind in enumerate(kinds):
        at = slot * (i + 0.75 + 0.5 * rng.random())
        rank = rng.randrange(ranks)
        steps = None
        if kind == "nan":
            # Steps at a fault-free pace: a system that lost time meets them later.
            first = int(at / step_time)
            steps = (first, first + 5)
        out.append(Fault(kind, round(at, 2), rank, steps))
    return out


def nan_window(faults: list[Fault]) -> tuple[int, int] | None:
    return next((f.steps for f in faults if f.kind == "nan"), None)
