"""A relaunch whose checkpoints cannot be judged (the job's hands do not answer, as
on a machine too busy to run them, or a daemon just restarted that has judged
nothing yet) waits until a hand has judged them, and resumes from the newest
checkpoint: never from scratch, nor from an older one judged before."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil
from conftest import Workspace, finish, wait_for
from trainwatch.privsep import child


def _comm(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().rstrip(b"\n")
    except OSError:
        return b""


def _newest(ws: Workspace) -> int:
    return max((int(m.group(1)) for p in ws.ckpt.iterdir()
                if (m := re.fullmatch(r"step_(\d+)", p.name))), default=0)


class _Stopper:
    """Keeps every hand of trainwatch `pid` stopped (SIGSTOP) until released: its
    hands are the children named so (privsep/child.py). Not by command line: a
    keeper has trainwatch's until its exec, and stopped there it held trainwatch
    in posix_spawn (a loaded run)."""

    def __init__(self, pid: int) -> None:
        self.me, self.done = psutil.Process(pid), threading.Event()
        self.stopped: set[int] = set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.is_set():
            for c in self.me.children():
                try:
                    if c.pid not in self.stopped and _comm(c.pid) == child.NAME:
                        c.suspend()
                        self.stopped.add(c.pid)
                except psutil.Error:
                    continue
            time.sleep(0.02)

    def release(self) -> None:
        self.done.set()
        self.thread.join()
        for pid in self.stopped:
            try:
                psutil.Process(pid).resume()
            except psutil.Error:
                continue


def test_a_relaunch_waits_for_its_checkpoints_to_be_judged_rather_than_start_over(
        ws: Workspace) -> None:
    cfg = ws.config({"command": ws.worker("--steps", "100000", "--interval", "0.1")},
                    {"max_restarts": 2})
    p = ws.run(cfg)
    stopper = _Stopper(p.pid)  # from the start: no checkpoint of this job is ever judged
    try:
        try:
            wait_for(lambda: _newest(ws) >= 30, timeout=90, what="step 30")
        except AssertionError as e:
            stopper.release()
            p.terminate()
            raise AssertionError(f"{e}; status {ws.status()}; trainwatch said:\n"
                                 f"{finish(p, timeout=60)[1][-4000:]}") from None
        # The loop waits out each stopped hand's deadline (5 s): its status may come late.
        wait_for(lambda: ws.status().get("state") == "running", timeout=90,
                 what="the job's status")
        r = ws.faultinject("crash")
        assert r.returncode == 0, r.stderr
        newest = _newest(ws)
        wait_for(lambda: ws.incidents(), timeout=60, what="the crash's incident")
        time.sleep(3)  # relaunches are due after 0.05 s: none comes while nothing is judged
        assert ws.incidents()[0]["relaunched_at"] is None, ws.incidents()
    finally:
        stopper.release()
    [inc] = wait_for(lambda: [i for i in ws.incidents() if i["relaunched_at"] is not None],
                     timeout=180, what="the relaunch, once a hand answers")
    p.terminate()
    _, out = finish(p, timeout=60)
    assert inc["resumed_step"] == newest, (inc, out[-3000:])
    assert "relaunching from scratch" not in out, out[-3000:]
