"""A job that writes trainwatch snapshots, for tests/test_snapshot_daemon.py.

``raw``: writes ``snapshot-<step>`` folders straight through the store
(trainwatch.snapshot.blobs), one chunk shared by every snapshot and one of its
own, with ``keep`` in each manifest, reporting each as the Snapshotter does.

``numpy``: a deterministic numpy "training" under the Snapshotter (remote
optional); crashes (SIGKILL) after step ``--crash-at`` on attempt 0 once that
step's snapshot is uploaded; writes its final state to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from trainwatch import client


def raw(root: str, steps: int, keep: int | None, pause: float) -> None:
    from trainwatch.snapshot import blobs
    from trainwatch.snapshot.format import Leaf, Manifest

    shared = b"frozen base " * 1000
    hb = client.connect()
    for step in range(1, steps + 1):
        own = f"step {step} ".encode() * 500
        staging = blobs.Staging(root, step)
        leaves = []
        for data in (shared, own):
            c = staging.add(blobs.digest(data), len(data), lambda d=data: (d, None))
            leaves.append(Leaf("bytes", None, None, len(data), [c]))
        m = Manifest(step, time.time(), [{"$leaf": 0}, {"$leaf": 1}], leaves, keep)
        folder, _ = blobs.publish(staging, m.dumps())
        hb.checkpoint(step, folder)
        hb.beat(step)
        time.sleep(pause)


def numpy_job(root: str, steps: int, crash_at: int | None, remote: str | None,
              out: str) -> None:
    import numpy as np
    from trainwatch.snapshot import Snapshotter

    snap = Snapshotter(root, every_steps=5, keep=3, remote=remote)
    restored = snap.restore()
    start, w = 0, np.arange(64, dtype=np.float64)
    if restored is not None:
        start, state = restored
        w = state["w"]
        assert state["step"] == start
    hb = client.connect()
    attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out + ".log", "a") as f:
        f.write(f"attempt {attempt} from {start} ({os.environ.get('TRAINWATCH_RESUME_FROM')})\n")
    for step in range(start + 1, steps + 1):
        w = w * 0.999 + np.sin(w + step)  # every step depends on the one before
        hb.beat(step)
        if snap.maybe_save(step, {"w": w, "step": step}):
            snap.wait()  # one save at a time: none coalesced, the steps saved are known
        if crash_at is not None and step == crash_at and attempt == 0:
            snap.close()  # the snapshot of crash_at is published and uploaded
            os.kill(os.getpid(), signal.SIGKILL)
    snap.close()
    np.save(out, w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("raw", "numpy"))
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", type=int)
    ap.add_argument("--pause", type=float, default=0.3)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--remote")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.mode == "raw":
        raw(a.dir, a.steps, a.keep, a.pause)
    else:
        numpy_job(a.dir, a.steps, a.crash_at, a.remote, a.out)


if __name__ == "__main__":
    main()
