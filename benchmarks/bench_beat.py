"""Cost of one ``hb.beat(...)`` call from ``trainwatch.client``, in µs.

How: a reader (a separate process by default, or a thread with
``--reader thread``) binds the daemon's own ``HeartbeatSocket`` (AF_UNIX
datagram, SO_PASSCRED, its socket options) and drains it with blocking ``recvmsg``
(``--reader-mode poll``: a busy non-blocking loop, so no wake-up is needed),
counting datagrams in shared memory. The sender is ``client.connect(path)``;
each call is timed alone with ``time.perf_counter_ns`` around it:

* paced: before each call the sender waits (untimed) until the reader has
  received everything sent so far, so the queue (net.unix.max_dgram_qlen,
  10 here) is empty, then ``--gap-us`` more so a blocking reader is asleep
  again: each send has to wake it, as a beat wakes the daemon;
* sleep 1 ms: each call after ``time.sleep(0.001)``, nearer a training loop
  (the caller's caches colder, the reader asleep);
* batch: ``--batch`` calls back to back (below the queue limit) after the
  queue has drained; the figure is each batch's mean per call.

Variants: ``beat(step, loss=, grad_norm=)``, ``beat(step, loss=None,
grad_norm=)``, ``beat(step)`` (loss and grad_norm None: the client's short
path), and a baseline ``sock.send()`` of a prebuilt message of the same size,
which is the kernel's share. Drops (EAGAIN) are counted and printed: a dropped
beat is cheaper than a sent one, so a figure with drops would be flattering.
The timer's own cost is printed; it is included in the figures, not subtracted.

Goal (issue): median ≤ 5 µs per beat.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Summary, fmt_summary, machine, machine_line, summarize, write_json
from trainwatch import client
from trainwatch.sources.heartbeat import HeartbeatSocket

_STOP = b"STOP"
GOAL_US = 5.0
FULL, LOSS_NONE, STEP_ONLY, RAW = "full", "loss_none", "step_only", "raw"
NAMES = {
    FULL: "beat(step, loss=, grad_norm=)",
    LOSS_NONE: "beat(step, loss=None, grad_norm=)",
    STEP_ONLY: "beat(step)  [loss=grad_norm=None]",
    RAW: "baseline: sock.send(prebuilt)",
}
RAW_MSG = b'{"v":1,"k":"beat","rank":0,"step":123456,"loss":2.4876543,"grad_norm":1.234}'


def reader(path: str, ready: Any, count: Any, poll: bool) -> None:
    """Bind ``path`` with the daemon's own HeartbeatSocket (its socket options,
    SO_PASSCRED included) and count datagrams (in shared memory) until STOP:
    blocking recvmsg, or a busy non-blocking loop with ``poll``."""
    hs = HeartbeatSocket(path, lambda _pid, _uid: True)
    s = hs.sock
    s.setblocking(not poll)
    anc = socket.CMSG_SPACE(12)
    recvmsg = s.recvmsg
    ready.set()
    while True:
        try:
            data, _anc, _flags, _addr = recvmsg(4096, anc)
        except BlockingIOError:
            continue
        if data == _STOP:
            break
        count.value += 1
    hs.close()


@dataclass
class Result:
    variant: str
    mode: str
    per_call_us: Summary
    dropped: int
    calls: int


def spin_until(t_ns: int) -> None:
    pc = time.perf_counter_ns
    while pc() < t_ns:
        pass


def timer_overhead_ns(n: int = 100_000) -> Summary:
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = pc()
        t1 = pc()
        out.append(t1 - t0)
    return summarize(out)


class Harness:
    """The sender's side: a client.Heartbeat and a raw socket to the reader, and
    a count of every datagram offered so far (sent or dropped)."""

    def __init__(self, path: str, count: Any, gap_ns: int) -> None:
        hb = client.connect(path, rank=0)
        assert isinstance(hb, client.Heartbeat), "connect() returned a no-op object"
        self.hb = hb
        self.raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.raw.setblocking(False)
        self.raw.connect(path)
        self.count = count
        self.offered = 0
        self.gap_ns = gap_ns
        self.stalls = 0  # the reader did not catch up within 100 ms

    def settle(self) -> None:
        """Wait until the reader has every datagram sent so far (so the queue is
        empty), then ``gap_ns`` more, so that a blocking reader is asleep again."""
        want = self.offered - self.hb.dropped
        c = self.count
        deadline = time.perf_counter_ns() + 100_000_000
        while c.value < want:
            if time.perf_counter_ns() > deadline:
                self.stalls += 1
                break
        spin_until(time.perf_counter_ns() + self.gap_ns)

    def calls(self, variant: str, n: int, before: str) -> list[float]:
        """Per-call µs of ``n`` calls of ``variant``; before each, ``settle`` or
        ``sleep`` 1 ms. Each call is written out so that no wrapper is timed."""
        pc = time.perf_counter_ns
        beat, send, hb = self.hb.beat, self.raw.send, self.hb
        pause = self.settle if before == "settle" else (lambda: time.sleep(0.001))
        losses = [2.5 - i * 1e-7 for i in range(n)]
        gns = [1.0 + (i % 97) * 0.013 for i in range(n)]
        out = [0.0] * n
        for i in range(n):
            loss, gn = losses[i], gns[i]
            pause()
            if variant == FULL:
                t0 = pc()
                beat(i, loss=loss, grad_norm=gn)
                t1 = pc()
            elif variant == LOSS_NONE:
                t0 = pc()
                beat(i, loss=None, grad_norm=gn)
                t1 = pc()
            elif variant == STEP_ONLY:
                t0 = pc()
                beat(i)
                t1 = pc()
            else:
                t0 = pc()
                try:
                    send(RAW_MSG)
                except BlockingIOError:
                    hb.dropped += 1  # counted with the client's drops
                t1 = pc()
            self.offered += 1
            out[i] = (t1 - t0) / 1000.0
        self.settle()
        return out

    def batches(self, variant: str, batches: int, size: int) -> list[float]:
        """The mean µs per call of each batch of ``size`` back-to-back calls."""
        pc = time.perf_counter_ns
        beat = self.hb.beat
        out = [0.0] * batches
        for b in range(batches):
            base = b * size
            steps = list(range(base, base + size))
            losses = [2.5 - s * 1e-7 for s in steps]
            gns = [1.0 + (s % 97) * 0.013 for s in steps]
            self.settle()
            if variant == FULL:
                t0 = pc()
                for s, loss, gn in zip(steps, losses, gns):  # noqa: B905 - same length
                    beat(s, loss=loss, grad_norm=gn)
                t1 = pc()
            else:
                t0 = pc()
                for s in steps:
                    beat(s)
                t1 = pc()
            self.offered += size
            out[b] = (t1 - t0) / 1000.0 / size
        self.settle()
        return out

    def close(self) -> None:
        self.hb.close()
        self.raw.close()


def run(args: argparse.Namespace, reader_mode: str) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="twbb-", dir="/tmp"))
    path = str(d / "hb.sock")
    ctx = mp.get_context("fork")
    count = ctx.RawValue("q", 0)
    proc: Any = None
    poll = reader_mode == "poll"
    if args.reader == "process":
        ready: Any = ctx.Event()
        proc = ctx.Process(target=reader, args=(path, ready, count, poll), daemon=True)
    else:
        ready = threading.Event()
        proc = threading.Thread(target=reader, args=(path, ready, count, poll), daemon=True)
    proc.start()
    if not ready.wait(10):
        raise RuntimeError("the reader did not start")

    h = Harness(path, count, args.gap_us * 1000)
    overhead = timer_overhead_ns()
    results: list[Result] = []
    if args.no_gc:
        gc.disable()
    try:
        for v in (FULL, LOSS_NONE, STEP_ONLY, RAW):  # warm up every path
            h.calls(v, 2000, "settle")

        def record(variant: str, mode: str, t: list[float], d0: int) -> None:
            results.append(Result(variant, mode, summarize(t), h.hb.dropped - d0, len(t)))

        for v in (FULL, LOSS_NONE, STEP_ONLY, RAW):
            d0 = h.hb.dropped
            record(v, f"paced {args.gap_us} µs", h.calls(v, args.calls, "settle"), d0)
        for v in (FULL, STEP_ONLY, RAW):
            d0 = h.hb.dropped
            record(v, "sleep 1 ms", h.calls(v, args.sleep_calls, "sleep"), d0)
        for v in (FULL, STEP_ONLY):
            d0 = h.hb.dropped
            t = h.batches(v, args.batches, args.batch)
            results.append(
                Result(
                    v,
                    f"batch of {args.batch}",
                    summarize(t),
                    h.hb.dropped - d0,
                    args.batches * args.batch,
                )
            )
    finally:
        gc.enable()
        stopper = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        stopper.sendto(_STOP, path)  # blocking: it must arrive
        stopper.close()
        proc.join(10)
        if isinstance(proc, mp.process.BaseProcess) and proc.is_alive():
            proc.kill()
        h.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            d.rmdir()

    received = int(count.value)
    dropped = h.hb.dropped
    print(f"bench_beat ({reader_mode}): cost of client.beat() against a drained AF_UNIX socket")
    print(machine_line())
    how = "blocking recvmsg" if not poll else "busy non-blocking recvmsg"
    print(
        f"reader: {args.reader}, {how} on trainwatch's HeartbeatSocket; before each paced "
        f"call the sender waits until the reader has everything, then {args.gap_us} µs; gc "
        f"{'off' if args.no_gc else 'on'}; net.unix.max_dgram_qlen={_qlen()}"
    )
    print(
        f"timer overhead (two perf_counter_ns back to back, included below): median "
        f"{overhead.median:.0f} ns, p99 {overhead.p99:.0f} ns"
    )
    w = max(len(NAMES[r.variant]) for r in results)
    m = max(len(r.mode) for r in results)
    for r in results:
        flag = f"  DROPPED {r.dropped}" if r.dropped else ""
        print(f"  {NAMES[r.variant]:<{w}}  {r.mode:<{m}}  {fmt_summary(r.per_call_us, 'µs')}{flag}")
    print(
        f"datagrams: offered {h.offered}, dropped by EAGAIN {dropped}, reader received "
        f"{received}; reader stalls (>100 ms to catch up): {h.stalls}"
    )
    paced = {r.variant: r.per_call_us.median for r in results if r.mode.startswith("paced")}
    share = {v: paced[v] - paced[RAW] for v in (FULL, LOSS_NONE, STEP_ONLY)}
    print(
        "client's share over a raw send (difference of paced medians): "
        + ", ".join(f"{NAMES[v].split('  ')[0]} +{share[v]:.2f} µs" for v in share)
    )
    main = results[0].per_call_us
    verdict = "meets" if main.median <= GOAL_US else "misses"
    print(
        f"goal: median ≤ {GOAL_US:g} µs per beat: {verdict} with a {reader_mode} reader "
        f"(paced full beat: median {main.median:.2f} µs, p99 {main.p99:.2f} µs; "
        f"{'waking the reader included' if not poll else 'no wake-up: the client alone'})"
    )
    return {
        "machine": machine(),
        "reader": args.reader,
        "reader_mode": reader_mode,
        "timer_overhead_ns": overhead.as_dict(),
        "results": [
            {
                "variant": r.variant,
                "name": NAMES[r.variant],
                "mode": r.mode,
                "per_call_us": r.per_call_us.as_dict(),
                "dropped": r.dropped,
                "calls": r.calls,
            }
            for r in results
        ],
        "offered": h.offered,
        "dropped": dropped,
        "received": received,
        "client_share_us": share,
        "goal_median_us": GOAL_US,
    }


def _qlen() -> str:
    try:
        return Path("/proc/sys/net/unix/max_dgram_qlen").read_text().strip()
    except OSError:
        return "?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=20000, help="timed calls per variant")
    p.add_argument("--sleep-calls", type=int, default=2000, help="calls in the 1 ms sleep mode")
    p.add_argument("--batches", type=int, default=2000, help="batches in the batch mode")
    p.add_argument("--batch", type=int, default=8, help="calls per batch (< qlen 10)")
    p.add_argument("--gap-us", type=int, default=20, help="busy-wait once the reader has caught up")
    p.add_argument("--reader", choices=("process", "thread"), default="process")
    p.add_argument(
        "--reader-mode",
        choices=("block", "poll", "both"),
        default="both",
        help="block: the reader sleeps in recvmsg, as the daemon sleeps in select, so a"
        " send must wake it; poll: it spins, so the figure is the client's own cost",
    )
    p.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = ("block", "poll") if args.reader_mode == "both" else (args.reader_mode,)
    out: dict[str, Any] = {}
    for i, mode in enumerate(modes):
        if i:
            print()
        out[mode] = run(args, mode)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
