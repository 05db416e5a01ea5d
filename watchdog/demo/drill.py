"""``trainwatch demo``: the embedded default.

Supervises the bundled trainer in a temp dir, breaks it on purpose at seeded
steps (a SIGKILL, a SIGSTOP that silences its heartbeats, an Xid, then a
gradient the trainer really scales x100: a loss spike) with the same drills
``faultinject`` runs, and prints what trainwatch saw and did. At the end it
proves that training continued from each checkpoint's exact state: every
resume loaded the parameters that were checkpointed, and the final parameters
equal those of a fault-free run that skips the same window as the rollback
did, bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
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
from trainwatch.host.supervisor import Supervisor
from trainwatch.lifecycle.job import JobRunner
from trainwatch.state.ledger import Ledger
from trainwatch.types import FaultKind, JobState
from trainwatch.watch.gpuwatch import GpuWatch

from faultinject import drills

JOB = "demo"
STEPS = 750
CKPT_EVERY = 50
HANG_TIMEOUT = 2.0
XID_GPU = 1
SPIKE_MARGIN = 10
LOSS_KINDS = {FaultKind.NAN_LOSS.value, FaultKind.LOSS_SPIKE.value,
              FaultKind.GRAD_NORM_OUTLIER.value, FaultKind.DIVERGENCE.value}


_BLAS_ENV = ("OPENBLAS_", "GOTO", "OMP_", "MKL_", "NPY_")


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
                # The fault-free reference is computed here, and a job's environment is
                # a clean one: numpy's BLAS must pick the same kernels in both (a host
                # that sets OPENBLAS_CORETYPE gave other bits from the first step).
                "env": {k: v for k, v in os.environ.items() if k.startswith(_BLAS_ENV)},
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
                "backoff": {"initial": "0.5s", "factor": 2, "max": "2s", "jitter": 0.1},
                "kill_grace": "5s",
                # Resume from a checkpoint at least 10 steps before a loss anomaly's
                # onset (PaLM went back ~100): the one taken just before the spike
                # is quarantined too.
                "rollback": {"before": SPIKE_MARGIN},
            }
        },
    }


class _Drill(threading.Thread):
    """Waits for the job to reach each seeded step, then injects that fault."""

    def __init__(self, state_dir: str, ckpt_dir: Path, runner: JobRunner,
                 gpus: GpuWatch | None, plan: list[tuple[str, int]]) -> None:
        super().__init__(name="drill", daemon=True)
        self.state_dir = state_dir
        self.ckpt_dir = ckpt_dir
        self.runner = runner
        self.gpus = gpus
        self.plan = plan
        self.injected: list[dict[str, Any]] = []
        # At the spike's rollback: the checkpoints quarantined (name -> on disk then).
        self.quarantined: dict[str, bool] = {}
        self.finished = threading.Event()

    def _reached(self, kind: str, step: int, i: int) -> bool:
        r = self.runner
        if r.state is not JobState.RUNNING or r.number < i:
            return False
        if kind == "grad-spike":
            # Right after the checkpoint of ``step``: the trainer's own file says
            # where it is (the steps trainwatch has read lag by up to RING_POLL).
            return (self.ckpt_dir / f"step_{step}.npz").exists()
        return (r.last_step or 0) >= step

    def run(self) -> None:
        log = logging.getLogger("trainwatch")
        for i, (kind, step) in enumerate(self.plan):
            r = self.runner
            while not self.finished.is_set():
                # Each fault lands on a fresh attempt once it has reached the step
                # (read in memory for precision; the drill itself goes through
                # the published status, as faultinject does).
                if self._reached(kind, step, i):
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
                elif kind == "grad-spike":  # the trainer scales its real gradient
                    done = drills.in_trainer(self.state_dir, JOB, kind)
                    what = f"{done.signal} to {done.what}: gradient x100 for 10 steps"
                else:  # the path the control socket's gpu-xid drill takes
                    assert self.gpus is not None
                    self.gpus.inject_xid(XID_GPU, 79, "GPU has fallen off the bus.")
                    what = f"Xid 79 on simulated GPU {XID_GPU}"
            except drills.DrillError as e:
                log.warning("drill: %s not injected: %s", kind, e)
                continue
            self.injected.append({"kind": kind, "at": at, "step": r.last_step})
            log.info("drill: %s at step %s: %s", kind, r.last_step, what)
            if kind == "grad-spike":
                self._note_quarantine(r)

    def _note_quarantine(self, r: JobRunner) -> None:
        """The rollback's fence is up until the next attempt starts (and may write
        checkpoints of the same steps anew): note what it quarantined meanwhile."""
        while not self.finished.is_set():
            fence = r.catalog.fence
            if fence is not None:
                for e in r.catalog.entries():
                    if e.step > fence[0]:
                        self.quarantined[Path(e.path).name] = Path(e.path).exists()
                return
            time.sleep(0.005)


def _journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _skip_window(events: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The skip window the last attempt was given (TRAINWATCH_SKIP_STEPS)."""
    told = [e.get("skip") for e in events if e["event"] in ("start", "resume")]
    last = told[-1] if told else None
    return (int(last[0]), int(last[1])) if last else None


def _loss_lines(inc: dict[str, Any], alerts: list[dict[str, Any]], drill: _Drill,
                events: list[dict[str, Any]]) -> bool:
    """The rollback of a loss anomaly: its alerts, the checkpoint resumed from
    (before the onset), the quarantined ones and the skipped window. Whether
    it was as it must be."""
    mine = [a for a in alerts if a["attempt"] == inc["attempt"] and a["time"] <= inc["time"]]
    if mine:
        said = ", ".join(f"{a['kind']} at step {a['evidence'].get('noticed_step')}" for a in mine)
        print(f"  alerted        {said} (an outlier run: alert only, it may be transient)")
    ev = inc["evidence"]
    run = ev.get("run")
    print(f"  acted          {inc['action']} at step {ev.get('noticed_step')}"
          + (f", after {run} outliers in a row (sustained)" if run else ""))
    resumed = inc["resumed_step"]
    ok = inc["action"] == "rollback" and resumed is not None and resumed < inc["onset_step"]
    where = Path(inc["resumed_from"]).name if inc["resumed_from"] else "a fresh start"
    print(f"  rolled back to {where} (step {resumed}), the newest good checkpoint more "
          f"than {SPIKE_MARGIN} steps before the onset at step {inc['onset_step']}")
    q = ", ".join(f"{name} ({'kept on disk' if there else 'MISSING'})"
                  for name, there in sorted(drill.quarantined.items()))
    ok &= all(drill.quarantined.values())
    print(f"  quarantined    {q or 'none (no checkpoint was taken after the onset)'}; "
          "never resumed from")
    skip = _skip_window(events)
    ok &= skip is not None and skip[0] <= inc["onset_step"] <= skip[1]
    attempt = inc["attempt"] + 1
    print(f"  skipped        steps {skip[0]}-{skip[1]}: attempt {attempt} was given "
          f"TRAINWATCH_SKIP_STEPS={skip[0]}:{skip[1]} and trained on none of their data"
          if skip else "  skipped        nothing: NO skip window reached the job")
    rb = ev.get("rollback")
    said = f"{rb.get('skip')}: {rb.get('skip_why')}" if isinstance(rb, dict) else "not recorded"
    ok &= isinstance(rb, dict) and rb.get("skip") == "exact"
    print(f"  skip           {said}")
    return ok


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
    # A loss anomaly's alerts (a transient spike is only ever an alert) come
    # before the sustained one that is acted on: told as part of its incident.
    alerts = [i for i in incidents if i["action"] == "alert" and i["kind"] in LOSS_KINDS]
    acted = [i for i in incidents if i not in alerts]
    for n, inc in enumerate(acted, 1):
        inj = drill.injected[n - 1] if n - 1 < len(drill.injected) else None
        ev = inc["evidence"]
        if inc["kind"] == "crash":
            cause = f"crash ({ev.get('signal') or 'exit ' + str(ev.get('exit_code'))})"
        elif inc["kind"] == "gpu_xid":
            cause = f"Xid {ev.get('xid')} on GPU {inc['gpu']} ({ev.get('class')})"
        elif inc["kind"] in LOSS_KINDS:
            cause = (f"{inc['kind']} ({ev.get('series')} {ev.get('value'):.4g} at step "
                     f"{ev.get('noticed_step')}, {ev.get('ratio', 0):.3g} x its baseline), "
                     f"onset")
        else:
            cause = f"hang (rank {inc['rank']} silent for {ev.get('no_beat_for_s')} s)"
        print(f"incident {n}: {cause} at step {inc['onset_step']}")
        if inj is not None:
            since = inc["time"] - inj["at"]
            print(f"  detected       {since:.3f} s after the {inj['kind']} was injected")
            if inc["kind"] == "hang":
                print(f"                 {inc['detection_latency_s']:.3f} s past the "
                      f"{HANG_TIMEOUT:g} s heartbeat timeout after the last beat")
        if inc["kind"] in LOSS_KINDS:
            ok &= _loss_lines(inc, alerts, drill, events)
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
    ok &= len(acted) == len(drill.plan)

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
    skip = _skip_window(events)
    _, ref_digest = trainer.reference(seed, STEPS, skip)
    if done:
        same = done[-1]["digest"] == ref_digest
        ok &= same
        skipping = f", skipping steps {skip[0]}-{skip[1]}," if skip else ""
        print(f"  final parameters {done[-1]['digest']} {'==' if same else '!='} "
              f"an uninterrupted, fault-free run's{skipping} {ref_digest}")
    print()
    _metrics(registry)
    print(f"demo {'passed' if ok else 'FAILED'} in {elapsed:.1f} s")
    if keep or not ok:
        print(f"ledger, logs and checkpoints: {tmp} "
              f"(trainwatch incidents --state-dir {tmp / 'state'})")
    return ok


def run_demo(seed: int = 7, keep: bool = False) -> int:
    from trainwatch.export.logformat import IsoFormatter

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(IsoFormatter("%(asctime)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # Short, so that the socket path fits in sun_path.
    tmp = Path(tempfile.mkdtemp(prefix="twdemo-"))
    rng = random.Random(seed)
    # The spike comes right after the checkpoint of step 650, once the
    # detectors have warmed up (100 steps) on the attempt resumed after the Xid.
    plan = [("crash", rng.randint(100, 200)), ("hang", rng.randint(280, 380)),
            ("xid", rng.randint(460, 540)), ("grad-spike", 650)]
    config = from_mapping(_config(tmp, seed), "<demo>")
    start = time.monotonic()
    supervisor = Supervisor(config)
    drill = _Drill(config.state_dir, tmp / "ckpt", supervisor.runners[0], supervisor.gpus,
                   plan)
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
