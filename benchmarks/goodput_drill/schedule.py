"""The seeded schedule of faults: the same times, kinds and ranks for every system.

Times are seconds after the job's first step, drawn from the seed in equal slots over
the run (one fault per slot, at a random point in its middle half), so faults never
pile up on one restart. By default one fault of each kind; ``wanted`` may name others
(``--kinds crash:6,hang:6``: many samples of a few kinds in one run). The NaN window
is data: steps, not a time, so every system meets it at the same step. A lost GPU
(Xid 79) goes last: a system that cannot leave a GPU out never trains again after it,
which would hide how it handles the rest.
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


# At most once in a schedule: the trainer takes one NaN window, and the drill's hosts
# have one GPU to spare.
ONCE = ("nan", "xid")


def parse_kinds(text: str) -> tuple[str, ...]:
    """``crash:6,hang:6`` (a kind alone is one of it) as the kinds of one schedule, in
    the order given; raises ValueError with what was wrong."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        kind, _, count = part.partition(":")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"{part!r}: the count after ':' must be a whole number") from None
        if not 1 <= n <= 100:
            raise ValueError(f"{part!r}: between 1 and 100 faults of a kind")
        out += [kind] * n
    if not out:
        raise ValueError("no fault kinds given")
    for kind in ONCE:
        if out.count(kind) > 1:
            raise ValueError(f"{kind} at most once in a schedule (one NaN window, one spare GPU)")
    return tuple(out)


def draw(seed: int, seconds: float, ranks: int, step_time: float,
         wanted: tuple[str, ...] = KINDS) -> list[Fault]:
    rng = random.Random(seed)
    kinds = [k for k in wanted if k != "xid"]
    rng.shuffle(kinds)
    kinds += [k for k in wanted if k == "xid"]
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


def per_trial(seed: int, trials: int, seconds: float, ranks: int, step_time: float,
              kinds: tuple[str, ...] = KINDS) -> list[list[Fault]]:
    """Trial t's schedule is drawn from seed + t: replayed at the same seconds in every
    trial, one schedule meets a monitor that looks on a fixed period (NVRx: 5 s) at
    the same phase each time, so its detection would be sampled once."""
    return [draw(seed + t, seconds, ranks, step_time, kinds) for t in range(trials)]


def nan_window(faults: list[Fault]) -> tuple[int, int] | None:
    return next((f.steps for f in faults if f.kind == "nan"), None)
