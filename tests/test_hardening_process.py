"""Adversarial cases of the job's processes against a real `trainwatch run`
(issue items 2, 4, 10, 11 and 13): a job with `user:` gets that user's groups,
never root's; its logs are readable by its group only; a SIGKILLed `run`
leaves no job behind; a reader that stops reading our stdout does not stall
the loop; a full or read-only log folder does not stop supervision."""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

from conftest import (
    Workspace,
    finish,
    local_group,
    local_user,
    missing,
    need_root,
    run_name,
    wait_for,
)
from trainwatch.actions.tree import is_gone

USER, GROUP = run_name("test1"), run_name("testg")  # this run's own (conftest)


def _need_root() -> None:
    need_root("other users, mounts")


def _user(name: str) -> pwd.struct_passwd:
    _need_root()
    return local_user(name)


def _group(name: str) -> grp.struct_group:
    _need_root()
    return local_group(name)


def _logs(ws: Workspace) -> Path:
    return ws.state / "jobs" / "job" / "logs"


def _log_text(ws: Workspace) -> str:
    return "".join(p.read_text() for p in sorted(_logs(ws).glob("attempt-0-*.log")))


def _run(ws: Workspace, job: dict[str, object]) -> tuple[int, str]:
    p = ws.run(ws.config(job, {"max_restarts": 0}))
    return finish(p, timeout=60)


def test_job_with_a_user_gets_that_users_groups_and_logs_only_it_can_read(
        ws: Workspace, open_tmp: Path) -> None:
    """`user:` gives the user's gid, groups (never 0) and HOME; a 0640 root:root file stays shut."""
    pw = _user(USER)
    secret = open_tmp / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o640)
    public = open_tmp / "public"
    public.write_text("anyone\n")
    public.chmod(0o644)
    script = (f"echo uid=$(id -u) gid=$(id -g) groups=$(id -G | tr ' ' ,) home=$HOME user=$USER; "
              f"cat {public}; cat {secret} || echo secret-denied")
    rc, out = _run(ws, {"command": ["sh", "-c", script], "user": USER})
    assert rc == 0, out
    text = _log_text(ws)
    groups = ",".join(map(str, os.getgrouplist(USER, pw.pw_gid)))
    assert (f"uid={pw.pw_uid} gid={pw.pw_gid} groups={groups} home={pw.pw_dir} user={USER}"
            in text), text
    assert "0" not in groups.split(",")
    assert "anyone" in text and "secret-denied" in text and "root only" not in text
    d, f = _logs(ws), next(_logs(ws).glob("attempt-0-*.log"))
    assert stat.S_IMODE(d.stat().st_mode) == 0o750 and d.stat().st_gid == pw.pw_gid
    assert stat.S_IMODE(f.stat().st_mode) == 0o640 and f.stat().st_gid == pw.pw_gid


def test_job_with_a_group_runs_with_it_as_its_primary_group(ws: Workspace) -> None:
    """`group:` is the job's primary group, and its logs belong to that group."""
    pw, g = _user(USER), _group(GROUP)
    rc, out = _run(ws, {"command": ["sh", "-c", "echo uid=$(id -u) gid=$(id -g) groups=$(id -G)"],
                        "user": USER, "group": GROUP})
    assert rc == 0, out
    text = _log_text(ws)
    assert f"uid={pw.pw_uid} gid={g.gr_gid} " in text, text
    assert " 0 " not in f" {text.split('groups=')[1].strip()} "
    assert next(_logs(ws).glob("attempt-0-*.log")).stat().st_gid == g.gr_gid


def test_sigkilled_trainwatch_run_takes_its_job_down(ws: Workspace) -> None:
    """After SIGKILL of `trainwatch run`, the job's leader and an escaped descendant are gone."""
    _need_root()
    escaped_file = ws.root / "escaped"
    cmd = (f"setsid sh -c 'sleep 300 & echo $! > {escaped_file}' & exec sleep 300")
    p = ws.run(ws.config({"command": ["sh", "-c", cmd]}))
    leader = int(wait_for(lambda: ws.status().get("state") == "running" and ws.status()["pid"],
                          timeout=30, what="the job to run"))
    escaped = int(wait_for(lambda: escaped_file.exists() and escaped_file.read_text().strip(),
                           what="the escaped pid"))
    p.kill()
    p.wait()
    try:
        wait_for(lambda: is_gone(leader), timeout=10, what="the leader to die with trainwatch")
        wait_for(lambda: is_gone(escaped), timeout=10, what="the escaped process to die too")
    finally:
        for pid in (leader, escaped):  # on failure: leave nothing behind
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)


# `trainwatch run` where cgroups are not ours to write (as for a user without a
# delegated subtree): cgroup.base() says so.
_RUN_WITHOUT_CGROUP = (
    "import sys, trainwatch.actions.cgroup as c; c.base = lambda *a, **k: None; "
    "from trainwatch.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_sigkilled_trainwatch_run_without_a_cgroup_takes_the_jobs_children_down(
        ws: Workspace) -> None:
    """Without a cgroup, SIGKILL of `run` still kills a child in the job's process group, one
    in its session but another group, and that one's child that left the session."""
    _need_root()
    f = {k: ws.root / k for k in ("group", "session", "escaped")}
    child = ("import os, subprocess, time; os.setpgid(0, 0); "
             f"open('{f['session']}', 'w').write(str(os.getpid())); "
             "p = subprocess.Popen(['setsid', 'sleep', '300']); "
             f"open('{f['escaped']}', 'w').write(str(p.pid)); time.sleep(300)")
    script = (f"sleep 300 & echo $! > {f['group']}; {sys.executable} -c {shlex.quote(child)} & "
              "wait")
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    p = subprocess.Popen([sys.executable, "-c", _RUN_WITHOUT_CGROUP, "run", "--config",
                          str(ws.config({"command": ["bash", "-c", script]})),
                          "--no-passthrough"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ws.procs.append(p)
    pids: list[int] = []
    try:
        s = wait_for(lambda: (st := ws.status()).get("pid") and st, timeout=30,
                     what="the job to start")
        assert s["cgroup"] is None  # the fallback: membership by session and process group
        pids = [int(s["pid"])] + [
            int(wait_for(lambda k=k: f[k].exists() and f[k].read_text().strip(),
                         what=f"the {k} pid")) for k in ("group", "session", "escaped")]
        leader, group, session, escaped = pids
        assert os.getpgid(group) == leader
        assert os.getsid(session) == leader and os.getpgid(session) != leader
        # `setsid sleep` calls setsid() once it runs: its pid is written before that.
        wait_for(lambda: os.getsid(escaped) != leader, timeout=30,
                 what="the escapee's own session")
        p.kill()
        p.wait()
        for pid in pids:
            wait_for(lambda pid=pid: is_gone(pid), timeout=10,
                     what=f"process {pid} to die with trainwatch")
        assert bystander.poll() is None  # never a stranger
    finally:
        for pid in pids:  # on failure: leave nothing behind
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()


def test_reader_that_stops_reading_our_stdout_does_not_stall_the_loop(ws: Workspace) -> None:
    """`trainwatch run ... | sleep`: the job's exit is still handled at once and run ends."""
    r, w = os.pipe()
    reader = subprocess.Popen(["sleep", "300"], stdin=r)
    os.close(r)
    cmd = ["bash", "-c", "echo hi; head -c 300000 /dev/zero; head -c 300000 /dev/zero >&2; "
           "exit 3"]
    tw = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "run", "--name", "job", "--state-dir",
         str(ws.state), "--run-dir", str(ws.root / "run"), "--metrics-port", "0",
         "--max-restarts", "0", "--", *cmd],
        stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    ws.procs.append(tw)
    try:
        # Our stderr is read, and is not the stalled stream: only stdout is `| sleep`.
        _, err = tw.communicate(timeout=30)
        assert tw.returncode == 1, err.decode(errors="replace")
        assert ws.status().get("state") == "fatal"
        assert reader.poll() is None  # the reader never read a byte, and still does not
    finally:
        reader.kill()
        reader.wait()


def _mounted_run(ws: Workspace, mount: str, job_cmd: str) -> tuple[int, str]:
    """`trainwatch run` in a private mount namespace where the job's log folder is `mount`d."""
    _need_root()
    if shutil.which("unshare") is None:
        missing("needs unshare (util-linux)")
    logs = _logs(ws)
    script = f'set -e; mkdir -p "$0"; {mount}; exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(logs),
            sys.executable, "-m", "trainwatch.cli", "run", "--name", "job", "--state-dir",
            str(ws.state), "--run-dir", str(ws.root / "run"), "--metrics-port", "0",
            "--no-passthrough", "--max-restarts", "2", "--backoff", "0.05s", "--", "sh", "-c",
            job_cmd]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    return p.returncode, p.stdout + p.stderr


def test_full_log_folder_loses_output_but_not_supervision(ws: Workspace) -> None:
    """With the log folder on a full 256 KB tmpfs, the job is relaunched until its budget ends
    (the job writes its log itself: ENOSPC is its own write's, and trainwatch goes on)."""
    rc, out = _mounted_run(ws, 'mount -t tmpfs -o size=256k tw-full "$0"',
                           "head -c 400000 /dev/zero; echo; exit 3")
    assert rc == 1, out  # fatal after its restarts: supervised to the end, no exit 2
    assert "Traceback" not in out
    assert [i["attempt"] for i in ws.incidents()] == [0, 1, 2]


def test_read_only_log_folder_does_not_stop_the_launch(ws: Workspace) -> None:
    """With a read-only log folder the job still starts, runs and is relaunched."""
    rc, out = _mounted_run(ws, 'mount --bind "$0" "$0"; mount -o remount,bind,ro "$0"',
                           "echo started >&2; exit 3")
    assert rc == 1, out
    assert "Traceback" not in out and "cannot open" in out
    assert [i["attempt"] for i in ws.incidents()] == [0, 1, 2]
