"""The client side of attaching a Slurm step's rank to its node's daemon
(trainwatch.slurmattach, client.connect() in a Slurm step, ``trainwatch
attach -- CMD``), without Slurm: the daemon is the real ControlSocket on a
real AF_UNIX socket at ``<run_dir>/control.sock``, served from a thread as
the daemon serves it, whose ``attach`` op answers from a script (pending,
failed, refused, proven) and records each request with the sender's pid as
the kernel gave it (SCM_CREDENTIALS). Ranks are this test process or real
child processes."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ServedControl, need_root
from trainwatch import slurmattach
from trainwatch.host import control
from trainwatch.privsep.access import Peer, Refused

NOBODY = 65534
JOB, STEP, RANK = 4242, 0, 3
SLURM = {"SLURM_JOB_ID": str(JOB), "SLURM_STEP_ID": str(STEP), "SLURM_PROCID": str(RANK)}
OURS = ("TRAINWATCH_SOCKET", "TRAINWATCH_RING_DIR", "TRAINWATCH_ATTEMPT",
        "TRAINWATCH_RESUME_FROM", "TRAINWATCH_JOB", "TRAINWATCH_ATTACH",
        "TRAINWATCH_RUN_DIR", "TRAINWATCH_ATTACH_TIMEOUT", "RANK", "SLURMD_NODENAME",
        *SLURM)
LONG = 60.0  # an attach deadline no test should reach on a busy machine
RUN_FOR = 120  # seconds a child process may take on a busy machine

PENDING = {"pending": True, "retry": 0.05}
FAILED = {"proven": False, "pending": False, "error": "attach: job: scontrol timed out",
          "retry": 0.05}


def proven(socket_path: str, ring_dir: str | None = None,
           resume_from: str | None = "/ckpt/step_100") -> dict[str, Any]:
    return {"proven": True, "pending": False, "job": JOB, "step": STEP, "rank": RANK,
            "node": "n1", "name": f"slurm-{JOB}", "socket": socket_path, "ring_dir": ring_dir,
            "attempt": 2, "resume_from": resume_from, "resumed_step": 100}


class Daemon(ServedControl):
    """The daemon's control socket with a scripted ``attach``: each request takes
    the next answer (the last one repeats); a Refused is raised as the daemon's
    refusal is. ``seen``: (args, sender pid) of each attach request."""

    def __init__(self, run_dir: str, *script: dict[str, Any] | Refused) -> None:
        self.script = list(script)
        self.seen: list[tuple[dict[str, Any], int]] = []
        self._lock = threading.Lock()
        super().__init__(control.ControlSocket(run_dir, self._handle))

    def _handle(self, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if op != "attach":
            raise ValueError(f"unknown op {op}")
        with self._lock:
            self.seen.append((args, peer.pid))
            answer = self.script[0] if len(self.script) == 1 else self.script.pop(0)
        if isinstance(answer, Refused):
            raise answer
        return dict(answer)

    def requests(self) -> int:
        with self._lock:
            return len(self.seen)


@pytest.fixture
def root() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="twa", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def env() -> Iterator[None]:
    """This process's environment as a Slurm task's (SLURM_*; none of ours), restored after."""
    saved = dict(os.environ)
    for k in OURS:
        os.environ.pop(k, None)
    os.environ.update(SLURM)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        d.stop()


def serve(made: list[Daemon], run_dir: Path, *script: dict[str, Any] | Refused) -> Daemon:
    d = Daemon(str(run_dir), *script)
    made.append(d)
    return d


def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: a Slurm task's, none of ours, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if k not in OURS}
    return {**base, **SLURM, **extra}


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x]
    assert len(lines) == 1, lines
    assert lines[0].startswith("trainwatch: attach: "), lines[0]
    return lines[0]


def test_pending_twice_then_proven_sets_the_environment(
        root: Path, env: None, daemons: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    """Pending twice, then proven: three requests with the same claim from this pid; the
    reply is returned and its fields are in os.environ (RANK from SLURM_PROCID; a null
    ring_dir leaves none, even an inherited one)."""
    d = serve(daemons, root, PENDING, PENDING, proven("/run/x/hb.sock"))
    os.environ["TRAINWATCH_RING_DIR"] = "/stale/ring"
    reply = slurmattach.attach(str(root), timeout=LONG, checkpoints_dir="ckpt", argv0="train.py")
    assert reply is not None and reply["proven"] is True and reply["name"] == f"slurm-{JOB}"
    want = {"job": JOB, "step": STEP, "rank": RANK,
            "checkpoints_dir": os.path.abspath("ckpt"), "argv0": "train.py"}
    assert d.seen == [(want, os.getpid())] * 3
    assert os.environ["TRAINWATCH_SOCKET"] == "/run/x/hb.sock"
    assert os.environ["TRAINWATCH_JOB"] == f"slurm-{JOB}"
    assert os.environ["TRAINWATCH_ATTEMPT"] == "2"
    assert os.environ["TRAINWATCH_RESUME_FROM"] == "/ckpt/step_100"
    assert "TRAINWATCH_RING_DIR" not in os.environ
    assert os.environ["RANK"] == str(RANK)
    assert capsys.readouterr().err == ""


def test_failed_then_proven_keeps_rank_and_sets_ring(
        root: Path, env: None, daemons: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    """Slurm gave no answer once (failed: ask again after retry), then proven; a RANK
    already set is kept; ring_dir is set; a null resume_from leaves none."""
    d = serve(daemons, root, FAILED, proven("/s.sock", ring_dir="/r", resume_from=None))
    os.environ["RANK"] = "11"
    os.environ["TRAINWATCH_RESUME_FROM"] = "/inherited/ckpt"
    assert slurmattach.attach(str(root), timeout=LONG) is not None
    assert d.requests() == 2
    assert d.seen[0][0] == {"job": JOB, "step": STEP, "rank": RANK}
    assert (os.environ["RANK"], os.environ["TRAINWATCH_RING_DIR"]) == ("11", "/r")
    assert "TRAINWATCH_RESUME_FROM" not in os.environ
    assert capsys.readouterr().err == ""


def test_refusal_gives_up_at_once_with_one_line(
        root: Path, env: None, daemons: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    """A refusal: one request, None well before the deadline, one stderr line with the
    daemon's reason, and nothing of ours in the environment."""
    d = serve(daemons, root, Refused("rank: pid 1 is task 0, not rank 3"))
    start = time.monotonic()
    assert slurmattach.attach(str(root), timeout=LONG) is None
    assert time.monotonic() - start < LONG / 2
    assert d.requests() == 1
    line = one_line(capsys.readouterr().err)
    assert "refused" in line and "rank: pid 1 is task 0, not rank 3" in line
    assert "TRAINWATCH_SOCKET" not in os.environ and "RANK" not in os.environ


def test_no_daemon_returns_none_within_the_timeout(
        root: Path, env: None, capsys: pytest.CaptureFixture[str]) -> None:
    """No control socket: None at once; a socket file nothing listens on (a daemon
    stopped or restarting): asked again until the deadline, then None; one line each."""
    start = time.monotonic()
    assert slurmattach.attach(str(root), timeout=LONG) is None
    assert time.monotonic() - start < LONG / 2
    assert "does not exist" in one_line(capsys.readouterr().err)

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(control.control_path(str(root)))  # the file stays after close
    start = time.monotonic()
    assert slurmattach.attach(str(root), timeout=2) is None
    took = time.monotonic() - start
    assert 1.5 < took < 2 + 20, took  # its deadline, then at once (a loose upper bound)
    line = one_line(capsys.readouterr().err)
    assert "within 2s" in line and "nothing is listening" in line
    assert "TRAINWATCH_SOCKET" not in os.environ


def test_reply_from_another_uid_is_not_believed(
        root: Path, env: None, daemons: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    """The socket file is owned by uid 65534 but its replies come from root: the reply's
    sender (SCM_CREDENTIALS) is not the owner, so no reply is believed: None at the deadline."""
    need_root("chown the control socket to another uid")
    d = serve(daemons, root, proven("/forged.sock"))
    os.chown(control.control_path(str(root)), NOBODY, NOBODY)
    assert slurmattach.attach(str(root), timeout=3) is None
    assert d.requests() >= 1  # it was asked, and answered
    assert "no reply" in one_line(capsys.readouterr().err)
    assert "TRAINWATCH_SOCKET" not in os.environ


def test_node_in_run_dir_picks_this_nodes_daemon(
        root: Path, env: None, daemons: list[Daemon]) -> None:
    """TRAINWATCH_RUN_DIR with {node}: two "nodes" on one machine, each with its own
    daemon; the rank asks only SLURMD_NODENAME's."""
    n1 = serve(daemons, root / "n1", proven("/n1.sock"))
    n2 = serve(daemons, root / "n2", proven("/n2.sock"))
    os.environ.update(TRAINWATCH_RUN_DIR=str(root / "{node}"), SLURMD_NODENAME="n2",
                      TRAINWATCH_ATTACH_TIMEOUT=str(LONG))
    assert slurmattach.attach() is not None
    assert (n1.requests(), n2.requests()) == (0, 1)
    assert os.environ["TRAINWATCH_SOCKET"] == "/n2.sock"


def test_bad_input_never_raises(
        root: Path, env: None, daemons: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    """Not a Slurm step (a variable unset or not a number): None, silently, nothing sent.
    A bad timeout, a {node} without SLURMD_NODENAME, a malformed proof: one line, None."""
    d = serve(daemons, root, {"proven": True, "pending": False, "socket": 7})
    for name, value in (("SLURM_PROCID", None), ("SLURM_STEP_ID", "x"), ("SLURM_JOB_ID", "-1")):
        os.environ.update(SLURM)
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
        assert slurmattach.attach(str(root), timeout=LONG) is None
    assert capsys.readouterr().err == ""
    assert d.requests() == 0
    os.environ.update(SLURM)

    os.environ["TRAINWATCH_ATTACH_TIMEOUT"] = "soon"
    assert slurmattach.attach(str(root)) is None
    assert "TRAINWATCH_ATTACH_TIMEOUT" in one_line(capsys.readouterr().err)
    for bad in (-1.0, float("nan"), "x"):
        assert slurmattach.attach(str(root), timeout=bad) is None  # type: ignore[arg-type]
        assert "timeout" in one_line(capsys.readouterr().err)
    assert slurmattach.attach(str(root / "{node}"), timeout=LONG) is None
    assert "SLURMD_NODENAME" in one_line(capsys.readouterr().err)
    assert slurmattach.attach(str(root), timeout=LONG, checkpoints_dir=5) is None  # type: ignore[arg-type]
    one_line(capsys.readouterr().err)
    assert d.requests() == 0

    assert slurmattach.attach(str(root), timeout=LONG) is None  # the proof lacks a socket
    assert "malformed reply" in one_line(capsys.readouterr().err)
    assert d.requests() == 1
    assert not any(k in os.environ for k in ("TRAINWATCH_SOCKET", "RANK", "TRAINWATCH_JOB"))


def test_agrees_with_the_control_socket() -> None:
    """The few lines slurmattach repeats from control.py (it imports none of it) agree."""
    assert slurmattach.control_path("/r") == control.control_path("/r")
    assert slurmattach.MAX_REQUEST == control.MAX_REQUEST
    assert slurmattach.MAX_REPLY == control.MAX_REPLY


def test_import_pulls_in_nothing_else() -> None:
    """A fresh import of trainwatch.slurmattach loads no other trainwatch module."""
    code = "import sys; from trainwatch import slurmattach; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=RUN_FOR).stdout
    modules = set(ast.literal_eval(out.strip()))
    assert {m for m in modules if m.split(".")[0] == "trainwatch"} == {
        "trainwatch", "trainwatch.slurmattach"}


CONNECT_TWICE = """
import json, os
from trainwatch import client
a = client.connect()
b = client.connect()
a.beat(5)
print(json.dumps({"a": type(a).__name__, "b": type(b).__name__, "rank": a.rank,
                  "attach": os.environ.get("TRAINWATCH_ATTACH")}))
"""


def _connect_twice(root: Path, **extra: str) -> tuple[dict[str, Any], str]:
    p = subprocess.run(
        [sys.executable, "-c", CONNECT_TWICE], capture_output=True, text=True, timeout=RUN_FOR,
        env=child_env(TRAINWATCH_RUN_DIR=str(root), TRAINWATCH_ATTACH_TIMEOUT=str(LONG),
                      **extra))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_connect_attaches_once_per_process(root: Path, daemons: list[Daemon]) -> None:
    """client.connect() twice in a Slurm step: one attach (after a pending), both senders
    on the proven socket, the beat arrives with rank SLURM_PROCID."""
    hb_path = str(root / "hb.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as hb:
        hb.bind(hb_path)
        hb.settimeout(RUN_FOR)
        d = serve(daemons, root, PENDING, proven(hb_path))
        out, err = _connect_twice(root)
        beat = json.loads(hb.recv(4096))
    assert (out["a"], out["b"], out["rank"], out["attach"]) == ("Heartbeat", "Heartbeat", RANK,
                                                                None)
    assert (beat["k"], beat["step"], beat["rank"]) == ("beat", 5, RANK)
    assert d.requests() == 2  # the pending and the proven one: one registration
    assert len({pid for _, pid in d.seen}) == 1
    assert err == ""


def test_connect_after_a_refusal_asks_once_and_beats_nowhere(
        root: Path, daemons: list[Daemon]) -> None:
    """Refused: connect() twice asks once, both are no-op senders, one stderr line, and
    TRAINWATCH_ATTACH=0 keeps its children from asking again; with TRAINWATCH_ATTACH=0
    set, connect() asks nothing."""
    d = serve(daemons, root, Refused("job: not RUNNING"))
    out, err = _connect_twice(root)
    assert (out["a"], out["b"], out["attach"]) == ("NullHeartbeat", "NullHeartbeat", "0")
    assert d.requests() == 1
    assert "not RUNNING" in one_line(err)

    out, err = _connect_twice(root, TRAINWATCH_ATTACH="0")
    assert (out["a"], d.requests(), err) == ("NullHeartbeat", 1, "")


SHOW = "import os; print(os.environ.get('TRAINWATCH_SOCKET'), os.getpid(), " \
       "os.environ.get('TRAINWATCH_ATTACH'), os.environ.get('RANK'))"


def _attach_cli(root: Path, *cmd: str) -> tuple[subprocess.CompletedProcess[str], int]:
    p = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "attach", "--run-dir", str(root),
         "--timeout", str(LONG), *cmd],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    out, err = p.communicate(timeout=RUN_FOR)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), p.pid


def test_cli_attach_execs_with_the_proven_pid(root: Path, daemons: list[Daemon]) -> None:
    """`trainwatch attach -- python ...`: attached, then exec'd: the trainer's pid is the
    one the daemon saw in SCM_CREDENTIALS, and it has TRAINWATCH_SOCKET."""
    d = serve(daemons, root, PENDING, proven("/run/x/hb.sock"))
    p, pid = _attach_cli(root, "--", sys.executable, "-c", SHOW)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["/run/x/hb.sock", str(pid), "None", str(RANK)]
    assert [s for _, s in d.seen] == [pid, pid]
    assert d.seen[0][0]["argv0"] == sys.executable
    assert p.stderr == ""


def test_cli_attach_execs_even_when_refused(root: Path, daemons: list[Daemon]) -> None:
    """Refused: one line, then CMD runs anyway, unwatched (no TRAINWATCH_SOCKET) and with
    TRAINWATCH_ATTACH=0 so that its client does not ask again; its exit code is CMD's."""
    d = serve(daemons, root, Refused("uid: job 4242 belongs to uid 1000"))
    p, pid = _attach_cli(root, "--", sys.executable, "-c", SHOW + "; raise SystemExit(3)")
    assert p.returncode == 3, p.stderr
    assert p.stdout.split() == ["None", str(pid), "0", "None"]
    assert [s for _, s in d.seen] == [pid]
    assert "belongs to uid 1000" in one_line(p.stderr)


def test_cli_attach_without_a_command(root: Path) -> None:
    """No CMD: one clear line and exit 2; a CMD that cannot be run: one line, exit 127."""
    p, _ = _attach_cli(root)
    assert p.returncode == 2
    assert p.stderr.strip() == "trainwatch attach: expected a command after --, got nothing"
    p, _ = _attach_cli(root, "--", str(root / "no-such-trainer"))
    assert p.returncode == 127
    assert p.stderr.splitlines()[-1].endswith("no-such-trainer: No such file or directory")


FORK_WHILE_ATTACHING = """
import os, signal, sys, threading, time
from trainwatch import client
t = threading.Thread(target=client.connect)
t.start()
while not client._attach_tried:  # the thread holds the lock, asking
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    os._exit(0 if type(client.connect()).__name__ == "NullHeartbeat" else 1)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    status = -1
t.join()
print(os.waitstatus_to_exitcode(status) if status >= 0 else "stuck",
      type(client.connect()).__name__)
"""


def test_connect_in_a_child_forked_while_attaching_does_not_wait(
        root: Path, daemons: list[Daemon]) -> None:
    """A process forked while another thread attaches: the child's connect() returns at
    once (a no-op sender; it asks nothing), never stuck on the parent's lock."""
    d = serve(daemons, root, *[PENDING] * 20, proven(str(root / "hb.sock")))
    p = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_ATTACHING, str(RUN_FOR / 2)], capture_output=True,
        text=True, timeout=RUN_FOR,
        env=child_env(TRAINWATCH_RUN_DIR=str(root), TRAINWATCH_ATTACH_TIMEOUT=str(LONG)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "Heartbeat"]
    assert len({pid for _, pid in d.seen}) == 1  # only the parent asked
