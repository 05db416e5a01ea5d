"""trainwatch.slurm against a real Slurm (tests/slurmcluster.py: slurmctld and two
slurmd, n1 and n2, on this host): requeue a running 2-node batch job and start it
at once, the requeues Slurm refuses, drain with a `trainwatch:` reason,
resume_if_ours (ours resumed, an operator's left), listpids, and a slurmctld that
does not answer."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from slurmcluster import TASK, SlurmCluster, poll
from trainwatch.slurm import actions
from trainwatch.slurm.command import Outcome, Result, Slurm
from trainwatch.slurm.parse import ListedPid

# A requeued job's BeginTime is CRED_EXPIRE + 1 s after the requeue: long enough
# that a start well before it can only be trainwatch's `StartTime=now`.
CRED_EXPIRE = 60

@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with SlurmCluster.start(cred_expire=CRED_EXPIRE) as c:
        yield c


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Slurm:
    """The cluster as trainwatch reaches it; a deadline no healthy call comes near."""
    return Slurm(conf=str(cluster.conf), timeout=60)


def submit(cluster: SlurmCluster, sleep: float, *opts: str,
           slow_to_die: bool = False) -> tuple[int, Path]:
    """A 2-node batch job running `srun -N2 -n2` of TASK; its id and the folder its
    tasks write their records to."""
    out = cluster.root / "out" / secrets.token_hex(4)
    out.mkdir(parents=True)
    (out / "task.py").write_text(TASK)
    task = f"{sys.executable} {out / 'task.py'} {out} {sleep}{' slow' if slow_to_die else ''}"
    script = f"#!/bin/sh\nsrun -N2 -n2 {task}\n"
    return cluster.sbatch(script, "-N2", "-n2", *opts), out


def records(cluster: SlurmCluster, job: int, out: Path, restart: int,
            timeout: float = 120) -> list[dict[str, Any]]:
    """The records of both tasks of the job's run number `restart` (0: the first)."""
    def read() -> list[dict[str, Any]] | None:
        found = sorted(out.glob(f"{job}.{restart}.*.json"))
        return [json.loads(p.read_text()) for p in found] if len(found) == 2 else None
    try:
        return poll(read, timeout, f"the task records of run {restart} in {out}")
    except AssertionError as e:
        raise AssertionError(f"{e}; {cluster.describe(job)}") from None


def operator_drain(cluster: SlurmCluster, node: str, reason: str) -> None:
    """Drain `node` as an operator would, with scontrol."""
    cluster.scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
    poll(lambda: "DRAIN" in cluster.node(node)["State"], 60, f"{node} to be drained")


def undrain(cluster: SlurmCluster, node: str) -> None:
    """Put `node` back in service (IDLE) for the next test, whoever drained it."""
    cluster.scontrol("update", f"NodeName={node}", "State=RESUME", check=False)
    # After RESUME the node reads IDLE+NOT_RESPONDING until slurmctld pings it.
    poll(lambda: cluster.node(node)["State"] == "IDLE", 60, f"{node} to be idle again")


@pytest.mark.parametrize("slow_to_die", [False, True], ids=["tasks_end_at_once",
                                                         "tasks_slow_to_die"])
def test_requeue_brings_a_running_two_node_job_back_at_once_with_restart_count_1(
        cluster: SlurmCluster, slurm: Slurm, slow_to_die: bool) -> None:
    """requeue() of a running 2-node batch job kills its tasks and starts it again on
    both nodes at once: well before the BeginTime Slurm sets when it has completed
    (61 s here), same job, new pids, SLURM_RESTART_COUNT=1 in every task,
    restart_count 0 then 1. Tasks that end at once: the start is not sent in the
    requeue's second (Slurm would kill the job). Tasks slow to die: not before the
    job has completed (Slurm would undo the start)."""
    job, out = submit(cluster, 300, slow_to_die=slow_to_die)
    try:
        first = records(cluster, job, out, 0)
        assert actions.restart_count(job, slurm=slurm) == Result(Outcome.OK, value=0)
        if not slow_to_die:  # requeue early in a second: a start sent at once falls in it
            time.sleep(1.02 - time.time() % 1)
        began = time.monotonic()
        r = actions.requeue(job, slurm=slurm)
        assert (r.outcome, r.done, r.value) == (Outcome.OK, ("requeue", "start"), 1), r
        again = records(cluster, job, out, 1, timeout=CRED_EXPIRE / 2)
        assert time.monotonic() - began < CRED_EXPIRE / 2
        assert [x["SLURM_RESTART_COUNT"] for x in again] == ["1", "1"]
        assert {x["SLURM_JOB_ID"] for x in again} == {str(job)}
        assert {x["SLURMD_NODENAME"] for x in again} == {"n1", "n2"}
        assert {x["pid"] for x in again}.isdisjoint(x["pid"] for x in first)
        assert cluster.job(job)["JobState"] == "RUNNING"
        assert actions.restart_count(job, slurm=slurm).value == 1
    finally:
        cluster.cancel(job)


def test_requeue_of_a_no_requeue_job_is_refused_with_slurms_reason(
        cluster: SlurmCluster, slurm: Slurm) -> None:
    """A job submitted with --no-requeue: refused with Slurm's "Requested operation is
    presently disabled", nothing done, and the job runs on, never requeued."""
    job, out = submit(cluster, 300, "--no-requeue")
    try:
        records(cluster, job, out, 0)
        r = actions.requeue(job, slurm=slurm)
        assert r.outcome is Outcome.REFUSED and r.done == (), r
        assert "Requested operation is presently disabled" in r.message
        fields = cluster.job(job)
        assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "0")
    finally:
        cluster.cancel(job)


def test_requeue_of_an_ended_job_is_refused_never_brought_back(
        cluster: SlurmCluster, slurm: Slurm) -> None:
    """A job that has ended is refused, naming its state, and stays ended (Slurm's
    plain `scontrol requeue` would run it again, even one its user cancelled)."""
    job, out = submit(cluster, 0)
    records(cluster, job, out, 0)
    assert cluster.wait_ended(job)["JobState"] == "COMPLETED"
    r = actions.requeue(job, slurm=slurm)
    assert r.outcome is Outcome.REFUSED and r.done == (), r
    assert "it was COMPLETED" in r.message
    time.sleep(1)
    fields = cluster.job(job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "0")


def test_requeue_of_an_srun_job_is_refused_as_not_batch(
        cluster: SlurmCluster, slurm: Slurm) -> None:
    """A job that srun started (no batch script) is refused with Slurm's "Only batch
    jobs are accepted or processed"."""
    name = f"tw-srun-{secrets.token_hex(4)}"
    p = subprocess.Popen(["srun", "-N1", "-n1", f"--job-name={name}", "sleep", "300"],
                         env=cluster.env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    job = 0
    try:
        job = int(poll(lambda: cluster.squeue("-h", "-t", "RUNNING", "-n", name, "-o", "%i")
                       .strip(), 120, f"srun job {name} to run"))
        r = actions.requeue(job, slurm=slurm)
        assert r.outcome is Outcome.REFUSED and r.done == (), r
        assert "Only batch jobs are accepted or processed" in r.message
    finally:
        if job:
            cluster.cancel(job)
        p.kill()
        p.wait()


def test_drain_sets_a_trainwatch_reason(cluster: SlurmCluster, slurm: Slurm) -> None:
    """drain() drains the node with the reason `trainwatch: <why>`, made one line."""
    try:
        r = actions.drain("n2", "Xid 79 on GPU 3\n(fell off the bus)", slurm=slurm)
        assert (r.outcome, r.done) == (Outcome.OK, ("drain",)), r
        poll(lambda: cluster.node("n2")["State"] == "IDLE+DRAIN", 60, "n2 to be drained")
        reason = cluster.node("n2")["Reason"]
        assert reason.startswith("trainwatch: Xid 79 on GPU 3 (fell off the bus) [root@"), reason
    finally:
        undrain(cluster, "n2")


def test_resume_if_ours_resumes_a_trainwatch_drain(cluster: SlurmCluster, slurm: Slurm) -> None:
    """A node trainwatch drained is resumed by resume_if_ours: IDLE, no reason."""
    try:
        assert actions.drain("n2", "ecc", slurm=slurm).done == ("drain",)
        r = actions.resume_if_ours("n2", slurm=slurm)
        assert (r.outcome, r.done) == (Outcome.OK, ("resume",)), r
        assert "trainwatch: ecc" in r.message
        poll(lambda: cluster.node("n2")["State"] == "IDLE", 60, "n2 to be resumed")
        assert not cluster.node("n2").get("Reason")
    finally:
        undrain(cluster, "n2")


def test_resume_if_ours_leaves_an_operators_drain_drained(
        cluster: SlurmCluster, slurm: Slurm) -> None:
    """A drain whose reason is an operator's ("maintenance") is left drained, and the
    result says whose it is."""
    operator_drain(cluster, "n2", "maintenance")
    try:
        r = actions.resume_if_ours("n2", slurm=slurm)
        assert (r.outcome, r.done) == (Outcome.OK, ()), r
        assert "maintenance" in r.message
        time.sleep(1)
        node = cluster.node("n2")
        assert node["State"] == "IDLE+DRAIN"
        assert node["Reason"].startswith("maintenance [root@")
    finally:
        undrain(cluster, "n2")


def test_drain_keeps_an_operators_drain_reason(cluster: SlurmCluster, slurm: Slurm) -> None:
    """drain() of a node an operator drained leaves the operator's reason (replaced,
    resume_if_ours would later undo the operator's drain)."""
    operator_drain(cluster, "n2", "maintenance")
    try:
        r = actions.drain("n2", "Xid 79", slurm=slurm)
        assert (r.outcome, r.done) == (Outcome.OK, ()), r
        assert "maintenance" in r.message
        assert cluster.node("n2")["Reason"].startswith("maintenance [root@")
        assert actions.resume_if_ours("n2", slurm=slurm).done == ()
    finally:
        undrain(cluster, "n2")


def test_listpids_finds_each_tasks_pid_with_its_global_rank(
        cluster: SlurmCluster, slurm: Slurm) -> None:
    """listpids(job, node) lists each node's own srun task: its pid in step 0 with its
    local id 0 and global id (SLURM_PROCID), and not the other node's task."""
    job, out = submit(cluster, 300)
    try:
        for rec in records(cluster, job, out, 0):
            node, pid, rank = rec["SLURMD_NODENAME"], rec["pid"], int(rec["SLURM_PROCID"])
            r = actions.listpids(job, node, slurm=slurm)
            assert r.ok and r.value is not None, r
            assert ListedPid(pid, job, "0", 0, rank) in r.value
            other = actions.listpids(job, "n2" if node == "n1" else "n1", slurm=slurm)
            assert other.value is not None and pid not in [x.pid for x in other.value]
    finally:
        cluster.cancel(job)


def test_listpids_of_a_job_with_nothing_on_the_node_is_empty(slurm: Slurm) -> None:
    """A job with no step on the node (here: no such job) lists no pid: ok, ()."""
    r = actions.listpids(999_999, "n1", slurm=slurm)
    assert (r.outcome, r.value) == (Outcome.OK, ())


def calls(slurm: Slurm) -> dict[str, Callable[[], Result[Any]]]:
    """One call of each action that asks slurmctld."""
    return {"requeue": lambda: actions.requeue(1, slurm=slurm),
            "drain": lambda: actions.drain("n2", "x", slurm=slurm),
            "resume_if_ours": lambda: actions.resume_if_ours("n2", slurm=slurm),
            "restart_count": lambda: actions.restart_count(1, slurm=slurm)}


def test_a_slurm_conf_naming_a_dead_port_gives_failed_within_the_timeout(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """With slurm.conf naming a port nothing listens on, every action gives failed
    within its 1 s deadline (scontrol on its own retries for ~9 s)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={free_port()}",
                           cluster.conf.read_text()))
    for name, call in calls(Slurm(conf=str(conf), timeout=1)).items():
        began = time.monotonic()
        r = call()
        assert r.outcome is Outcome.FAILED and r.done == (), (name, r)
        assert time.monotonic() - began < 6, (name, r)


def test_a_stopped_slurmctld_gives_failed_within_the_timeout_not_a_hang(
        cluster: SlurmCluster) -> None:
    """While slurmctld is stopped (SIGSTOP: it accepts no request and answers none),
    every action gives failed at its 2 s deadline, saying so (scontrol on its own
    waits 10 s)."""
    ctld = cluster.procs["slurmctld"]
    os.kill(ctld.pid, signal.SIGSTOP)
    try:
        for name, call in calls(Slurm(conf=str(cluster.conf), timeout=2)).items():
            began = time.monotonic()
            r = call()
            assert r.outcome is Outcome.FAILED and r.done == (), (name, r)
            assert "no answer within 2s" in r.message, (name, r)
            assert time.monotonic() - began < 8, (name, r)
    finally:
        os.kill(ctld.pid, signal.SIGCONT)
    poll(lambda: cluster.run("scontrol", "ping", check=False).returncode == 0, 60,
         "slurmctld to answer again")
    poll(lambda: all(cluster.node(n)["State"] == "IDLE" for n in ("n1", "n2")), 60,
         "n1 and n2 to be idle (and responding) for the next test")
