"""The daemon's side of the beat rings (intake.py), with a real `trainwatch run`
and real jobs: every step of every rank reaches trainwatch through the rings
with a datagram only per new ring, a ring from outside the job's tree is never
read, and the attempt's ring folder lives exactly as long as the attempt."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Workspace, finish, wait_for
from trainwatch.sources import ring
from trainwatch.types import Beat
from trainwatch.watch.intake import Intake

# Forks `ranks` processes; each beats `steps` times as fast as it can (a loss
# falling as 1 / step: a healthy curve), waits for the file `release` (well
# within the hang timeout), beats once more (10 ms later: into its ring, or as a
# datagram where it has none) and exits 0. The job's own process (the last rank) exits only after
# every other rank has: its exit is what the final reading of the rings follows,
# so the final status.json then counts everything (a parent that left first had
# two ranks' last beats unwritten at that reading on a loaded machine).
_JOB = textwrap.dedent(
    """
    import os, sys, time
    from trainwatch import client
    ranks, steps, release = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    for rank in range(ranks):
        if rank == ranks - 1 or os.fork() == 0:
            break
    hb = client.connect(rank=rank)
    for step in range(1, steps + 1):
        hb.beat(step, loss=1.0 / step)
        if step % 500 == 0:
            time.sleep(0.05)  # 1,000s of steps/s: the rings are read every second
    while not os.path.exists(release):
        time.sleep(0.05)
    time.sleep(0.01)  # past the client's 5 ms between datagrams, for a client without rings
    hb.beat(steps + 1, loss=1.0 / (steps + 1))
    if rank == ranks - 1:
        for _ in range(ranks - 1):
            os.wait()
    """
)


def _job(ws: Workspace, ranks: int, steps: int) -> Path:
    script = ws.root / "job.py"
    script.write_text(_JOB)
    return ws.config({"command": [sys.executable, str(script), str(ranks), str(steps),
                                  str(ws.root / "release")],
                      "heartbeat": {"timeout": "60s", "ranks": ranks}})


def _rings(ws: Workspace) -> Path:
    return ws.root / "run" / "jobs" / "job.attempt-0.rings"


def test_every_step_of_every_rank_arrives_through_the_rings(ws: Workspace) -> None:
    """8 ranks x 3,000 steps as fast as Python beats: every value is read from the
    rings (none lapped), the step is every rank's last, and the socket carried
    only the first beat of each rank (plus any sent again while unread)."""
    p = ws.run(_job(ws, 8, 3000))
    found = wait_for(lambda: len(r := ring.scan(str(_rings(ws)))) == 8 and r, timeout=30,
                     what="8 rings")
    (ws.root / "release").touch()
    code, out = finish(p)
    assert code == 0, out
    st = ws.status()
    assert st["state"] == "exited", st
    assert st["rings"]["values"] == 8 * 3001, st["rings"]
    assert st["rings"]["lapped"] == 0, st["rings"]
    assert st["rings"]["refused"] == 0, st["rings"]
    assert st["step"] == 3001, st
    assert st["datagrams"]["received"] <= 8 * 4, st["datagrams"]
    assert sorted(rank for rank, _, _ in found) == list(range(8))
    assert not _rings(ws).exists(), "the ring folder outlived its attempt"


def test_a_ring_from_outside_the_jobs_tree_is_never_read(ws: Workspace) -> None:
    """A process that is not the job's writes a ring into the attempt's folder,
    named with its own pid or the job's: trainwatch counts it refused and
    never takes its steps."""
    p = ws.run(_job(ws, 1, 10))
    st = wait_for(lambda: (s := ws.status()).get("step") == 10 and s, what="step 10")
    job_pid = st["ranks"]["0"]
    stranger = textwrap.dedent(
        f"""
        import os, shutil, time
        from trainwatch.sources import ring
        d = {str(_rings(ws))!r}
        w = ring.RingWriter(d, 0)
        w.write(10**6, 1.0, None)
        # The same ring under the job's own pid's name: the header names ours.
        shutil.copy(w.path, os.path.join(d, ring.file_name(1, {job_pid})))
        print("ok", flush=True)
        time.sleep(30)
        """
    )
    s = subprocess.Popen([sys.executable, "-c", stranger], stdout=subprocess.PIPE, text=True)
    try:
        assert s.stdout is not None and s.stdout.readline().strip() == "ok"
        time.sleep(1.5)  # the rings are read every second: the strange ones too, if at all
        (ws.root / "release").touch()
        code, out = finish(p)
    finally:
        s.kill()
        s.wait()
    assert code == 0, out
    st = ws.status()
    assert st["step"] == 11, st
    assert set(st["ranks"]) == {"0"}, st["ranks"]
    assert (st["rings"]["read"], st["rings"]["refused"]) == (1, 2), st["rings"]
    assert st["rings"]["values"] == 11, st["rings"]
    assert "not reading the ring" in out, out


def test_without_a_ring_folder_beats_come_as_datagrams(ws: Workspace) -> None:
    """Where the folder cannot be made (run_dir/jobs holds a file of that name),
    the job is told nothing and its client sends every beat as before."""
    cfg = _job(ws, 2, 200)
    _rings(ws).parent.mkdir(parents=True)
    os.chmod(_rings(ws).parent, 0o755)
    _rings(ws).write_text("in the way")
    p = ws.run(cfg)
    # (beats closer than 5 ms are not sent as datagrams: few of the 200 arrive)
    wait_for(lambda: ws.status().get("state") == "running", timeout=30, what="a first beat")
    (ws.root / "release").touch()
    code, out = finish(p)
    assert code == 0, out
    st = ws.status()
    assert (st["rings"]["read"], st["rings"]["values"]) == (0, 0), st["rings"]
    assert st["step"] == 201, st
    assert st["datagrams"]["received"] >= 2 * 2, st["datagrams"]  # first and last of each
    assert "beats come as datagrams" in out, out


def test_a_ring_first_read_after_its_writer_exited_still_counts(ws: Workspace) -> None:
    """A loaded loop may first look at a rank after the rank is gone: its beats
    (the datagram that announces its ring, then the ring) are still the job's.
    Here trainwatch is stopped (SIGSTOP) while the job beats 20 times and exits."""
    script = ws.root / "late.py"
    script.write_text(textwrap.dedent(
        """
        import os, sys, time
        from trainwatch import client
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.02)
        hb = client.connect()
        for step in range(1, 21):
            hb.beat(step, loss=1.0 / step)
        """))
    go = ws.root / "go"
    p = ws.run(ws.config({"command": [sys.executable, str(script), str(go)],
                          "heartbeat": {"timeout": "60s"}}))
    pid = wait_for(lambda: ws.status().get("pid"), timeout=30, what="the job's pid")
    os.kill(p.pid, signal.SIGSTOP)
    try:
        go.touch()
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=30, what="the job to end")
    finally:
        os.kill(p.pid, signal.SIGCONT)
    code, out = finish(p)
    assert code == 0, out
    st = ws.status()
    assert (st["state"], st["step"]) == ("exited", 20), (st, out[-2000:])
    assert (st["rings"]["read"], st["rings"]["refused"]) == (1, 0), st["rings"]


@dataclass
class _Bare:
    """A real Intake on a temp folder, believing as the runner does: root's datagrams
    (the tests run as root) and the pids that have beaten; ``beats`` in order."""

    intake: Intake
    rings: Path
    sock: Path
    beats: list[Beat]


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[_Bare]:
    believed: set[int] = set()
    got: list[Beat] = []

    def on_beats(beats: Sequence[Beat]) -> None:
        believed.update(b.pid for b in beats)
        got.extend(beats)

    sel = selectors.DefaultSelector()
    rings = tmp_path / "rings"
    rings.mkdir()
    intake = Intake("job", str(tmp_path / "job.sock"), sel,
                    lambda pid, uid: uid == 0 or pid in believed,
                    time.monotonic, None, on_beats, lambda _r: None)
    try:
        intake.new_attempt(str(rings))
        yield _Bare(intake, rings, tmp_path / "job.sock", got)
    finally:
        intake.close()
        sel.close()


@contextlib.contextmanager
def _writer(code: str, *args: str, ready: str) -> Iterator[subprocess.Popen[str]]:
    """A client process that beats, prints ``ready`` and waits for a line on stdin
    before the rest of its beats (``_go``): the test acts in between."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == ready + "\n"
        yield p
    finally:
        p.kill()
        p.wait()


def _go(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_a_beat_sent_both_as_a_datagram_and_in_the_ring_is_handed_on_once(bare: _Bare) -> None:
    """A client with a ring sends its first beat and each non-finite one as a datagram
    too: the detectors get every step once, in order once the ring is being read
    (a step counted twice weighs twice in their statistics and an incident's series)."""
    # Steps 1-4, then (once told on stdin) 5-8; 1 (its first) and the NaNs 3 and 7
    # come both ways: 3 before its ring is open, 7 after.
    code = ("import math, sys\nfrom trainwatch import client\n"
            "hb = client.Heartbeat(sys.argv[1], 0, sys.argv[2])\n"
            "def beats(a, b):\n"
            "    for s in range(a, b):\n"
            "        hb.beat(s, loss=math.nan if s in (3, 7) else 1.0 / s)\n"
            "beats(1, 5)\nprint('4', flush=True)\nsys.stdin.readline()\nbeats(5, 9)\n")
    with _writer(code, str(bare.sock), str(bare.rings), ready="4") as p:
        bare.intake.drain()
        assert len(bare.intake.readers) == 1
        assert sorted(b.step for b in bare.beats) == [1, 2, 3, 4], bare.beats
        _go(p)
        bare.intake.drain()
        assert [b.step for b in bare.beats[4:]] == [5, 6, 7, 8], bare.beats
        assert [repr(b.loss) for b in bare.beats if b.step in (3, 7)] == ["nan", "nan"]


def test_a_ring_seen_before_its_writers_first_datagram_is_read_once_that_comes(
        bare: _Bare) -> None:
    """The loop's ring poll finds a rank's ring before the datagram that announces
    it (the writer has beaten 20 times, its datagrams not come yet): not provable
    yet, the ring is looked at again when that pid's datagram comes, and all 20
    steps count."""
    # Its beats into the ring, their datagrams lost (no socket at that path); then,
    # once told, one datagram from the same pid to the real socket.
    code = ("import sys\nfrom trainwatch import client\n"
            "hb = client.Heartbeat(sys.argv[1] + '.absent', 0, sys.argv[2])\n"
            "for s in range(1, 21):\n    hb.beat(s, loss=1.0 / s)\n"
            "print('20', flush=True)\nsys.stdin.readline()\n"
            "client.Heartbeat(sys.argv[1], 0).beat(20, loss=1.0 / 20)\n")
    with _writer(code, str(bare.sock), str(bare.rings), ready="20") as p:
        intake = bare.intake
        intake.tick(time.monotonic() + 2)  # the ring poll first: its writer is unknown
        assert intake.readers == {} and intake.rings_refused == 1
        _go(p)
        intake.drain()  # then its datagram: the pid beat, the ring is looked at again
        assert sorted({b.step for b in bare.beats}) == list(range(1, 21)), bare.beats
        assert (len(intake.readers), intake.rings_refused) == (1, 0)


def test_what_an_ended_attempt_sent_is_read_as_its_own_not_the_next_attempts(
        bare: _Bare) -> None:
    """An attempt killed with a NaN beat still queued on the socket (a loaded loop had
    not read it yet): ending the attempt reads it, so the next attempt never gets a
    killed process's beat (root's datagrams are believed whoever sends them)."""
    code = ("import math, sys\nfrom trainwatch import client\n"
            "hb = client.Heartbeat(sys.argv[1], 0)\nhb.beat(21, loss=math.nan)\n")
    subprocess.run([sys.executable, "-c", code, str(bare.sock)], check=True, timeout=60)
    bare.intake.end_attempt()  # its processes are gone
    ended = [(b.step, b.loss) for b in bare.beats]
    bare.intake.new_attempt(str(bare.rings))
    bare.intake.drain()
    assert len(ended) == 1 and ended[0][0] == 21, ended
    assert len(bare.beats) == 1, "a beat of the ended attempt reached the next one"


def test_a_checkpoint_reported_before_a_ring_step_is_known_before_that_step(
        tmp_path: Path) -> None:
    """A rank reports checkpoint 5, then beats a NaN at step 6 into its ring (and as a
    datagram): the loop's ring poll hands on the report before the NaN, so a rollback
    decided on that NaN knows checkpoint 5 (it resumed from an older one under load)."""
    order: list[str] = []
    believed: set[int] = set()

    def on_beats(beats: Sequence[Beat]) -> None:
        believed.update(b.pid for b in beats)
        order.extend(f"beat {b.step}" for b in beats)

    sel = selectors.DefaultSelector()
    rings = tmp_path / "rings"
    rings.mkdir()
    intake = Intake("job", str(tmp_path / "job.sock"), sel,
                    lambda pid, uid: uid == 0 or pid in believed, time.monotonic, None,
                    on_beats, lambda r: order.append(f"report {r.step}"))
    code = ("import math, sys\nfrom trainwatch import client\n"
            "hb = client.Heartbeat(sys.argv[1], 0, sys.argv[2])\nhb.beat(1, loss=1.0)\n"
            "print('1', flush=True)\nsys.stdin.readline()\n"
            "open(sys.argv[3], 'w').close()\nhb.checkpoint(5, sys.argv[3])\n"
            "hb.beat(6, loss=math.nan)\n")
    try:
        intake.new_attempt(str(rings))
        with _writer(code, str(tmp_path / "job.sock"), str(rings), str(tmp_path / "step_5"),
                     ready="1") as p:
            intake.drain()  # its first beat: the ring is open from here
            assert order == ["beat 1"] and len(intake.readers) == 1, order
            _go(p)
            intake.tick(time.monotonic() + 2 * 60)  # the ring poll, before any socket poll
            assert order == ["beat 1", "report 5", "beat 6"], order
    finally:
        intake.close()
        sel.close()
