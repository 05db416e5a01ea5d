"""The GPU layer: Xid → incident through each path, the cost of one poll, and
the CPU of ``trainwatch run`` polling simulated GPUs at 1 Hz.

How, figure by figure:

1. Xid → incident.

   (a) kernel log and (b) drill, end to end with the real CLI: ``trainwatch
   run --config C --state-dir D/s --run-dir D/r --no-passthrough -q`` (D a
   short temp dir under /tmp) supervises a job that beats every 50 ms with
   ``trainwatch.client``; C has ``gpu: {backend: sim, count: 4, kmsg: D/kern.log,
   poll_interval: 1s}`` and the default policy ``backoff: {initial: 0.2s, max:
   1s, jitter: 0}`` with ``xid_actions`` making every Xid used here an
   ``alert``, so the job keeps running and many samples come from one run.
   The two paths alternate, 0.1-0.3 s apart (a random phase against the
   kernel-log reader's 50 ms tick). Each sample takes a (GPU, Xid) pair not
   used for 11 s, because one Xid on one GPU within 10 s is deduplicated.

   (a) appends the driver's real-format line (``NVRM: Xid (PCI:0000:11:00): 79,
   pid=..., name=faultinject, ...``; sim GPU i is bus 0x10+i) to D/kern.log in
   one ``write()``; t0 = ``time.time()`` just before it.
   (b) sends ``gpu-xid`` over the control socket (``faultinject.drills.gpu_xid``);
   t0 just before the request. Handled in the loop's own thread: the same queue
   and drain as NVML's event thread, without the cross-thread wake-up (that is
   in (c2)).

   Both: Xid → incident = the new row's ``time`` (wall clock at the insert) in
   D/s/ledger.db ``incidents`` - t0. The ledger's ``detection_latency_s``
   (the reader or drill stamped the Xid → incident) is shown as well: the rest
   is the kernel-log reader's tick (and its position-file fsync, /tmp's file
   system is printed).

   (c) NVML's event thread, in this process, over the fake pynvml
   (``tests/fake_pynvml.FakeNvml``, 8 GPUs):
   (c1) ``NvmlSource.start_event_thread(callback)``: ``emit_xid`` → callback
   (``time.perf_counter``);
   (c2) the same through ``GpuWatch`` (``gpu.backend: nvml``, the fake put in
   place of ``pynvml``): ``emit_xid`` → the event thread → queue + wake-up pipe →
   a loop thread in ``select()`` → ``drain()`` returns the gpu_xid fault. Xid
   numbers here are arbitrary and never repeat (dedup). The thread waits with
   ``nvmlEventSetWait_v2(set, 500 ms)``; an event ends the wait at once (the
   fake's wait is a condition variable, the driver's a blocking wait), so the
   500 ms only bounds how long ``stop()`` takes.

   (d) a lost GPU (the poll path), in this process: the same ``GpuWatch`` polls
   at ``--poll-interval`` (default 1 s, the config default); at a random phase,
   ``FakeNvml.lose(gpu)`` (alternately GpuIsLost and ResetRequired), then the
   time until ``drain()`` returns the gpu_lost fault; then the GPU is restored
   and the next GPU is used. Bounded by one poll interval plus the poll.
   With the sim backend a GPU is never lost, so this path is not in (a)/(b).

2. One poll of 8 GPUs through the fake module: ``NvmlSource(FakeNvml(8)).poll()``
   timed one call at a time (``--polls`` calls after 100 warm-up ones); the
   NVML calls per GPU per poll and the fake's own cost per call (a trivial
   fake getter in a loop) are printed, so the figure can be read for the real
   library: the fake's calls are Python, the real ones are ctypes into
   libnvidia-ml (microseconds to a millisecond each, by field). ``--real-nvml``
   also times the real pynvml when a driver is there.

3. CPU of the whole ``trainwatch run`` process (every thread; psutil
   ``cpu_times()`` user + system over ``--cpu-duration`` s, ≥ 20 s, after a 3 s
   warm-up; per 1 s interval from /proc/<pid>/task/*/schedstat) supervising
   ``sleep 3600`` (never beats), with ``gpu.backend: off``, then ``sim``
   with 8 GPUs at ``poll_interval: 1s`` and ``kmsg: null``, then the same with
   a quiet kernel-log file (the reader ticks every 50 ms). The GPU layer's
   share is the difference from ``off``. The job's process is not counted.

Goals (issue #3): ≤ 0.1 s for NVML events and the kernel log; ≤ 0.5 % of a
core at 1 Hz polling of 8 simulated GPUs. The machine line (nproc, load
average) is printed at the start and the end: on a small machine with other
work running, the figures are only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import select
import sqlite3
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psutil
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import (  # noqa: E402
    JOB_NAME,
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
    write_json,
)
from fake_pynvml import (  # noqa: E402
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_RESET_REQUIRED,
    FakeNvml,
)
from trainwatch.config import Gpu  # noqa: E402
from trainwatch.sources.nvml import GpuUnavailable, NvmlSource  # noqa: E402
from trainwatch.sources.nvmlevents import EVENT_WAIT_MS  # noqa: E402
from trainwatch.types import Fault, FaultKind, XidEvent  # noqa: E402
from trainwatch.watch.gpuwatch import GpuWatch  # noqa: E402

from faultinject import drills  # noqa: E402

JOB = """\
import sys, time
from trainwatch import client

period = float(sys.argv[1])
hb = client.connect()
step = 0
nxt = time.monotonic()
while True:
    hb.beat(step, loss=2.5 / (1 + step * 1e-3), grad_norm=1.0)
    step += 1
    nxt += period
    time.sleep(max(0.0, nxt - time.monotonic()))
"""

# Xids taken in turn on the 4 simulated GPUs (all made `alert` by the policy):
# 15 x 4 = 60 (GPU, Xid) pairs, so at ~5 samples/s a pair comes back after ~12 s.
XIDS = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 109, 119, 120)
SIM_GPUS = 4
DEDUP_S = 10.0  # trainwatch.state.gpuhealth.GpuHealth's dedup_window
REUSE_S = DEDUP_S + 1.0
LATENCY_GOAL_MS = 100.0
CPU_GOAL_PCT = 0.5


# --- helpers ---------------------------------------------------------------------


def fs_type(path: str) -> str:
    """The file system type that ``path`` lives on (/proc/mounts, longest prefix)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def scaled(s: Summary, k: float) -> Summary:
    return Summary(s.n, s.median * k, s.p99 * k, s.min * k, s.max * k, s.mean * k)


def plain(obj: Any) -> Any:
    """Summaries -> dicts, for the JSON file."""
    if isinstance(obj, Summary):
        return obj.as_dict()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def verdict(s: Summary, goal: float) -> str:
    tail = "p99" if s.n >= 50 else "max"
    tail_v = s.p99 if s.n >= 50 else s.max
    return (
        f"median {'meets' if s.median <= goal else 'misses'}, "
        f"{tail} {'meets' if tail_v <= goal else 'misses'}"
    )


def write_yaml_config(
    d: Path, command: list[str], gpu: dict[str, Any], xid_actions: dict[int, str] | None = None
) -> Path:
    """A config for one job named JOB_NAME, as YAML (xid_actions' keys are ints,
    which JSON cannot spell)."""
    policy: dict[str, Any] = {
        "max_restarts": 1000,
        "kill_grace": "2s",
        "backoff": {"initial": "0.2s", "max": "1s", "jitter": 0},
    }
    if xid_actions:
        policy["xid_actions"] = xid_actions
    cfg = {
        "state_dir": str(d / "s"),
        "run_dir": str(d / "r"),
        "gpu": gpu,
        "jobs": [{"name": JOB_NAME, "command": command, "policy": "default"}],
        "policies": {"default": policy},
    }
    path = d / "trainwatch.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class PairPicker:
    """(GPU, Xid) pairs in turn, each reused only ``reuse`` s after its last use."""

    def __init__(self, gpus: int, xids: tuple[int, ...], reuse: float) -> None:
        self.pairs = [(g, x) for x in xids for g in range(gpus)]
        self.last: dict[tuple[int, int], float] = {}
        self.reuse = reuse
        self.i = 0
        self.waited_s = 0.0

    def next(self) -> tuple[int, int]:
        pair = self.pairs[self.i % len(self.pairs)]
        self.i += 1
        wait = self.last.get(pair, -1e9) + self.reuse - time.monotonic()
        if wait > 0:
            self.waited_s += wait
            time.sleep(wait)
        return pair

    def used(self, pair: tuple[int, int]) -> None:
        self.last[pair] = time.monotonic()


# --- 1 (a), (b): Xid -> incident with the real `trainwatch run` --------------------


def last_id(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COALESCE(MAX(id), 0) FROM incidents").fetchone()[0])


def wait_row(db: sqlite3.Connection, after: int, tw: TrainwatchRun, timeout: float) -> sqlite3.Row:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row: sqlite3.Row | None = db.execute(
            "SELECT * FROM incidents WHERE id > ? ORDER BY id LIMIT 1", (after,)
        ).fetchone()
        if row is not None:
            return row
        if not tw.alive():
            break
        time.sleep(0.005)
    raise RuntimeError(f"no incident after id {after} within {timeout:g}s:\n{tw.stderr_tail()}")


def xid_paths(args: argparse.Namespace) -> dict[str, Any]:
    d = scratch_dir("twbg-")
    job = d / "job.py"
    job.write_text(JOB)
    kern = d / "kern.log"
    kern.write_text("")
    cfg = write_yaml_config(
        d,
        [sys.executable, str(job), "0.05"],
        {"backend": "sim", "count": SIM_GPUS, "kmsg": str(kern), "poll_interval": "1s"},
        dict.fromkeys(XIDS, "alert"),
    )
    tw = TrainwatchRun(d, cfg)
    rng = random.Random(args.seed)
    picker = PairPicker(SIM_GPUS, XIDS, REUSE_S)
    rows: dict[str, list[dict[str, float]]] = {"kmsg": [], "drill": []}
    problems: list[str] = []
    rc: int | None = None
    try:
        tw.wait_running(0, timeout=30.0)
        db = tw.ledger()
        for i in range(2 * args.xids):
            path = ("kmsg", "drill")[i % 2]
            time.sleep(rng.uniform(0.1, 0.3))
            gpu, xid = picker.next()
            after = last_id(db)
            request_s = float("nan")
            if path == "kmsg":
                line = drills.kmsg_line(
                    f"0000:{0x10 + gpu:02x}:00", xid, drills.xid_message(xid), os.getpid()
                )
                data = (line + "\n").encode()
                fd = os.open(kern, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                try:
                    t0 = time.time()
                    os.write(fd, data)
                finally:
                    os.close(fd)
            else:
                t0 = time.time()
                drills.gpu_xid(str(tw.run_dir), gpu, xid)
                request_s = time.time() - t0
            picker.used((gpu, xid))
            row = wait_row(db, after, tw, timeout=10.0)
            ev = json.loads(row["evidence"])
            want_source = "kmsg" if path == "kmsg" else "drill"
            got = (row["kind"], row["gpu"], ev.get("xid"), ev.get("source"), row["action"])
            if got != ("gpu_xid", gpu, xid, want_source, "alert"):
                problems.append(f"{path} Xid {xid} on GPU {gpu}: got {got}")
                continue
            rows[path].append(
                {
                    "to_incident_s": float(row["time"]) - t0,
                    "detection_latency_s": float(row["detection_latency_s"]),
                    "request_s": request_s,
                }
            )
        status = tw.status() or {}
        if status.get("state") != "running" or int(status.get("attempt", -1)) != 0:
            problems.append(
                f"job is {status.get('state')} attempt {status.get('attempt')}, "
                "expected attempt 0 still running"
            )
        incidents = last_id(db)
        db.close()
    finally:
        rc = tw.stop()
    if rc != 130:
        problems.append(f"trainwatch run exited {rc} after SIGINT (expected 130)")
    remove(d, args.keep)

    def col(p: str, key: str) -> Summary:
        return summarize([r[key] * 1000.0 for r in rows[p]])

    return {
        "kmsg": {
            "to_incident_ms": col("kmsg", "to_incident_s"),
            "detection_latency_ms": col("kmsg", "detection_latency_s"),
        },
        "drill": {
            "to_incident_ms": col("drill", "to_incident_s"),
            "detection_latency_ms": col("drill", "detection_latency_s"),
            "request_ms": col("drill", "request_s"),
        },
        "incidents": incidents,
        "paced_wait_s": picker.waited_s,
        "problems": problems,
        "exit_code": rc,
    }


# --- 1 (c), (d): NVML's event thread and the poll, in this process ----------------


@contextlib.contextmanager
def fake_pynvml(fake: FakeNvml) -> Iterator[None]:
    """``import pynvml`` gives ``fake`` while inside."""
    saved = sys.modules.get("pynvml")
    sys.modules["pynvml"] = cast(types.ModuleType, fake)
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved


def event_callback(n: int, rng: random.Random) -> Summary:
    """(c1) emit_xid -> NvmlSource's event thread calls back, µs."""
    fake = FakeNvml(gpus=8)
    src = NvmlSource(fake)
    src.start()
    got: queue.SimpleQueue[tuple[float, list[XidEvent]]] = queue.SimpleQueue()
    if not src.start_event_thread(lambda evs: got.put((time.perf_counter(), evs))):
        raise RuntimeError("NvmlSource: no Xid events registered on the fake")
    out: list[float] = []
    try:
        for i in range(n):
            time.sleep(rng.uniform(0.002, 0.01))
            gpu, xid = i % 8, 1000 + i
            t0 = time.perf_counter()
            fake.emit_xid(gpu, xid)
            t1, evs = got.get(timeout=5.0)
            if [(e.gpu, e.xid) for e in evs] != [(gpu, xid)]:
                raise RuntimeError(f"event thread delivered {evs}, expected Xid {xid} on {gpu}")
            out.append((t1 - t0) * 1e6)
    finally:
        src.stop()
        src.close()
    return summarize(out)


@dataclass
class Delivered:
    at: float  # perf_counter when drain() returned it
    fault: Fault


class LoopThread:
    """Stands in for the supervisor's loop: sleeps in select() on a wake-up pipe
    (the GpuWatch's ``wake``) and drains the GpuWatch each time it wakes."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.faults: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
        self.watch: GpuWatch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-loop", daemon=True)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.w, b"\0")

    def start(self, watch: GpuWatch) -> None:
        self.watch = watch
        self._thread.start()

    def _run(self) -> None:
        assert self.watch is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([self.r], [], [], 0.5)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.r, 512)
            faults = self.watch.drain()
            now = time.perf_counter()
            for f in faults:
                self.faults.put(Delivered(now, f))

    def next_fault(
        self, kind: FaultKind, gpu: int, xid: int | None = None, *, timeout: float
    ) -> Delivered:
        """The next fault of ``kind`` on ``gpu`` (and with Xid ``xid``); others are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {kind.value} fault on GPU {gpu} from GpuWatch")
            d = self.faults.get(timeout=left)
            f = d.fault
            if f.kind is kind and f.gpu == gpu and (xid is None or f.evidence.get("xid") == xid):
                return d

    def close(self) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(2.0)
        os.close(self.r)
        os.close(self.w)


def gpuwatch_paths(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """(c2) emit_xid -> fault out of GpuWatch.drain(); (d) lose() -> gpu_lost fault."""
    fake = FakeNvml(gpus=8)
    state = scratch_dir("twbgw-")
    loop = LoopThread()
    spec = Gpu(backend="nvml", poll_interval=args.poll_interval, kmsg=None)
    with fake_pynvml(fake):
        watch = GpuWatch(spec, str(state), loop.wake)
        watch.start()
    if watch.backend is None or not watch.up["nvml"]:
        raise RuntimeError("GpuWatch did not start on the fake NVML")
    loop.start(watch)
    xid_us: list[float] = []
    lost_ms: list[float] = []
    kinds: dict[str, int] = {}
    try:
        for i in range(args.events):
            time.sleep(rng.uniform(0.002, 0.01))
            gpu, xid = i % 8, 2000 + i
            t0 = time.perf_counter()
            fake.emit_xid(gpu, xid)
            d = loop.next_fault(FaultKind.GPU_XID, gpu, xid, timeout=5.0)
            xid_us.append((d.at - t0) * 1e6)
        for i in range(args.lost):
            gpu = i % 8
            error = NVML_ERROR_GPU_IS_LOST if i % 2 == 0 else NVML_ERROR_RESET_REQUIRED
            time.sleep(rng.uniform(0.0, args.poll_interval))
            t0 = time.perf_counter()
            fake.lose(gpu, error)
            d = loop.next_fault(FaultKind.GPU_LOST, gpu, timeout=args.poll_interval * 3 + 5.0)
            lost_ms.append((d.at - t0) * 1e3)
            kind = str(d.fault.evidence.get("nvml"))
            kinds[kind] = kinds.get(kind, 0) + 1
            fake.gpus[gpu].lost = None  # back; its next sample is healthy again
    finally:
        loop.close()
        watch.close()
        remove(state, False)
    return {
        "to_fault_us": summarize(xid_us),
        "lost_to_fault_ms": summarize(lost_ms),
        "lost_kinds": kinds,
    }


def lost_in_one_poll() -> tuple[str | None, int]:
    """NvmlSource.poll() right after lose(): the lost GPU's sample, and how many
    GPUs of the poll were read normally."""
    fake = FakeNvml(gpus=8)
    src = NvmlSource(fake)
    src.start()
    try:
        src.poll()
        fake.lose(3)
        samples = src.poll()
    finally:
        src.close()
    ok = sum(1 for s in samples if s.lost is None and s.temperature_c is not None)
    return samples[3].lost, ok


# --- 2: one poll of 8 GPUs ----------------------------------------------------------


def poll_cost(n: int, nvml: Any | None = None) -> dict[str, Any]:
    """NvmlSource.poll() over ``nvml`` (None: the real pynvml), timed per call."""
    src = NvmlSource(nvml)
    src.start()
    try:
        gpus = len(src.gpus)
        for _ in range(100):
            src.poll()
        calls0 = sum(nvml.calls.values()) if isinstance(nvml, FakeNvml) else 0
        per_poll: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            src.poll()
            per_poll.append((time.perf_counter() - t0) * 1e6)
        calls = (sum(nvml.calls.values()) - calls0) if isinstance(nvml, FakeNvml) else 0
        name = src.gpus[0].name if src.gpus else "?"
    finally:
        src.close()
    per_gpu = [t / max(1, gpus) for t in per_poll]
    return {
        "gpus": gpus,
        "name": name,
        "per_poll_us": summarize(per_poll),
        "per_gpu_us": summarize(per_gpu),
        "calls_per_gpu": calls / n / max(1, gpus) if calls else float("nan"),
    }


def fake_call_us(reps: int = 20000) -> float:
    """The fake's own cost of one trivial NVML getter (nvmlDeviceGetPowerUsage), µs."""
    fake = FakeNvml(gpus=1)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fn = fake.nvmlDeviceGetPowerUsage
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(h)
    return (time.perf_counter() - t0) / reps * 1e6


# --- 3: CPU of `trainwatch run` -------------------------------------------------------


def cpu_run(label: str, gpu: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    d = scratch_dir("twbc-")
    if gpu.get("kmsg") == "QUIET":
        quiet = d / "kern.log"
        quiet.write_text("")
        gpu = {**gpu, "kmsg": str(quiet)}
    cfg = write_yaml_config(d, ["sleep", "3600"], gpu)
    tw = TrainwatchRun(d, cfg, ["--heartbeat-timeout", "30s"])
    per: list[float] = []
    try:
        tw.wait_for(lambda s: s.get("state") in ("starting", "running"), 30.0, "the start")
        time.sleep(args.warmup)
        p = psutil.Process(tw.pid)
        threads = p.num_threads()
        c0 = p.cpu_times()
        x0 = voluntary_switches(tw.pid)
        w0 = time.monotonic()
        s_prev, w_prev = schedstat_ns(tw.pid), w0
        s0 = s_prev
        nxt = w0
        while True:
            nxt += 1.0
            time.sleep(max(0.0, nxt - time.monotonic()))
            s_now, w_now = schedstat_ns(tw.pid), time.monotonic()
            per.append(100.0 * (s_now - s_prev) / 1e9 / (w_now - w_prev))
            s_prev, w_prev = s_now, w_now
            if w_now - w0 >= args.cpu_duration:
                break
        c1 = p.cpu_times()
        x1 = voluntary_switches(tw.pid)
        w1 = time.monotonic()
        rss_mb = p.memory_info().rss / 1e6
        db = tw.ledger()
        incidents = last_id(db)
        db.close()
    finally:
        rc = tw.stop()
    remove(d, args.keep)
    wall = w1 - w0
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    sched_pct = 100.0 * (s_prev - s0) / 1e9 / (w_prev - w0)
    return {
        "label": label,
        "gpu": gpu,
        "window_s": wall,
        "threads": threads,
        "cpu_pct": 100.0 * cpu_s / wall,
        "cpu_ms": cpu_s * 1000.0,
        "sched_pct": sched_pct,
        "interval_pct": summarize(per),
        "wakes_per_s": (x1 - x0) / wall,
        "rss_mb": rss_mb,
        "incidents": incidents,
        "exit_code": rc,
    }


# --- main -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"machine": machine(), "tmp_fs": fs_type("/tmp")}
    print("bench_gpu: the GPU layer (Xid paths, poll cost, CPU at 1 Hz)")
    print(machine_line())
    problems: list[str] = []

    if not args.skip_xid:
        x = xid_paths(args)
        problems += x["problems"]
        out["xid"] = x
    events = event_callback(args.events, rng)
    gw = gpuwatch_paths(args, rng)
    lost_kind, lost_ok = lost_in_one_poll()
    out["events"] = {
        "to_callback_us": events,
        "to_fault_us": gw["to_fault_us"],
        "wait_ms": EVENT_WAIT_MS,
    }
    out["lost"] = {
        "to_fault_ms": gw["lost_to_fault_ms"],
        "poll_interval_s": args.poll_interval,
        "kinds": gw["lost_kinds"],
        "one_poll": lost_kind,
        "others_read": lost_ok,
    }

    print("\n1. Xid -> incident")
    if "xid" in out:
        x = out["xid"]
        print(
            f"  trainwatch run, sim backend {SIM_GPUS} GPUs, job beating every 50 ms, Xids "
            f"{', '.join(map(str, XIDS))} made 'alert' by xid_actions; /tmp is "
            f"{out['tmp_fs']}; {x['incidents']} incidents, job never restarted"
            + (
                f"; waited {x['paced_wait_s']:.1f} s for the 10 s dedup"
                if x["paced_wait_s"] > 0.05
                else ""
            )
        )
        k, dr = x["kmsg"], x["drill"]
        print(
            f"  (a) kernel log (write of an NVRM: Xid line -> ledger row): "
            f"{fmt_summary(k['to_incident_ms'], 'ms', 2)}"
        )
        print(
            f"      of which reader stamped it -> ledger row (detection_latency_s): "
            f"{fmt_summary(k['detection_latency_ms'], 'ms', 2)}"
        )
        print(
            f"      goal ≤ {LATENCY_GOAL_MS:g} ms: "
            f"{verdict(k['to_incident_ms'], LATENCY_GOAL_MS)}"
            " (the reader tails a file every 50 ms; /dev/kmsg is select()ed instead)"
        )
        print(
            f"  (b) drill over the control socket (request -> ledger row): "
            f"{fmt_summary(dr['to_incident_ms'], 'ms', 2)}"
        )
        print(
            f"      of which drill stamped it -> ledger row (detection_latency_s): "
            f"{fmt_summary(dr['detection_latency_ms'], 'ms', 2)}"
        )
        print(
            f"      the request's round trip (reply comes before the incident is written): "
            f"{fmt_summary(dr['request_ms'], 'ms', 2)}"
        )
        print(
            f"      goal ≤ {LATENCY_GOAL_MS:g} ms: {verdict(dr['to_incident_ms'], LATENCY_GOAL_MS)}"
        )
        if x["problems"]:
            print("  PROBLEM: " + "; ".join(x["problems"]))
        print(f"  trainwatch run exit code after SIGINT: {x['exit_code']} (expected 130)")
    ev = out["events"]
    print(
        f"  (c) NVML event thread, in-process over the fake pynvml (8 GPUs; the thread "
        f"waits nvmlEventSetWait_v2 with {EVENT_WAIT_MS} ms timeouts, an event ends the "
        "wait at once):"
    )
    print(
        f"      (c1) emit_xid -> NvmlSource callback: {fmt_summary(ev['to_callback_us'], 'µs', 1)}"
    )
    print(
        f"      (c2) emit_xid -> GpuWatch queue + wake-up pipe -> loop thread's drain() -> "
        f"gpu_xid fault: {fmt_summary(ev['to_fault_us'], 'µs', 1)}"
    )
    print(
        f"      goal ≤ {LATENCY_GOAL_MS:g} ms: (c2) "
        f"{verdict(scaled(ev['to_fault_us'], 1e-3), LATENCY_GOAL_MS)}; the ledger row "
        "comes after that, as in (b)'s detection_latency_s"
    )
    lo = out["lost"]
    print(
        f"  (d) poll path, in-process: one NvmlSource.poll() right after lose(3) -> GPU 3's "
        f"sample lost={lo['one_poll']!r}, the other {lo['others_read']} of 7 read normally"
    )
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(lo["kinds"].items()))
    print(
        f"      lose() at a random phase -> GpuWatch gpu_lost fault, poll_interval "
        f"{args.poll_interval:g} s ({kinds}): {fmt_summary(lo['to_fault_ms'], 'ms', 1)}"
    )
    print(
        f"      bound: one poll_interval ({args.poll_interval * 1000:g} ms) plus one poll; "
        "expected median about half of it"
    )

    print("\n2. one poll through the fake pynvml")
    pc = poll_cost(args.polls, FakeNvml(gpus=8))
    fake_us = fake_call_us()
    out["poll"] = {**pc, "fake_call_us": fake_us}
    print(f"  NvmlSource.poll() of {pc['gpus']} GPUs: {fmt_summary(pc['per_poll_us'], 'µs', 1)}")
    print(f"  per GPU: {fmt_summary(pc['per_gpu_us'], 'µs', 2)}")
    print(
        f"  {pc['calls_per_gpu']:.0f} NVML calls per GPU per poll; the fake's own cost of one "
        f"trivial call {fake_us:.2f} µs, so about {pc['calls_per_gpu'] * fake_us:.0f} µs "
        "of each GPU's figure is the fake (the real calls go through ctypes to the driver)"
    )
    if args.real_nvml:
        try:
            real = poll_cost(args.polls)
        except GpuUnavailable as e:
            print(f"  real NVML: not here ({e})")
        else:
            out["poll_real"] = real
            print(
                f"  real NVML, {real['gpus']} x {real['name']}: per poll "
                f"{fmt_summary(real['per_poll_us'], 'µs', 1)}"
            )
            print(f"  real NVML per GPU: {fmt_summary(real['per_gpu_us'], 'µs', 1)}")

    print(
        f"\n3. CPU of trainwatch run (job: sleep 3600, never beats; window "
        f"{args.cpu_duration:g} s after {args.warmup:g} s)"
    )
    runs = [
        cpu_run("gpu.backend off", {"backend": "off"}, args),
        cpu_run(
            "sim, 8 GPUs, poll_interval 1s, kmsg null",
            {"backend": "sim", "count": 8, "poll_interval": "1s", "kmsg": None},
            args,
        ),
        cpu_run(
            "sim, 8 GPUs, poll_interval 1s, kmsg: a quiet file",
            {"backend": "sim", "count": 8, "poll_interval": "1s", "kmsg": "QUIET"},
            args,
        ),
    ]
    base, base_s = runs[0]["cpu_pct"], runs[0]["sched_pct"]
    for r in runs:
        share = ""
        if r is not runs[0]:
            share = (
                f"; GPU layer over off: {r['cpu_pct'] - base:+.3f} % "
                f"(schedstat {r['sched_pct'] - base_s:+.3f} %)"
            )
        print(
            f"  {r['label']}: {r['cpu_pct']:.3f} % of a core by psutil cpu_times "
            f"({r['cpu_ms']:.0f} ms CPU in {r['window_s']:.1f} s, 10 ms ticks), "
            f"{r['sched_pct']:.3f} % by schedstat (ns){share}"
        )
        print(
            f"      {r['threads']} threads; {r['wakes_per_s']:.1f} wake-ups/s; "
            f"RSS {r['rss_mb']:.1f} MB; per 1 s interval (schedstat): "
            f"{fmt_summary(r['interval_pct'], '%', 3)}"
        )
        if r["incidents"]:
            problems.append(f"{r['label']}: {r['incidents']} incident(s)")
        if r["exit_code"] != 130:
            problems.append(f"{r['label']}: trainwatch exited {r['exit_code']}")
    out["cpu"] = {
        "runs": runs,
        "off_pct": base,
        "sim_pct": runs[1]["cpu_pct"],
        "sim_kmsg_pct": runs[2]["cpu_pct"],
        "share_pct": runs[1]["cpu_pct"] - base,
        "share_kmsg_pct": runs[2]["cpu_pct"] - base,
        "sched_off_pct": base_s,
        "sched_sim_pct": runs[1]["sched_pct"],
        "sched_sim_kmsg_pct": runs[2]["sched_pct"],
    }
    c = out["cpu"]
    print(
        f"  goal ≤ {CPU_GOAL_PCT:g} % of a core at 1 Hz x 8 simulated GPUs (whole process, "
        f"psutil): kmsg null {'meets' if c['sim_pct'] <= CPU_GOAL_PCT else 'misses'} "
        f"({c['sim_pct']:.3f} %); with the kernel-log file "
        f"{'meets' if c['sim_kmsg_pct'] <= CPU_GOAL_PCT else 'misses'} "
        f"({c['sim_kmsg_pct']:.3f} %)"
    )
    if problems:
        print("PROBLEM: " + "; ".join(problems))
    print(machine_line().replace("machine:", "machine at the end:"))
    out["problems"] = problems
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--xids",
        type=int,
        default=100,
        help="samples of each end-to-end Xid path, kernel log and drill (default 100)",
    )
    p.add_argument(
        "--events",
        type=int,
        default=500,
        help="in-process NVML event samples, (c1) and (c2) each (default 500)",
    )
    p.add_argument("--lost", type=int, default=20, help="lost-GPU samples (default 20)")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        help="GpuWatch's poll interval for the lost-GPU figure, s (default 1)",
    )
    p.add_argument("--polls", type=int, default=5000, help="timed polls of 8 GPUs (default 5000)")
    p.add_argument(
        "--real-nvml",
        action="store_true",
        help="also time NvmlSource.poll() over the real pynvml, if a driver is here",
    )
    p.add_argument(
        "--cpu-duration",
        type=float,
        default=20.0,
        help="CPU window per configuration, s (≥ 20; default 20)",
    )
    p.add_argument("--warmup", type=float, default=3.0, help="s before each CPU window")
    p.add_argument("--skip-xid", action="store_true", help="skip the end-to-end (a) and (b)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the temp dirs")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_json(args.json, plain(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
