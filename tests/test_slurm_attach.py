"""Slurm jobs trainwatch did not launch (issue 23, part 1): each rank of a 2-node
`sbatch` + `srun` job attaches to its node's daemon through the client, is
proven (scontrol listpids, the peer's uid) and then watched like a launched
job: its steps, its checkpoints, its end as Slurm judged it. A forged rank is
refused. Two daemons, `--host n1` and `--host n2`, stand for the two nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import wait_for
from slurmcluster import NODES, SlurmCluster

# Beats every 0.05 s with the client (which attaches on its first connect()),
# checkpoints every 10 steps into the shared folder and reports them; ends
# after `steps` steps. Its "weights" are one float updated each step by a
# deterministic rule and kept exactly (float.hex) in each checkpoint; at the
# end rank 0 writes them to <ckpt>/final.
TRAINER = textwrap.dedent("""
    import math, os, sys, time
    from trainwatch import client
    ckpt, steps = sys.argv[1], int(sys.argv[2])
    hb = client.connect()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    start, w = 0, 1.0
    if client.resume_from():
        s, h = open(client.resume_from()).read().split()
        start, w = int(s), float.fromhex(h)
    print(f"rank {rank} attached to {os.environ.get('TRAINWATCH_JOB')} from {start}",
          flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(0.05)
        w -= 0.1 * (w - math.sin(step))
        hb.beat(step, loss=1.0 / step)
        if rank == 0 and step % 10 == 0:
            path = os.path.join(ckpt, f"step_{step}")
            with open(path + ".tmp", "w") as f:
                f.write(f"{step} {w.hex()}")
            os.replace(path + ".tmp", path)
            hb.checkpoint(step, path)
    if rank == 0:
        with open(os.path.join(ckpt, "final"), "w") as f:
            f.write(w.hex())
""")


class Node:
    """One node's trainwatch daemon (`--host <node>`, its own state and run dirs)."""

    def __init__(self, cluster: SlurmCluster, name: str, root: Path,
                 timeout: str = "60s", gpus: int = 0, restarts: int = 5) -> None:
        self.name, self.root = name, root / name
        self.root.mkdir(parents=True)
        cfg = {"state_dir": str(self.root / "state"), "run_dir": str(self.root / "run"),
               "metrics": {"port": 0}, "jobs": [],
               "policies": {"slurm": {"max_restarts": restarts}},
               "gpu": {"backend": "sim", "count": gpus, "kmsg": None, "poll_interval": "0.2s"}
               if gpus else {"backend": "off", "kmsg": None},
               "slurm": {"node": name, "conf": str(cluster.conf), "forget_after": "3s",
                         "job": {
                   "policy": "slurm",
                   "checkpoints": {"pattern": "step_{step}", "quiet_for": "1s"},
                   "heartbeat": {"timeout": timeout}}}}
        self.config, self.env = self.root / "trainwatch.yaml", cluster.env
        self.config.write_text(yaml.safe_dump(cfg))
        self.out = (self.root / "daemon.log").open("ab")
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(self.config),
             "--host", self.name], env=self.env, stdout=self.out, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        """SIGTERM the daemon (its jobs run on), then start a new one."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.output()[-3000:]
        self.proc = self._start()

    def status(self, job: str) -> dict[str, Any]:
        try:
            p = self.root / "state" / "jobs" / job / "status.json"
            return dict(json.loads(p.read_text()))
        except (OSError, ValueError):
            return {}

    def output(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")

    def incidents(self, job: str) -> list[dict[str, Any]]:
        r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "incidents", "--json",
                            "--state-dir", str(self.root / "state")],
                           capture_output=True, text=True, timeout=60, check=False)
        try:
            got = json.loads(r.stdout)
        except ValueError:
            return []
        rows = got.get("incidents", []) if isinstance(got, dict) else got
        return [x for x in rows if x.get("job") == job]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with SlurmCluster.start() as c:
        yield c


@pytest.fixture
def nodes(cluster: SlurmCluster, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[dict[str, Node]]:
    timeout, gpus, *restarts = getattr(request, "param", ("60s", 0))
    ns = {n: Node(cluster, n, tmp_path, timeout, gpus, *restarts) for n in NODES}
    try:
        for n in ns.values():
            wait_for(lambda n=n: (n.root / "run" / "control.sock").exists(), timeout=60,
                     what=f"{n.name}'s daemon to listen")
        yield ns
    finally:
        for n in ns.values():
            n.stop()


def _submit(cluster: SlurmCluster, tmp_path: Path, steps: int,
            *opts: str, srun: str = "") -> tuple[int, Path]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (tmp_path / "train.py").write_text(TRAINER)
    run_dir = str(tmp_path / "{node}" / "run")
    script = (f"#!/bin/sh\nexport TRAINWATCH_RUN_DIR='{run_dir}'\n"
              f"export TRAINWATCH_CHECKPOINT_DIR='{ckpt}'\n"
              f"export PYTHONPATH='{os.pathsep.join(sys.path[1:])}'\n"
              f"srun -N2 -n2 {srun} {sys.executable} {tmp_path / 'train.py'} {ckpt} {steps}\n")
    return cluster.sbatch(script, "-N2", "-n2", *opts), ckpt


def _story(cluster: SlurmCluster, job: int, nodes: dict[str, Node]) -> str:
    out = (cluster.root / "jobs" / f"{job}.out")
    said = out.read_text(errors="replace")[-2000:] if out.exists() else "(no output)"
    return (f"{cluster.describe(job)}\njob output:\n{said}\n" +
            "\n".join(f"{n.name}:\n{n.output()[-3000:]}" for n in nodes.values()))


def _at_step(nodes: dict[str, Node], name: str, step: int) -> None:
    for n in nodes.values():
        wait_for(lambda n=n: (n.status(name).get("step") or 0) >= step, timeout=120,
                 what=f"{name} at step {step} on {n.name}")


def _stop_rank_1(nodes: dict[str, Node], name: str) -> tuple[str, int]:
    """SIGSTOP rank 1 wherever it runs; (its node, its pid)."""
    host, pid = wait_for(lambda: next(((n.name, int(r["1"])) for n in nodes.values()
                                       if "1" in (r := n.status(name).get("ranks") or {})),
                                      None), timeout=60, what="rank 1's pid")
    os.kill(pid, signal.SIGSTOP)
    return host, pid


def test_both_ranks_attach_are_watched_and_end_as_slurm_judged(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """Rank 0 on one node, rank 1 on the other: each node's daemon watches
    slurm-J (steps advancing, attempt 0 = Slurm's restart count), judges the
    reported checkpoints, and once the job has COMPLETED says it exited."""
    job, _ = _submit(cluster, tmp_path, 120)
    name = f"slurm-{job}"
    try:
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") == "running"
                     and (n.status(name).get("step") or 0) >= 5, timeout=90,
                     what=f"{name} running on {n.name}")
        assert {n.status(name)["attempt"] for n in nodes.values()} == {0}
        cluster.wait_ended(job)
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") == "exited", timeout=60,
                     what=f"{name} exited on {n.name}")
            assert n.status(name)["step"] == 120
            # Every step came through the rank's ring: the socket carried its first beat
            # (maybe sent again while unread) and rank 0's 12 checkpoint reports.
            rings = n.status(name)["rings"]
            assert (rings["read"], rings["refused"]) == (1, 0), rings
            assert rings["values"] >= 119, rings
            assert n.status(name)["datagrams"]["received"] <= 12 + 4, n.status(name)
            assert not (n.root / "run" / f"{name}.attempt-0.rings").exists()
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    assert cluster.job(job).get("JobState") == "COMPLETED"
    for n in nodes.values():
        assert "attached (Slurm job" in n.output()
        assert not n.incidents(name), n.incidents(name)
        # Dropped forget_after (3 s) later: a node's daemon does not keep every job.
        wait_for(lambda n=n: f"job {name}: exited 3s ago: forgotten" in n.output(),
                 timeout=60, what=f"{name} forgotten on {n.name}")


def test_a_rank_that_claims_another_jobs_place_is_refused(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """A process outside the job (here: the test itself) claiming to be rank 0
    of a running job gets a refusal, and no runner is made for it."""
    job, _ = _submit(cluster, tmp_path, 400)
    name = f"slurm-{job}"
    try:
        wait_for(lambda: nodes["n1"].status(name).get("state") == "running", timeout=90,
                 what=f"{name} running on n1")
        from trainwatch import slurmattach
        env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
               "SLURMD_NODENAME": "n1"}
        code = ("import os; from trainwatch import slurmattach as s; "
                "print(s.attach(timeout=20))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={**os.environ, **env,
                                            "TRAINWATCH_RUN_DIR": str(nodes["n1"].root / "run")},
                           check=False)
        assert r.stdout.strip() == "None", (r.stdout, r.stderr)
        assert "trainwatch: attach: " in r.stderr, r.stderr
        assert slurmattach.__name__  # the module the trainer's client loads
    finally:
        cluster.cancel(job)


@pytest.mark.parametrize("nodes", [("3s", 0)], indirect=True)
def test_a_stopped_rank_is_requeued_through_slurm_and_both_nodes_resume_from_one_checkpoint(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """Rank 1 stopped (SIGSTOP) on its node: that node's daemon sees the hang,
    requeues the job through Slurm and has it started at once; Slurm ends both
    ranks, the next run (restart 1) attaches on both nodes and resumes from the
    newest checkpoint judged before the hang, the same on both."""
    job, _ = _submit(cluster, tmp_path, 100_000)
    name = f"slurm-{job}"
    try:
        _at_step(nodes, name, 35)
        host, _ = _stop_rank_1(nodes, name)
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") == "running"
                     and n.status(name).get("attempt") == 1, timeout=120,
                     what=f"{name}'s run 1 running on {n.name}")
        assert cluster.job(job).get("Restarts") == "1", cluster.job(job)
        got = {n.name: n.incidents(name) for n in nodes.values()}
        [hang] = got[host]
        assert hang["kind"] == "hang", hang
        assert "requeued (restart 1)" in hang["evidence"]["slurm"], hang
        assert hang["backoff_s"] == 0.0, hang  # the one applied: Slurm starts it at once
        resumed = {n: i[0]["resumed_step"] for n, i in got.items()}
        assert len(set(resumed.values())) == 1 and resumed[host] >= 30, got
        out = (cluster.root / "jobs" / f"{job}.out").read_text()
        assert out.count(f"from {resumed[host]}") == 2, out[-2000:]
    except (AssertionError, ValueError, TypeError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


def test_a_restarted_daemon_takes_its_attached_ranks_back(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """n1's daemon is stopped (SIGTERM) and started again while the job runs: the
    new one proves the rank the old one had joined again (the client does nothing)
    and watches it on: its steps, then its end as Slurm judged it."""
    job, _ = _submit(cluster, tmp_path, 600)
    name = f"slurm-{job}"
    n1 = nodes["n1"]
    try:
        _at_step(nodes, name, 20)
        n1.restart()
        wait_for(lambda: "taken back after a restart of the daemon" in n1.output(),
                 timeout=60, what=f"{name}'s rank taken back on n1")
        at = n1.status(name).get("step") or 0
        wait_for(lambda: (n1.status(name).get("step") or 0) > at, timeout=60,
                 what=f"{name}'s steps on n1 after the restart")
        cluster.wait_ended(job, timeout=240)
        wait_for(lambda: n1.status(name).get("state") == "exited", timeout=60,
                 what=f"{name} exited on n1")
        assert n1.status(name)["step"] == 600, n1.status(name)
        assert cluster.job(job).get("JobState") == "COMPLETED", cluster.job(job)
        assert not n1.incidents(name), n1.incidents(name)
        out = (cluster.root / "jobs" / f"{job}.out").read_text()
        assert out.count("attached to") == 2, out[-2000:]  # one attach per rank, ever
    except (AssertionError, ValueError, TypeError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


@pytest.mark.parametrize("nodes", [("3s", 0)], indirect=True)
def test_a_requeued_job_ends_with_the_weights_of_a_fault_free_run(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """The same trainer run alone, without a fault, and under Slurm with rank 1
    stopped at step 35: requeued, resumed on both nodes from the checkpoint
    trainwatch judged, it completes with the fault-free run's weights, bit for bit."""
    steps = 300
    alone = tmp_path / "alone"
    alone.mkdir()
    (tmp_path / "train.py").write_text(TRAINER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINWATCH_", "SLURM_"))}
    subprocess.run([sys.executable, str(tmp_path / "train.py"), str(alone), str(steps)],
                   env={**env, "PYTHONPATH": os.pathsep.join(sys.path[1:])},
                   check=True, timeout=120, capture_output=True)
    expected = (alone / "final").read_text()
    job, ckpt = _submit(cluster, tmp_path, steps)
    name = f"slurm-{job}"
    try:
        _at_step(nodes, name, 35)
        _stop_rank_1(nodes, name)
        cluster.wait_state(job, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", timeout=240)
        assert cluster.job(job).get("Restarts") == "1", cluster.job(job)
        assert cluster.job(job).get("JobState") == "COMPLETED", cluster.job(job)
        resumed = [i["resumed_step"] for n in nodes.values() for i in n.incidents(name)]
        assert resumed and 0 < resumed[0] < steps, resumed
        assert (ckpt / "final").read_text() == expected
    except (AssertionError, ValueError, TypeError, OSError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


@pytest.mark.parametrize("nodes", [("3s", 0)], indirect=True)
def test_a_job_slurm_will_not_requeue_is_one_loud_incident_and_no_retry(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """`sbatch --no-requeue`: the hang's requeue is refused by Slurm; the incident
    says so, the job is FATAL here (left to Slurm), and nothing is tried again."""
    job, _ = _submit(cluster, tmp_path, 100_000, "--no-requeue")
    name = f"slurm-{job}"
    try:
        _at_step(nodes, name, 5)
        host, pid = _stop_rank_1(nodes, name)
        node = nodes[host]
        wait_for(lambda: node.status(name).get("state") == "fatal", timeout=120,
                 what=f"{name} fatal on {host}")
        [hang] = node.incidents(name)
        assert hang["evidence"]["slurm_outcome"] == "refused", hang
        assert "was not requeued" in node.output()
        assert cluster.job(job).get("Restarts") == "0", cluster.job(job)
        assert node.output().count("requeue of Slurm job") == 1
        os.kill(pid, signal.SIGCONT)
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("nodes", [("60s", 1)], indirect=True)
def test_an_xid_drains_its_node_and_the_node_resumes_only_after_its_pre_flight(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """Xid 79 on n2's (simulated) GPU: n2 is drained with a `trainwatch:` reason
    and the job requeued; with one node left it waits (PENDING) while n2's
    pre-flight fails; once the GPU is cleared the pre-flight passes, trainwatch
    resumes n2 and the job runs again on both nodes."""
    job, _ = _submit(cluster, tmp_path, 100_000)
    name = f"slurm-{job}"
    n2 = nodes["n2"]
    try:
        _at_step(nodes, name, 25)
        p = _cli("faultinject.cli", "gpu-xid", "--gpu", "0", "--xid", "79",
                 "--run-dir", str(n2.root / "run"))
        assert p.returncode == 0, p.stderr
        node = wait_for(lambda: (x := cluster.node("n2")).get("Reason", "").startswith(
            "trainwatch:") and x, timeout=60, what="n2 drained by trainwatch")
        assert "DRAIN" in node["State"] and "79 on GPU 0" in node["Reason"], node
        wait_for(lambda: cluster.job(job).get("Restarts") == "1", timeout=60,
                 what="the job requeued")
        time.sleep(5)  # pre-flights every 2 s meanwhile, each failing on the broken GPU
        assert cluster.job(job)["JobState"] == "PENDING", cluster.job(job)
        assert "DRAIN" in cluster.node("n2")["State"]
        assert "stays drained: pre-flight of GPUs 0" in n2.output()
        clear = _cli("trainwatch.cli", "clear-gpu", "0", "--run-dir", str(n2.root / "run"))
        assert clear.returncode == 0, clear.stderr
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") == "running"
                     and n.status(name).get("attempt") == 1, timeout=120,
                     what=f"{name}'s run 1 running on {n.name}")
        assert "DRAIN" not in cluster.node("n2")["State"], cluster.node("n2")
        [xid] = n2.incidents(name)
        assert xid["kind"] == "gpu_xid" and "n2 drained: trainwatch:" in \
            xid["evidence"]["slurm_drain"], xid
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)
        cluster.scontrol("update", "NodeName=n2", "State=RESUME", check=False)


@pytest.mark.parametrize("nodes", [("60s", 1)], indirect=True)
def test_an_operators_drain_is_never_undone(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """n2 drained by an operator while the job runs, then an Xid there: trainwatch
    leaves the operator's drain as it is (no drain over it), requeues, and after
    the GPU is cleared and passes its pre-flight it still does not resume n2."""
    job, _ = _submit(cluster, tmp_path, 100_000)
    name = f"slurm-{job}"
    n2 = nodes["n2"]
    try:
        _at_step(nodes, name, 25)
        cluster.scontrol("update", "NodeName=n2", "State=DRAIN", "Reason=maintenance")
        p = _cli("faultinject.cli", "gpu-xid", "--gpu", "0", "--xid", "79",
                 "--run-dir", str(n2.root / "run"))
        assert p.returncode == 0, p.stderr
        wait_for(lambda: cluster.job(job).get("Restarts") == "1", timeout=60,
                 what="the job requeued")
        [xid] = wait_for(lambda: [i for i in n2.incidents(name)
                                  if "slurm_drain" in i["evidence"]], timeout=60,
                         what="the drain's outcome in the incident")
        assert "left as it is" in xid["evidence"]["slurm_drain"], xid
        clear = _cli("trainwatch.cli", "clear-gpu", "0", "--run-dir", str(n2.root / "run"))
        assert clear.returncode == 0, clear.stderr
        time.sleep(6)  # pre-flights every 2 s: none resumes a drain that is not ours
        node = cluster.node("n2")
        assert "DRAIN" in node["State"] and node["Reason"].startswith("maintenance"), node
        assert cluster.job(job)["JobState"] == "PENDING", cluster.job(job)
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)
        cluster.scontrol("update", "NodeName=n2", "State=RESUME", check=False)


def test_a_crashed_rank_is_slurms_to_handle_and_recorded_on_both_nodes(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """Rank 1 SIGKILLed under `srun --kill-on-bad-exit=1`: Slurm ends the step and the
    job FAILED; each node records a crash of slurm-J from Slurm's verdict (never a
    clean end), and nothing is requeued (Slurm's own handling)."""
    job, _ = _submit(cluster, tmp_path, 100_000, srun="--kill-on-bad-exit=1")
    name = f"slurm-{job}"
    try:
        _at_step(nodes, name, 10)
        host, pid = _stop_rank_1(nodes, name)
        os.kill(pid, signal.SIGKILL)
        assert cluster.wait_ended(job)["JobState"] == "FAILED", cluster.job(job)
        for n in nodes.values():
            [crash] = wait_for(lambda n=n: n.incidents(name), timeout=60,
                               what=f"the crash's incident on {n.name}")
            assert crash["kind"] == "crash", crash
            assert crash["evidence"]["exit_code"] != 0, crash
            wait_for(lambda n=n: n.status(name).get("state") in ("backoff", "fatal"),
                     timeout=30, what=f"{name} done on {n.name}")
        assert cluster.job(job).get("Restarts") == "0", cluster.job(job)
        assert "requeue of Slurm job" not in nodes[host].output()
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


def test_a_trainer_without_the_client_is_attached_by_trainwatch_attach(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """`srun trainwatch attach -- python plain.py`: each rank is attached before its
    trainer starts (exec: the same pid, so the proof holds for it), watched as
    slurm-J, and ends as Slurm judged (exited)."""
    plain = tmp_path / "plain.py"
    plain.write_text("import os, time\nprint('plain', os.getpid(), flush=True)\n"
                     "time.sleep(6)\n")
    run_dir = str(tmp_path / "{node}" / "run")
    script = (f"#!/bin/sh\nexport TRAINWATCH_RUN_DIR='{run_dir}'\n"
              f"export PYTHONPATH='{os.pathsep.join(sys.path[1:])}'\n"
              f"srun -N2 -n2 {sys.executable} -m trainwatch.cli attach -- "
              f"{sys.executable} {plain}\n")
    job = cluster.sbatch(script, "-N2", "-n2")
    name = f"slurm-{job}"
    try:
        for n in nodes.values():
            st = wait_for(lambda n=n: (s := n.status(name)).get("state") in
                          ("starting", "running") and s, timeout=90,
                          what=f"{name} watched on {n.name}")
            assert st["attempt"] == 0, st
        assert cluster.wait_ended(job)["JobState"] == "COMPLETED"
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") == "exited", timeout=60,
                     what=f"{name} exited on {n.name}")
        out = (cluster.root / "jobs" / f"{job}.out").read_text()
        pids = {int(x.split()[1]) for x in out.splitlines() if x.startswith("plain ")}
        assert pids == {nodes[n].status(name)["pid"] for n in nodes}, (pids, out)
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None


@pytest.mark.parametrize("nodes", [("3s", 0, 1)], indirect=True)
def test_the_restart_budget_is_slurms_restart_count(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """max_restarts 1: the first stopped rank is requeued (Restarts=1); the next,
    in run 1, is not: the budget is spent, the job is FATAL here and left to
    Slurm (still Restarts=1)."""
    job, _ = _submit(cluster, tmp_path, 100_000)
    name = f"slurm-{job}"
    try:
        _at_step(nodes, name, 10)
        _stop_rank_1(nodes, name)
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("attempt") == 1
                     and (n.status(name).get("step") or 0) >= 10, timeout=120,
                     what=f"{name}'s run 1 stepping on {n.name}")
        host, pid = _stop_rank_1(nodes, name)
        node = nodes[host]
        wait_for(lambda: node.status(name).get("state") == "fatal", timeout=60,
                 what=f"{name} fatal on {host}")
        last = node.incidents(name)[-1]
        # This node's own count, or Slurm's where a peer requeued before: both are 1.
        assert "budget spent" in last["decision"] \
            or last["evidence"].get("slurm_outcome") == "budget", last
        assert cluster.job(job).get("Restarts") == "1", cluster.job(job)
        os.kill(pid, signal.SIGCONT)
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)


def test_a_node_whose_rank_tells_no_steps_counts_the_steps_lost_from_the_other_nodes(
        cluster: SlurmCluster, nodes: dict[str, Node], tmp_path: Path) -> None:
    """Rank 0 beats and reports checkpoints; rank 1 runs without the client
    (`trainwatch attach`), so its node knows no step. Rank 0 stopped (SIGSTOP):
    its node requeues the job; both nodes record the same steps lost, counted
    from the step rank 0 reached (rank 1's node recorded none)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "train.py").write_text(TRAINER)
    (tmp_path / "plain.py").write_text("import time\nwhile True:\n    time.sleep(0.5)\n")
    py, run_dir = sys.executable, str(tmp_path / "{node}" / "run")
    (tmp_path / "rank.sh").write_text(
        f"#!/bin/sh\nif [ \"$SLURM_PROCID\" = 1 ]; then exec {py} -m trainwatch.cli attach "
        f"-- {py} {tmp_path / 'plain.py'}; fi\nexec {py} {tmp_path / 'train.py'} {ckpt} 100000\n")
    script = (f"#!/bin/sh\nexport TRAINWATCH_RUN_DIR='{run_dir}'\n"
              f"export TRAINWATCH_CHECKPOINT_DIR='{ckpt}'\n"
              f"export PYTHONPATH='{os.pathsep.join(sys.path[1:])}'\n"
              f"srun -N2 -n2 sh {tmp_path / 'rank.sh'}\n")
    job = cluster.sbatch(script, "-N2", "-n2")
    name = f"slurm-{job}"
    try:
        host, pid = wait_for(lambda: next(((n.name, int(r["0"])) for n in nodes.values()
                                           if (n.status(name).get("step") or 0) >= 35
                                           and "0" in (r := n.status(name).get("ranks") or {})),
                                          None), timeout=120, what="rank 0 past step 35")
        os.kill(pid, signal.SIGSTOP)
        for n in nodes.values():
            wait_for(lambda n=n: n.status(name).get("state") in ("starting", "running")
                     and n.status(name).get("attempt") == 1, timeout=120,
                     what=f"{name}'s run 1 on {n.name}")
        got = {n.name: wait_for(lambda n=n: [i for i in n.incidents(name)
                                             if i.get("resumed_step") is not None] or None,
                                timeout=60, what=f"{n.name}'s incident resumed")
               for n in nodes.values()}
        resumed = {i[0]["resumed_step"] for i in got.values()}
        assert len(resumed) == 1 and resumed.pop() >= 30, got
        lost = {n: i[0]["steps_lost"] for n, i in got.items()}
        hang = got[host][0]
        reached = max(hang["evidence"]["steps"].values())  # as the hang found it stopped
        truth = reached - hang["resumed_step"]  # a beat may have been in flight
        assert all(x is not None and abs(x - truth) <= 2 for x in lost.values()), (truth, lost)
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise AssertionError(f"{e}\n{_story(cluster, job, nodes)}") from None
    finally:
        cluster.cancel(job)
