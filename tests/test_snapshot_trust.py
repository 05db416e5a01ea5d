"""What trainwatch trusts of a remote snapshot store and of a first run (issue 21):
a malicious remote's manifest and chunks are checked against caps and the
objects' real sizes before anything is allocated (B12); the pull uses the job's
own credentials, a failed pull never starts a run that uploads over a remote
holding snapshots, and a damaged newest snapshot falls back to an older intact
one (C13); the Snapshotter's keep holds from the first snapshot (C20). Against
a real S3 server over HTTP (moto_server, tests/s3server.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import Workspace, finish

# The fixtures s3server (a moto_server process, one per session) and s3 (a fresh bucket).
pytest_plugins = ["s3server"]

SNAPJOB = Path(__file__).parent / "jobs" / "snapjob.py"


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("snapshot-*"))


# -- C20: the Snapshotter's keep from the first snapshot --------------------------


def test_snapshotter_keep_holds_from_the_first_run_under_the_default_layout(
        ws: Workspace) -> None:
    """A first run under the default layout (auto) with the real Snapshotter(keep=3) and no
    keep rule in the config: the daemon keeps the newest three snapshots, not all twelve,
    and no store chunk is left that no snapshot links."""
    cmd = [sys.executable, str(SNAPJOB), "numpy", "--dir", str(ws.ckpt), "--steps", "60",
           "--out", str(ws.root / "final")]
    cfg = ws.config({"command": cmd, "checkpoints": {"dir": str(ws.ckpt)}})
    rc, out = finish(ws.run(cfg), timeout=60)
    assert rc == 0, out
    left = _steps(ws.ckpt)
    # The last good always stays; the plan after the final report leaves the newest three
    # (one more, the resumed-from or not yet judged, is allowed on a busy machine).
    assert left[-1] == 60 and len(left) <= 4, (left, out)
    assert "keeping the newest 3 good snapshots" in out, out
    files = [p for p in (ws.ckpt / "blobs").rglob("*") if p.is_file()]
    assert all(p.stat().st_nlink >= 2 for p in files), files
