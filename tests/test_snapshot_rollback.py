"""Point-in-time restore of trainwatch snapshots through the operator's
`trainwatch rollback JOB --to-step N`, end to end: a real `trainwatch run`
supervising a job that saves with the Snapshotter (tests/jobs/rollbackjob.py),
the CLI speaking to its control socket, and for the remote case a real S3
server (moto_server). The relaunched job restores the state it saved at step N
bit for bit; newer snapshots are quarantined, still on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conftest import Workspace, finish, wait_for
from trainwatch.host.control import request

if TYPE_CHECKING:
    from s3server import S3Bucket

# The fixtures s3server (a moto_server process, one per session) and s3 (a fresh bucket).
pytest_plugins = ["s3server"]

JOB = Path(__file__).parent / "jobs" / "rollbackjob.py"


def _tw(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    """The operator's CLI against the running trainwatch's control socket."""
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args, "--run-dir",
                           str(ws.root / "run")], capture_output=True, text=True, timeout=30,
                          check=False)


def _verdicts(ws: Workspace) -> dict[int, str]:
    p = _tw(ws, "checkpoints", "job", "--json")
    assert p.returncode == 0, p.stderr
    return {c["step"]: c["verdict"] for c in json.loads(p.stdout)["checkpoints"]}


def _rows(ws: Workspace) -> list[dict[str, Any]]:
    return ws.events()  # the job's journal (ws.journal)


# The job's own pace, not trainwatch's (its start, numpy's and s3fs's imports, four
# saves each uploaded): over 20 s at a load of 15 on 2 cores.
JOB_WAIT = 60.0


def _saved(ws: Workspace, last: int) -> dict[int, str]:
    """Wait for attempt 0 to have saved (and uploaded) up to ``last``: step -> digest."""
    wait_for(lambda: any(r.get("saved") == last for r in _rows(ws)), timeout=JOB_WAIT,
             what=f"the job's snapshot of step {last}")
    saved = {r["saved"]: r["digest"] for r in _rows(ws) if "saved" in r}
    assert len(set(saved.values())) == len(saved), saved  # every step's state differs
    return saved


def _restored(ws: Workspace, attempt: int) -> dict[str, Any]:
    return dict(wait_for(
        lambda: next((r for r in _rows(ws) if r["attempt"] == attempt), None), timeout=JOB_WAIT,
        what=f"attempt {attempt} to start"))


def _command(ws: Workspace, *extra: str) -> list[str]:
    return [sys.executable, str(JOB), "--dir", str(ws.ckpt), "--journal", str(ws.journal),
            "--stop", str(ws.root / "stop"), "--steps", "20", "--every", "5", *extra]


def _end(ws: Workspace, p: subprocess.Popen[bytes]) -> str:
    (ws.root / "stop").touch()
    rc, out = finish(p, timeout=30)
    assert rc == 0, out[-3000:]
    return out


def test_rollback_to_a_local_snapshot_restores_that_step_bit_for_bit(ws: Workspace) -> None:
    """Snapshots at 5, 10, 15, 20 of a running job; `rollback --to-step 10` relaunches it
    with TRAINWATCH_RESUME_FROM = snapshot-10, whose restored state is bit-identical to
    the state saved at 10; 15 and 20 are quarantined and stay on disk."""
    cfg = ws.config({"command": _command(ws), "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "layout": "trainwatch"}})
    p = ws.run(cfg)
    saved = _saved(ws, 20)
    assert sorted(saved) == [5, 10, 15, 20], saved
    wait_for(lambda: _verdicts(ws) == {5: "good", 10: "good", 15: "good", 20: "good"},
             timeout=JOB_WAIT, what="four good snapshots in the catalog")

    r = _tw(ws, "rollback", "job", "--to-step", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"job: relaunching from step 10 ({ws.ckpt / 'snapshot-10'})", \
        r.stdout

    got = _restored(ws, 1)
    assert got["restored"] == 10 and got["state_step"] == 10, got
    assert got["resume_from"] == str(ws.ckpt / "snapshot-10"), got
    assert got["digest"] == saved[10], (got, saved)
    assert _verdicts(ws) == {5: "good", 10: "good", 15: "quarantined", 20: "quarantined"}
    assert all((ws.ckpt / f"snapshot-{s}").is_dir() for s in (5, 10, 15, 20))
    _end(ws, p)


def test_rollback_to_a_step_only_the_remote_holds_pulls_it_then_restores_it(
        ws: Workspace, s3: S3Bucket) -> None:
    """Snapshots uploaded to S3 and, locally, retention (keep 2) deletes 5 and 10:
    `rollback --to-step 5` pulls snapshot-5 from the remote, then relaunches from it,
    bit-identical to the state saved at 5; 15 and 20 are quarantined."""
    from trainwatch.snapshot import remote

    url = f"{s3.url}/job"
    cfg = ws.config({"command": _command(ws, "--keep", "2", "--remote", url),
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "layout": "trainwatch",
                                     "remote": url}})
    p = ws.run(cfg)
    saved = _saved(ws, 20)
    assert remote.steps(url) == [5, 10, 15, 20]
    wait_for(lambda: not (ws.ckpt / "snapshot-5").exists()
             and not (ws.ckpt / "snapshot-10").exists(), timeout=JOB_WAIT,
             what="retention to delete the local snapshots 5 and 10")
    assert _verdicts(ws) == {15: "good", 20: "good"}

    r = _tw(ws, "rollback", "job", "--to-step", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"job: relaunching from step 5 ({ws.ckpt / 'snapshot-5'}, "
                                f"being pulled from {url})"), r.stdout

    got = _restored(ws, 1)
    assert got["restored"] == 5 and got["state_step"] == 5, got
    assert got["resume_from"] == str(ws.ckpt / "snapshot-5"), got
    assert got["digest"] == saved[5], (got, saved)
    assert _verdicts(ws) == {5: "good", 15: "quarantined", 20: "quarantined"}
    out = _end(ws, p)
    assert f"pulled the snapshot of step 5 from {url}" in out, out[-3000:]


def test_rollback_to_a_step_neither_local_nor_remote_holds_is_refused_untouched(
        ws: Workspace, s3: S3Bucket) -> None:
    """A step with no snapshot on disk nor on the remote: one line naming it, a non-zero
    exit, and the job goes on as it was (same attempt, nothing quarantined)."""
    url = f"{s3.url}/job"
    cfg = ws.config({"command": _command(ws, "--remote", url), "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "layout": "trainwatch",
                                     "remote": url}})
    p = ws.run(cfg)
    _saved(ws, 20)
    wait_for(lambda: _verdicts(ws) == {5: "good", 10: "good", 15: "good", 20: "good"},
             timeout=JOB_WAIT, what="four good snapshots in the catalog")
    before = ws.status()

    r = _tw(ws, "rollback", "job", "--to-step", "7")
    assert r.returncode != 0, r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "step 7" in lines[0] and url in lines[0], lines
    assert "Traceback" not in r.stderr

    assert _verdicts(ws) == {5: "good", 10: "good", 15: "good", 20: "good"}
    now = ws.status()
    assert (now.get("attempt"), now.get("state")) == (before.get("attempt"),
                                                      before.get("state")), (before, now)
    assert [r["attempt"] for r in _rows(ws) if "restored" in r] == [0]
    out = _end(ws, p)
    assert "snapshot of step 7" not in out, out[-3000:]


CREDS = """#!/bin/sh
# A credential_process that takes its time while the file HOLD exists.
while [ -e {hold} ]; do touch {waiting}; sleep 0.05; done
echo '{{"Version": 1, "AccessKeyId": "testing", "SecretAccessKey": "testing"}}'
"""


def test_a_rollback_waiting_on_the_remote_leaves_the_daemon_answering(
        ws: Workspace, s3: S3Bucket) -> None:
    """The job's credentials come from a credential_process (run as the job's user,
    in the hand that lists the remote) that takes its time: while `rollback
    --to-step 5` waits for the listing, `status` is answered, as every other job
    would be; once the listing is done, the rollback is answered and carried out."""
    url = f"{s3.url}/job"
    hold, waiting, script = ws.root / "HOLD", ws.root / "waiting", ws.root / "creds.sh"
    script.write_text(CREDS.format(hold=hold, waiting=waiting))
    script.chmod(0o755)
    (ws.root / "aws.cfg").write_text(f"[default]\ncredential_process = {script}\n")
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
           "AWS_CONFIG_FILE": str(ws.root / "aws.cfg"),
           "AWS_SHARED_CREDENTIALS_FILE": str(ws.root / "none")}
    cfg = ws.config({"command": _command(ws, "--keep", "2", "--remote", url),
                     "resume_args": [], "env": env,
                     "checkpoints": {"dir": str(ws.ckpt), "layout": "trainwatch",
                                     "remote": url}})
    p = ws.run(cfg)
    saved = _saved(ws, 20)
    wait_for(lambda: not (ws.ckpt / "snapshot-5").exists(), timeout=JOB_WAIT,
             what="retention to delete the local snapshot 5")

    hold.touch()
    rollback = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "rollback", "job", "--to-step", "5",
         "--run-dir", str(ws.root / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_for(waiting.exists, timeout=20, what="the listing to wait for its credentials")
        # Asked on the control socket from here: the listing is held (its 10 s running)
        # only as long as the daemon takes to answer, not for another interpreter's start
        # (seconds under load: the hold then ran the listing past its deadline).
        st = request(str(ws.root / "run"), "status", {}, timeout=30)
        assert st["ok"] and [j["job"] for j in st["jobs"]] == ["job"], st
        assert rollback.poll() is None, rollback.communicate()  # still waiting for the listing
    finally:
        hold.unlink()
    out, err = rollback.communicate(timeout=60)
    assert rollback.returncode == 0, err
    assert out.strip() == (f"job: relaunching from step 5 ({ws.ckpt / 'snapshot-5'}, "
                           f"being pulled from {url})"), out
    got = _restored(ws, 1)
    assert got["restored"] == 5 and got["digest"] == saved[5], (got, saved)
    _end(ws, p)
