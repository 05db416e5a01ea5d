"""Each user controls only their own jobs (issue 21, item 9): a real `trainwatch
daemon` run as root supervises job `a` running as alice and job `b` running
as bob, and real users drive it with the real CLI (`setpriv` to their uid,
gid and groups): alice and bob see and act on their own job only and are
refused on the other's, which stays untouched; admin (a supplementary member
of the daemon's admin group, its config's `admin_group`) acts on both and alone
reloads or drills a GPU; carol, who has no job, sees none. The control socket is
open to every local user: who may do what is decided per request from the
kernel's credentials. The users and the admin group are this run's own
(conftest.run_name), made for the module and removed at the session's end."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    UserPython,
    free_port,
    local_group,
    local_user,
    need_root,
    run_name,
    wait_for,
)

ADMIN, ALICE, BOB, CAROL = (run_name(role) for role in ("admin", "alice", "bob", "carol"))
JOBS = {"a": ALICE, "b": BOB}
# The daemon's admin_group: a group of this run's, not the machine's own trainwatch
# group (trainwatch.privsep.access.GROUP, the default), whose members would be admins here.
GROUP = run_name("admins")
# The job: beats ten times a second through the client (running from its first beat).
BEATER = ("import time\nfrom trainwatch import client\nhb = client.connect()\n"
          "step = 0\nwhile True:\n    step += 1\n    hb.beat(step)\n    time.sleep(0.1)\n")


def _admin_group_member(user: str) -> None:
    """``user`` in the admin group as a supplementary group, as `make install` and
    `usermod -aG trainwatch USER` leave it."""
    local_group(GROUP, (user,))


@dataclass
class Host:
    root: Path
    run_dir: Path
    state_dir: Path
    daemon: subprocess.Popen[bytes]
    out: Path
    up: UserPython
    port: int

    def cli(self, user: str | None, *argv: str) -> subprocess.CompletedProcess[str]:
        """The real `trainwatch` CLI as ``user`` (its uid, gid and groups); None: root."""
        cmd = [self.up.python, "-m", "trainwatch.cli", *argv, "--run-dir", str(self.run_dir)]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}",
                   "--init-groups", *cmd]
        return subprocess.run(cmd, env=self.up.env(), capture_output=True, text=True,
                              timeout=60, check=False)

    def ask(self, user: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """One raw request from a process running as ``user`` (what faultinject sends)."""
        code = ("import json, sys; from trainwatch.host.control import request; "
                "print(json.dumps(request(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))")
        p = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}",
                            "--init-groups", self.up.python, "-c", code, str(self.run_dir), op,
                            json.dumps(args)],
                           env=self.up.env(), capture_output=True, text=True, timeout=60,
                           check=False)
        assert p.returncode == 0, p.stderr
        return dict(json.loads(p.stdout))

    def status(self, job: str) -> dict[str, Any]:
        """The job as root's `trainwatch status --json` shows it."""
        p = self.cli(None, "status", "--json")
        assert p.returncode == 0, p.stderr
        return next(j for j in json.loads(p.stdout)["jobs"] if j["job"] == job)

    def state(self, job: str) -> str | None:
        """The job's state from its status.json (cheap enough to poll)."""
        try:
            return str(json.loads((self.state_dir / "jobs" / job / "status.json")
                                  .read_text())["state"])
        except (OSError, ValueError, KeyError):
            return None

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the daemon's /metrics, or None."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def output(self) -> str:
        return self.out.read_text(errors="replace")


def _refusal(user: str, job: str, verb: str = "act on") -> str:
    pw = pwd.getpwnam(user)
    return f"job {job} runs as {JOBS[job]}; uid {pw.pw_uid} ({user}) may {verb} only its own jobs"


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    return p.stderr.strip()


def _jobs(p: subprocess.CompletedProcess[str]) -> list[str]:
    assert p.returncode == 0, p.stderr
    return sorted(j["job"] for j in json.loads(p.stdout)["jobs"])


@pytest.fixture(scope="module")
def host(user_python: UserPython) -> Iterator[Host]:
    need_root("jobs and CLI users of their own")
    for name in (ADMIN, ALICE, BOB, CAROL):
        local_user(name)
    _admin_group_member(ADMIN)
    root = Path(tempfile.mkdtemp(prefix="twz", dir="/tmp"))
    root.chmod(0o755)  # the users reach run_dir/control.sock through it
    jobs = []
    for job, user in JOBS.items():
        d = root / job
        (d / "ckpt").mkdir(parents=True)
        pw = pwd.getpwnam(user)
        for p in (d, d / "ckpt"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        jobs.append({"name": job, "user": user, "workdir": str(d),
                     "command": [user_python.python, "-c", BEATER],
                     "env": {"PYTHONPATH": user_python.path},
                     "checkpoints": {"dir": str(d / "ckpt")}})
    config = root / "trainwatch.yaml"
    port = free_port()
    config.write_text(yaml.safe_dump({
        "state_dir": str(root / "state"), "run_dir": str(root / "run"), "admin_group": GROUP,
        "metrics": {"port": port}, "gpu": {"backend": "off", "kmsg": None}, "jobs": jobs,
        "policies": {"default": {"max_restarts": 3, "kill_grace": "2s",
                                 "backoff": {"initial": "0.1s", "max": "1s", "jitter": 0}}}}))
    out = root / "daemon.out"
    with open(out, "wb") as f:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True)
    h = Host(root, root / "run", root / "state", daemon, out, user_python, port)
    try:
        for job in JOBS:
            wait_for(lambda job=job: daemon.poll() is None and h.state(job) == "running",
                     timeout=60, what=f"job {job} running")
        yield h
    finally:
        # The daemon leaves its jobs running by design: stop them first, then it.
        for job in JOBS:
            with contextlib.suppress(Exception):
                h.cli(None, "stop", job)
        for job in JOBS:
            with contextlib.suppress(Exception):
                wait_for(lambda job=job: h.state(job) in ("paused", "exited", "fatal"),
                         timeout=30, what=f"job {job} stopped")
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        for job in JOBS:  # a job the daemon could not stop: by its pid, if still ours
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pid = int(json.loads((h.state_dir / "jobs" / job / "status.json")
                                     .read_text())["pid"])
                if b"client.connect" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_each_user_sees_only_the_jobs_that_run_as_them(host: Host) -> None:
    """status and incidents: alice sees a, bob b, the admin both, carol (no job) none."""
    assert _jobs(host.cli(ALICE, "status", "--json")) == ["a"]
    assert _jobs(host.cli(BOB, "status", "--json")) == ["b"]
    assert _jobs(host.cli(ADMIN, "status", "--json")) == ["a", "b"]
    assert _jobs(host.cli(CAROL, "status", "--json")) == []
    p = host.cli(CAROL, "incidents", "--json")
    assert p.returncode == 0 and json.loads(p.stdout) == [], p.stderr
    assert _one_line(host.cli(ALICE, "incidents", "--job", "b")) == \
        f"trainwatch incidents: {_refusal(ALICE, 'b', 'read')}"
    assert _one_line(host.cli(ALICE, "checkpoints", "b")) == \
        f"trainwatch checkpoints: {_refusal(ALICE, 'b', 'read')}"
    assert host.cli(ALICE, "checkpoints", "a").returncode == 0


def test_a_user_pauses_stops_and_starts_their_own_job(host: Host) -> None:
    """alice pauses, resumes, stops and starts job a with the CLI; each takes effect."""
    assert host.cli(ALICE, "pause", "a").stdout == "a: running (paused)\n"
    assert host.status("a")["paused"] is True
    assert host.cli(ALICE, "resume", "a").returncode == 0
    assert host.status("a")["paused"] is False
    pid = host.status("a")["pid"]
    assert host.cli(ALICE, "stop", "a").returncode == 0
    wait_for(lambda: host.state("a") == "paused", timeout=30, what="a stopped")
    assert host.cli(ALICE, "start", "a").returncode == 0
    wait_for(lambda: host.state("a") == "running", timeout=30, what="a running again")
    assert host.status("a")["pid"] != pid


def test_a_user_is_refused_on_another_users_job_which_stays_untouched(host: Host) -> None:
    """alice's pause, stop, rollback and drills on bob's job: refused in one line, b as it was."""
    before = host.status("b")
    refused = host.metric("trainwatch_control_requests_total", outcome="refused") or 0.0
    for argv in (("pause", "b"), ("stop", "b"), ("rollback", "b", "--to-step", "1")):
        assert _one_line(host.cli(ALICE, *argv)) == f"trainwatch {argv[0]}: {_refusal(ALICE, 'b')}"
    for args in ({"job": "b", "kind": "nan"}, {"job": "b", "kind": "crash", "pids": []}):
        assert host.ask(ALICE, "drill", args) == {"ok": False,
                                                  "error": f"drill: {_refusal(ALICE, 'b')}"}
    after = host.status("b")
    assert (after["state"], after["paused"], after["pid"], after["attempt"],
            after["last_incident"]) == ("running", False, before["pid"], before["attempt"], None)
    # Refusals are counted and exported, and logged, but not one line per request.
    assert host.metric("trainwatch_control_requests_total", outcome="refused") == refused + 5
    lines = [line for line in host.output().splitlines()
             if "control: refused" in line and f"({ALICE})" in line]
    assert 1 <= len(lines) < 5, lines


def test_a_user_with_no_jobs_acts_on_none(host: Host) -> None:
    """carol, who has no job, is refused on both and named as the one refused."""
    for job in JOBS:
        assert _one_line(host.cli(CAROL, "pause", job)) == \
            f"trainwatch pause: {_refusal(CAROL, job)}"
    assert host.status("a")["paused"] is False and host.status("b")["paused"] is False


def test_the_admin_group_acts_on_every_job_where_other_users_are_refused(host: Host) -> None:
    """admin, a supplementary member of the admin group, pauses and resumes a and b,
    each refused to the other job's user."""
    for job, other in (("a", BOB), ("b", ALICE)):
        assert _one_line(host.cli(other, "pause", job)) == \
            f"trainwatch pause: {_refusal(other, job)}"
        assert host.cli(ADMIN, "pause", job).stdout == f"{job}: running (paused)\n"
        assert host.status(job)["paused"] is True
        assert host.cli(ADMIN, "resume", job).returncode == 0
        assert host.status(job)["paused"] is False


def test_host_wide_requests_are_for_admins_only(host: Host) -> None:
    """reload and GPU drills: refused to alice before any work; the admin's are carried out."""
    uid = pwd.getpwnam(ALICE).pw_uid
    assert _one_line(host.cli(ALICE, "reload")) == (
        f"trainwatch reload: reload is for root and the {GROUP} group only; uid {uid} "
        f"({ALICE}) may act only on its own jobs")
    # Refused before the daemon even looks at its GPUs (monitoring is off here).
    assert host.ask(ALICE, "gpu-xid", {"gpu": 0, "xid": 79})["error"] == (
        f"gpu-xid: the GPU drill gpu-xid is for root and the {GROUP} group only; uid {uid} "
        f"({ALICE}) may act only on its own jobs")
    assert host.ask(ADMIN, "gpu-xid", {"gpu": 0, "xid": 79})["error"] == \
        "gpu-xid: GPU monitoring is off (gpu.backend: off)"
    p = host.cli(ADMIN, "reload")
    assert p.returncode == 0 and p.stdout.startswith("reloaded: no changes"), p.stderr


def _get(host: Host, user: str | None, path: str) -> tuple[int, str]:
    """GET ``path`` on the daemon's metrics port from a process running as ``user``
    (None: root): (HTTP status, body)."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    r = urllib.request.urlopen(sys.argv[1], timeout=30)\n"
            "    status, body = r.status, r.read()\n"
            "except urllib.error.HTTPError as e:\n"
            "    status, body = e.code, e.read()\n"
            "print(status)\nsys.stdout.write(body.decode())\n")
    cmd = [host.up.python, "-c", code, f"http://127.0.0.1:{host.port}{path}"]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}",
               "--init-groups", *cmd]
    p = subprocess.run(cmd, env=host.up.env(), capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr
    status, _, body = p.stdout.partition("\n")
    return int(status), body


def test_each_user_is_served_the_incident_pages_of_their_own_jobs_only(host: Host) -> None:
    """Each job crashes once (SIGKILL); on the metrics port, /incidents/ lists alice's
    incident to alice, bob's to bob, both to the admin and none to carol, and
    /incidents/N of another user's job is 404, as if it did not exist. (Run after
    the others but the reload's: it leaves an incident on each job.)"""
    before = {job: host.status(job) for job in JOBS}
    for job in JOBS:
        os.kill(before[job]["pid"], signal.SIGKILL)
    for job in JOBS:
        wait_for(lambda job=job: host.state(job) == "running"
                 and host.status(job)["attempt"] > before[job]["attempt"], timeout=60,
                 what=f"job {job} relaunched")
    p = host.cli(None, "incidents", "--json")
    assert p.returncode == 0, p.stderr
    ids = {i["job"]: i["id"] for i in json.loads(p.stdout)}
    assert sorted(ids) == ["a", "b"], p.stdout
    for user, mine in ((ALICE, ["a"]), (BOB, ["b"]), (ADMIN, ["a", "b"]), (CAROL, [])):
        status, index = _get(host, user, "/incidents/")
        assert status == 200, index
        assert sorted(j for j in JOBS if f'href="/incidents/{ids[j]}"' in index) == mine, \
            (user, index[:2000])
        for job, n in ids.items():
            status, page = _get(host, user, f"/incidents/{n}")
            if job in mine:
                assert status == 200 and f"trainwatch incident {n}: crash on {job}" in page, \
                    (user, status, page[:500])
            else:
                assert (status, page.count(f"crash on {job}")) == (404, 0), (user, page[:500])
    assert _get(host, None, f"/incidents/{ids['a']}")[0] == 200  # root: an admin
    assert _get(host, ALICE, "/incidents/nope")[0] == 404


def _as(host: Host, user: str, code: str, *argv: str) -> list[str]:
    """``python -c code argv...`` as ``user`` (its uid, gid and groups)."""
    return ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}",
            "--init-groups", host.up.python, "-c", code, *argv]


# Bob's private socket: bound in a folder only bob may enter; told "go" on stdin, it
# prints every datagram that came to it, none waited for.
_VICTIM = ("import json, socket, sys\n"
           "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
           "s.bind(sys.argv[1])\n"
           "print('ready', flush=True)\n"
           "sys.stdin.readline()\n"
           "s.setblocking(False)\n"
           "got = []\n"
           "while True:\n"
           "    try:\n"
           "        got.append(s.recv(65536).decode(errors='replace'))\n"
           "    except BlockingIOError:\n"
           "        break\n"
           "print(json.dumps(got), flush=True)\n")
# Alice, six times: binds a socket at a path of hers, sends a request (its text hers),
# and at once swaps that path for a link to bob's socket. Then one ordinary request
# (the daemon answers in order: the six were answered before it). Prints the replies
# her own sockets got, and what her own sendto to bob's socket got.
_SWAPPER = ("import json, os, socket, sys\n"
            "from trainwatch.host.control import control_path, request\n"
            "run_dir, at, victim = sys.argv[1:4]\n"
            "mine = []\n"
            "for i in range(6):\n"
            "    op = 'status' if i % 2 else 'pause'\n"
            "    args = {} if i % 2 else {'job': 'FORGED: restart budget spent -> fatal'}\n"
            "    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "    s.bind(at)\n"
            "    s.sendto(json.dumps({'v': 1, 'op': op, 'args': args}).encode(),\n"
            "             control_path(run_dir))\n"
            "    os.unlink(at)\n"
            "    os.symlink(victim, at)\n"
            "    request(run_dir, 'status', {})\n"
            "    s.setblocking(False)\n"
            "    try:\n"
            "        mine.append(s.recv(65536).decode())\n"
            "    except BlockingIOError:\n"
            "        pass\n"
            "    s.close()\n"
            "    os.unlink(at)\n"
            "try:\n"
            "    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', victim)\n"
            "    own = 'sent'\n"
            "except OSError as e:\n"
            "    own = type(e).__name__\n"
            "print(json.dumps({'mine': len(mine), 'own': own}))\n")


def test_a_reply_never_reaches_another_users_socket_through_a_swapped_path(
        host: Host) -> None:
    """Row 1 of issue 38, as the red team ran it on a root daemon: alice binds her
    reply socket at a path of hers and, after each of six requests, swaps that path
    for a link to bob's private socket (in bob's 0700 folder, where her own sendto
    gets EACCES). Bob's socket gets none of the six replies (root's sendto followed
    the link: 4 of 6 were delivered, one with alice's text); the daemon serves on."""
    private = host.root / "b" / "private"
    private.mkdir(mode=0o700)
    bob = pwd.getpwnam(BOB)
    os.chown(private, bob.pw_uid, bob.pw_gid)
    victim = private / "inbox.sock"
    at = host.root / "a" / "reply.sock"  # job a's folder: alice's
    listener = subprocess.Popen(_as(host, BOB, _VICTIM, str(victim)), env=host.up.env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdin is not None
        assert listener.stdout.readline() == "ready\n"
        p = subprocess.run(_as(host, ALICE, _SWAPPER, str(host.run_dir), str(at),
                               str(victim)), env=host.up.env(), capture_output=True,
                           text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        swapper = json.loads(p.stdout)
        assert swapper["own"] == "PermissionError", swapper
        out, _ = listener.communicate("go\n", timeout=60)
    finally:
        listener.kill()
        listener.wait()
    assert json.loads(out) == [], out
    assert _jobs(host.cli(ALICE, "status", "--json")) == ["a"]


# Alice's flood: 16 threads asking for /incidents/ over and over; says "flooding" once
# they have had 64 answers, stops on a line on stdin and prints the answers' statuses.
_FLOOD = ("import collections, json, sys, threading, urllib.error, urllib.request\n"
          "url = sys.argv[1]\n"
          "stop, lock, seen = threading.Event(), threading.Lock(), collections.Counter()\n"
          "def ask():\n"
          "    while not stop.is_set():\n"
          "        try:\n"
          "            with urllib.request.urlopen(url, timeout=30) as r:\n"
          "                r.read()\n"
          "                code = str(r.status)\n"
          "        except urllib.error.HTTPError as e:\n"
          "            code = str(e.code)\n"
          "        except OSError as e:\n"
          "            code = type(e).__name__\n"
          "        with lock:\n"
          "            seen[code] += 1\n"
          "            if sum(seen.values()) == 64:\n"
          "                print('flooding', flush=True)\n"
          "threads = [threading.Thread(target=ask) for _ in range(16)]\n"
          "for t in threads:\n"
          "    t.start()\n"
          "sys.stdin.readline()\n"
          "stop.set()\n"
          "for t in threads:\n"
          "    t.join()\n"
          "print(json.dumps(seen), flush=True)\n")


def test_one_users_page_flood_leaves_another_users_pages_served(host: Host) -> None:
    """Row 5 of issue 38, on a root daemon: while alice's 16 threads ask for
    /incidents/ without pause, bob's five requests are all served, his page (each
    user has a share of the page queue; it was one line of 8, and bob got 503 on
    5 of 5). Metrics are served throughout."""
    flood = subprocess.Popen(
        _as(host, ALICE, _FLOOD, f"http://127.0.0.1:{host.port}/incidents/"),
        env=host.up.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline() == "flooding\n"
        bobs = [_get(host, BOB, "/incidents/") for _ in range(5)]
        assert host.metric("trainwatch_job_state", job="b", state="running") == 1
        out, _ = flood.communicate("stop\n", timeout=120)
    finally:
        flood.kill()
        flood.wait()
    assert [status for status, _ in bobs] == [200] * 5, [b[:200] for _, b in bobs]
    assert all("trainwatch" in body for _, body in bobs)
    seen = json.loads(out)
    assert seen.get("200", 0) > 0, seen  # alice was served her share meanwhile


def _reload_with(host: Host, group: str) -> None:
    """The daemon's config file with ``admin_group: group``, reloaded by root."""
    config = host.root / "trainwatch.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["admin_group"] = group
    config.write_text(yaml.safe_dump(doc))
    p = host.cli(None, "reload")
    assert p.returncode == 0 and p.stdout.startswith("reloaded"), (p.stdout, p.stderr)


def test_a_reload_makes_another_group_the_admin_group(host: Host) -> None:
    """admin_group set to alice's own group and reloaded: alice sees every job, on the
    control socket and on the incident pages, and admin is refused a reload that names
    that group; reloaded back, admin is an admin again. (Run last: it reads the
    incidents the incident pages' test left.)"""
    alices = grp.getgrgid(pwd.getpwnam(ALICE).pw_gid).gr_name
    p = host.cli(None, "incidents", "--json")
    assert p.returncode == 0, p.stderr
    links = [f'href="/incidents/{i["id"]}"' for i in json.loads(p.stdout)]
    assert len(links) == 2, p.stdout
    try:
        _reload_with(host, alices)
        assert _jobs(host.cli(ALICE, "status", "--json")) == ["a", "b"]
        assert _jobs(host.cli(ADMIN, "status", "--json")) == []
        uid = pwd.getpwnam(ADMIN).pw_uid
        assert _one_line(host.cli(ADMIN, "reload")) == (
            f"trainwatch reload: reload is for root and the {alices} group only; uid {uid} "
            f"({ADMIN}) may act only on its own jobs")
        status, index = _get(host, ALICE, "/incidents/")
        assert status == 200 and all(link in index for link in links), index[:2000]
        status, index = _get(host, ADMIN, "/incidents/")
        assert status == 200 and not any(link in index for link in links), index[:2000]
    finally:
        _reload_with(host, GROUP)
    assert _jobs(host.cli(ADMIN, "status", "--json")) == ["a", "b"]
    assert _jobs(host.cli(ALICE, "status", "--json")) == ["a"]
