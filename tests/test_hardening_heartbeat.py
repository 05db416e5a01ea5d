"""The heartbeat socket under attack, with a real `trainwatch run`, a real job
and real attacker processes (issue 9, items 1, 6 and 7): another user cannot
reach the socket at all, a flood from outside the job's tree neither starves
the job's beats nor costs unbounded CPU, and nothing a datagram carries
(huge numbers, fake ranks) can crash trainwatch or get the job killed as hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import UserPython, Workspace, local_user, need_root, run_name, wait_for

# trainwatch and its job run as this user where a foreign sender must share it (this
# run's own: conftest)
USER = run_name("test1")
NOBODY = 65534

# The job: beats at 100 Hz through the client and does one misdeed on attempt 0.
_JOB = textwrap.dedent(
    """
    import json, os, socket, sys, threading, time
    from trainwatch import client
    mode, report = sys.argv[1], sys.argv[2]
    hb = client.connect()
    attempt = int(os.environ["TRAINWATCH_ATTEMPT"])
    step = 0
    def beat_for(seconds):
        global step
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step += 1
            hb.beat(step)
            time.sleep(0.01)
    def raw():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.connect(os.environ["TRAINWATCH_SOCKET"])
        return s
    def fake_ranks():
        s = raw()
        for r in range(1, 50001):
            s.send(b'{"v":1,"k":"beat","rank":%d,"step":1}' % r)
    beat_for(0.5)
    done = "ok"
    if attempt == 0 and mode == "huge":
        for _ in range(3):
            time.sleep(0.02)  # past the client's 5 ms rate limit: each is sent
            hb.beat(10**309)
    elif attempt == 0 and mode == "int64-crash":
        for _ in range(3):
            time.sleep(0.02)
            hb.beat(2**63)
        time.sleep(0.2)
        sys.exit(3)
    elif attempt == 0 and mode == "fake-ranks":
        t = threading.Thread(target=fake_ranks)
        t.start()
        while t.is_alive():
            beat_for(0.05)
    with open(report + ".tmp", "w") as f:
        json.dump({"attempt": attempt, "done": done, "step": step}, f)
    os.replace(report + ".tmp", report)
    beat_for(3600)
    """
)

_FLOOD = textwrap.dedent(
    """
    import errno, socket, sys
    path, n = sys.argv[1], int(sys.argv[2])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(path)
    except OSError as e:
        print(errno.errorcode[e.errno], flush=True)
        sys.exit(0)
    for _ in range(n):
        s.send(b"x")
    print("sent", n, flush=True)
    """
)


def _ensure_user() -> tuple[int, int]:
    need_root("these attacks act as other users")
    pw = local_user(USER)
    return pw.pw_uid, pw.pw_gid


def _as(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def _start(
    ws: Workspace, mode: str, as_user: tuple[int, int] | None = None,
    user_python: UserPython | None = None,
) -> subprocess.Popen[bytes]:
    """`trainwatch run` (as root, or as ``as_user`` with ``user_python``) supervising the
    job in ``mode``."""
    script = ws.root / "job.py"
    script.write_text(_JOB)
    python, env = sys.executable, dict(os.environ)
    if as_user is not None:
        assert user_python is not None
        os.chown(ws.root, *as_user)
        os.chmod(ws.root, 0o700)
        python, env = user_python.python, user_python.env()
    argv = [python, "-m", "trainwatch.cli", "run", "--name", "job",
            "--state-dir", str(ws.state), "--run-dir", str(ws.root / "run"),
            "--metrics-port", "0", "--no-passthrough", "--heartbeat-timeout", "5s",
            "--max-restarts", "3", "--", python, str(script), mode,
            str(ws.root / "report.json")]
    if as_user is not None:
        argv = _as(*as_user) + argv
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         cwd=ws.root, env=env)
    ws.procs.append(p)
    return p


def _report(ws: Workspace) -> dict[str, object]:
    try:
        return dict(json.loads((ws.root / "report.json").read_text()))
    except (OSError, ValueError):
        return {}


def _running(ws: Workspace, p: subprocess.Popen[bytes], attempt: int = 0) -> dict[str, object]:
    def ok() -> dict[str, object] | None:
        assert p.poll() is None, f"trainwatch exited {p.returncode}: {_output(p)}"
        s = ws.status()
        return s if s.get("state") == "running" and s.get("attempt") == attempt else None
    return dict(wait_for(ok, what=f"attempt {attempt} running"))


def _output(p: subprocess.Popen[bytes]) -> str:
    if p.poll() is None:
        p.terminate()
    out, _ = p.communicate(timeout=30)
    return out.decode(errors="replace")


def _counters(ws: Workspace) -> dict[str, int]:
    return dict(ws.status().get("datagrams") or {})


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _hangs(ws: Workspace) -> list[dict[str, object]]:
    return [i for i in ws.incidents() if i.get("kind") == "hang"]


def _finish_clean(ws: Workspace, p: subprocess.Popen[bytes]) -> str:
    """Stop trainwatch; its output, which must hold no traceback."""
    assert p.poll() is None, f"trainwatch exited {p.returncode}"
    p.send_signal(2)
    out, _ = p.communicate(timeout=30)
    text = out.decode(errors="replace")
    assert "Traceback" not in text, text
    return text


def test_another_user_cannot_connect_to_the_jobs_socket(ws: Workspace) -> None:
    """uid 65534 gets EACCES at connect(); trainwatch receives nothing and the job is unharmed."""
    _ensure_user()
    p = _start(ws, "beat")
    _running(ws, p)
    sock = str(ws.status()["socket"])
    out = subprocess.run([*_as(NOBODY, NOBODY), sys.executable, "-c", _FLOOD, sock, "15000"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "EACCES"
    c = _counters(ws)
    assert (c["foreign"], c["malformed"]) == (0, 0)
    assert ws.incidents() == []
    _finish_clean(ws, p)


def test_a_flood_from_outside_the_tree_is_cheap_and_harmless(
        ws: Workspace, user_python: UserPython) -> None:
    """15,000 datagrams from the job's own user outside its tree: no hang incident, each
    counted foreign, and trainwatch's CPU for them stays bounded."""
    user = _ensure_user()
    p = _start(ws, "beat", as_user=user, user_python=user_python)
    _running(ws, p)
    sock = str(ws.status()["socket"])
    cpu0 = _cpu(p.pid)
    out = subprocess.run([*_as(*user), user_python.python, "-c", _FLOOD, sock, "15000"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "sent 15000"
    wait_for(lambda: _counters(ws).get("foreign", 0) >= 15000, what="15,000 foreign datagrams")
    cpu = _cpu(p.pid) - cpu0
    # A generous bound (the issue measured 14 s; the benchmark measures the real figure).
    assert cpu < 5.0, f"trainwatch used {cpu:.2f} s of CPU for 15,000 foreign datagrams"
    s = _running(ws, p)  # still attempt 0: never restarted
    assert int(str(s["step"])) > 0
    assert _hangs(ws) == []
    _finish_clean(ws, p)


@pytest.mark.parametrize("mode", ["huge", "int64-crash", "fake-ranks"])
def test_nothing_a_datagram_carries_crashes_trainwatch(ws: Workspace, mode: str) -> None:
    """hb.beat(10**309), hb.beat(2**63) then a crash, and 50,000 fake ranks from inside the
    tree: trainwatch keeps supervising, no traceback, no hang, and the drops are counted."""
    p = _start(ws, mode)
    attempt = 1 if mode == "int64-crash" else 0
    wait_for(lambda: _report(ws).get("attempt") == attempt, timeout=60,
             what=f"the job's misdeed ({mode}) done")
    s = _running(ws, p, attempt)
    if mode == "fake-ranks":
        # The fake ranks each beat once and went quiet; past the 5 s timeout the
        # job, whose real rank still beats, must not be judged hung.
        time.sleep(6.0)
        s = _running(ws, p, attempt)
        assert len(dict(s["ranks"])) <= 1024  # type: ignore[call-overload]
        wait_for(lambda: int(ws.status().get("ranks_over_cap") or 0) > 0,
                 what="the over-cap beats counted in status.json")
    else:
        wait_for(lambda: _counters(ws).get("malformed", 0) >= 1, what="a malformed datagram")
    assert _hangs(ws) == []
    if mode == "int64-crash":
        (crash,) = ws.incidents()
        assert crash["kind"] == "crash"
        step = crash.get("onset_step")
        assert step is None or int(step) < 2**63
    else:
        assert ws.incidents() == []
    _finish_clean(ws, p)
