"""What the exporter says about a real `trainwatch run`, read from real scrapes of
/metrics: the cost of a fault, GPUs it cannot see, Xids, dropped datagrams, and
a port already taken."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from conftest import Workspace, finish, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, frozenset(labels.items())))

    def names(self) -> set[str]:
        return {name for name, _ in self.samples()}


def _run(ws: Workspace, job: dict[str, Any], **top: Any) -> Scrape:
    port = free_port()
    ws.run(ws.config(job, metrics={"address": "127.0.0.1", "port": port}, **top))
    scrape = Scrape(port)
    wait_for(lambda: scrape.get("trainwatch_build_info", version=_version(),
                                python=_python()) == 1, what="the exporter")
    return scrape


def _version() -> str:
    from trainwatch import __version__

    return __version__


def _python() -> str:
    import platform

    return platform.python_version()


def test_a_crash_costs_steps_and_seconds_and_lowers_goodput(ws: Workspace) -> None:
    """Crash at step 15 with a checkpoint at 10: 5 steps lost, some seconds lost,
    goodput below 1, one restart of kind crash, the relaunch observed (the detection
    latency of a crash is unknown, so not observed)."""
    s = _run(ws, {"command": ws.worker("--steps", "100000", "--interval", "0.02",
                                       "--crash-at", "15")})
    wait_for(lambda: s.get("trainwatch_job_seconds_lost_total", job="job"), timeout=30,
             what="the relaunch's first heartbeat")
    assert s.get("trainwatch_job_restarts_total", job="job", kind="crash") == 1
    assert s.get("trainwatch_job_faults_total", job="job", kind="crash") == 1
    assert s.get("trainwatch_job_restarts_total", job="job", kind="hang") == 0
    assert s.get("trainwatch_job_steps_lost_total", job="job") == 5
    # A crash's onset is unknown (the kernel says a process died, not when): its
    # detection latency is not observed rather than recorded as 0.
    assert s.get("trainwatch_job_detection_seconds_count", job="job") == 0
    assert s.get("trainwatch_job_relaunch_seconds_count", job="job") == 1
    assert s.get("trainwatch_job_attempts_total", job="job") == 2
    goodput = s.get("trainwatch_job_goodput_ratio", job="job")
    assert goodput is not None and 0 < goodput < 1
    assert s.get("trainwatch_job_state", job="job", state="running") == 1
    # Resumed from 10; the relaunched attempt may have checkpointed 20 before this scrape.
    last_good = s.get("trainwatch_job_last_good_checkpoint_step", job="job")
    assert last_good is not None and last_good >= 10 and last_good % 10 == 0, last_good
    step = s.get("trainwatch_job_step", job="job")
    assert step is not None and step >= 10
    assert s.get("trainwatch_rank_heartbeat_age_seconds", job="job", rank="0") is not None
    assert s.get("trainwatch_job_loss", job="job") is not None


def test_a_finished_job_shows_exited_and_no_heartbeat_age(ws: Workspace) -> None:
    """Once the job has ended, its ranks' ages are not exported: a finished job
    must not look like a stale heartbeat."""
    port = free_port()
    # The daemon with a second, long job keeps the exporter up after the first ends.
    cfg = ws.config({"command": ws.worker("--steps", "20", "--interval", "0.01")},
                    metrics={"address": "127.0.0.1", "port": port})
    doc = yaml.safe_load(cfg.read_text())
    doc["jobs"].append({"name": "long", "command": [sys.executable, "-c",
                                                    "import time; time.sleep(60)"]})
    cfg.write_text(yaml.safe_dump(doc))
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ws.procs.append(p)
    s2 = Scrape(port)
    wait_for(lambda: s2.get("trainwatch_job_state", job="job", state="exited") == 1,
             timeout=30, what="the job exited")
    assert s2.get("trainwatch_rank_step", job="job", rank="0") == 20
    assert s2.get("trainwatch_rank_heartbeat_age_seconds", job="job", rank="0") is None
    assert s2.get("trainwatch_job_goodput_ratio", job="job") == 1


def test_a_lost_gpu_is_unknown_and_lost_never_healthy(ws: Workspace) -> None:
    """A GPU NVML says is lost: state unknown, lost 1; its neighbour stays healthy."""
    s = _run(ws, {"command": ws.worker("--steps", "100000", "--interval", "0.05")},
             gpu={"backend": "sim", "count": 2, "kmsg": None})
    r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-lost", "--run-dir",
                        str(ws.root / "run"), "--gpu", "1"], capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: s.get("trainwatch_gpu_lost", gpu="1", uuid="GPU-sim-0001") == 1,
             what="GPU 1 lost")
    states = {st: s.get("trainwatch_gpu_state", gpu="1", uuid="GPU-sim-0001", state=st)
              for st in ("healthy", "unknown", "excluded")}
    # Policy's default for gpu_lost excludes the GPU; either way it is not healthy.
    assert states["healthy"] == 0 and states["unknown"] + states["excluded"] == 1, states
    assert s.get("trainwatch_gpu_state", gpu="0", uuid="GPU-sim-0000", state="healthy") == 1
    assert s.get("trainwatch_job_faults_total", job="job", kind="gpu_lost") == 1


def _nvml_loads() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_gpus_trainwatch_cannot_see_are_unknown(ws: Workspace) -> None:
    """No NVML on the host (gpu.backend auto): the job's GPUs are exported as
    unknown, never healthy, and the nvml source as down. On a host where NVML
    works, the same run shows the nvml source up instead."""
    s = _run(ws, {"command": ws.worker("--steps", "100000", "--interval", "0.05"),
                  "gpus": {"devices": [0, 1]}}, gpu={"backend": "auto", "kmsg": None})
    if _nvml_loads():
        wait_for(lambda: s.get("trainwatch_source_up", source="nvml") == 1, what="nvml up")
        return
    wait_for(lambda: s.get("trainwatch_source_up", source="nvml") == 0, what="nvml down")
    for gpu in ("0", "1"):
        assert s.get("trainwatch_gpu_state", gpu=gpu, uuid="", state="unknown") == 1
        assert s.get("trainwatch_gpu_state", gpu=gpu, uuid="", state="healthy") == 0
    assert "trainwatch_gpu_temperature_celsius" not in s.names()


def test_an_xid_counts_once_per_error_by_gpu_xid_and_class(ws: Workspace) -> None:
    """Two drills of one Xid within the dedup window are one error; the same Xid
    in the kernel log is another (a drill never hides a real one)."""
    kmsg = ws.root / "kern.log"
    kmsg.write_text("")
    s = _run(ws, {"command": ws.worker("--steps", "100000", "--interval", "0.05")},
             gpu={"backend": "sim", "count": 2, "kmsg": str(kmsg)})
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--run-dir",
                            str(ws.root / "run"), "--gpu", "0", "--xid", "63"],
                           capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 0, r.stderr
    labels = {"gpu": "0", "uuid": "GPU-sim-0000", "xid": "63", "class": "ignore"}
    wait_for(lambda: s.get("trainwatch_gpu_xid_errors_total", **labels) == 1, what="one Xid")
    r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--kmsg", str(kmsg),
                        "--pci", "0000:10:00", "--xid", "63"], capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: s.get("trainwatch_gpu_xid_errors_total", **labels) == 2,
             what="the kernel log's Xid counted too")
    assert s.get("trainwatch_source_up", source="kmsg") == 1


def test_garbage_datagrams_are_counted_as_dropped(ws: Workspace) -> None:
    """A datagram that is not a heartbeat is dropped and counted by reason."""
    s = _run(ws, {"command": ws.worker("--steps", "100000", "--interval", "0.05")})
    wait_for(lambda: s.get("trainwatch_job_ranks", job="job") == 1, what="a beat")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as c:
        c.sendto(b"not json", str(Path(ws.root / "run" / "jobs" / "job.sock")))
    # From outside the job's tree: foreign; as root (believed): malformed.
    wait_for(lambda: sum(s.get("trainwatch_heartbeat_dropped_total", job="job", reason=r) or 0
                         for r in ("foreign", "malformed")) == 1, what="the datagram counted")
    assert s.get("trainwatch_heartbeat_dropped_total", job="job", reason="oversized") == 0


def test_a_metrics_port_already_taken_is_one_line_and_exit_2(ws: Workspace) -> None:
    """Another process on the port: trainwatch says so in one line and starts nothing."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = ws.run(ws.config({"command": ws.worker("--steps", "5")},
                             metrics={"address": "127.0.0.1", "port": port}))
        rc, out = finish(p)
    assert rc == 2
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and f"metrics: cannot listen on 127.0.0.1:{port}" in lines[0], out
    assert not ws.journal.exists()  # the job never started


def test_a_beat_without_loss_keeps_the_exported_loss_and_its_step(ws: Workspace) -> None:
    """A job that sends loss= only every 10th beat: the loss series stays, with its step."""
    script = ws.root / "sparse.py"
    script.write_text(
        "import time\nfrom trainwatch import client\nhb = client.connect()\n"
        "for step in range(1, 100000):\n"
        "    hb.beat(step, loss=1.0 / step if step % 10 == 0 else None)\n"
        "    time.sleep(0.02)\n")
    scrape = _run(ws, {"command": [sys.executable, str(script)]})
    wait_for(lambda: (scrape.get("trainwatch_job_step", job="job") or 0) >= 25, timeout=60,
             what="step 25")
    for _ in range(5):  # whatever the scrape lands on, beats with and without loss
        got = wait_for(scrape.samples, what="a scrape")  # both from one scrape
        job = frozenset({("job", "job")})
        loss = got.get(("trainwatch_job_loss", job))
        at = got.get(("trainwatch_job_loss_step", job))
        assert loss is not None and at is not None
        assert at % 10 == 0 and loss == 1.0 / at
        time.sleep(0.03)
