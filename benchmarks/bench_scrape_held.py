"""Scrapes of /metrics that get through while a local user holds connections open.

How: a real `trainwatch daemon` (no jobs, GPUs off) serves /metrics on a free
port of 127.0.0.1. A separate process (the "holder", as any local user could
run) opens ``--held`` connections to that port and sends nothing; whenever the
server closes one, it connects again at once, so ``--held`` connections are
always open or opening. Once they are all open, ``--scrapes`` scrapes are made
one after another, ``--interval`` s apart, each a plain HTTP GET with a
``--timeout`` s limit for the whole answer (Prometheus' default scrape_timeout
is 10 s); a scrape succeeds when it returns 200 with trainwatch's metrics in
time. Repeated for ``--trials`` fresh daemons; prints each trial and the
medians over trials (successes, and the scrape time of the successful ones).

    python benchmarks/bench_scrape_held.py [--held 64] [--scrapes 20] [--trials 3]
        [--timeout 10] [--interval 0.25] [--json FILE]

To measure another checkout's server, put its package first on PYTHONPATH
(a folder with ``trainwatch`` linked to that checkout's ``watchdog/``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from multiprocessing.synchronize import Event
from pathlib import Path

from _common import machine_line, write_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hold(port: int, n: int, stop: Event, opened: mp.Value) -> None:  # type: ignore[valid-type]
    """The holder: n idle connections, each reopened as soon as the server closes it."""
    sel = selectors.DefaultSelector()

    def connect() -> None:
        while not stop.is_set():
            s = socket.socket()
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                time.sleep(0.01)
                continue
            sel.register(s, selectors.EVENT_READ)
            opened.value += 1  # type: ignore[attr-defined]
            return

    for _ in range(n):
        connect()
    while not stop.is_set():
        for key, _ in sel.select(0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # closed by the server: come back at once
                sel.unregister(s)
                s.close()
                connect()
    for key in list(sel.get_map().values()):
        with contextlib.suppress(OSError):
            key.fileobj.close()  # type: ignore[union-attr]


def scrape(port: int, timeout: float) -> float | None:
    """Seconds to the last byte of a good answer, or None on any failure."""
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            body = r.read()
            ok = r.status == 200 and b"trainwatch_metrics_connections" in body
    except (OSError, ValueError):
        return None
    took = time.perf_counter() - t0
    return took if ok and took <= timeout else None


def trial(args: argparse.Namespace) -> tuple[int, list[float], int]:
    """(scrapes that succeeded, their times, the holder's connects) for one fresh daemon."""
    root = Path(tempfile.mkdtemp(prefix="twbs", dir="/tmp"))
    port = free_port()
    config = root / "trainwatch.yaml"
    config.write_text(f"state_dir: {root}/s\nrun_dir: {root}/r\n"
                      f"metrics: {{address: 127.0.0.1, port: {port}}}\n"
                      "gpu: {backend: off, kmsg: null}\njobs: []\n")
    out = open(root / "daemon.out", "wb")  # noqa: SIM115  # closed in finally
    daemon = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                               str(config)], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    stop = mp.Event()
    opened = mp.Value("l", 0)
    holder = None
    try:
        deadline = time.monotonic() + 60
        while scrape(port, 2) is None:  # the daemon is up
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"the daemon did not serve /metrics: "
                                 f"{(root / 'daemon.out').read_text()[-2000:]}")
            time.sleep(0.1)
        holder = mp.Process(target=hold, args=(port, args.held, stop, opened), daemon=True)
        holder.start()
        while opened.value < args.held:  # type: ignore[attr-defined]
            time.sleep(0.05)
        time.sleep(1.0)  # let the server admit or refuse them
        took: list[float] = []
        for _ in range(args.scrapes):
            t = scrape(port, args.timeout)
            if t is not None:
                took.append(t)
            time.sleep(args.interval)
        return len(took), took, int(opened.value)  # type: ignore[attr-defined]
    finally:
        stop.set()
        if holder is not None:
            holder.join(timeout=10)
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=30)
        out.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", type=int, default=64)
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(machine_line())
    print(f"{args.held} connections held (reopened when closed), {args.scrapes} scrapes"
          f" {args.interval:g} s apart, each with a {args.timeout:g} s timeout")
    results = []
    for n in range(args.trials):
        ok, took, connects = trial(args)
        med = statistics.median(took) * 1000 if took else float("nan")
        print(f"trial {n + 1}: {ok}/{args.scrapes} scrapes served, median {med:.1f} ms;"
              f" the holder connected {connects} times")
        results.append({"served": ok, "median_ms": med, "connects": connects})
    served = statistics.median(r["served"] for r in results)
    times = [r["median_ms"] for r in results if r["served"]]
    print(f"median over {args.trials} trials: {served:g}/{args.scrapes} scrapes served"
          f" (goal >= 19), scrape time {statistics.median(times) if times else float('nan'):.1f}"
          " ms")
    write_json(args.json, {"held": args.held, "scrapes": args.scrapes, "timeout": args.timeout,
                           "trials": results, "served_median": served})
    return 0


if __name__ == "__main__":
    sys.exit(main())
