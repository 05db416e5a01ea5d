"""Heartbeat rings against datagrams: what ``hb.beat()`` costs the job, and how
many of the values it reports reach the reader.

(a) cost: ``client.Heartbeat.beat(step, loss=, grad_norm=)`` timed alone
    (perf_counter_ns, gc on), with TRAINWATCH_RING_DIR (ring) and without
    (datagram, the client's 5 ms limit switched off so every call sends; a
    receiver process drains the socket with blocking recv, as an idle daemon
    would); back to back, and after ``time.sleep(0.001)`` (cold caches, as
    after a training step).
(b) delivery: 8 writer processes x 1,000 steps/s for 5 s; a reader polls every
    0.25 s, reading every ring (RingReader) or draining the socket (as the
    daemon does, net.unix.max_dgram_qlen as the system has it): values
    delivered / written.

Goals (issues 10, 11): median ≤ 2 µs per beat; no value lost with the ring.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_summary, machine_line, scratch_dir, summarize
from trainwatch import client
from trainwatch.sources import ring, ringreader

GOAL_US = 2.0


def _drain_forever(path: str, ready: Any) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    ready.set()
    while s.recv(4096) != b"STOP":
        pass


def cost(d: Path, mode: str, n: int, sleep: bool) -> list[float]:
    client._MIN_INTERVAL = 0.0  # type: ignore[attr-defined]  # datagram rows: send every call
    rd = str(d / "rings") if mode == "ring" else None
    hb = client.Heartbeat(str(d / "hb.sock"), 0, rd)
    beat, pc, pause = hb.beat, time.perf_counter_ns, time.sleep
    for i in range(200):  # warm up (and announce the ring)
        beat(i, loss=1.0, grad_norm=1.0)
    out = [0.0] * n
    for i in range(n):
        loss, gn = 2.5 - i * 1e-7, 1.0 + (i % 97) * 0.013
        if sleep:
            pause(0.001)
        t0 = pc()
        beat(i, loss=loss, grad_norm=gn)
        t1 = pc()
        out[i] = (t1 - t0) / 1000.0
    hb.close()
    client._MIN_INTERVAL = 0.005
    return out


def _writer(sock: str, rings: str | None, rank: int, rate: float, seconds: float,
            start: float, written: Any) -> None:
    hb = client.Heartbeat(sock, rank, rings)
    period, t, step = 1.0 / rate, start, 0
    while time.monotonic() < start:
        pass
    end = start + seconds
    while t < end:
        t += period
        d = t - time.monotonic()
        if d > 0:
            time.sleep(d)
        hb.beat(step, loss=step * 2.0, grad_norm=1.0)
        step += 1
    written[rank] = step


def delivery(d: Path, mode: str, ranks: int, rate: float, seconds: float,
             poll: float) -> tuple[int, int, int]:
    """(written, delivered, lost-as-counted) for one mode."""
    client._MIN_INTERVAL = 0.005  # as shipped
    sock = str(d / f"{mode}.sock")
    rings = str(d / f"rings-{mode}")
    os.mkdir(rings, 0o700)
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(sock)
    rx.setblocking(False)
    ctx = mp.get_context("fork")
    written = ctx.Array("q", ranks)
    start = time.monotonic() + 0.5
    procs = [ctx.Process(target=_writer, args=(sock, rings if mode == "ring" else None, r, rate,
                                               seconds, start, written)) for r in range(ranks)]
    for p in procs:
        p.start()
    readers: dict[str, ringreader.RingReader] = {}
    got = 0
    ring_values = 0

    def poll_once() -> None:
        nonlocal got, ring_values
        while True:  # the socket, as the daemon drains it
            try:
                rx.recv(4096)
                got += 1
            except BlockingIOError:
                break
        if mode == "ring":
            for _r, _p, path in ring.scan(rings):
                if path not in readers:
                    readers[path] = ringreader.RingReader(path)
            for r in readers.values():
                ring_values += len(r.read())

    while any(p.is_alive() for p in procs):
        time.sleep(poll)
        poll_once()
    for p in procs:
        p.join()
    poll_once()
    rx.close()
    total = sum(written[:])
    lapped = sum(r.lapped for r in readers.values())
    delivered = ring_values if mode == "ring" else got
    return total, delivered, lapped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--calls", type=int, default=200_000, help="back-to-back calls per mode")
    ap.add_argument("--sleep-calls", type=int, default=3000, help="calls after a 1 ms sleep")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1000.0, help="steps/s per writer")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--poll", type=float, default=0.25)
    args = ap.parse_args(argv)
    d = scratch_dir("twring-")
    try:
        print("bench_ring: hb.beat() with a heartbeat ring vs a datagram per beat")
        print(machine_line())
        qlen = Path("/proc/sys/net/unix/max_dgram_qlen").read_text().strip()
        (d / "rings").mkdir(mode=0o700)
        ctx = mp.get_context("fork")
        ready = ctx.Event()
        drainer = ctx.Process(target=_drain_forever, args=(str(d / "hb.sock"), ready))
        drainer.start()
        ready.wait(10)
        rows = []
        for sleep in (False, True):
            for mode in ("ring", "datagram"):
                us = cost(d, mode, args.sleep_calls if sleep else args.calls, sleep)
                rows.append((mode, "after sleep(0.001)" if sleep else "back to back",
                             summarize(us)))
        stop = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        stop.sendto(b"STOP", str(d / "hb.sock"))
        stop.close()
        drainer.join(10)
        print("(a) cost per beat(step, loss=, grad_norm=), µs (timer included; datagram rows: "
              "every call sent, receiver asleep in recv in another process)")
        for mode, how, s in rows:
            print(f"  {mode:<8} {how:<19} {fmt_summary(s, 'µs', 2)}")
        print(f"(b) delivery: {args.ranks} writers x {args.rate:g} steps/s x {args.seconds:g} s, "
              f"reader every {args.poll:g} s, net.unix.max_dgram_qlen={qlen}")
        res = {}
        for mode in ("ring", "datagram"):
            total, got, lapped = delivery(d, mode, args.ranks, args.rate, args.seconds, args.poll)
            res[mode] = (total, got)
            extra = f", lapped {lapped}" if mode == "ring" else " (client skips beats < 5 ms apart)"
            print(f"  {mode:<8} written {total}, delivered {got} "
                  f"({100.0 * got / max(1, total):.1f} %){extra}")
        ring_sleep = next(s for m, h, s in rows if m == "ring" and h.startswith("after"))
        ring_b2b = next(s for m, h, s in rows if m == "ring" and h.startswith("back"))
        print("goals:")
        print(f"  median ≤ {GOAL_US:g} µs per beat (ring): back to back {ring_b2b.median:.2f} µs "
              f"{'meets' if ring_b2b.median <= GOAL_US else 'MISSES'}; after a sleep "
              f"{ring_sleep.median:.2f} µs {'meets' if ring_sleep.median <= GOAL_US else 'MISSES'}")
        total, got = res["ring"]
        print(f"  0 values lost with the ring: lost {total - got} "
              f"{'meets' if got == total else 'MISSES'}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
