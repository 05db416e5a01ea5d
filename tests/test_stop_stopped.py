"""Stopping a job whose processes are stopped (issue 21, item C22): SIGTERM stays
pending in a stopped process, so the stop sends SIGCONT after it, as systemd and
NVIDIA's launcher do; the job then acts on SIGTERM at once instead of being
SIGKILLed after the whole kill_grace."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from conftest import Workspace, finish, wait_for

PRINTER = Path(__file__).parent / "jobs" / "printer.py"


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2:].split()[0]


def test_a_sigstopped_job_is_stopped_by_its_sigterm_well_within_kill_grace(ws: Workspace) -> None:
    """Every process of a 2-rank job SIGSTOPped (`faultinject hang`), then the operator's stop
    under kill_grace 30 s: each process handles SIGTERM (its handler runs) and all are gone
    within a few seconds, no SIGKILL."""
    d = ws.root / "job"
    cfg = ws.config({"command": [sys.executable, str(PRINTER), "--dir", str(d), "--ranks", "2"],
                     "heartbeat": {"timeout": "10m"}}, {"kill_grace": "30s"})
    p = ws.run(cfg)
    s = wait_for(lambda: len((st := ws.status()).get("ranks", {})) == 2 and st, timeout=60,
                 what="both ranks beating")
    pids = {int(x) for x in s["ranks"].values()}
    fi = ws.faultinject("hang")
    assert fi.returncode == 0, fi.stderr
    wait_for(lambda: all(_state(pid) == "T" for pid in pids), timeout=20,
             what="every process stopped")
    log = Path(s["log"])
    before = log.read_text()
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc, out = finish(p, timeout=60)
    took = time.monotonic() - t0
    assert rc == 130, out
    assert took < 10, f"stopped in {took:.1f}s: it waited for kill_grace\n{out}"
    assert "SIGKILL" not in out, out
    after = log.read_text()[len(before):]
    # Each process ran its own SIGTERM handler (printer.py prints "signal 15" and exits 143).
    # Two processes print at once into one log: their lines may run together.
    assert after.count("signal 15") == 2, after
