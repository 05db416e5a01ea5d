"""A job that saves a deterministic state per step with trainwatch.snapshot, for
the crash table (tests/test_snapshot_crash.py). numpy and bytes only (fast).

    python tests/jobs/snapshot_writer.py ROOT --steps N [--keep K] [--compress zstd]
        [--garbage-at S] [--free-running]

On start it restores the newest snapshot and exits 3 unless it is bit-identical
to ``expected(step)``; then saves steps start+1 .. start+N. By default it waits
for each save (each step is saved, so a crash point named ``name@k`` lands at a
known save) and appends ``saved <step>`` to ROOT/../progress once the save,
its keep and its GC are done. ``--free-running``: no waiting (saves coalesce),
for kills at random instants. ``--garbage-at S``: before saving step S, leave
what a crashed writer leaves (a dead process's staging folder, a .deleting
folder) for GC to remove. TRAINWATCH_SNAPSHOT_CRASH_AT picks the kill point.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
from trainwatch.snapshot import Snapshotter, blobs, crashpoint

FROZEN = np.arange(20_000, dtype=np.float32)  # the same bytes every step: one stored chunk


class Live:
    """A leaf whose deep copy (phase 1) is a crash point: a kill in the middle
    of staging. Staged, it is a plain dict."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, int]:
        crashpoint.at("job.stage_copy")
        return {"live": self.step}


def state(step: int) -> dict[Any, Any]:
    return {
        "frozen": FROZEN,
        "w": np.random.default_rng(step).standard_normal(3_000),  # new every step
        "ints": np.full(5_000, step % 3, dtype=np.int64),  # compresses; repeats every 3 steps
        "raw": bytes([step % 256]) * 1_000,
        "meta": {"step": step, "lr": 0.1 / step, "nan": math.nan, 1: (step, "x")},
        "live": Live(step),
    }


def expected(step: int) -> dict[Any, Any]:
    """What a snapshot of ``step`` must restore to."""
    return {**state(step), "live": {"live": step}}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and bool(a == b)


def garbage(root: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = os.path.join(root, f".staging-99-{blobs._host()}-{child.pid}-1")
    os.makedirs(dead, exist_ok=True)
    with open(os.path.join(dead, "junk.tmp"), "wb") as f:
        f.write(b"half a chunk")
    os.makedirs(os.path.join(root, ".deleting-1-7"), exist_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--compress", default=None)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--garbage-at", type=int, default=None)
    ap.add_argument("--free-running", action="store_true")
    a = ap.parse_args()
    snap = Snapshotter(a.root, every_steps=1, keep=a.keep, compress=a.compress,
                       incremental=not a.full)
    restored = snap.restore()
    start = 0
    if restored is not None:
        start, got = restored
        if not same(expected(start), got):
            print(f"restored step {start} differs from what was saved", flush=True)
            return 3
    progress = os.path.join(os.path.dirname(os.path.abspath(a.root)), "progress")
    print(f"ready {start}", flush=True)
    for step in range(start + 1, start + a.steps + 1):
        if step == a.garbage_at:
            garbage(a.root)
        if a.free_running:
            snap.maybe_save(step, state(step))
            time.sleep(0.001)
            continue
        assert snap.maybe_save(step, state(step))
        snap.wait()
        if snap.failures:
            break
        with open(progress, "a") as f:
            f.write(f"saved {step}\n")
    snap.close()
    return 1 if snap.failures else 0


if __name__ == "__main__":
    sys.exit(main())
