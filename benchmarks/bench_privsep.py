"""What privilege separation costs (issue 21): a job's *hand* (trainwatch.privsep,
a process forked from the daemon as the job's user) does every listing,
judgement and hash in the job's folders; here is what that costs, and whether a
job user can still grow the daemon.

How (run as root: a local system user ``twprivsep`` is created when missing, as
the tests' ``local_user`` does; a scratch folder under /tmp, 0755, removed at the
end; disk use 1 GiB for (b)):

(a) A hand call's round trip: ``Hand.call(os.getuid)`` on a warm hand as that
    user, ``--calls`` times (median, p99); the first call of a new hand (fork,
    drop to the user, answer), 20 hands. For scale, one catalog refresh of an
    unchanged folder of 10 checkpoints, as the loop makes it: ``OnDisk.refresh()``
    in process vs ``HandDisk.refresh()`` over a warm hand.
(b) Judge + verify of a 1 GiB checkpoint (``step_1000/``: 8 files of 128 MiB of
    random bytes and a marker, generic layout, owned by the user, 0600), cold:
    each file fsynced and dropped from the page cache with
    ``posix_fadvise(DONTNEED)`` first (as bench_verify.py). Judge: a forced
    listing and judgement by a new ``OnDisk`` (in process) or ``HandDisk`` (in a
    hand as the user); verify: ``Verifier.verify()`` with the manifest already
    made (a check: what a relaunch waits for; docs/figures.md's 0.37 s) and without
    one (made now), the verifier without a hand vs with one. The hands are warm
    (forked before), as a running daemon's are. ``--n`` rounds (default 5), the
    two ways interleaved per round so that a busy machine hurts both alike.
(c) The daemon's memory after planted files: a real ``trainwatch daemon``
    (bench_daemon.py's host: 4 jobs x 8 ranks of ``tests/jobs/printer.py``
    beating at 10 Hz through the client and checkpointing every 5 s, 8 sim GPUs)
    whose jobs run as the user (a copy of trainwatch in the scratch folder on
    their PYTHONPATH, ``/usr/bin/python3.X``). After (d): its RSS, USS (private
    pages) and PSS (median of 5 samples, 1 s apart) and ``trainwatch status``
    timed 5 times. (The hands are forks of the daemon: the pages they share with
    it are split among them in PSS, so the daemon's PSS is no longer its size;
    its USS drifts up as shared pages are written (copy on write); the goal is
    judged on RSS.)
    Then, as the user, ``--plant`` (600,000) empty files ``step_<10,000,000+i>``
    in job j0's checkpoint folder and as many ``rank-<i>-999999`` (ring names,
    sources/ring.py ``file_name``) in its attempt's ring folder (the job's
    ``TRAINWATCH_RING_DIR``, read from its environment). Waited for: the
    daemon's log line that the catalog's listing was cut (or that the hand did
    not answer), and the ring warning; ``status`` is timed every 5 s meanwhile.
    Then the files are deleted, and after ``--after`` (75 s: the catalog lists
    again within RELIST_MAX, 60 s) the memory is sampled again (median of 10).
    The daemon's catalog is asked (``trainwatch checkpoints j0 --json``) until
    it no longer shows a planted step, and the hand's listing of the planted
    folder is timed here too (a new hand as the user, ``HandDisk.refresh``).
    ``--what steps|rings`` plants one kind only; ``--what none`` is a control:
    the same timeline (``--control-wait`` s in place of planting and waiting),
    nothing planted, to tell the drift from the growth.
    Goal: the daemon back within 5 MB of its baseline. Every hand (a child of
    the daemon with the daemon's command line, the job's uid) is reported apart:
    count, RSS and PSS, and new hands forked meanwhile. VmHWM gives the peak.
(d) The daemon's CPU with 4 jobs x 8 ranks checkpointing: bench_daemon.py's
    steady-state measurement (utime+stime over ``--seconds``, 30 s, and the
    median of six schedstat windows) after ``--settle`` s, plus the CPU of its
    hands over the same 30 s (schedstat: a hand's share is below a 10 ms tick)
    and the daemon's cutime+cstime (hands reaped meanwhile). Goal: <= 0.5 % of
    a core; the hands are part of the cost.

Every process started is killed at the end by pid (bench_daemon's cleanup);
hands left after the daemon is gone are counted and reported (a leak).
``--root-jobs`` runs (c) and (d) with the jobs as root (their hands too), for
contrast. ``--parts`` picks parts (default ``abcd``).

Run: ``.venv/bin/python benchmarks/bench_privsep.py [--n 5] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_daemon
from _common import (
    TRAINWATCH,
    fmt_summary,
    machine,
    machine_line,
    remove,
    schedstat_ns,
    scratch_dir,
    summarize,
    write_json,
)
from bench_verify import FILES, TOTAL, drop_cache, resident, write_checkpoint
from trainwatch.config import Checkpoints
from trainwatch.privsep import child, credentials
from trainwatch.privsep.credentials import Identity
from trainwatch.privsep.hand import Hand
from trainwatch.sources import ring
from trainwatch.state.checkpointlayout import make_layout
from trainwatch.state.handdisk import HandDisk
from trainwatch.state.manifest import Store
from trainwatch.state.ondisk import OnDisk
from trainwatch.state.verifier import Verifier

USER = "twprivsep"
GB = 1e9
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
STEP = 1000
PLANT_BASE = 10_000_000  # planted steps: above every real one (the newest are kept)
RING_PID = 999_999  # planted rings' pid: not one of the job's


# --- the user -------------------------------------------------------------------


def bench_user() -> Identity:
    """The local system user the jobs and hands run as, created when missing."""
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                        "/usr/sbin/nologin", USER], check=True, capture_output=True, timeout=30)
    ident = credentials.resolve(USER, None)
    assert ident is not None
    return ident


def as_user(ident: Identity, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` in a child that dropped to the user (planting is the user's doing)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups(list(ident.groups))
            os.setresgid(ident.gid, ident.gid, ident.gid)
            os.setresuid(ident.uid, ident.uid, ident.uid)
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{fn.__name__} as {USER} failed")


def chown_tree(path: Path, ident: Identity) -> None:
    os.chown(path, ident.uid, ident.gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.chown(os.path.join(root, n), ident.uid, ident.gid)


def user_site(d: Path) -> Path:
    """trainwatch copied where the user can read it (the checkout's interpreter is under
    /root); the client needs nothing else."""
    import trainwatch

    site = d / "site"
    shutil.copytree(Path(trainwatch.__file__).parent, site / "trainwatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for root, _dirs, files in os.walk(site):
        os.chmod(root, 0o755)
        for n in files:
            os.chmod(os.path.join(root, n), 0o644)
    return site


def user_python(site: Path) -> str:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", "/usr/bin/python3"):
        probe = subprocess.run(
            ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", python, "-c",
             "import trainwatch.client"], env={"PATH": os.defpath, "PYTHONPATH": str(site)},
            capture_output=True, check=False, timeout=60)
        if probe.returncode == 0:
            return python
    raise RuntimeError(f"no {version} that {USER} can run trainwatch.client with")


# --- (a) a call's round trip ------------------------------------------------------


def part_a(ident: Identity, d: Path, calls: int) -> dict[str, Any]:
    first = []
    for i in range(20):
        h = Hand(f"bench first {i}", ident)
        try:
            t0 = time.perf_counter()
            uid = h.call(os.getuid, timeout=10)
            first.append((time.perf_counter() - t0) * 1e3)
            assert uid == ident.uid, uid
        finally:
            h.close()
    h = Hand("bench", ident)
    try:
        for _ in range(50):
            h.call(os.getuid, timeout=10)
        rt = []
        for _ in range(calls):
            t0 = time.perf_counter()
            h.call(os.getuid, timeout=10)
            rt.append((time.perf_counter() - t0) * 1e6)
        # The loop's call: a refresh of an unchanged folder of 10 checkpoints.
        ck = d / "a_ckpt"
        ck.mkdir()
        for s in range(10, 110, 10):
            (ck / f"step_{s}").write_text(str(s))
        chown_tree(ck, ident)
        spec = Checkpoints(dir=str(ck), layout="generic", quiet_for=0.0)
        local = OnDisk(make_layout(spec, {}, {}), str(ck))
        remote = HandDisk(make_layout(spec, {}, {}), str(ck), h, "bench a")
        local.refresh(True)
        remote.refresh(True)
        assert len(remote.verdicts) == 10 and all(v[1] for v in remote.verdicts.values())
        refresh: dict[str, list[float]] = {"in process": [], "in a hand": []}
        for _ in range(max(100, calls // 4)):
            for name, disk in (("in process", local), ("in a hand", remote)):
                t0 = time.perf_counter()
                disk.refresh()
                refresh[name].append((time.perf_counter() - t0) * 1e6)
    finally:
        h.close()
    return {"first_call_ms": summarize(first), "round_trip_us": summarize(rt),
            "refresh_us": {k: summarize(v) for k, v in refresh.items()}}


# --- (b) judge + verify a 1 GiB checkpoint --------------------------------------------


def part_b(ident: Identity, d: Path, n: int) -> dict[str, Any]:
    ck = d / "b_ckpt"
    ck.mkdir()
    path = ck / f"step_{STEP}"
    files = write_checkpoint(path)
    (path / "done").write_text("")
    for p in files:
        p.chmod(0o600)
    chown_tree(ck, ident)
    drop_cache(files)
    out: dict[str, Any] = {"resident_after_drop": resident(files)}
    spec = Checkpoints(dir=str(ck), layout="generic", marker="done")
    quick, bulk = Hand("bench quick", ident), Hand("bench bulk", ident)
    quick.call(os.getuid, timeout=10)  # warm, as a running daemon's hands are
    bulk.call(os.getuid, timeout=10)
    store = Store(d / "b_state" / "manifests")
    ways: dict[str, Verifier] = {"in process": Verifier(store),
                                 "in a hand": Verifier(store, hand=bulk)}
    times: dict[str, dict[str, list[float]]] = {
        f"{w} {have}": {"judge": [], "verify": [], "total": []}
        for have in ("check", "make") for w in ways}
    try:
        ways["in process"].verify(STEP, str(path), 600)  # the manifest to check against
        for have in ("check", "make"):
            for i in range(n):
                for w, v in ways.items():
                    if have == "make":
                        store.drop(STEP)
                    elif store.get(STEP) is None:
                        v.verify(STEP, str(path), 600)
                    drop_cache(files)
                    t0 = time.perf_counter()
                    disk: OnDisk | HandDisk = (
                        OnDisk(make_layout(spec, {}, {}), str(ck)) if w == "in process" else
                        HandDisk(make_layout(spec, {}, {}), str(ck), quick, f"bench b {i} {have}"))
                    disk.refresh(True)
                    t1 = time.perf_counter()
                    verdict = disk.verdicts.get(STEP)
                    assert verdict is not None and verdict[1], (w, verdict)
                    ok, why = v.verify(STEP, str(path), 600)
                    t2 = time.perf_counter()
                    assert ok, (w, why)
                    want = "verified" if have == "check" else "manifest made now"
                    assert why == want, (w, have, why)
                    r = times[f"{w} {have}"]
                    r["judge"].append(t1 - t0)
                    r["verify"].append(t2 - t1)
                    r["total"].append(t2 - t0)
    finally:
        for v in ways.values():
            v.close()
        quick.close()
        bulk.close()
    out["times_s"] = {k: {p: summarize(x) for p, x in r.items()} for k, r in times.items()}
    return out


# --- the daemon: its hands, memory, CPU ---------------------------------------------------


def proc_stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children_ticks(pid: int) -> int:
    """cutime + cstime: children of ``pid`` it reaped (hands that exited)."""
    f = proc_stat(pid)
    return int(f[13]) + int(f[14])


def mem(pid: int) -> dict[str, float]:
    """PSS and USS (private pages, smaps_rollup), RSS and VmHWM (the peak RSS), MB.
    The hands are forks of the daemon: the pages they still share with it are
    split between them in PSS, so the daemon's PSS falls as hands are forked; USS
    and RSS do not move with them. USS grows, though, as the daemon writes to
    pages it still shared with its hands (reference counts, the GC: copy on
    write); a control run with nothing planted showed +11 MB USS and +1.5 MB RSS
    over (c)'s timeline, so the goal is judged on RSS."""
    out = {"pss": 0.0, "uss": 0.0, "rss": 0.0, "hwm": 0.0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss"] = int(line.split()[1]) / 1e3
            elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                out["uss"] += int(line.split()[1]) / 1e3
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss"] = int(line.split()[1]) / 1e3
            elif line.startswith("VmHWM:"):
                out["hwm"] = int(line.split()[1]) / 1e3
    return out


def hands_of(daemon: int) -> dict[int, int]:
    """{pid: uid} of the daemon's hands: its children named as hands (not a keeper
    between its fork and its exec, which has the daemon's command line)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(proc_stat(int(p.name))[1]) == daemon \
                    and (p / "comm").read_bytes().rstrip(b"\n") == child.NAME:
                out[int(p.name)] = proc_uid(int(p.name))
    return out


def proc_uid(pid: int) -> int:
    """The real uid, from Uid: (a hand that dropped from root is not dumpable, so its
    /proc files are root's whatever its uid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise ValueError(f"no Uid: for {pid}")


def stray_hands(cmd: bytes, uid: int | None) -> list[int]:
    """Processes with the daemon's command line left after it is gone (leaked hands)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if (p / "cmdline").read_bytes() == cmd and (
                        uid is None or proc_uid(int(p.name)) == uid):
                    out.append(int(p.name))
    return out


def cgroup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text().strip()
    except OSError:
        return "?"


def hands_mem(daemon: int) -> dict[str, Any]:
    hs = hands_of(daemon)
    ms = [mem(p) for p in hs]
    return {"pids": sorted(hs), "uids": sorted(set(hs.values())), "n": len(hs),
            "in_daemon_cgroup": sum(1 for p in hs if cgroup(p) == cgroup(daemon)),
            "rss": sum(m["rss"] for m in ms), "pss": sum(m["pss"] for m in ms),
            "uss": sum(m["uss"] for m in ms),
            "max_rss": max((m["rss"] for m in ms), default=0.0)}


class UserHost(bench_daemon.Host):
    """bench_daemon's host, its jobs run as ``ident`` (None: as root, as there)."""

    def __init__(self, d: Path, ident: Identity | None, site: Path | None,
                 python: str | None) -> None:
        self.ident, self.site, self.python = ident, site, python
        super().__init__(d, bench_daemon.RANKS, "sim")

    def write_config(self) -> None:
        super().write_config()
        if self.ident is None:
            return
        assert self.site is not None and self.python is not None
        cfg = json.loads(self.config.read_text())
        for job in cfg["jobs"]:
            jd = self.d / job["name"]
            job["user"] = USER
            job["workdir"] = str(jd)
            job["env"] = {"PYTHONPATH": str(self.site)}
            job["command"][0] = self.python
            chown_tree(jd, self.ident)
        self.config.write_text(json.dumps(cfg, indent=1) + "\n")

    def log_path(self) -> Path:
        return self.d / f"daemon-{self.n - 1}.out"

    def log(self) -> str:
        try:
            return self.log_path().read_text(errors="replace")
        except OSError:
            return ""


def time_status(h: UserHost) -> tuple[float, int]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([TRAINWATCH, "status", "--config", str(h.config)],
                           capture_output=True, timeout=60, check=False)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = -1
    return time.perf_counter() - t0, rc


def part_d(h: UserHost, seconds: float) -> dict[str, Any]:
    assert h.daemon is not None
    pid = h.daemon.pid
    # The hands' CPU in ns (schedstat): a hand's share is far below a 10 ms tick.
    before = {p: (bench_daemon.start_time(p), schedstat_ns(p)) for p in hands_of(pid)}
    reaped0 = children_ticks(pid)
    t0 = time.monotonic()
    steady = bench_daemon.steady(h, seconds)
    elapsed = time.monotonic() - t0
    after = hands_of(pid)
    ns = 0
    for p in after:
        with contextlib.suppress(OSError, ValueError, IndexError):
            t = schedstat_ns(p)
            if p in before and before[p][0] == bench_daemon.start_time(p):
                t -= before[p][1]
            ns += t
    reaped = children_ticks(pid) - reaped0
    hands_pct = 100.0 * ns / 1e9 / elapsed
    reaped_pct = 100.0 * reaped / TICK / elapsed
    return {**steady, "hands": len(after), "hands_new": len(set(after) - set(before)),
            "hands_cpu_pct": hands_pct, "reaped_cpu_pct": reaped_pct,
            "with_hands_cpu_pct": steady["cpu_pct_stat_total"] + hands_pct + reaped_pct,
            "mem": mem(pid), "hands_mem": hands_mem(pid)}


class Sampler(threading.Thread):
    """The daemon's and its hands' memory every 0.5 s, in a thread."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, dict[str, float], dict[str, Any]]] = []
        self.stop_ = threading.Event()
        self.hand_pids: set[int] = set()

    def run(self) -> None:
        while not self.stop_.wait(0.5):
            hm = hands_mem(self.pid)
            self.hand_pids.update(hm["pids"])
            self.samples.append((time.monotonic(), mem(self.pid), hm))


def settle_mem(pid: int, n: int) -> dict[str, Any]:
    ms, hs = [], []
    for i in range(n):
        if i:
            time.sleep(1)
        ms.append(mem(pid))
        hs.append(hands_mem(pid))
    return {"pss": statistics.median(m["pss"] for m in ms),
            "uss": statistics.median(m["uss"] for m in ms),
            "rss": statistics.median(m["rss"] for m in ms), "hwm": ms[-1]["hwm"],
            "hands": hs[-1]}


def plant(folder: str, names: list[str]) -> None:
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    for n in names:
        os.close(os.open(os.path.join(folder, n), flags, 0o644))


def job_env(pid: int, key: str) -> str | None:
    for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        k, _, v = kv.partition(b"=")
        if k.decode() == key:
            return v.decode()
    return None


def planted_listed(h: UserHost) -> int | None:
    """Planted steps among the (newest 200) checkpoints ``trainwatch checkpoints j0``
    shows; None when it gave no answer."""
    try:
        p = subprocess.run([TRAINWATCH, "checkpoints", "j0", "--json", "--config",
                            str(h.config)], capture_output=True, timeout=60, check=False)
        cps = json.loads(p.stdout)["checkpoints"]
    except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return None
    return sum(1 for c in cps if int(c["step"]) >= PLANT_BASE)


def log_times(text: str, marks: dict[str, str], since: float) -> dict[str, float]:
    """Seconds from ``since`` (time.time()) to the first log line with each mark."""
    seen: dict[str, float] = {}
    for line in text.splitlines():
        for what, mark in marks.items():
            if what not in seen and mark in line:
                with contextlib.suppress(ValueError):
                    seen[what] = datetime.fromisoformat(line.split(" ", 1)[0]).timestamp() - since
    return seen


def time_listing(ident: Identity | None, folder: str, runs: int = 3) -> list[float]:
    """The daemon's call, made here: a new hand lists and judges the folder."""
    spec = Checkpoints(dir=folder, layout="generic")
    out = []
    logging.getLogger("trainwatch").setLevel(logging.CRITICAL)  # its "cut" line: the daemon's
    for i in range(runs):
        hand = Hand(f"bench listing {i}", ident)
        try:
            hand.call(os.getuid, timeout=10)
            disk = HandDisk(make_layout(spec, {}, {}), folder, hand, f"bench c {i}", timeout=120)
            t0 = time.perf_counter()
            disk.refresh(True)
            out.append(time.perf_counter() - t0)
            if disk.unanswered:
                raise RuntimeError(f"the listing of {folder}: {disk.why_unanswered}")
        finally:
            hand.close()
    return out


def part_c(h: UserHost, ident: Identity | None, count: int, what: str, after: float,
           control_wait: float) -> dict[str, Any]:
    """``what``: steps, rings, both, or none (a control: the same timeline, nothing planted)."""
    assert h.daemon is not None
    pid = h.daemon.pid
    if what == "none":
        count = 0
    out: dict[str, Any] = {"planted": count, "what": what}
    out["status_before_s"] = summarize([time_status(h)[0] for _ in range(5)])
    out["baseline"] = settle_mem(pid, 5)
    st = h.status("j0")
    ckpt = str(h.d / "j0" / "ckpt")
    rings = job_env(int(st["pid"]), ring.ENV)
    if rings is None:
        raise RuntimeError(f"job j0 (pid {st['pid']}) has no {ring.ENV}")
    out["ring_dir"] = rings
    plan: list[tuple[str, list[str]]] = []
    if what in ("steps", "both"):
        plan.append((ckpt, [f"step_{PLANT_BASE + i}" for i in range(count)]))
    if what in ("rings", "both"):
        names = [ring.file_name(i, RING_PID) for i in range(count)]
        assert all(ring.parse_name(n) is not None for n in names[:10])
        plan.append((rings, names))
    log0 = len(h.log())
    wall0, t0 = time.time(), time.monotonic()
    sampler = Sampler(pid)
    sampler.start()
    for folder, names in plan:
        if ident is not None:
            as_user(ident, plant, folder, names)
        else:
            plant(folder, names)
    out["plant_s"] = time.monotonic() - t0
    statuses: list[tuple[float, int]] = []
    marks = {"catalog listing cut": "checkpoints are kept track of",
             "catalog hand gave no answer": "not judged:",
             "rings refused": "not reading the ring"}
    want = {"catalog listing cut"} if what in ("steps", "both") else set()
    if what in ("rings", "both"):
        want.add("rings refused")
    deadline = (t0 + control_wait if what == "none" else time.monotonic() + 240)
    next_status = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        h.alive_or_fail("the daemon to look at the planted files")
        seen = log_times(h.log()[log0:], marks, wall0)
        if time.monotonic() >= next_status:
            statuses.append(time_status(h))
            next_status = time.monotonic() + 5
        looked = (want <= set(seen) or ("catalog hand gave no answer" in seen
                                        and want - set(seen) <= {"catalog listing cut"}))
        if what != "none" and looked and len(statuses) >= 5 and (
                time.monotonic() - t0 > max(seen.values()) + 15):
            break
        time.sleep(0.25)
    out["seen_s"] = seen  # from the start of planting
    out["status_during_s"] = summarize([s for s, _ in statuses])
    out["status_during_rc"] = sorted({rc for _, rc in statuses})
    out["planted_listed"] = planted_listed(h)
    out["during_peak"] = {
        "pss": max((m["pss"] for _, m, _ in sampler.samples), default=0.0),
        "uss": max((m["uss"] for _, m, _ in sampler.samples), default=0.0),
        "rss": max((m["rss"] for _, m, _ in sampler.samples), default=0.0),
        "hands_rss": max((hm["rss"] for _, _, hm in sampler.samples), default=0.0),
        "hand_max_rss": max((hm["max_rss"] for _, _, hm in sampler.samples), default=0.0),
        "hwm": mem(pid)["hwm"]}
    if what in ("steps", "both"):
        out["listing_here_s"] = summarize(time_listing(ident, ckpt))
    t0 = time.monotonic()
    for folder, names in plan:
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, n))
    out["delete_s"] = time.monotonic() - t0
    # At least ``after``; and until the catalog has forgotten the planted steps.
    time.sleep(after)
    deadline = time.monotonic() + 120
    left = planted_listed(h)
    while left and time.monotonic() < deadline:
        time.sleep(5)
        left = planted_listed(h)
    out["planted_listed_after"] = left
    out["after_s"] = time.monotonic() - t0
    sampler.stop_.set()
    sampler.join()
    out["after"] = settle_mem(pid, 10)
    out["hands_forked"] = len((sampler.hand_pids | set(out["after"]["hands"]["pids"]))
                              - set(out["baseline"]["hands"]["pids"]))
    text = h.log()[log0:]
    out["log"] = [line for line in text.splitlines()  # the job's own progress left out
                  if "checkpoint step" not in line][:40]
    out["status_after_s"] = summarize([time_status(h)[0] for _ in range(5)])
    return out


def daemon_parts(args: argparse.Namespace, ident: Identity | None, d: Path,
                 result: dict[str, Any]) -> None:
    site = python = None
    if ident is not None:
        site = user_site(d)
        python = user_python(site)
    h = UserHost(d / "main", ident, site, python)
    cmd = b""
    try:
        t0 = h.start()
        h.wait_ready(t0)
        h.all_running(90)
        assert h.daemon is not None
        cmd = Path(f"/proc/{h.daemon.pid}/cmdline").read_bytes()
        time.sleep(args.settle)
        if "d" in args.parts:
            result["d"] = part_d(h, args.seconds)
            print_d(result["d"])
        if "c" in args.parts:
            result["c"] = part_c(h, ident, args.plant, args.what, args.after,
                                 args.control_wait)
            print_c(result["c"])
        h.terminate()
    finally:
        h.close()
    if cmd:
        deadline = time.monotonic() + 10
        left = stray_hands(cmd, ident.uid if ident else None)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = stray_hands(cmd, ident.uid if ident else None)
        result["hands_left_after_daemon"] = left
        print(f"hands left after the daemon stopped: {len(left)} {left if left else ''}")
        for p in left:  # ours: the daemon's children, by pid
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


# --- printing ----------------------------------------------------------------------


def print_a(a: dict[str, Any]) -> None:
    print("\n(a) a hand call (Hand.call(os.getuid), as the user)")
    print(f"  round trip, warm hand:       {fmt_summary(a['round_trip_us'], 'µs', 1)}")
    print(f"  first call (fork+drop):      {fmt_summary(a['first_call_ms'], 'ms', 2)}")
    for k, s in a["refresh_us"].items():
        print(f"  refresh, 10 ckpts, {k:10s} {fmt_summary(s, 'µs', 1)}")


def print_b(b: dict[str, Any]) -> None:
    left = b["resident_after_drop"]
    print(f"\n(b) judge + verify of a {TOTAL / GB:.3f} GB checkpoint ({FILES} files), cold "
          f"(resident after DONTNEED: {'?' if left is None else left} bytes), s")
    for k, r in b["times_s"].items():
        print(f"  {k:24s} total {fmt_summary(r['total'], 's')}")
        print(f"  {'':24s}  judge median {r['judge'].median:.4f} s, verify median"
              f" {r['verify'].median:.3f} s")


def print_d(r: dict[str, Any]) -> None:
    print(f"\n(d) the daemon with 4 jobs x {bench_daemon.RANKS} ranks checkpointing, "
          f"{r['seconds']:.0f} s")
    ok = "ok" if r["cpu_pct_stat_total"] <= 0.5 else "MISSED"
    print(f"  daemon CPU, utime+stime:     {r['cpu_pct_stat_total']:.3f} % of a core"
          f"  goal <= 0.5 %  {ok}")
    print(f"  daemon CPU, schedstat:       {fmt_summary(r['cpu_pct_windows'], '%')}")
    print(f"  daemon wake-ups (all threads): {r['wakeups_per_s']:.0f} /s, {r['threads']} threads")
    print(f"  its hands ({r['hands']}, {r['hands_new']} new): "
          f"{r['hands_cpu_pct']:.3f} %; reaped children {r['reaped_cpu_pct']:.3f} %")
    ok = "ok" if r["with_hands_cpu_pct"] <= 0.5 else "MISSED"
    print(f"  daemon + hands:              {r['with_hands_cpu_pct']:.3f} % of a core"
          f"  goal <= 0.5 %  {ok}")
    hm = r["hands_mem"]
    m = r["mem"]
    print(f"  daemon PSS {fmt_summary(r['pss_mb'], 'MB', 1)}")
    print(f"  daemon RSS {m['rss']:.1f} MB, USS {m['uss']:.1f} MB; hands RSS {hm['rss']:.1f} MB,"
          f" PSS {hm['pss']:.1f}, USS {hm['uss']:.1f} MB in all; keepers"
          f" {r['keepers_cpu_pct_total']:.3f} %")
    print(f"  hands as uid {hm['uids']}, {hm['in_daemon_cgroup']} of {hm['n']} in the daemon's"
          " cgroup (their memory is charged to it, not to the job's)")


def print_c(c: dict[str, Any]) -> None:
    b, a, p = c["baseline"], c["after"], c["during_peak"]
    kinds = {"both": f"{c['planted']:,} step_N + {c['planted']:,} ring names",
             "steps": f"{c['planted']:,} step_N names", "rings": f"{c['planted']:,} ring names",
             "none": "nothing (a control)"}[c["what"]]
    print(f"\n(c) the daemon's memory, {kinds} planted in {c['plant_s']:.1f} s (j0),"
          f" deleted in {c['delete_s']:.1f} s")
    print(f"  daemon baseline:   RSS {b['rss']:.1f} MB, USS {b['uss']:.1f}, PSS {b['pss']:.1f}"
          f" (VmHWM {b['hwm']:.1f}); hands {b['hands']['n']}: RSS {b['hands']['rss']:.1f},"
          f" USS {b['hands']['uss']:.1f}, PSS {b['hands']['pss']:.1f} MB")
    print(f"  while planted:     peak RSS {p['rss']:.1f} MB, USS {p['uss']:.1f}, PSS"
          f" {p['pss']:.1f} (VmHWM {p['hwm']:.1f}); hands RSS peak {p['hands_rss']:.1f} MB"
          f" (largest hand {p['hand_max_rss']:.1f})")
    print("  in the log after:  " + (", ".join(f"{k} {v:.1f} s" for k, v in c["seen_s"].items())
                                     or "nothing") + " (from the start of planting)")
    print(f"  planted steps among `checkpoints j0` (newest 200): {c['planted_listed']} while"
          f" planted, {c['planted_listed_after']} after")
    if "listing_here_s" in c:
        print(f"  the hand's listing + judging of the folder, timed here: "
              f"{fmt_summary(c['listing_here_s'], 's')}")
    ok = "ok" if a["rss"] - b["rss"] <= 5 else "MISSED"  # RSS: USS drifts (see mem())
    print(f"  {c['after_s']:.0f} s after delete: RSS {a['rss']:.1f} MB"
          f" ({a['rss'] - b['rss']:+.1f}), USS {a['uss']:.1f} ({a['uss'] - b['uss']:+.1f}),"
          f" PSS {a['pss']:.1f} ({a['pss'] - b['pss']:+.1f})  goal within 5 MB  {ok}")
    print(f"  hands after:       {a['hands']['n']}: RSS {a['hands']['rss']:.1f}, USS "
          f"{a['hands']['uss']:.1f}, PSS {a['hands']['pss']:.1f} MB; hands forked meanwhile"
          f" {c['hands_forked']}")
    print(f"  trainwatch status: before {fmt_summary(c['status_before_s'], 's')}")
    print(f"                     planted {fmt_summary(c['status_during_s'], 's')}, rc "
          f"{c['status_during_rc']}")
    print(f"                     after   {fmt_summary(c['status_after_s'], 's')}")
    for line in c["log"][:12]:
        print(f"  log: {line[:200]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="abcd", help="which of a, b, c, d")
    p.add_argument("--n", type=int, default=5, help="rounds of (b)")
    p.add_argument("--calls", type=int, default=2000, help="calls timed in (a)")
    p.add_argument("--plant", type=int, default=600_000, help="files of each kind in (c)")
    p.add_argument("--what", choices=("both", "steps", "rings", "none"), default="both",
                   help="(c): what to plant; none: a control, the same timeline")
    p.add_argument("--control-wait", type=float, default=100.0,
                   help="(c) with --what none: s in place of planting and waiting")
    p.add_argument("--after", type=float, default=75.0, help="s after deleting them (c)")
    p.add_argument("--seconds", type=float, default=30.0, help="CPU measurement (d)")
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--root-jobs", action="store_true", help="(c), (d): jobs run as root")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench_privsep: run as root (a job user and hands as that user)", file=sys.stderr)
        return 2
    print(machine_line())
    ident = bench_user()
    print(f"user {USER} (uid {ident.uid}); jobs in (c), (d) as "
          f"{'root' if args.root_jobs else USER}")
    d = scratch_dir("twps")
    d.chmod(0o755)
    result: dict[str, Any] = {"machine": machine(), "user": USER, "root_jobs": args.root_jobs}
    try:
        if "a" in args.parts:
            result["a"] = part_a(ident, d, args.calls)
            print_a(result["a"])
        if "b" in args.parts:
            result["b"] = part_b(ident, d, args.n)
            print_b(result["b"])
            shutil.rmtree(d / "b_ckpt", ignore_errors=True)
        if "c" in args.parts or "d" in args.parts:
            daemon_parts(args, None if args.root_jobs else ident, d, result)
    except RuntimeError as e:
        print(f"bench_privsep: {e}", file=sys.stderr)
        return 1
    finally:
        remove(d, args.keep)
    result["machine_end"] = machine()
    print(machine_line().replace("machine:", "machine at the end:"))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
