"""A job across hosts without the client (no beats): two "hosts" on this machine
(two trainwatch processes, one torchrun agent each, one rank per host), default
stall settings. Host B's one rank stopped (SIGSTOP): B sees it stopped, the
others (its launcher here, host A's rank) not, and the output silent, so B names
it within the stall floor; A's rank, blocked in the all-reduce, tells nothing.
Host B decides the group's restart (the right host first) and every rank
resumes from a checkpoint found in the folder by its name, within one interval
of the newest."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from conftest import wait_for
from test_multihost_group import _journal, _stop, back_and_done
from test_multihost_known import _TRAINER, EVERY, KILL_AT, two_hosts

# The same trainer, never connected: no beats, no reports.
_NO_CLIENT = (_TRAINER.replace("hb = connect()\n", "")
              .replace("    hb.beat(step)\n", "")
              .replace("        hb.checkpoint(step, d)\n", ""))


def test_a_stopped_rank_of_a_job_across_hosts_without_the_client_is_named_by_its_host(
        tmp_path: Path) -> None:
    _drill(tmp_path, stop=True)


def test_a_wedged_rank_of_a_job_across_hosts_without_the_client_is_named_by_its_host(
        tmp_path: Path) -> None:
    """Host B's rank sleeps in its own code (idle, not stopped), host A's waits in the
    all-reduce: B reads its rank's stacks outside any collective, A's read (shared
    beside the group's records) is inside one, so B names its rank."""
    _drill(tmp_path, stop=False)


def _drill(tmp_path: Path, stop: bool) -> None:
    assert "hb." not in _NO_CLIENT
    journal = tmp_path / "journal.jsonl"
    hosts = two_hosts(tmp_path, _NO_CLIENT, "hA")
    newest = KILL_AT // EVERY * EVERY
    try:
        paused = tmp_path / "paused"
        wait_for(lambda: paused.exists(), timeout=120, what=f"host B's rank at step {KILL_AT}")
        victim = int(paused.read_text())
        if stop:
            os.kill(victim, signal.SIGSTOP)
        t0, w0 = time.monotonic(), time.time()
        [inc] = wait_for(lambda: hosts[1].incidents() or None, timeout=120,
                         what="host B's incident")
        named = inc["time"] - w0
        back = back_and_done(tmp_path, journal, 4, t0)
    finally:
        outs = _stop(hosts)
    story = [o[-4000:] for o in outs]
    runs = _journal(journal)
    # step_40 was renamed into place a moment before the stop: with nothing to say it
    # is complete, it is judged after quiet_for; step_30, which the job moved past, is.
    starts = [e["start"] for e in runs]
    assert starts[:2] == [0, 0] and starts[2:] in ([newest] * 2, [newest - EVERY] * 2), \
        (runs, *story)
    rank = next(e["rank"] for e in runs if e["pid"] == victim)  # as the rendezvous gave it
    ev = json.loads(inc["evidence"])
    assert (inc["kind"], inc["rank"], ev.get("decided_by"), ev.get("client")) == \
        ("nccl_stall", rank, "process_state" if stop else "stacks", False), (inc, ev, *story)
    for ws in hosts:
        evs = [json.loads(i["evidence"]) for i in ws.incidents()]
        assert {e.get("group_restart") for e in evs} == {1}, (ws.root.name, evs, *story)
        # Host B decided, and the restart began at its rank: the right host first.
        assert {(e.get("decided_on"), e.get("began")) for e in evs} == \
            {("hB", f"hB rank {rank}")}, (ws.root.name, evs, *story)
    print(f"no client, {'SIGSTOP' if stop else 'wedged'} on hB: named {named:.1f}s, "
          f"back in {back:.1f}s "
          f"from step {starts[2]}")
