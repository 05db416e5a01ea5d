"""/metrics scrape time and series count at 8 GPUs x 4 jobs x 8 ranks.

How: a real `trainwatch daemon` supervises 4 jobs of the test worker, each
with 8 ranks beating every 0.1 s and checkpointing, on 8 simulated GPUs (the
same GpuSample fields NVML fills); one Xid is drilled on each GPU so the Xid
counters exist. Once every rank of every job has beaten, /metrics is fetched
over HTTP ``--scrapes`` times in a row, timed from the client as Prometheus
times a scrape (request sent to the last byte read). Prints the median, p99
and max, the exposition's size, and the number of series (samples), all and
trainwatch_* only.

    python benchmarks/bench_metrics.py [--scrapes 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _common import machine_line, summarize
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "jobs" / "worker.py"
GPUS, JOBS, RANKS = 8, 4, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> tuple[float, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.perf_counter()
    conn.request("GET", "/metrics")
    body = conn.getresponse().read()
    took = time.perf_counter() - t0
    conn.close()
    return took, body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    print(machine_line())
    root = Path(tempfile.mkdtemp(prefix="twbm", dir="/tmp"))
    port = free_port()
    jobs = []
    for j in range(JOBS):
        ckpt = root / f"ckpt{j}"
        ckpt.mkdir()
        jobs.append({
            "name": f"job{j}",
            "command": [sys.executable, str(WORKER), "--ckpt-dir", str(ckpt), "--steps",
                        "1000000", "--interval", "0.1", "--ranks", str(RANKS)],
            "checkpoints": {"dir": str(ckpt)},
            "gpus": {"devices": list(range(GPUS))},
        })
    config = root / "trainwatch.yaml"
    config.write_text(yaml.safe_dump({
        "state_dir": str(root / "state"), "run_dir": str(root / "run"),
        "metrics": {"address": "127.0.0.1", "port": port},
        "gpu": {"backend": "sim", "count": GPUS, "kmsg": None},
        "jobs": jobs,
    }))
    daemon = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                               str(config)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                text = scrape(port)[1].decode()
            except OSError:
                text = ""
            ranks = text.count("trainwatch_rank_heartbeat_age_seconds{")
            if ranks == JOBS * RANKS:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {ranks} of {JOBS * RANKS} ranks beat within 60 s")
            time.sleep(0.5)
        for g in range(GPUS):  # Xid 63 is alert-only: counted, nothing relaunched
            subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--config",
                            str(config), "--gpu", str(g), "--xid", "63"], check=True,
                           capture_output=True)
        time.sleep(1.0)
        times, body = [], b""
        for _ in range(a.scrapes):
            took, body = scrape(port)
            times.append(took * 1000)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    ours = [s for s in samples if s.name.startswith("trainwatch_")]
    st = summarize(times)
    print(f"setup: {GPUS} simulated GPUs x {JOBS} jobs x {RANKS} ranks, trainwatch daemon, "
          f"{a.scrapes} scrapes over HTTP")
    print(f"/metrics scrape: median {st.median:.2f} ms, p99 {st.p99:.2f} ms, max {st.max:.2f} "
          f"ms (goal: median <= 10 ms: {'met' if st.median <= 10 else 'NOT met'})")
    print(f"exposition: {len(body)} bytes; series: {len(samples)} in all, {len(ours)} "
          "trainwatch_*")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "scrape_ms": st.as_dict(), "bytes": len(body), "series": len(samples),
            "series_trainwatch": len(ours), "gpus": GPUS, "jobs": JOBS, "ranks": RANKS,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
