"""What a flood of datagrams on a job's heartbeat socket costs trainwatch, and
whether the job's real beats survive it (issue 9, item 1).

Setup: a real ``trainwatch run --name bench --state-dir D/s --run-dir D/r
--metrics-port 0 --no-passthrough -q --heartbeat-timeout 5s -- python job.py D``
(D a short temp dir under /tmp), run as an unprivileged user (``twbench``,
created if absent) so that its job shares that uid, supervising a job that
beats through ``trainwatch.client`` at 100 Hz and counts its own calls and the
client's drops (EAGAIN: the kernel queue, net.unix.max_dgram_qlen, was full).
Once the job is running, ``--datagrams`` (100,000) datagrams are sent as fast
as a blocking ``send()`` allows by:

* other-uid: uid 65534 (``setpriv --reuid=65534 --regid=65534 --clear-groups``);
  the socket is 0600 and owned by the job's user, so connect() gets EACCES and
  every further ``sendto()`` too (attempted, all refused);
* foreign: the job's own uid from outside the job's process tree (counted
  ``foreign``: rejected on SO_PASSCRED credentials);
* malformed: a process the job forks (inside its tree) sending garbage
  (counted ``malformed``).

For each: trainwatch's CPU seconds (psutil ``cpu_times`` user+sys of the
trainwatch process) from the flood's start until it ends and the queue is
drained, scaled to 100,000 datagrams; the same less trainwatch's own cost of
the job's 100 Hz beats over that time (measured for 2 s before the flood); the
job's beats lost (beats the job made minus beats trainwatch accepted, from the
job's own count and status.json's ``datagrams`` counters after a final marker
beat), of which the client saw how many refused by the kernel (EAGAIN); and
the hang incidents in ledger.db (goal: none). Medians of ``--runs`` (3) runs,
each with a fresh trainwatch.

Goal (issue 9): ≤ 0.5 s of trainwatch CPU per 100,000 foreign or malformed
datagrams, and 0 beats lost.

    sudo .venv/bin/python benchmarks/bench_flood.py [--runs 3] [--datagrams 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
from _common import machine_line

ROOT = Path(__file__).resolve().parent.parent
USER = "twbench"
NOBODY = 65534
PY = sys.executable

JOB = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from trainwatch import client
    d = sys.argv[1]
    n = int(sys.argv[2])
    hb = client.connect()
    made = 0
    step = 0
    def flood():
        if os.fork() == 0:  # a process of the job's own tree sends the garbage
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.connect(os.environ["TRAINWATCH_SOCKET"])
            for _ in range(n):
                s.send(b"x")
            open(os.path.join(d, "flood.done"), "w").close()
            os._exit(0)
    flooding = False
    while not os.path.exists(os.path.join(d, "stop")):
        step += 1
        made += 1
        hb.beat(step)
        if not flooding and os.path.exists(os.path.join(d, "flood")):
            flooding = True
            flood()
        time.sleep(0.01)
    time.sleep(1.2)  # so that trainwatch publishes the marker's step with its counters
    step += 1
    made += 1
    hb.beat(step)
    with open(os.path.join(d, "job.json.tmp"), "w") as f:
        json.dump({"made": made, "dropped": hb.dropped, "skipped": hb.skipped, "marker": step}, f)
    os.replace(os.path.join(d, "job.json.tmp"), os.path.join(d, "job.json"))
    time.sleep(3600)
    """
)

FLOOD = textwrap.dedent(
    """
    import errno, json, socket, sys
    path, n = sys.argv[1], int(sys.argv[2])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    refused, sent = {}, 0
    try:
        s.connect(path)
    except OSError as e:  # cannot connect: try every datagram with sendto, as an attacker would
        refused[errno.errorcode[e.errno]] = 1
        for _ in range(n):
            try:
                s.sendto(b"x", path)
                sent += 1
            except OSError as e:
                name = errno.errorcode[e.errno]
                refused[name] = refused.get(name, 0) + 1
    else:
        for _ in range(n):
            s.send(b"x")
        sent = n
    print(json.dumps({"sent": sent, "refused": refused}))
    """
)


def _user() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", USER], check=True)
        pw = pwd.getpwnam(USER)
    return pw.pw_uid, pw.pw_gid


def _as(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def _job_python(user: tuple[int, int]) -> str:
    """An interpreter the job's user may run (the check trainwatch makes is
    os.access, which a venv under /root fails for another user)."""
    probe = "import os, sys; sys.exit(not os.access(sys.argv[1], os.X_OK))"
    for py in (PY, "/usr/bin/python3", "/usr/local/bin/python3"):
        if subprocess.run([*_as(*user), PY, "-c", probe, py], check=False).returncode == 0:
            return py
    return PY


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _status(d: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((d / "s" / "jobs" / "bench" / "status.json").read_text()))
    except (OSError, ValueError):
        return {}


def _wait(cond: Any, timeout: float, what: str, tw: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tw.poll() is not None:
            raise RuntimeError(f"trainwatch exited {tw.returncode} waiting for {what}")
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def _hangs(d: Path) -> int:
    db = d / "s" / "ledger.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT count(*) FROM incidents WHERE kind = 'hang'").fetchone()[0])
    finally:
        con.close()


def one_run(kind: str, n: int, user: tuple[int, int], keep: bool) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="twf", dir="/tmp"))
    os.chown(d, *user)
    (d / "job.py").write_text(JOB)
    (d / "lib").mkdir()
    (d / "lib" / "trainwatch").symlink_to(ROOT / "watchdog")  # the client, for any python
    argv = [*_as(*user), PY, "-m", "trainwatch.cli", "run", "--name", "bench",
            "--state-dir", str(d / "s"), "--run-dir", str(d / "r"), "--metrics-port", "0",
            "--no-passthrough", "-q", "--heartbeat-timeout", "5s", "--",
            _job_python(user), str(d / "job.py"), str(d), str(n)]
    err = open(d / "trainwatch.stderr", "wb")  # noqa: SIM115 - closed below
    tw = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=err, cwd=d, env={**os.environ, "PYTHONPATH": str(d / "lib")})
    out: dict[str, Any] = {"kind": kind}
    try:
        _wait(lambda: _status(d).get("state") == "running", 30, "the job running", tw)
        sock = str(_status(d)["socket"])
        c0 = _cpu(tw.pid)
        time.sleep(2.0)
        base_rate = (_cpu(tw.pid) - c0) / 2.0  # trainwatch's own cost of 100 Hz beats
        cpu0, t0 = _cpu(tw.pid), time.monotonic()
        if kind == "malformed":
            (d / "flood").touch()
            _wait(lambda: (d / "flood.done").exists(), 600, "the job's flood", tw)
            out["attacker"] = {"sent": n}
        elif kind != "baseline":
            who = (NOBODY, NOBODY) if kind == "other-uid" else user
            r = subprocess.run([*_as(*who), PY, "-c", FLOOD, sock, str(n)],
                               capture_output=True, text=True, timeout=600, check=True)
            out["attacker"] = json.loads(r.stdout)
        else:
            time.sleep(2.0)
        time.sleep(0.2)  # the last (at most net.unix.max_dgram_qlen) datagrams are read
        out["flood_s"] = time.monotonic() - t0
        out["cpu_s"] = _cpu(tw.pid) - cpu0
        out["cpu_less_beats_s"] = max(0.0, out["cpu_s"] - base_rate * out["flood_s"])
        (d / "stop").touch()
        job = _wait(lambda: json.loads((d / "job.json").read_text())
                    if (d / "job.json").exists() else None, 30, "the job's count", tw)
        st = _wait(lambda: (s := _status(d)).get("step") == job["marker"] and s, 30,
                   "trainwatch's counters after the marker", tw)
        c = st["datagrams"]
        accepted = c["received"] - c["malformed"] - c["oversized"] - c["foreign"]
        out.update(made=job["made"], accepted=accepted, lost=job["made"] - accepted,
                   refused_by_kernel=job["dropped"], skipped=job["skipped"], counters=c,
                   hangs=_hangs(d), attempt=st.get("attempt"))
    finally:
        if tw.poll() is None:
            tw.send_signal(signal.SIGINT)
            try:
                tw.wait(30)
            except subprocess.TimeoutExpired:
                tw.kill()
                tw.wait()
        err.close()
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--datagrams", type=int, default=100_000)
    p.add_argument("--kinds", default="baseline,other-uid,foreign,malformed")
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("bench_flood needs root (it acts as other users)", file=sys.stderr)
        return 2
    user = _user()
    print(machine_line())
    qlen = Path("/proc/sys/net/unix/max_dgram_qlen").read_text().strip()
    print(f"net.unix.max_dgram_qlen = {qlen}")
    per = 100_000 / a.datagrams
    results: dict[str, list[dict[str, Any]]] = {}
    for kind in a.kinds.split(","):
        runs = [one_run(kind, a.datagrams, user, a.keep) for _ in range(a.runs)]
        results[kind] = runs

        def med(key: str, rs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in rs))

        scale = 1.0 if kind == "baseline" else per
        print(
            f"{kind:>9}: trainwatch CPU {med('cpu_s') * scale:.3f} s"
            f"{'' if kind == 'baseline' else ' per 100,000'} "
            f"({med('cpu_less_beats_s') * scale:.3f} s less its 100 Hz beats), "
            f"over {med('flood_s'):.2f} s; "
            f"beats lost {med('lost'):g} of {med('made'):g} "
            f"(refused by the kernel queue: {med('refused_by_kernel'):g}); "
            f"hang incidents {sum(r['hangs'] for r in runs)}; "
            f"runs={len(runs)}"
        )
        for r in runs:
            print(f"           run: {json.dumps({k: v for k, v in r.items() if k != 'kind'})}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
