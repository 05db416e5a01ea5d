"""``trainwatch demo``: the embedded default.

Supervises the bundled trainer in a temp dir, breaks it on purpose at seeded
steps (a SIGKILL, then a SIGSTOP that silences its heartbeats) with the same
drills ``faultinject`` runs, and prints what trainwatch saw and did. At the
end it proves that training continued from each checkpoint's exact state:
every resume loaded the parameters that were checkpointed, and the final
parameters equal those of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from trainwatch.config import from_mapping
from trainwatch.demo import trainer
from trainwatch.gpuwatch import GpuWatch
from trainwatch.job import JobRunner
from trainwatch.state.ledger import Ledger
from trainwatch.supervisor import Supervisor
from trainwatch.types import JobState

from faultinject import drills

JOB = "demo"
STEPS = 600
CKPT_EVERY = 50
HANG_TIMEOUT = 2.0
XID_GPU = 1


def _config(tmp: Path, seed: int) -> dict[str, Any]:
    return {
        "state_dir": str(tmp / "state"),
        "run_dir": str(tmp / "run"),
        # No HTTP port (a busy 9445 must not fail the demo): the report reads the registry.
        "metrics": {"port": 0},
        "jobs": [
            {
                "name": JOB,
                "command": [sys.executable, "-m", "trainwatch.demo.trainer",
                            "--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"),
                            "--ckpt-every", str(CKPT_EVERY), "--seed", str(seed),
                            "--journal", str(tmp / "journal.jsonl")],
                "checkpoints": {"dir": str(tmp / "ckpt"), "pattern": "step_{step}.npz"},
                "heartbeat": {"timeout": HANG_TIMEOUT},
                "gpus": {"devices": [0, 1, 2, 3], "min": 2},
            }
        ],
        # Four simulated GPUs; their Xids come from the drill (kmsg off: not this host's).
        "gpu": {"backend": "sim", "count": 4, "kmsg": None},
        "policies": {
            "default": {
                "max_restarts": 5,
                "backoff": {"initial": "0.5s", "factor": 2, "max": "4s", "jitter": 0.1},
                "kill_grace": "5s",
            }
        },
    }


class _Drill(threading.Thread):
    """Waits for the job to reach each seeded step, then injects that fault."""

    def __init__(self, state_dir: str, runner: JobRunner, gpus: GpuWatch | None,
                 plan: list[tuple[str, int]]) -> None:
        super().__init__(name="drill", daemon=True)
        self.state_dir = state_dir
        self.runner = runner
        self.gpus = gpus
        self.plan = plan
        self.injected: list[dict[str, Any]] = []
        self.finished = threading.Event()

    def run(self) -> None:
        log = logging.getLogger("trainwatch")
        for i, (kind, step) in enumerate(self.plan):
            r = self.runner
            while not self.finished.is_set():
                # Each fault lands on a fresh attempt once it has reached the step
                # (read in memory for precision; the drill itself goes through
                # the published status, as faultinject does).
                if r.state is JobState.RUNNING and (r.last_step or 0) >= step and r.number >= i:
                    break
                time.sleep(0.005)
            else:
                return
            try:
                at = time.time()
                if kind == "crash":
                    what = f"SIGKILL to {drills.crash(self.state_dir, JOB).what}"
                elif kind == "hang":
                    what = f"SIGSTOP to {drills.hang(self.state_dir, JOB, rank=0).what}"
                else:  # the path the control socket's gpu-xid drill takes
                    assert self.gpus is not None
                    self.gpus.inject_xid(XID_GPU, 79, "GPU has fallen off the bus.")
                    what = f"Xid 79 on simulated GPU {XID_GPU}"
            except drills.DrillError as e:
                log.warning("drill: %s not injected: %s", kind, e)
                continue
            self.injected.append({"kind": kind, "at": at, "step": r.last_step})
            log.info("drill: %s at step %s: %s", kind, r.last_step, what)


def _journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _metrics(registry: CollectorRegistry) -> None:
    """What Prometheus would scrape now: the counters and gauges that tell the story."""
    text = generate_latest(registry).decode()
    wanted = ("trainwatch_job_faults_total", "trainwatch_job_restarts_total",
              "trainwatch_job_steps_lost_total", "trainwatch_job_seconds_lost_total",
              "trainwatch_job_goodput_ratio", "trainwatch_gpu_xid_errors_total",
              "trainwatch_job_detection_seconds_count")
    print("metrics (what /metrics serves, the non-zero series that tell this story):")
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            excluded = smp.name == "trainwatch_gpu_state" and smp.labels.get("state") == "excluded"
            if (smp.name in wanted or excluded) and smp.value:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items()))
                print(f"  {smp.name}{{{labels}}} {smp.value:g}")
    print()


def _report(tmp: Path, seed: int, drill: _Drill, rc: int, elapsed: float, keep: bool,
            registry: CollectorRegistry) -> bool:
    ledger = Ledger(tmp / "state", readonly=True)
    incidents = ledger.incidents(JOB)
    ledger.close()
    events = _journal(tmp / "journal.jsonl")
    ok = rc == 0
    print()
    print(f"trainwatch demo: a {STEPS}-step MLP under supervision, faults at seeded steps "
          f"(seed {seed})")
    print()
    for n, inc in enumerate(incidents, 1):
        inj = drill.injected[n - 1] if n - 1 < len(drill.injected) else None
        ev = inc["evidence"]
        if inc["kind"] == "crash":
            cause = f"crash ({ev.get('signal') or 'exit ' + str(ev.get('exit_code'))})"
        elif inc["kind"] == "gpu_xid":
            cause = f"Xid {ev.get('xid')} on GPU {inc['gpu']} ({ev.get('class')})"
        else:
            cause = f"hang (rank {inc['rank']} silent for {ev.get('no_beat_for_s')} s)"
        print(f"incident {n}: {cause} at step {inc['onset_step']}")
        if inj is not None:
            since = inc["time"] - inj["at"]
            print(f"  detected       {since:.3f} s after the {inj['kind']} was injected")
            if inc["kind"] == "hang":
                print(f"                 {inc['detection_latency_s']:.3f} s past the "
                      f"{HANG_TIMEOUT:g} s heartbeat timeout after the last beat")
        if inc["relaunched_at"] is not None:
            backoff = inc["backoff_s"] or 0.0
            print(f"  relaunched     {inc['time_to_relaunch_s']:.3f} s after detection "
                  f"({backoff:.3f} s of it policy backoff)")
            where = Path(inc["resumed_from"]).name if inc["resumed_from"] else "a fresh start"
            print(f"  resumed from   {where} (step {inc['resumed_step']})")
            if inc["action"] == "restart_exclude_gpu":
                gpus = [e.get("gpus") for e in events
                        if e["event"] == "resume" and e["step"] == inc["resumed_step"]]
                print(f"  relaunched on  GPUs {gpus[-1] if gpus else '?'} "
                      f"(GPU {inc['gpu']} excluded)")
            print(f"  steps lost     {inc['steps_lost']}")
        print()
    ok &= len(incidents) == len(drill.plan)

    done = [e for e in events if e["event"] == "done"]
    attempts = 1 + max((e["attempt"] for e in events), default=0)
    print(f"training: {STEPS} steps done in {attempts} attempts" + (
        f", final loss {done[-1]['loss']:.5f}" if done else " (did not finish)"))
    ok &= bool(done)
    print("proof that training continued from each checkpoint's state:")
    saved = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    for e in events:
        if e["event"] != "resume":
            continue
        cp = saved.get(e["step"])
        same = cp is not None and cp["digest"] == e["digest"]
        ok &= same
        print(f"  attempt {e['attempt']} loaded step {e['step']}: parameters {e['digest']} "
              f"{'==' if same else '!='} checkpointed {cp['digest'] if cp else '?'}")
    _, ref_digest = trainer.reference(seed, STEPS)
    if done:
        same = done[-1]["digest"] == ref_digest
        ok &= same
        print(f"  final parameters {done[-1]['digest']} {'==' if same else '!='} "
              f"an uninterrupted run's {ref_digest}")
    print()
    _metrics(registry)
    print(f"demo {'passed' if ok else 'FAILED'} in {elapsed:.1f} s")
    if keep or not ok:
        print(f"ledger, logs and checkpoints: {tmp} "
              f"(trainwatch incidents --state-dir {tmp / 'state'})")
    return ok


def run_demo(seed: int = 7, keep: bool = False) -> int:
    from trainwatch.cli import IsoFormatter

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(IsoFormatter("%(asctime)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # Short, so that the socket path fits in sun_path.
    tmp = Path(tempfile.mkdtemp(prefix="twdemo-"))
    rng = random.Random(seed)
    plan = [("crash", rng.randint(100, 200)), ("hang", rng.randint(280, 380)),
            ("xid", rng.randint(460, 540))]
    config = from_mapping(_config(tmp, seed), "<demo>")
    start = time.monotonic()
    supervisor = Supervisor(config)
    drill = _Drill(config.state_dir, supervisor.runners[0], supervisor.gpus, plan)
    drill.start()
    try:
        rc = supervisor.run()
    finally:
        drill.finished.set()
        drill.join(timeout=1)
    ok = _report(tmp, seed, drill, rc, time.monotonic() - start, keep,
                 supervisor.exporter.registry)
    if not keep and ok:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1
