"""A real daemon (issue 21, A3): one job's Megatron tracker is a link to
/proc/kmsg (as root, a read that blocks); the daemon's loop is never frozen by
it: another job's crash is relaunched, status answers, and SIGTERM stops the
daemon at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import wait_for
from test_daemon import Host, host, started

__all__ = ["host"]


def test_a_checkpoint_file_whose_read_blocks_freezes_no_other_job(host: Host) -> None:
    """A tracker linked to /proc/kmsg in job a's folder; job b crashes and is relaunched
    meanwhile, the control socket answers, and the daemon stops on SIGTERM."""
    a = host.job_doc("a")
    a["checkpoints"] = {"dir": str(host.job_dir("a") / "ckpt"), "layout": "megatron"}
    b = host.job_doc("b")
    host.config([a, b])
    ckpt = host.job_dir("a") / "ckpt"
    (ckpt / "iter_0000010").mkdir()
    (ckpt / "iter_0000010" / "metadata.json").write_text("{}")
    (ckpt / "latest_checkpointed_iteration.txt").symlink_to("/proc/kmsg")
    d = host.daemon()
    started(host, d, "b")
    started(host, d, "a")
    first = host.status("b")["attempt"]
    host.trigger("b", "exit_code", "3")
    wait_for(lambda: host.running("b") and host.status("b")["attempt"] > first, timeout=60,
             what="job b relaunched after its crash")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "trainwatch.cli", "status", "--run-dir",
                          str(host.run_dir), "--json"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 30
    d.signal(signal.SIGTERM)
    d.proc.wait(timeout=30)
