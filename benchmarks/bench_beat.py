"""Cost of one ``hb.beat(...)`` call from ``trainwatch.client``, in µs.

Headline: a real job under the real ``trainwatch run``
--------------------------------------------------------
``trainwatch run --config C --state-dir D/s --run-dir D/r --no-passthrough -q
--heartbeat-timeout 30s`` (D a short temp dir under /tmp) supervises a small
Python job (one rank) that calls ``client.connect()`` (TRAINWATCH_SOCKET, as
any job), beats untimed for ``--job-warmup`` s (1) at 100 Hz so that it is
running, then goes through ``--job-phases``, each ``period:duration[:kind]``
(default ``10ms:10s,10ms:4s:control,1ms:5s``):

* sleep (the default): ``hb.beat(step, loss=..., grad_norm=...)`` on a fixed
  schedule, ``time.sleep`` until each slot (a training loop that waits rather
  than computes); the first phase, 100 Hz for 10 s, is the headline;
* busy: the same with 4 MB of memory-bound numpy work until each slot instead
  of the sleep (not in the default);
* control: no ``beat()``; after the same sleep, alternate slots time the
  client's own formatting of the message (its helpers, the same f-string,
  ``encode``) without sending it, and a plain ``sock.send()`` of that message
  on a socket of the job's own: how much of a beat is the first touch of cold
  code and data after a sleep rather than the client or trainwatch.

Each call is timed alone with ``time.perf_counter_ns`` (gc on, as in a real
job; the timer's own cost is included, not subtracted). The job writes every
per-call time, which calls were dropped (``hb.dropped`` went up) and each
phase's start and end (CLOCK_MONOTONIC) to a file and exits 0, so trainwatch
must exit 0 too.

This is the figure a job sees: while beats flow, trainwatch does not wait on
the socket but reads it every 50 ms (``BEAT_POLL`` in trainwatch/sources/beatpoll.py), so
a ``send()`` normally has nobody to wake. The kernel queues at most
net.unix.max_dgram_qlen (+1) datagrams between two reads; a beat beyond that
is dropped (EAGAIN; the next supersedes it). A dropped call is cheaper than a
sent one, so the drops are printed and the sent calls are summarised on their
own as well. Meanwhile the benchmark samples trainwatch's voluntary context
switches (its wake-ups) and on-CPU time (schedstat) every 0.1 s and reports
them per phase, with trainwatch's own count of datagrams received
(status.json) against the job's count of sent ones.

Secondary: an isolated reader (not trainwatch)
-----------------------------------------------
The client against a reader that binds trainwatch's own ``HeartbeatSocket``
(AF_UNIX datagram, SO_PASSCRED, its socket options) in a separate process (or
a thread with ``--reader thread``) and drains it with blocking ``recvmsg``
(mode ``block``: every send must wake it, as trainwatch's idle socket would)
or with a busy non-blocking loop (mode ``poll``: nobody to wake, the client
alone), counting datagrams in shared memory. The sender is
``client.connect(path)``; each call is timed alone:

* paced: before each call the sender waits (untimed) until the reader has
  received everything sent so far, so the queue (net.unix.max_dgram_qlen,
  10 here) is empty, then ``--gap-us`` more so a blocking reader is asleep
  again: each send has to wake it;
* sleep 1 ms: each call after ``time.sleep(0.001)`` (the caller's caches
  colder, a blocking reader asleep);
* batch: ``--batch`` calls back to back (below the queue limit) after the
  queue has drained; the figure is each batch's mean per call.

Variants: ``beat(step, loss=, grad_norm=)``, ``beat(step, loss=None,
grad_norm=)``, ``beat(step)`` (loss and grad_norm None: the client's short
path), and a baseline ``sock.send()`` of a prebuilt message of the same size,
which is the kernel's share. Drops (EAGAIN) are counted and printed.

Goal (issue): median ≤ 5 µs per beat.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Summary,
    TrainwatchRun,
    fmt_summary,
    machine,
    machine_line,
    remove,
    schedstat_ns,
    scratch_dir,
    summarize,
    voluntary_switches,
    write_config,
    write_json,
)
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


# --- headline: a real job under `trainwatch run` ---------------------------------

JOB = """\
import json, os, socket, sys, time
from trainwatch import client

out, phases, warmup = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
hb = client.connect()  # TRAINWATCH_SOCKET, as any job
if not isinstance(hb, client.Heartbeat):
    sys.exit("client.connect() returned a no-op object: no TRAINWATCH_SOCKET?")
pc, mono, sleep = time.perf_counter_ns, time.monotonic, time.sleep
beat = hb.beat
# control: the client's own formatting (its helpers, the same f-string) without
# the send, and a plain send of that message on a socket of our own
head, num = client._head(0), client._num
raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
raw.setblocking(False)
raw.connect(os.environ["TRAINWATCH_SOCKET"])
raw_sent = raw_dropped = 0
work = None
beats_called = 0

over = [0] * 100_000
for i in range(len(over)):
    t0 = pc()
    t1 = pc()
    over[i] = t1 - t0

def phase(period, n, step, kind):
    global raw_sent, raw_dropped, work, beats_called
    if kind == "busy" and work is None:
        import numpy as np
        work = (np.multiply, np.ones(500_000), np.empty(500_000))  # 4 MB each
    ns = [0] * n
    dropped, skipped, fmt, send = [], [], [], []
    nxt = mono()
    t_start = nxt
    for i in range(n):
        nxt += period
        if kind == "busy":  # memory-bound numpy work until the slot, instead of sleeping
            mul, src, dst = work
            while mono() < nxt:
                mul(src, 1.0000001, out=dst)
        else:
            d = nxt - mono()
            if d > 0:
                sleep(d)
        loss = 2.5 / (1.0 + step * 1e-3)
        gn = 1.0 + (step % 97) * 0.013
        if kind == "control" and i % 2 == 0:
            t0 = pc()
            msg = f'{head}{int(step)},"loss":{num(loss)},"grad_norm":{num(gn)}}}'.encode()
            t1 = pc()
            fmt.append(t1 - t0)
        elif kind == "control":
            msg = f'{head}{int(step)},"loss":{num(loss)},"grad_norm":{num(gn)}}}'.encode()
            try:
                t0 = pc()
                raw.send(msg)
                t1 = pc()
                raw_sent += 1
            except BlockingIOError:
                t1 = pc()
                raw_dropped += 1
            send.append(t1 - t0)
        else:
            d0, s0 = hb.dropped, hb.skipped
            t0 = pc()
            beat(step, loss=loss, grad_norm=gn)
            t1 = pc()
            ns[i] = t1 - t0
            if hb.dropped != d0:
                dropped.append(i)
            if hb.skipped != s0:
                skipped.append(i)
            beats_called += 1
        step += 1
    if kind == "control":
        ns = []
    return {"period_s": period, "kind": kind, "n": n, "ns": ns, "dropped": dropped,
            "skipped": skipped,
            "fmt_ns": fmt, "send_ns": send, "t_start": t_start, "t_end": mono()}, step

_, step = phase(0.01, int(warmup / 0.01), 0, "sleep")  # untimed warm-up
dropped_warmup = hb.dropped
res = []
for period, seconds, kind in phases:
    r, step = phase(period, max(2, round(seconds / period)), step, kind)
    res.append(r)
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump({"phases": res, "timer_ns": sorted(over), "calls": beats_called,
               "dropped_total": hb.dropped, "dropped_warmup": dropped_warmup,
               "skipped_total": hb.skipped,
               "raw_sent": raw_sent, "raw_dropped": raw_dropped, "pid": os.getpid()}, f)
os.replace(tmp, out)
"""


KINDS = {
    "sleep": "time.sleep between calls",
    "busy": "4 MB of numpy work between calls",
    "control": "no beat() (control)",
}


def parse_phases(text: str) -> list[tuple[float, float, str]]:
    """``10ms:10s,1ms:5s,10ms:4s:control`` -> [(0.01, 10.0, "sleep"), (0.001, 5.0,
    "sleep"), (0.01, 4.0, "control")]: period and duration in s, and what the job does
    between calls (sleep, busy) or, for control, instead of beat()."""

    def secs(x: str) -> float:
        x = x.strip()
        for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("µs", 1e-6), ("s", 1.0)):
            if x.endswith(suffix):
                return float(x[: -len(suffix)]) * scale
        return float(x)

    out = []
    for part in text.split(","):
        bits = part.strip().split(":")
        kind = bits[2].strip() if len(bits) > 2 else "sleep"
        if kind not in KINDS:
            raise SystemExit(f"--job-phases: {part!r}: kind must be one of {', '.join(KINDS)}")
        out.append((secs(bits[0]), secs(bits[1] if len(bits) > 1 else "10s"), kind))
    return out


def _rate_label(period: float, kind: str = "sleep") -> str:
    hz = 1.0 / period
    rate = f"{hz / 1000:g} kHz" if hz >= 1000 else f"{hz:g} Hz"
    return f"every {period * 1000:g} ms ({rate}){', busy between' if kind == 'busy' else ''}"


def _window(
    samples: list[tuple[float, int, int]], a: float, b: float
) -> tuple[float, float] | None:
    """Wake-ups per s and % of a core from the samples taken within [a, b]."""
    inside = [x for x in samples if a <= x[0] <= b]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5:
        return None
    (t0, v0, c0), (t1, v1, c1) = inside[0], inside[-1]
    return (v1 - v0) / (t1 - t0), 100.0 * (c1 - c0) / 1e9 / (t1 - t0)


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    phases = parse_phases(args.job_phases)
    if phases[0][2] == "control":
        raise SystemExit("--job-phases: the first phase (the headline) must call beat()")
    d = scratch_dir("twbj-")
    job = d / "job.py"
    job.write_text(JOB)
    out_path = d / "beats.json"
    argv = [sys.executable, str(job), str(out_path), json.dumps(phases), f"{args.job_warmup:g}"]
    cfg = write_config(d, argv)
    tw = TrainwatchRun(d, cfg, ["--heartbeat-timeout", "30s"])
    samples: list[tuple[float, int, int]] = []  # (monotonic, voluntary switches, on-CPU ns)
    status: dict[str, Any] = {}
    rc: int | None = None
    log_path: str | None = None
    budget = args.job_warmup + sum(p[1] for p in phases) * 1.5 + 30.0
    try:
        tw.wait_running(0, timeout=30.0)
        deadline = time.monotonic() + budget
        while tw.alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                samples.append((time.monotonic(), voluntary_switches(tw.pid), schedstat_ns(tw.pid)))
            status = tw.status() or status
            time.sleep(0.1)
        try:
            rc = tw.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # stopped below; reported as a problem
            rc = None
        status = tw.status() or status
        log_path = status.get("log")
        err = tw.stderr_tail()
    finally:
        rc_stop = tw.stop()
    rc = rc if rc is not None else rc_stop
    if not out_path.exists():
        job_log = ""
        with contextlib.suppress(OSError, TypeError):
            job_log = Path(str(log_path)).read_text(errors="replace")[-2000:]
        remove(d, True)
        raise RuntimeError(
            f"the job wrote no timings (trainwatch exit {rc}):\n{err}\njob log:\n{job_log}"
        )
    data = json.loads(out_path.read_text())
    remove(d, args.keep)

    timer = summarize(data["timer_ns"])
    dgrams = status.get("datagrams") or {}
    rings = status.get("rings") or {}
    # Under trainwatch the job's client writes every beat to its ring
    # (TRAINWATCH_RING_DIR) and sends a datagram only to announce the ring.
    ringed = bool(rings.get("read"))
    sent = (int(rings.get("read", 0)) if ringed else
            int(data["calls"]) - int(data["dropped_total"]) - int(data["skipped_total"])
            ) + int(data["raw_sent"])
    qlen = _qlen()
    rows: list[dict[str, Any]] = []
    controls: list[dict[str, Any]] = []
    for ph in data["phases"]:
        wall = ph["t_end"] - ph["t_start"]
        sup = _window(samples, ph["t_start"] + 0.2, ph["t_end"])
        common = {
            "period_s": ph["period_s"],
            "kind": ph["kind"],
            "label": _rate_label(ph["period_s"], ph["kind"]),
            "achieved_hz": ph["n"] / wall if wall > 0 else float("nan"),
            "supervisor_wakes_per_s": sup[0] if sup else float("nan"),
            "supervisor_cpu_pct": sup[1] if sup else float("nan"),
        }
        if ph["kind"] == "control":
            controls.append(
                {
                    **common,
                    "format_us": summarize([x / 1000.0 for x in ph["fmt_ns"]]),
                    "send_us": summarize([x / 1000.0 for x in ph["send_ns"]]),
                }
            )
            continue
        us = [x / 1000.0 for x in ph["ns"]]
        dropped = set(ph["dropped"])
        not_sent = dropped | set(ph["skipped"])
        rows.append(
            {
                **common,
                "per_call_us": summarize(us),
                "sent_only_us": summarize([x for i, x in enumerate(us) if i not in not_sent]),
                "dropped": len(dropped),
                "skipped": len(ph["skipped"]),
                "calls": len(us),
            }
        )

    print("bench_beat: hb.beat() in a real job under `trainwatch run` (headline)")
    print(machine_line())
    print(
        "trainwatch run -q --no-passthrough supervising one rank that calls client.connect() "
        "and, on a fixed schedule, beat(step, loss=, grad_norm=), each call timed alone (gc on; "
        f"{args.job_warmup:g} s untimed warm-up at 100 Hz); with a ring (TRAINWATCH_RING_DIR) "
        "every beat goes to shared memory, read once a second; without, trainwatch reads the "
        f"socket every 50 ms while beats flow; net.unix.max_dgram_qlen={qlen}"
    )
    print(
        f"timer overhead (two perf_counter_ns back to back in the job, included below): median "
        f"{timer.median:.0f} ns, p99 {timer.p99:.0f} ns"
    )
    for r in rows:
        print(
            f"  beat(step, loss=, grad_norm=)  [real job, {r['label']}]  "
            f"{fmt_summary(r['per_call_us'], 'µs', 2)}"
        )
        print(
            f"      {KINDS[r['kind']]}; dropped (EAGAIN, queue full): {r['dropped']} of "
            f"{r['calls']} ({100.0 * r['dropped'] / max(1, r['calls']):.1f} %); skipped "
            f"(within the client's 5 ms rate limit): {r['skipped']}"
            + (
                f"; sent calls only: {fmt_summary(r['sent_only_us'], 'µs', 2)}"
                if r["dropped"] or r["skipped"]
                else ""
            )
        )
        print(
            f"      achieved {r['achieved_hz']:.0f} calls/s; trainwatch meanwhile: "
            f"{r['supervisor_wakes_per_s']:.1f} wake-ups/s, "
            f"{r['supervisor_cpu_pct']:.2f} % of a core"
        )
    for c in controls:
        print(
            f"  control [real job, {c['label']}, time.sleep between, alternate slots, no beat()]:"
        )
        print(
            f"      the client's formatting alone (its f-string and encode, no send): "
            f"{fmt_summary(c['format_us'], 'µs', 2)}"
        )
        print(
            f"      a plain sock.send() of that message on a socket of the job's own: "
            f"{fmt_summary(c['send_us'], 'µs', 2)}"
        )
    print(
        f"datagrams: the job made {data['calls']} beat() calls ({data['dropped_warmup']} dropped "
        f"in the warm-up, {data['dropped_total']} in all) and {data['raw_sent']} control sends "
        f"({data['raw_dropped']} dropped), so sent {sent}; trainwatch received "
        f"{dgrams.get('received', '?')} (malformed {dgrams.get('malformed', '?')}, foreign "
        f"{dgrams.get('foreign', '?')}, oversized {dgrams.get('oversized', '?')})"
    )
    if ringed:
        print(f"rings: every beat() call goes to the rank's ring; trainwatch read "
              f"{rings.get('values')} values of {data['calls']} calls, lapped "
              f"{rings.get('lapped')}; datagrams: 1 announcement per ring + the control sends")
    print(f"trainwatch run exit code after the job exited 0: {rc} (expected 0)")
    head = rows[0]
    main_row = head["per_call_us"]
    verdict = "meets" if main_row.median <= GOAL_US else "misses"
    print(
        f"goal: median ≤ {GOAL_US:g} µs per beat: {verdict} in a real job "
        f"({head['label']}: median {main_row.median:.2f} µs, p99 {main_row.p99:.2f} µs)"
    )
    problems = []
    if rc != 0:
        problems.append(f"trainwatch exited {rc}, expected 0")
    if dgrams.get("received") is not None and int(dgrams["received"]) != sent:
        problems.append(f"trainwatch received {dgrams['received']} datagrams, the job sent {sent}")
    if ringed and int(rings.get("values", -1)) != int(data["calls"]):
        problems.append(f"trainwatch read {rings.get('values')} ring values, the job made "
                        f"{data['calls']} calls")
    if problems:
        print("PROBLEM: " + "; ".join(problems))

    def plain(r: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.as_dict() if isinstance(v, Summary) else v) for k, v in r.items()}

    return {
        "machine": machine(),
        "name": NAMES[FULL],
        "timer_overhead_ns": timer.as_dict(),
        "phases": [plain(r) for r in rows],
        "controls": [plain(c) for c in controls],
        "calls": data["calls"],
        "sent": sent,
        "received": dgrams.get("received"),
        "datagrams": dgrams,
        "rings": rings,
        "exit_code": rc,
        "problems": problems,
        "goal_median_us": GOAL_US,
    }


# --- secondary: an isolated reader ------------------------------------------------


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
        # These rows measure the send path: the client's 5 ms rate limit is
        # switched off here (in a real job it only skips beats closer than that).
        client._MIN_INTERVAL = 0.0  # type: ignore[attr-defined]
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


def run_isolated(args: argparse.Namespace, reader_mode: str) -> dict[str, Any]:
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
    asleep = "reader asleep" if not poll else "reader polling"
    print(
        f"bench_beat, isolated reader ({asleep}; not trainwatch): client.beat() against a "
        "drained AF_UNIX socket"
    )
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
        print(
            f"  {NAMES[r.variant]:<{w}}  [isolated, {asleep}, {r.mode:<{m}}]  "
            f"{fmt_summary(r.per_call_us, 'µs')}{flag}"
        )
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
        f"goal: median ≤ {GOAL_US:g} µs per beat: {verdict} against an isolated {asleep} "
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
    p.add_argument(
        "--modes",
        default="job,block,poll",
        help="comma-separated: job (headline: a real job under trainwatch run), block and poll"
        " (an isolated reader asleep in recvmsg, or spinning)",
    )
    p.add_argument(
        "--job-phases",
        default="10ms:10s,10ms:4s:control,1ms:5s",
        help="job mode: period:duration[:kind] of each phase, kind sleep (the default), busy"
        " (numpy work between calls) or control (no beat(): the client's formatting alone and"
        " a plain send, in alternate slots); the first is the headline",
    )
    p.add_argument("--job-warmup", type=float, default=1.0, help="job mode: untimed beats, s")
    p.add_argument("--keep", action="store_true", help="job mode: keep the temp dir")
    p.add_argument("--calls", type=int, default=20000, help="isolated: timed calls per variant")
    p.add_argument("--sleep-calls", type=int, default=2000, help="calls in the 1 ms sleep mode")
    p.add_argument("--batches", type=int, default=2000, help="batches in the batch mode")
    p.add_argument("--batch", type=int, default=8, help="calls per batch (< qlen 10)")
    p.add_argument("--gap-us", type=int, default=20, help="busy-wait once the reader has caught up")
    p.add_argument("--reader", choices=("process", "thread"), default="process")
    p.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("job", "block", "poll")]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from job, block, poll")
    out: dict[str, Any] = {}
    for i, mode in enumerate(modes):
        if i:
            print()
        out[mode] = run_job(args) if mode == "job" else run_isolated(args, mode)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
