"""The real-Slurm harness (tests/slurmcluster.py) works, and the Slurm behaviours
issue 23 builds on hold on Debian's Slurm: a 2-node batch job with one srun task
per node, requeue + StartTime=now with SLURM_RESTART_COUNT, listpids, a refused
requeue of a --no-requeue job, drain with a reason and resume."""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from slurmcluster import TASK, ListedPid, SlurmCluster, poll


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with SlurmCluster.start() as c:
        yield c


def submit(cluster: SlurmCluster, sleep: float, *opts: str) -> tuple[int, Path]:
    """A 2-node batch job whose script runs `srun -N2 -n2` of TASK; its id and the
    folder its tasks write their records to."""
    out = cluster.root / "out" / secrets.token_hex(4)
    out.mkdir(parents=True)
    task = out / "task.py"
    task.write_text(TASK)
    script = f"#!/bin/sh\nsrun -N2 -n2 {sys.executable} {task} {out} {sleep}\n"
    return cluster.sbatch(script, "-N2", "-n2", *opts), out


def records(cluster: SlurmCluster, job: int, out: Path, restart: int, n: int = 2,
            timeout: float = 120) -> list[dict[str, Any]]:
    """The records of the `n` tasks of the job's run number `restart` (0: first run)."""
    def read() -> list[dict[str, Any]] | None:
        found = sorted(out.glob(f"{job}.{restart}.*.json"))
        return [json.loads(p.read_text()) for p in found] if len(found) >= n else None
    try:
        return poll(read, timeout, f"{n} task records of run {restart} in {out}")
    except AssertionError as e:
        raise AssertionError(f"{e}; {cluster.describe(job)}") from None


def test_two_node_sbatch_runs_one_srun_task_on_each_node(cluster: SlurmCluster) -> None:
    """`srun -N2 -n2` in a 2-node batch job runs task 0 and task 1, one on n1 and one
    on n2, with the job's id; SLURM_RESTART_COUNT is unset on a first run."""
    job, out = submit(cluster, 0)
    recs = records(cluster, job, out, 0)
    assert cluster.wait_ended(job)["JobState"] == "COMPLETED"
    assert sorted((r["SLURM_PROCID"], r["SLURMD_NODENAME"]) for r in recs) \
        in ([("0", "n1"), ("1", "n2")], [("0", "n2"), ("1", "n1")])
    assert {r["SLURM_JOB_ID"] for r in recs} == {str(job)}
    assert [r["SLURM_RESTART_COUNT"] for r in recs] == [None, None]


def test_requeue_then_start_now_runs_again_with_restart_count_1(
        cluster: SlurmCluster) -> None:
    """`scontrol requeue` of a running batch job kills its tasks on both nodes and leaves
    it PENDING (Reason=BeginTime, Restarts=1); `update StartTime=now` runs it again at
    once (if not in the requeue's second: see start_now), same job id, with
    SLURM_RESTART_COUNT=1 in every task."""
    job, out = submit(cluster, 300)
    first = records(cluster, job, out, 0)
    try:
        pending = cluster.requeue(job)
        read_by = time.time()
        assert pending["Restarts"] == "1", pending
        # Held until its begin time (EligibleTime, 6 s on); a loaded machine may first
        # see it PENDING after that, when Slurm's reason is None (a whole-suite run).
        begin = datetime.fromisoformat(pending["EligibleTime"]).timestamp()
        assert pending["Reason"] == "BeginTime" or (
            pending["Reason"] == "None" and begin <= read_by + 1), pending
        started = cluster.start_now(job)
        # cred_expire=5 holds it back 6 s only: on a slow machine it may have started.
        assert started.returncode == 0 or cluster.job(job)["JobState"] == "RUNNING", \
            started.stderr
        again = records(cluster, job, out, 1)
        assert {r["SLURM_JOB_ID"] for r in again} == {str(job)}
        assert {r["SLURMD_NODENAME"] for r in again} == {"n1", "n2"}
        assert [r["SLURM_RESTART_COUNT"] for r in again] == ["1", "1"]
        assert {r["pid"] for r in again}.isdisjoint(r["pid"] for r in first)
    finally:
        cluster.cancel(job)


def test_listpids_on_a_node_lists_the_task_pid(cluster: SlurmCluster) -> None:
    """`scontrol listpids <job> <node>` lists each node's own srun task (step 0, its local
    and global id), and job_of_pid maps a local pid back to its job that way."""
    job, out = submit(cluster, 300)
    try:
        for rec in records(cluster, job, out, 0):
            node, pid, rank = rec["SLURMD_NODENAME"], rec["pid"], rec["SLURM_PROCID"]
            rows = cluster.listpids(job, node)
            assert ListedPid(pid, job, "0", "0", rank) in rows, rows
            other = "n2" if node == "n1" else "n1"
            assert pid not in [r.pid for r in cluster.listpids(job, other)]
            assert cluster.job_of_pid(pid) == ListedPid(pid, job, "0", "0", rank)
    finally:
        cluster.cancel(job)


def test_no_requeue_job_refuses_scontrol_requeue(cluster: SlurmCluster) -> None:
    """A job submitted with --no-requeue: `scontrol requeue` fails with Slurm's
    "Requested operation is presently disabled" and the job keeps running."""
    job, out = submit(cluster, 300, "--no-requeue")
    try:
        records(cluster, job, out, 0)
        r = cluster.scontrol("requeue", str(job), check=False)
        assert r.returncode != 0
        assert "Requested operation is presently disabled" in r.stderr, r.stderr
        assert cluster.job(job)["JobState"] == "RUNNING"
        assert cluster.job(job)["Restarts"] == "0"
    finally:
        cluster.cancel(job)


def test_drain_with_reason_shows_in_sinfo_and_resume_makes_idle(
        cluster: SlurmCluster) -> None:
    """Draining n2 with reason "trainwatch: test" shows the reason in `sinfo -R` and in
    `scontrol show node` (with [root@time]); State=RESUME makes n2 idle again."""
    cluster.scontrol("update", "NodeName=n2", "State=DRAIN", "Reason=trainwatch: test")
    try:
        poll(lambda: cluster.node("n2")["State"] == "IDLE+DRAIN", 60, "n2 to be drained")
        assert cluster.node("n2")["Reason"].startswith("trainwatch: test [root@")
        reasons = cluster.run("sinfo", "-R", "-h", "-o", "%E|%u|%N").stdout.splitlines()
        assert reasons == ["trainwatch: test|root|n2"]
        assert "trainwatch: test" in cluster.run("sinfo", "-R").stdout
    finally:
        cluster.scontrol("update", "NodeName=n2", "State=RESUME")
    poll(lambda: cluster.node("n2")["State"] == "IDLE", 60, "n2 to be idle again")
    assert "Reason" not in cluster.node("n2") or not cluster.node("n2")["Reason"]
    assert cluster.run("sinfo", "-R", "-h").stdout.strip() == ""
