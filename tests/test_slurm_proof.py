"""trainwatch.slurm.proof: a rank's claim (job, step, rank) is believed only when
Slurm and the kernel bear it out. Tables for the pure parts (/proc/<pid>/stat,
the walk up a process's ancestors, the matching of listpids rows, the job's
state and owner, UserId=), SO_PEERCRED over a real unix socket, and the proof
against a real 2-node Slurm (tests/slurmcluster.py): the processes of a running
batch job connect to a socket of the test and send the claim their SLURM_*
environment makes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import UserPython, free_port
from slurmcluster import SlurmCluster, poll
from trainwatch.slurm import actions
from trainwatch.slurm.command import Outcome, Slurm
from trainwatch.slurm.parse import ExitCode, JobInfo, ListedPid, parse_owner
from trainwatch.slurm.proof import (
    CHECKS,
    Claim,
    PeerCred,
    Proven,
    Refusal,
    Stat,
    judge_job,
    lineage,
    match_task,
    parse_stat,
    peer_cred,
    prove,
    read_stat,
)

# --- /proc ---

STAT = "4242 (python3) S 4241 4242 4000 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 1 0 987654 123 45 x"


@pytest.mark.parametrize(("text", "stat"), [
    (STAT, Stat(4242, 4241, 987654)),
    (STAT.replace("(python3)", "(a) S 1 (b )"), Stat(4242, 4241, 987654)),
    (STAT.replace("(python3)", "()"), Stat(4242, 4241, 987654)),
    (STAT.replace(" S ", " R "), Stat(4242, 4241, 987654)),
    (STAT.replace(" S ", " Z "), None),
    (STAT.replace(" S ", " X "), None),
    (STAT.replace(" 987654 ", " -1 "), None),
    (STAT.replace(" 4241 ", " x "), None),
    (STAT.split(" 987654")[0], None),
    ("4242 python3 S 4241", None),
    ("", None),
    ("\x00" * 64, None),
])
def test_a_stat_line_gives_pid_parent_and_start_time_and_none_for_an_ended_process(
        text: str, stat: Stat | None) -> None:
    """/proc/<pid>/stat: pid, ppid (field 4) and start time (field 22), read after
    the last ')' (a comm may hold ') ('); a zombie or a line that is not one: None."""
    assert parse_stat(text) == stat


def test_read_stat_of_live_zombie_and_reaped_processes() -> None:
    """read_stat of this process gives its parent; a child killed but not reaped (a
    zombie) and a reaped child give None."""
    me = read_stat(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.start > 0
    child = subprocess.Popen(["sleep", "300"])
    try:
        assert read_stat(child.pid) is not None
        child.kill()
        poll(lambda: read_stat(child.pid) is None, 30, "the killed child to be a zombie")
        assert Path(f"/proc/{child.pid}").exists()  # not reaped yet
    finally:
        child.kill()
        child.wait()
    assert read_stat(child.pid) is None


def tree(*links: tuple[int, int]) -> dict[int, Stat]:
    """A fake process table: (pid, ppid) pairs, start time pid * 10."""
    return {pid: Stat(pid, ppid, pid * 10) for pid, ppid in links}


@pytest.mark.parametrize(("procs", "pid", "pids"), [
    (tree((30, 20), (20, 10), (10, 1)), 30, [30, 20, 10]),
    (tree((30, 20), (20, 10), (10, 0)), 30, [30, 20, 10]),
    (tree((30, 20), (10, 1)), 30, [30]),  # 20 exited: the walk ends there
    (tree((30, 30)), 30, [30]),
    (tree((30, 20), (20, 30)), 30, [30, 20]),
    (tree(*((p, p - 1) for p in range(2, 200))), 199, list(range(199, 135, -1))),
    (tree((10, 1)), 30, []),
    ({}, 1, []),
])
def test_lineage_walks_up_the_parents_bounded_and_never_to_pid_1(
        procs: dict[int, Stat], pid: int, pids: list[int]) -> None:
    """The process and its ancestors, nearest first; never pid 1; at most 64; a loop
    or an ancestor that is gone ends the walk."""
    assert [s.pid for s in lineage(pid, procs.get)] == pids


# --- listpids rows, job state and owner ---

CLAIM = Claim(7, 0, 1)
TASK = ListedPid(300, 7, "0", 0, 1)  # the srun task of global id 1
WORKER = ListedPid(310, 7, "0", None, None)  # e.g. torchrun's worker under it
BATCH = ListedPid(100, 7, "batch", 0, 0)  # the batch script
CHAIN = tuple(tree((320, 310), (310, 300), (300, 250), (250, 1)).values())  # 250: slurmstepd


@pytest.mark.parametrize(("claim", "chain", "rows", "expect"), [
    (CLAIM, CHAIN[2:], [TASK, WORKER, BATCH], TASK),  # the peer is the task
    (CLAIM, CHAIN[1:], [TASK, WORKER, BATCH], TASK),  # the task's child
    (CLAIM, CHAIN, [TASK, WORKER], TASK),  # a grandchild not listed itself
    (CLAIM, CHAIN, [TASK], TASK),  # nor its parent (proctrack/pgid may miss them)
    (Claim(7, 0, 0), CHAIN[1:], [TASK, WORKER], "rank"),
    (Claim(7, 1, 1), CHAIN[1:], [TASK, WORKER], "step"),
    (CLAIM, CHAIN[1:], [ListedPid(300, 7, "1", 0, 1), ListedPid(310, 7, "1", None, None)],
     "step"),
    (CLAIM, CHAIN[1:], [ListedPid(300, 7, "0", 0, 1), ListedPid(310, 7, "1", None, None)],
     "step"),
    (Claim(7, 0, 0), tree((100, 90)).values(), [BATCH], "step"),  # the batch script
    (Claim(7, 0, 0), tree((110, 100), (100, 90)).values(),  # what it started
     [BATCH, ListedPid(110, 7, "batch", None, None)], "step"),
    (Claim(7, 0, 0), CHAIN[2:], [ListedPid(300, 7, "extern", 0, 0)], "step"),
    (CLAIM, CHAIN[1:], [ListedPid(300, 7, "0+1", 0, 1)], "step"),
    (CLAIM, CHAIN[1:], [BATCH], "process"),
    (CLAIM, CHAIN[1:], [], "process"),
    (CLAIM, CHAIN[1:], [WORKER], "process"),  # in the step, under no task
    (CLAIM, (), [TASK], "process"),
])
def test_the_nearest_listed_task_of_a_numbered_step_proves_step_and_rank(
        claim: Claim, chain: tuple[Stat, ...], rows: list[ListedPid],
        expect: ListedPid | str) -> None:
    """The peer or an ancestor must be listed; the nearest listed one in the claim's
    numbered step (batch, extern, a het step: never), every listed one up to the
    task in that step, and the task's global id the claim's rank; else the refusal
    names the check."""
    got = match_task(claim, tuple(chain), rows)
    if isinstance(expect, ListedPid):
        assert got == expect
    else:
        assert isinstance(got, Refusal) and got.check == expect, got
        assert str(got).startswith(f"{expect}: ")


@pytest.mark.parametrize(("state", "owner", "peer_uid", "check"), [
    ("RUNNING", 1000, 1000, None),
    ("RUNNING", 0, 0, None),
    ("RUNNING", 1000, 0, "owner"),  # root gets no exception
    ("RUNNING", 1000, 1001, "owner"),
    ("PENDING", 1000, 1000, "state"),
    ("COMPLETING", 1000, 1000, "state"),
    ("SUSPENDED", 1000, 1000, "state"),
    ("PENDING", 1000, 1001, "owner"),  # a stranger is not told the state
])
def test_only_a_running_job_of_the_peers_own_uid_may_be_claimed(
        state: str, owner: int, peer_uid: int, check: str | None) -> None:
    """The job must be its owner's uid the peer's, root's included, and RUNNING; a
    stranger's refusal names neither the owner nor the state."""
    got = judge_job(CLAIM, JobInfo(7, state, 0), owner, peer_uid)
    assert (got.check if got else None) == check
    if check == "owner":
        assert got is not None and str(owner) not in got.why and state not in got.why


SHOW_JOB = ("JobId=7 JobName=train UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A "
            "JobState=RUNNING Restarts=0 Command=/tmp/my jobs/t.sh WorkDir=/tmp/my jobs")


@pytest.mark.parametrize(("text", "uid"), [
    (SHOW_JOB, 1000),
    (SHOW_JOB.replace("alice(1000)", "root(0)", 1), 0),
    (SHOW_JOB.replace("alice(1000)", "nobody(4321)", 1), 4321),
    (SHOW_JOB.replace("alice(1000)", "a(1)(1000)", 1), 1000),
    (SHOW_JOB.replace("JobName=train", "JobName=x UserId=root(0)"), None),
    (SHOW_JOB.replace("/tmp/my jobs/t.sh", "/tmp/x UserId=root(0)"), None),
    (SHOW_JOB.replace("JobName=train", "JobName=x UserId=root(0)\nrest"), None),
    (SHOW_JOB.replace("JobName=train", "JobName=UserId=root(0)"), 1000),
    (SHOW_JOB.replace("alice(1000)", "alice", 1), None),
    (SHOW_JOB.replace("alice(1000)", "alice(-1)", 1), None),
    (SHOW_JOB.replace("alice(1000)", "alice(4294967295)", 1), None),
    (SHOW_JOB.replace("UserId=alice(1000) ", ""), None),
    (SHOW_JOB + "\n" + SHOW_JOB, None),
    ("slurm_load_jobs error: Invalid job id specified", None),
])
def test_the_owner_is_the_uid_of_the_one_userid_field(text: str, uid: int | None) -> None:
    """UserId=name(uid): the uid; a UserId= that a job name or path forges (a key
    seen twice), an odd value or no line of the job: nothing."""
    assert parse_owner(text, 7).value == uid


# --- SO_PEERCRED ---


def test_peer_cred_names_the_process_that_connected(tmp_path: Path) -> None:
    """SO_PEERCRED of a socketpair is this process; of a unix socket a child
    connected to, the child's pid and uid."""
    a, b = socket.socketpair()
    with a, b:
        assert peer_cred(a) == PeerCred(os.getpid(), os.getuid(), os.getgid())
    path = str(tmp_path / "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        child = subprocess.Popen([sys.executable, "-c", CONNECT, path])
        try:
            conn, _ = listener.accept()
            with conn:
                assert peer_cred(conn) == PeerCred(child.pid, os.getuid(), os.getgid())
        finally:
            child.kill()
            child.wait()


CONNECT = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(1)"

# --- against a real Slurm ---

# A process of the job: connects to the test's socket, sends the claim its
# environment makes (the batch script claims rank 0 of step 0) and blocks until
# the test closes the connection.
CLAIMER = """\
import json, os, socket, sys
env, role = os.environ, sys.argv[2]
claim = {"role": role, "node": env.get("SLURMD_NODENAME", ""),
         "job": int(env["SLURM_JOB_ID"]), "step": int(env.get("SLURM_STEP_ID", "0")),
         "rank": int(env.get("SLURM_PROCID", "0"))}
if role == "batch":
    claim["step"] = claim["rank"] = 0
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(json.dumps(claim).encode() + b"\\n")
s.recv(1)
"""
# One srun task: three claimers under it, the third dropped to uid 65534.
TASK_SCRIPT = """\
import os, subprocess, sys
folder, python = sys.argv[1], sys.argv[2]
claimer = [python, "-I", os.path.join(folder, "claimer.py"), os.path.join(folder, "s")]
drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
kids = [subprocess.Popen(claimer + ["task"], cwd="/"),
        subprocess.Popen(claimer + ["victim"], cwd="/"),
        subprocess.Popen(drop + claimer + ["nobody"], cwd="/")]
for kid in kids:
    kid.wait()
"""
ROLES = ("task", "victim", "nobody")


@dataclass
class Peer:
    """A connection of the test's socket: who the kernel says connected, and what
    it claimed."""

    role: str
    node: str
    claim: Claim
    cred: PeerCred
    conn: socket.socket


@dataclass
class Job:
    id: int
    folder: Path
    python: str
    listener: socket.socket
    peers: list[Peer]

    def peer(self, role: str, node: str | None = None) -> Peer:
        found = [p for p in self.peers if p.role == role and node in (None, p.node)]
        assert len(found) == 1, (role, node, self.peers)
        return found[0]


def accept(listener: socket.socket, count: int, timeout: float, what: str) -> list[Peer]:
    """`count` connections, each with its SO_PEERCRED and the claim it sent."""
    peers: list[Peer] = []
    deadline = time.monotonic() + timeout
    listener.settimeout(1)
    while len(peers) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(peers)} of {count} claims in {timeout:g}s: {what}")
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(60)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            assert chunk, f"a claimer closed before its claim ({what})"
            data += chunk
        sent = json.loads(data)
        peers.append(Peer(sent["role"], sent["node"],
                          Claim(sent["job"], sent["step"], sent["rank"]), peer_cred(conn), conn))
    return peers


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with SlurmCluster.start() as c:
        yield c


@pytest.fixture(scope="module")
def job(cluster: SlurmCluster, user_python: UserPython) -> Iterator[Job]:
    """A running 2-node batch job, root's: its batch script has become a claimer,
    and `srun -N2 -n2` started a task on each node with its three claimers; all
    seven are connected."""
    folder = Path(tempfile.mkdtemp(prefix="twproof", dir="/tmp"))
    folder.chmod(0o755)  # uid 65534's claimer reads claimer.py and connects to s
    (folder / "claimer.py").write_text(CLAIMER)
    (folder / "task.py").write_text(TASK_SCRIPT)
    py = user_python.python
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "s"))
    (folder / "s").chmod(0o777)
    listener.listen(16)
    job_id = 0
    peers: list[Peer] = []
    try:
        job_id = cluster.sbatch(
            f"#!/bin/sh\nsrun -N2 -n2 {py} -I {folder}/task.py {folder} {py} &\n"
            f"exec {py} -I {folder}/claimer.py {folder}/s batch\n", "-N2", "-n2")
        peers = accept(listener, 1 + 2 * len(ROLES), 120, f"job {job_id}")
        yield Job(job_id, folder, py, listener, peers)
    except AssertionError as e:
        raise AssertionError(f"{e}; {cluster.describe(job_id)}") from None
    finally:
        for p in peers:
            p.conn.close()
        listener.close()
        if job_id:
            cluster.cancel(job_id)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Slurm:
    return Slurm(conf=str(cluster.conf), timeout=60)


def refused(check: str, claim: Claim, peer: Peer | PeerCred, node: str, slurm: Slurm) -> str:
    """prove() is refused by `check`; its message."""
    assert check in CHECKS
    cred = peer.cred if isinstance(peer, Peer) else peer
    r = prove(claim, cred.pid, cred.uid, node, slurm=slurm)
    assert r.outcome is Outcome.REFUSED and r.value is None, r
    assert r.message.startswith(f"{check}: "), r
    return r.message


def test_each_tasks_child_proves_its_true_claim_on_its_own_node_only(
        job: Job, slurm: Slurm) -> None:
    """The claim a task's child makes from its environment is proven on its node: the
    task (its parent) is listed with the claimed global id. On the other node, where
    it is no process of the job, the same claim is refused."""
    ranks = {}
    for node in ("n1", "n2"):
        peer = job.peer("task", node)
        assert peer.claim.job == job.id and peer.claim.step == 0
        stat = read_stat(peer.cred.pid)
        assert stat is not None
        r = prove(peer.claim, peer.cred.pid, peer.cred.uid, node, slurm=slurm)
        assert r.outcome is Outcome.OK, r
        task = read_stat(stat.ppid)
        assert task is not None
        assert r.value == Proven(job.id, 0, peer.claim.rank, node, peer.cred.pid, 0,
                                 stat.ppid, 0, restarts=0, start=stat.start,
                                 task_start=task.start)
        ranks[node] = peer.claim.rank
        other = "n2" if node == "n1" else "n1"
        refused("process", peer.claim, peer, other, slurm)
    assert sorted(ranks.values()) == [0, 1]


def test_the_true_peer_claiming_another_rank_or_step_is_refused(
        job: Job, slurm: Slurm) -> None:
    """A task's child that claims the other task's rank, or another step, is refused
    by the rank or step check."""
    for node in ("n1", "n2"):
        peer = job.peer("task", node)
        c = peer.claim
        assert "the claim says rank" in refused("rank", Claim(c.job, c.step, 1 - c.rank),
                                                peer, node, slurm)
        assert "the claim says step 1" in refused("step", Claim(c.job, 1, c.rank),
                                                  peer, node, slurm)


def test_the_batch_script_claiming_rank_0_of_step_0_is_refused_as_the_batch_step(
        job: Job, cluster: SlurmCluster, slurm: Slurm) -> None:
    """The batch script, listed as `batch 0 0` (global id 0), claiming rank 0 of step
    0 is refused: the batch step is not a task of srun's."""
    peer = job.peer("batch")
    assert peer.claim == Claim(job.id, 0, 0)
    rows = [r for r in cluster.listpids(job.id, peer.node) if r.pid == peer.cred.pid]
    assert [(r.step, r.global_id) for r in rows] == [("batch", "0")]
    assert "the batch step" in refused("step", peer.claim, peer, peer.node, slurm)


def test_a_process_of_another_uid_under_the_task_is_refused(job: Job, slurm: Slurm) -> None:
    """A child of root's task that runs as uid 65534 claims the task's rank: it is a
    process of the job, but not of the job owner's uid."""
    for node in ("n1", "n2"):
        peer = job.peer("nobody", node)
        assert peer.cred.uid == 65534
        assert peer.claim == job.peer("task", node).claim
        assert "is not uid 65534's" in refused(
            "owner", peer.claim, peer, node, slurm)


def forged(job: Job, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Peer]:
    """A claimer the test starts itself (root, as the job's owner), with `env`."""
    child = subprocess.Popen([job.python, "-I", str(job.folder / "claimer.py"),
                              str(job.folder / "s"), "forged"],
                             env={"PATH": os.defpath, **env}, cwd="/")
    [peer] = accept(job.listener, 1, 60, "the forged claimer")
    assert peer.cred.pid == child.pid
    return child, peer


def test_a_process_outside_the_job_with_a_forged_environment_is_refused(
        job: Job, slurm: Slurm) -> None:
    """A process of root's (the job's owner) outside the job, with the SLURM_*
    environment of rank 0's task, claims what that task's child claims: refused,
    neither it nor an ancestor is a process of the job."""
    true = next(p for p in job.peers if p.role == "task" and p.claim.rank == 0)
    child, peer = forged(job, {"SLURM_JOB_ID": str(job.id), "SLURM_STEP_ID": "0",
                               "SLURM_PROCID": "0", "SLURMD_NODENAME": true.node})
    try:
        assert peer.claim == true.claim and peer.cred.uid == true.cred.uid
        refused("process", peer.claim, peer, true.node, slurm)
    finally:
        peer.conn.close()
        child.kill()
        child.wait()


def test_a_peer_that_has_exited_is_refused(job: Job, slurm: Slurm) -> None:
    """A true claim whose process has since exited (killed: a zombie its task has not
    reaped yet, its pid not free) is refused by the peer check."""
    peer = job.peer("victim", "n2")
    assert prove(peer.claim, peer.cred.pid, peer.cred.uid, "n2", slurm=slurm).ok
    os.kill(peer.cred.pid, signal.SIGKILL)
    poll(lambda: read_stat(peer.cred.pid) is None, 60, "the killed claimer to exit")
    assert "has exited" in refused("peer", peer.claim, peer, "n2", slurm)


def test_a_peer_that_exits_while_it_is_checked_is_refused(
        job: Job, cluster: SlurmCluster, slurm: Slurm) -> None:
    """A true claim whose process is killed while prove() runs (by a wrapper of
    scontrol, as `listpids` starts: the pid may be listed still) is refused by the
    second look at the peer, never proven."""
    peer = job.peer("victim", "n1")
    assert prove(peer.claim, peer.cred.pid, peer.cred.uid, "n1", slurm=slurm).ok
    shim = job.folder / "shim"
    shim.mkdir(exist_ok=True)
    real = shutil.which("scontrol")
    assert real
    (shim / "scontrol").write_text(
        f'#!/bin/sh\n[ "$1" = listpids ] && kill -9 {peer.cred.pid}\nexec {real} "$@"\n')
    (shim / "scontrol").chmod(0o755)
    wrapped = Slurm(conf=str(cluster.conf), timeout=60, path=f"{shim}:{slurm.path}")
    r = prove(peer.claim, peer.cred.pid, peer.cred.uid, "n1", slurm=wrapped)
    assert r.outcome is Outcome.REFUSED and r.message.startswith("peer: "), r
    assert "while it was checked" in r.message
    assert read_stat(peer.cred.pid) is None


def test_a_proof_carries_the_restart_count_of_the_run_it_proved(
        job: Job, cluster: SlurmCluster, slurm: Slurm) -> None:
    """A 1-node batch job whose srun task claims rank 0: proven with restarts 0;
    requeued by Slurm and started again, its new task is proven with restarts 1
    (Slurm's Restarts=, the count every node reads)."""
    script = (f"#!/bin/sh\nexec srun -N1 -n1 {job.python} -I {job.folder}/claimer.py "
              f"{job.folder}/s task\n")
    requeued = cluster.sbatch(script, "-N1", "-n1")
    peers: list[Peer] = []
    try:
        for restarts in (0, 1):
            [peer] = accept(job.listener, 1, 120, f"run {restarts} of job {requeued}")
            peers.append(peer)
            assert peer.claim == Claim(requeued, 0, 0)
            r = prove(peer.claim, peer.cred.pid, peer.cred.uid, peer.node, slurm=slurm)
            assert r.outcome is Outcome.OK and r.value is not None, r
            assert (r.value.job, r.value.restarts) == (requeued, restarts)
            if restarts == 0:
                cluster.requeue(requeued)
                cluster.start_now(requeued)
    except AssertionError as e:
        raise AssertionError(f"{e}; {cluster.describe(requeued)}") from None
    finally:
        for p in peers:
            p.conn.close()
        cluster.cancel(requeued)


@pytest.mark.parametrize(("script", "state", "code"), [
    ("exit 3", "FAILED", ExitCode(3, 0)),
    ("kill -9 $$", "FAILED", ExitCode(0, 9)),
    ("exit 0", "COMPLETED", ExitCode(0, 0)),
])
def test_the_job_info_a_proof_reads_gives_slurms_exit_code_of_an_ended_job(
        cluster: SlurmCluster, slurm: Slurm, script: str, state: str, code: ExitCode) -> None:
    """The JobInfo that prove() reads (actions.job_owner) of a batch script that
    exited 3, was killed by signal 9, or exited 0: Slurm's ExitCode as status and
    signal."""
    ended = cluster.sbatch(f"#!/bin/sh\n{script}\n", "-N1", "-n1")
    cluster.wait_ended(ended)
    seen = actions.job_owner(ended, slurm=slurm)
    assert seen.value is not None, seen
    info, owner = seen.value
    assert (info.state, info.exit_code, owner) == (state, code, 0), cluster.describe(ended)


def test_a_claim_on_a_job_that_is_not_running_or_unknown_is_refused(
        job: Job, cluster: SlurmCluster, slurm: Slurm) -> None:
    """A true peer claiming a held (PENDING) job of the same owner is refused by the
    state check; claiming a job Slurm does not know, by the job check."""
    peer = job.peer("task", "n1")
    held = cluster.sbatch("#!/bin/sh\nsleep 300\n", "--hold")
    try:
        assert cluster.job(held)["JobState"] == "PENDING"
        assert "is PENDING, not RUNNING" in refused(
            "state", Claim(held, 0, peer.claim.rank), peer, "n1", slurm)
    finally:
        cluster.cancel(held)
    assert "Invalid job id" in refused("job", Claim(999_999, 0, 0), peer, "n1", slurm)


def test_a_job_whose_name_forges_userid_is_not_proven(
        job: Job, cluster: SlurmCluster, slurm: Slurm) -> None:
    """Root's job named `x UserId=nobody(65534)`: `scontrol show job` prints the
    name before the true UserId=root(0), and uid 65534's peer claiming it is not
    proven: the owner cannot be read (UserId= twice), failed."""
    peer = job.peer("nobody", "n1")
    forged_name = cluster.sbatch("#!/bin/sh\nsleep 300\n", "--hold",
                                 "--job-name=x UserId=nobody(65534)")
    try:
        assert "UserId=nobody(65534) UserId=root(0)" in cluster.scontrol(
            "show", "job", "-o", str(forged_name)).stdout
        r = prove(Claim(forged_name, 0, 0), peer.cred.pid, peer.cred.uid, "n1", slurm=slurm)
        assert r.outcome is Outcome.FAILED and r.message.startswith("job: "), r
        assert "UserId= appears 2 times" in r.message
    finally:
        cluster.cancel(forged_name)


def test_no_answer_from_slurm_is_failed_not_proven(
        job: Job, cluster: SlurmCluster, tmp_path: Path) -> None:
    """With slurm.conf naming a port nothing listens on, a true claim is failed (not
    proven, not refused), within the 1 s deadline."""
    conf = tmp_path / "slurm.conf"
    text = cluster.conf.read_text()
    conf.write_text("\n".join(f"SlurmctldPort={free_port()}" if x.startswith("SlurmctldPort=")
                              else x for x in text.splitlines()) + "\n")
    peer = job.peer("task", "n1")
    began = time.monotonic()
    r = prove(peer.claim, peer.cred.pid, peer.cred.uid, "n1",
              slurm=Slurm(conf=str(conf), timeout=1))
    assert r.outcome is Outcome.FAILED and r.message.startswith("job: "), r
    assert time.monotonic() - began < 6


@pytest.mark.parametrize(("claim", "pid", "uid", "node"), [
    (Claim(0, 0, 0), 1234, 0, "n1"),
    (Claim(7, -1, 0), 1234, 0, "n1"),
    (Claim(7, 0xFFFFFFFB, 0), 1234, 0, "n1"),  # SLURM_BATCH_SCRIPT's step id
    (Claim(7, 0, -1), 1234, 0, "n1"),
    (Claim(7, True, 0), 1234, 0, "n1"),
    (Claim(7, 0, "0"), 1234, 0, "n1"),  # type: ignore[arg-type]
    ((7, 0, 0), 1234, 0, "n1"),
    (Claim(7, 0, 0), 0, 0, "n1"),  # a socket with no peer
    (Claim(7, 0, 0), 1, 0, "n1"),
    (Claim(7, 0, 0), 1234, 0xFFFFFFFF, "n1"),
    (Claim(7, 0, 0), 1234, 0, "n[1-2]"),
])
def test_a_malformed_claim_is_refused_and_nothing_runs(
        claim: Claim, pid: int, uid: int, node: str) -> None:
    """A claim, peer or node that is not one is refused by the claim check before
    anything runs (no scontrol on this PATH: a run would be failed)."""
    r = prove(claim, pid, uid, node, slurm=Slurm(path="/nonexistent"))
    assert r.outcome is Outcome.REFUSED and r.message.startswith("claim: not run: "), r

