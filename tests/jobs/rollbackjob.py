"""A job for tests/test_snapshot_rollback.py: a deterministic numpy "training"
under the Snapshotter that stays alive, so that an operator can roll it back.

Fresh (no TRAINWATCH_RESUME_FROM): trains ``--steps`` steps, a snapshot every
``--every`` (each save waited for, and its upload when ``--remote``: the steps
saved are exactly the multiples of ``--every``), journaling a digest of every
state it saved. Resumed: journals the step and digest of the state it
restored. Then it idles, beating, until the file ``--stop`` exists.

The digest covers every leaf's type, dtype, shape and bytes (a float by its
hex, so -0.0 and nan count), dict key order and types included: equal digests
mean a bit-identical state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import numpy as np
from trainwatch import client


def canon(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, dict):
        return ("dict", [(canon(k), canon(v)) for k, v in x.items()])
    if isinstance(x, list | tuple):
        return (type(x).__name__, [canon(v) for v in x])
    if isinstance(x, float):
        return ("float", x.hex())
    return (type(x).__name__, x)


def digest(state: Any) -> str:
    return hashlib.sha256(repr(canon(state)).encode()).hexdigest()


def initial() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "model": {"w": rng.standard_normal((64, 64)).astype(np.float32),
                  # Never changes: one chunk shared by every snapshot.
                  "base": rng.standard_normal(32 * 1024).astype(np.float32)},
        "optim": {0: {"m": np.zeros((64, 64), np.float64), "count": np.zeros(8, np.int64)}},
        "rng": b"",
        "hist": [float("nan"), -0.0],
        "pair": (0, "start"),
        "step": 0,
    }


def train(state: dict[str, Any], step: int) -> dict[str, Any]:
    """One step: every leaf but the frozen base depends on the steps before."""
    w, opt = state["model"]["w"], state["optim"][0]
    g = np.sin(w * 1.7 + step).astype(np.float32)
    m = opt["m"] * 0.9 + g
    return {
        "model": {"w": (w - 0.01 * m).astype(np.float32), "base": state["model"]["base"]},
        "optim": {0: {"m": m, "count": opt["count"] + np.arange(8, dtype=np.int64) * step}},
        "rng": hashlib.sha256(state["rng"] + step.to_bytes(8, "little")).digest(),
        "hist": [*state["hist"][-6:], float(m.mean())],
        "pair": (step, f"after {step}"),
        "step": step,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=10)
    ap.add_argument("--remote")
    a = ap.parse_args()
    from trainwatch.snapshot import Snapshotter

    attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))

    def journal(**row: Any) -> None:
        with open(a.journal, "a") as f:
            f.write(json.dumps({"attempt": attempt, **row}) + "\n")

    snap = Snapshotter(a.dir, every_steps=a.every, keep=a.keep, remote=a.remote)
    hb = client.connect()
    restored = snap.restore()
    if restored is not None:
        step, state = restored
        journal(restored=step, resume_from=os.environ.get("TRAINWATCH_RESUME_FROM"),
                digest=digest(state), state_step=state["step"])
    else:
        journal(restored=None)
        state = initial()
        for step in range(1, a.steps + 1):
            state = train(state, step)
            hb.beat(step)
            if snap.maybe_save(step, state):
                snap.wait()
                up = getattr(snap, "_uploader", None)
                while up is not None and not up.idle():  # uploaded before the next
                    time.sleep(0.01)
                journal(saved=step, digest=digest(state))
    deadline = time.monotonic() + 60
    while not os.path.exists(a.stop) and time.monotonic() < deadline:
        hb.beat(step)
        time.sleep(0.05)
    snap.close()


if __name__ == "__main__":
    main()
