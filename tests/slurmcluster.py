"""A real two-node Slurm cluster on this host for the tests (issue 23): munged,
slurmctld and two slurmd named n1 and n2, all on 127.0.0.1, each daemon on a port
of its own, every one a child process of the test (never systemd), in a fresh
temp folder with its own munge key, slurm.conf, state, spool and logs.

    with SlurmCluster.start() as cluster:
        job = cluster.sbatch(script)
        cluster.wait_state(job, "RUNNING")

`cluster.env` is what a Slurm client needs (SLURM_CONF, and a mark that the close
uses to find and kill whatever the cluster's jobs left). Tested on Debian 12's
Slurm 22.05 as root; `need_slurm()` skips, or fails under CI=true, without it.
The folder (with the logs) stays when the start fails, or with TWTEST_SLURM_KEEP=1."""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from conftest import free_port, missing, need_root, stop

NODES = ("n1", "n2")
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd",
            "sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
PACKAGES = "slurmctld slurmd slurm-client munge"
# Set in the environment of the daemons and of every client call: slurmstepd
# inherits it from slurmd, a job's tasks from sbatch. close() kills what has it.
MARK = "TWTEST_SLURMCLUSTER"
START_TIMEOUT = 120.0
KEEP = "TWTEST_SLURM_KEEP"  # =1: leave the folder (logs, state) after close
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL",
         "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE", "SPECIAL_EXIT")

T = TypeVar("T")


def need_slurm() -> None:
    """Skip (fail under CI=true) without root or without Debian's Slurm and munge."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        missing(f"{', '.join(absent)} not installed (Debian packages {PACKAGES}; "
                ".ci/run installs them)")
    need_root("slurmctld and slurmd run as root (SlurmUser=root)")


def poll(cond: Callable[[], T | None], timeout: float, what: str, every: float = 0.25) -> T:
    """cond() until it is truthy; AssertionError naming `what` after `timeout` seconds.
    Slower than conftest.wait_for: each try here runs a Slurm client."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def parse_fields(line: str) -> dict[str, str]:
    """`scontrol show -o` output, Key=Value pairs (values may hold spaces)."""
    keys = list(re.finditer(r"(?:^| )([A-Za-z][\w/:.]*)=", line))
    out: dict[str, str] = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


# One srun task for the tests: what Slurm told it, written to
# <folder>/<job>.<restart>.<procid>.json, then a sleep (so the job can be requeued
# or listed). argv: folder, seconds[, "slow"]: with "slow" its first run ignores
# SIGTERM, as a training process busy on its GPU may: Slurm kills it after
# KillWait, and a requeued job stays COMPLETING for seconds.
TASK = """\
import json, os, signal, sys, time
if len(sys.argv) > 3 and not os.environ.get("SLURM_RESTART_COUNT"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
keys = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURMD_NODENAME", "SLURM_RESTART_COUNT")
rec = {k: os.environ.get(k) for k in keys}
rec["pid"] = os.getpid()
name = "%s.%s.%s.json" % (rec["SLURM_JOB_ID"], rec["SLURM_RESTART_COUNT"] or 0,
                          rec["SLURM_PROCID"])
path = os.path.join(sys.argv[1], name)
with open(path + ".tmp", "w") as f:
    json.dump(rec, f)
os.replace(path + ".tmp", path)
time.sleep(float(sys.argv[2]))
"""

@dataclass(frozen=True)
class ListedPid:
    """One row of `scontrol listpids`: a process slurmd's stepd tracks for a job."""

    pid: int
    job: int
    step: str  # "0", "batch", "extern", ...
    local_id: str  # "-" for the batch script
    global_id: str


def conf_text(root: Path, host: str, ctld_port: int, node_ports: dict[str, int],
              munge_socket: Path, cred_expire: int = 5) -> str:
    """The slurm.conf of a test cluster in `root`. A requeued job's BeginTime is
    `cred_expire` + 1 seconds after the requeue (minimum 5)."""
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs=2 State=UNKNOWN"
                      for n, p in node_ports.items())
    return f"""\
ClusterName=twtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=2
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=test Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    start_seconds: float = 0.0  # from the first daemon to both nodes idle
    _requeued: dict[int, float] = field(default_factory=dict)  # job: wall time of requeue

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client (and so of a job) on this cluster."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_"))}
        env.update(SLURM_CONF=str(self.conf), **{MARK: str(self.root)})
        return env

    def log(self, name: str) -> Path:
        """A daemon's log: "slurmctld", "slurmd.n1", "munged"."""
        return self.root / "log" / f"{name}.log"

    # --- start and stop ---

    @classmethod
    @contextlib.contextmanager
    def start(cls, timeout: float = START_TIMEOUT,
              cred_expire: int = 5) -> Iterator[SlurmCluster]:
        """A started cluster (both nodes idle); everything stopped on exit."""
        need_slurm()
        cluster = cls(Path(tempfile.mkdtemp(prefix="twslurm", dir="/tmp")))
        keep = os.environ.get(KEEP) == "1"
        try:
            try:
                cluster._start(timeout, cred_expire)
            except BaseException:
                keep = True  # the error names its logs
                raise
            yield cluster
        finally:
            cluster.close(keep=keep)

    def _start(self, timeout: float, cred_expire: int) -> None:
        for d in ("etc", "state", "run", "log", "munge", "jobs",
                  *(f"spool/{n}" for n in NODES)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        sock = self.root / "munge" / "munge.sock"
        host = socket.gethostname().split(".")[0]
        ports = {n: free_port() for n in NODES}
        self.conf.write_text(conf_text(self.root, host, free_port(), ports, sock, cred_expire))
        began = time.monotonic()
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={sock}",
                               f"--key-file={key}", f"--pid-file={self.root}/run/munged.pid",
                               f"--log-file={self.log('munged')}",
                               f"--seed-file={self.root}/munge/seed"])
        self._await(lambda: sock.exists(), timeout, "munged's socket", "munged")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._await(lambda: self.run("scontrol", "ping", check=False).returncode == 0,
                    timeout, "slurmctld to answer `scontrol ping`", "slurmctld")
        for n in NODES:
            self._spawn(f"slurmd.{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._await(self._all_idle, timeout, "sinfo to show n1 and n2 idle",
                    "slurmctld", *(f"slurmd.{n}" for n in NODES))
        self.start_seconds = time.monotonic() - began

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.root / "log" / f"{name}.out").open("wb")
        with out:
            self.procs[name] = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def _await(self, cond: Callable[[], Any], timeout: float, what: str, *logs: str) -> None:
        """Wait for cond(); a daemon that died or the timeout raises with the logs named."""
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [f"{n} exited {p.returncode}" for n, p in self.procs.items()
                    if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = ", ".join(dead) or f"timed out after {timeout:g}s"
                raise RuntimeError(f"test Slurm cluster: {why} waiting for {what}; see "
                                   + "; ".join(self._log_tail(n) for n in logs))
            time.sleep(0.25)

    def _log_tail(self, name: str) -> str:
        parts = []
        for path in (self.log(name), self.root / "log" / f"{name}.out"):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-8:]
                parts.append(f"{path}:\n  " + "\n  ".join(tail))
        return "\n".join(parts) or f"{self.log(name)} (empty)"

    def _all_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def close(self, keep: bool = False) -> None:
        """Cancel every job, stop the daemons, kill what the jobs left, and remove the
        folder unless `keep`."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, AssertionError):
                self.run("scancel", "--full", f"--user={os.geteuid()}", check=False)
                poll(lambda: not self.run("squeue", "-h", check=False).stdout.strip(),
                     30, "the cancelled jobs to end")
        for name in [*(f"slurmd.{n}" for n in NODES), "slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None:
                continue
            stop(p, timeout=15)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for _ in range(20):
            if not self.kill_marked():
                break
            time.sleep(0.1)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def kill_marked(self) -> int:
        """SIGKILL every process whose environment has this cluster's mark; how many."""
        mark = f"{MARK}={self.root}".encode()
        killed = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)
                    killed += 1
        return killed

    # --- clients ---

    def run(self, *argv: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm client command on this cluster; check=True raises with its output."""
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                           timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: "
                                 f"{r.stdout.strip()} {r.stderr.strip()}")
        return r

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", *args, check=check)

    def squeue(self, *args: str) -> str:
        return self.run("squeue", *args).stdout

    def sbatch(self, script: str, *opts: str) -> int:
        """Submit `script` (its text) with sbatch `opts`; the job id. Output goes to
        jobs/<id>.out under the cluster's folder, the work dir is jobs/."""
        path = self.root / "jobs" / f"script{secrets.token_hex(4)}.sh"
        path.write_text(script)
        path.chmod(0o755)
        jobs = self.root / "jobs"
        r = self.run("sbatch", "--parsable", f"--chdir={jobs}",
                     f"--output={jobs}/%j.out", *opts, str(path))
        return int(r.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict ({} once Slurm has forgotten the job)."""
        r = self.scontrol("show", "job", "-o", str(job), check=False)
        return parse_fields(r.stdout.strip()) if r.returncode == 0 else {}

    def wait_state(self, job: int, *states: str, timeout: float = 120) -> dict[str, str]:
        """Wait until the job's JobState is one of `states`; its fields then."""
        def now() -> dict[str, str] | None:
            fields = self.job(job)
            return fields if fields.get("JobState") in states else None
        return poll(now, timeout, f"job {job} to be {'/'.join(states)}")

    def node(self, name: str) -> dict[str, str]:
        """`scontrol show node -o` as a dict."""
        return parse_fields(self.scontrol("show", "node", "-o", name).stdout.strip())

    def listpids(self, job: int, node: str) -> list[ListedPid]:
        """`scontrol listpids <job> <node>`: the processes node's slurmstepds track for job.
        It asks the stepds through the sockets in that node's spool dir (this host only);
        a job with no step on the node gives [] (scontrol: "does not exist on node")."""
        out = self.scontrol("listpids", str(job), node, check=False).stdout
        rows = []
        for line in out.splitlines()[1:]:  # header: PID JOBID STEPID LOCALID GLOBALID
            cols = line.split()
            if len(cols) == 5 and cols[0].isdigit():
                rows.append(ListedPid(int(cols[0]), int(cols[1]), cols[2], cols[3], cols[4]))
        return rows

    def requeue(self, job: int) -> dict[str, str]:
        """`scontrol requeue` a running batch job; its fields once PENDING again."""
        self.scontrol("requeue", str(job))
        self._requeued[job] = time.time()
        return self.wait_state(job, "PENDING")

    def start_now(self, job: int) -> subprocess.CompletedProcess[str]:
        """`scontrol update JobId=<job> StartTime=now` after requeue(), but never in the
        second of the requeue: slurmd refuses a credential made in the second it
        revoked the old one (`cred->ctime <= revoked`, in seconds), and slurmctld then
        ends the job FAILED ("Killing non-startable batch JobId=N: Job credential
        revoked"). Returns scontrol's result (it fails once the job runs again)."""
        wait = math.floor(self._requeued.get(job, 0)) + 1.05 - time.time()
        if wait > 0:
            time.sleep(wait)
        return self.scontrol("update", f"JobId={job}", "StartTime=now", check=False)

    def describe(self, job: int) -> str:
        """A job's state and slurmctld's log lines about it, for a failure message."""
        f = self.job(job)
        lines = [x for x in self._read(self.log("slurmctld")).splitlines()
                 if re.search(rf"JobId={job}\b", x)]
        return (f"job {job}: JobState={f.get('JobState')} Reason={f.get('Reason')} "
                f"ExitCode={f.get('ExitCode')} Restarts={f.get('Restarts')}; "
                f"{self.log('slurmctld')}:\n  " + "\n  ".join(lines[-12:]))

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ended(self, job: int, timeout: float = 120) -> dict[str, str]:
        """Wait until the job has ended (JobState shows COMPLETING until its nodes are free)."""
        return self.wait_state(job, *ENDED, timeout=timeout)

    def cancel(self, job: int, timeout: float = 120) -> None:
        """scancel the job and wait until it no longer holds a node."""
        self.run("scancel", str(job), check=False)
        self.wait_ended(job, timeout)

    def job_of_pid(self, pid: int) -> ListedPid | None:
        """Which job (and step, task) slurmd tracks `pid` for: `listpids` of every job
        that runs now, on every node. Unlike a task's SLURM_JOB_ID, not a claim the
        process makes about itself."""
        jobs = self.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
        for job in jobs:
            for node in NODES:
                for row in self.listpids(int(job), node):
                    if row.pid == pid:
                        return row
        return None
