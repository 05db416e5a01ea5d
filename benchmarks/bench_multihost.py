"""Multi-host group restarts (issue 22): a fault on one host -> every rank of a
2-host torchrun job training again, restarts counted per host, steps lost, and
each host daemon's CPU.

How (tests/test_multihost_group.py's setup, on this one machine): two
``trainwatch run --config C --no-passthrough`` processes, "hosts" hA and hB
(each its own state and run dir, ``host: hA|hB``, job ``nodes: 2``), each
running a torchrun agent of one ``--nnodes=2 --nproc-per-node=R`` job (``--ranks
R``, default 1; c10d rendezvous on 127.0.0.1, gloo, ``--monitor-interval=0.1``)
with the test's deterministic trainer: a float64 all-reduce per step, 0.1 s
sleep, rank 0 checkpointing every step into a shared folder (``step_N/`` with
a ``done`` marker). Each rank appends to a shared journal a line when it starts
(after the rendezvous and the resume: ``start`` = the step resumed from) and one
per step, each with its ``time.time()``. Policy: backoff 0.05 s (max 1 s, no
jitter), kill_grace 2 s.

Per trial, interleaved so a busy machine hurts each alike:

* crash: once every rank has stepped ``--warmup`` steps, ``--steady`` seconds of
  steady state (the daemons' CPU window), then SIGKILL of host B's first rank at
  t0 = time.time(). "started" = the last new rank's start line - t0; "stepping"
  = the last new rank's first step line - t0 (every rank of both hosts).
* stopped: the same with SIGSTOP and ``heartbeat: {timeout: 3s}``.
* restarts per fault on each host: the incidents in its ledger (D/hX/state/
  ledger.db) that name a ``group_restart``, the distinct restart numbers, and how
  many were charged (decision text "restart N of"; "not charged" is not).
* steps lost: the highest step any rank journaled before t0 minus the step the
  new ranks resumed from.
* CPU of each host's daemon: utime+stime (/proc/<pid>/stat, clock ticks) of the
  ``trainwatch run`` process and of its forks with the same command line (hands)
  over the steady window, as % of one core (one tick over 8 s is 0.125 %:
  ``--steady`` longer for finer figures). Beside it, ``single``: one
  ``trainwatch run`` of a ``--nnodes=1 --nproc-per-node=R`` torchrun job of the
  same trainer (no ``nodes``), measured over a window of the same length.
* ``--torchrun-alone`` (default on): the same two agents started without
  trainwatch (plain ``python -m torch.distributed.run ... --max-restarts=3``, no
  trainwatch variables: the client is a no-op, every start is from step 0) and
  the same SIGKILL; "started" / "stepping" as above; restarts per agent = its
  log's "attempts left" lines (charged to torchrun's budget). ``--alone-store
  own`` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as trainwatch does; the
  default (shared) once left both new workers stuck in init_process_group
  past 90 s here (multinode.md §1.3's deadlock).

Everything started is stopped by pid at the end of each run (SIGINT to
trainwatch; the agents' process groups; any trainer pid the journal names).
Goals: crash <= 5 s, stopped <= 30 s, 1 restart per host, daemon CPU no more
than a single-host job's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    fmt_summary,
    json_lines,
    machine,
    machine_line,
    remove,
    scratch_dir,
    summarize,
    write_json,
)

CRASH_GOAL_S = 5.0
STOP_GOAL_S = 30.0
TICK = os.sysconf("SC_CLK_TCK")

# tests/test_multihost_group.py's trainer, with a timestamped journal line per
# step, a start line with the time, and no end (the run is stopped).
TRAINER = textwrap.dedent(
    """
    import datetime, json, os, shutil, sys, time
    import torch
    import torch.distributed as dist
    from trainwatch import client
    ckpt, journal = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ.get("TRAINWATCH_HOST") or os.environ.get("BENCH_HOST", "?")
    target = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    w, start = torch.zeros(4, dtype=torch.float64), 0
    if client.resume_from():
        state = torch.load(os.path.join(client.resume_from(), "state.pt"))
        w, start = state["w"], state["step"]
    pid = os.getpid()
    def say(**kw):
        with open(journal, "a") as f:
            f.write(json.dumps({"rank": rank, "host": host, "pid": pid, "t": time.time(),
                                **kw}) + "\\n")
    say(start=start)
    hb = client.connect()
    for step in range(start + 1, 10**9):
        g = (w - target) * (rank + 1)
        dist.all_reduce(g)
        w = w - 0.05 * g / world
        hb.beat(step, loss=float(((w - target) ** 2).sum()) if rank == 0 else None)
        say(step=step)
        if rank == 0:
            d = os.path.join(ckpt, f"step_{step}")
            os.makedirs(d + ".tmp", exist_ok=True)
            torch.save({"w": w, "step": step}, os.path.join(d + ".tmp", "state.pt"))
            open(os.path.join(d + ".tmp", "done"), "w").close()
            shutil.rmtree(d, ignore_errors=True)
            os.rename(d + ".tmp", d)
        time.sleep(0.1)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any trainwatch variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    env.update(extra)
    return env


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (every thread), in clock ticks."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(f[11]) + int(f[12])  # fields 14 and 15 of stat(5)


def daemon_pids(pid: int) -> list[int]:
    """``pid`` and its children with its command line (its hands: forks of it)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    out = [pid]
    for k in kids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{k}/cmdline").read_bytes() == cmd:
                out.append(int(k))
    return out


def cpu_percent(pids: Sequence[int], seconds: float) -> list[float]:
    """% of one core that each pid (with its hands) used over ``seconds``."""
    groups = [daemon_pids(p) for p in pids]
    t0 = time.monotonic()
    before = [sum(cpu_ticks(q) for q in g) for g in groups]
    time.sleep(seconds)
    after = [sum(cpu_ticks(q) for q in daemon_pids(p)) for p in pids]
    dt = time.monotonic() - t0
    return [100.0 * (a - b) / TICK / dt for a, b in zip(after, before, strict=True)]


def kill_pid(pid: int, marker: bytes) -> None:
    """SIGCONT+SIGKILL ``pid`` if its command line still has ``marker`` (not reused)."""
    try:
        if marker not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
    except OSError:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Job:
    """One 2-host (or single-host) run in a scratch folder: the processes started,
    the journal, and their cleanup."""

    def __init__(self, ranks: int, hosts: int) -> None:
        self.d = scratch_dir("twmh-")
        self.ranks, self.hosts = ranks, hosts
        self.ckpt = self.d / "ckpt"
        self.ckpt.mkdir()
        self.journal = self.d / "journal.jsonl"
        self.script = self.d / "trainer.py"
        self.script.write_text(TRAINER)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def torchrun(self, port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.hosts}",
                f"--nproc-per-node={self.ranks}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=tw-bench",
                "--monitor-interval=0.1", *extra, str(self.script), str(self.ckpt),
                str(self.journal)]

    def start(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        log = self.d / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def trainwatch(self, name: str, command: list[str], nodes: int | None,
                   heartbeat: dict[str, Any] | None) -> subprocess.Popen[bytes]:
        root = self.d / name
        root.mkdir()
        job: dict[str, Any] = {"name": "job", "command": command, "resume_args": [],
                               "checkpoints": {"dir": str(self.ckpt), "pattern": "step_{step}",
                                               "marker": "done"}}
        if nodes:
            job["nodes"] = nodes
        if heartbeat:
            job["heartbeat"] = heartbeat
        cfg = {"state_dir": str(root / "state"), "run_dir": str(root / "run"),
               "metrics": {"port": 0}, "host": name, "jobs": [job],
               "policies": {"default": {"backoff": {"initial": "0.05s", "max": "1s",
                                                    "jitter": 0}, "kill_grace": "2s"}}}
        path = root / "trainwatch.yaml"
        path.write_text(json.dumps(cfg))
        return self.start([sys.executable, "-m", "trainwatch.cli", "run", "--config", str(path),
                           "--no-passthrough"], clean_env(), name)

    def ledger(self, name: str) -> list[dict[str, Any]]:
        db = self.d / name / "state" / "ledger.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute("SELECT * FROM incidents ORDER BY id")]
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def tail(self, n: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}"
                         for p in self.logs if p.exists())

    def stop(self, keep: bool) -> None:
        trainwatch = [p for p in self.procs if b"trainwatch.cli" in b" ".join(
            a.encode() for a in p.args)]  # type: ignore[union-attr]
        for p in trainwatch:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
        for p in trainwatch:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:  # torchrun agents started here: their own process groups
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        # Workers are setsid children of their agent (killpg misses them), and a
        # worker stuck before its first journal line is named nowhere: find them
        # by this run's own script path (a fresh scratch folder).
        marker = str(self.script).encode()
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                kill_pid(int(proc.name), marker)
        remove(self.d, keep)


def stepping(j: Job, total: int, min_step: int) -> bool:
    """Every one of ``total`` ranks has journaled step ``min_step`` or later."""
    best: dict[int, int] = {}
    for e in json_lines(j.journal):
        if "step" in e:
            best[e["rank"]] = max(best.get(e["rank"], 0), e["step"])
    return len(best) >= total and min(best.values()) >= min_step


def back(j: Job, old: set[int], total: int, t0: float) -> dict[str, Any] | None:
    """Once every rank of a new round has started and stepped: the times (s after
    t0) and the step the new ranks resumed from; None before."""
    starts: dict[int, dict[str, Any]] = {}
    first: dict[int, float] = {}
    for e in json_lines(j.journal):
        if e["pid"] in old or e["t"] < t0:
            continue
        if "start" in e:
            starts[e["pid"]] = e
        elif "step" in e and e["pid"] not in first:
            first[e["pid"]] = e["t"]
    new = [p for p in starts if p in first]
    if len(starts) < total or len(new) < total:
        return None
    return {"started_s": max(e["t"] for e in starts.values()) - t0,
            "stepping_s": max(first.values()) - t0,
            "resumed": sorted({e["start"] for e in starts.values()})}


def fault(j: Job, sig: signal.Signals, args: argparse.Namespace,
          daemons: Sequence[int]) -> dict[str, Any]:
    """Warm up, measure the daemons' CPU over the steady window, ``sig`` to host B's
    first rank, wait until every rank is back and stepping."""
    total = 2 * args.ranks
    wait_for(lambda: stepping(j, total, args.warmup), 120, f"{total} ranks stepping")
    cpu = cpu_percent(daemons, args.steady)  # with none: the same wait
    before = json_lines(j.journal)
    old = {e["pid"] for e in before}
    victim = next(e["pid"] for e in before if "start" in e and e["host"] == "hB")
    t0 = time.time()
    os.kill(victim, sig)
    reached = max(e["step"] for e in before if "step" in e)
    got = wait_for(lambda: back(j, old, total, t0), args.wait, "every rank back and stepping")
    got["lost"] = reached - min(got["resumed"])
    got["reached"] = reached
    got["cpu"] = cpu
    return got


def restarts(j: Job, name: str) -> dict[str, int]:
    """One host's ledger: incidents naming a group restart, distinct restarts, charged."""
    rows = []
    for i in j.ledger(name):
        with contextlib.suppress(ValueError, TypeError):
            if json.loads(i["evidence"]).get("group_restart") is not None:
                rows.append(i)
    gens = {json.loads(i["evidence"])["group_restart"] for i in rows}
    charged = sum(1 for i in rows if re.search(r"restart \d+ of", i["decision"] or "")
                  and "not charged" not in (i["decision"] or ""))
    return {"incidents": len(rows), "restarts": len(gens), "charged": charged,
            "all_incidents": len(j.ledger(name))}


def trial_trainwatch(sig: signal.Signals, args: argparse.Namespace) -> dict[str, Any]:
    j = Job(args.ranks, 2)
    hb = {"timeout": "3s"} if sig == signal.SIGSTOP else None
    try:
        cmd = j.torchrun(free_port())
        a = j.trainwatch("hA", cmd, 2, hb)
        b = j.trainwatch("hB", cmd, 2, hb)
        got = fault(j, sig, args, [a.pid, b.pid])
        time.sleep(args.linger)  # the group records settle (2 s), a held hang (5 s)
        got["hosts"] = {n: restarts(j, n) for n in ("hA", "hB")}
        return got
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{j.tail()}") from None
    finally:
        j.stop(args.keep)


def trial_alone(args: argparse.Namespace) -> dict[str, Any]:
    j = Job(args.ranks, 2)
    try:
        cmd = j.torchrun(free_port(), "--max-restarts=3")
        store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if args.alone_store == "own" else {}
        for name in ("hA", "hB"):
            j.start(cmd, clean_env(BENCH_HOST=name, LOGLEVEL="INFO", **store), name)
        got = fault(j, signal.SIGKILL, args, [])
        time.sleep(args.linger)
        got["hosts"] = {p.stem: p.read_text(errors="replace").count("attempts left")
                        for p in j.logs}
        return got
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{j.tail()}") from None
    finally:
        j.stop(args.keep)


def trial_single(args: argparse.Namespace) -> float:
    """CPU % of one trainwatch run of a --nnodes=1 job of the same trainer."""
    j = Job(args.ranks, 1)
    try:
        p = j.trainwatch("single", j.torchrun(free_port()), None, None)
        wait_for(lambda: stepping(j, args.ranks, args.warmup), 120, "single-host ranks stepping")
        return cpu_percent([p.pid], args.steady)[0]
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{j.tail()}") from None
    finally:
        j.stop(args.keep)


def show(label: str, values: Sequence[float], unit: str, digits: int = 2) -> str:
    return f"  {label:<34} {fmt_summary(summarize(values), unit, digits)}"


def report(name: str, rows: list[dict[str, Any]], goal: float | None) -> dict[str, Any]:
    started = [r["started_s"] for r in rows]
    step = [r["stepping_s"] for r in rows]
    print(f"{name}, n={len(rows)}:")
    print(show("-> every rank started again", started, "s"))
    print(show("-> every rank stepping again", step, "s"))
    print(show("steps lost", [float(r["lost"]) for r in rows], "steps", 0))
    print(f"  resumed from / reached: {[(r['resumed'], r['reached']) for r in rows]}")
    print(f"  restarts per fault by host: {[r['hosts'] for r in rows]}")
    if goal is not None:
        med = summarize(step).median
        print(f"  goal <= {goal:g} s (stepping): {'meets' if med <= goal else 'misses'}")
    return {"started_s": summarize(started).as_dict(), "stepping_s": summarize(step).as_dict(),
            "raw": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--warmup", type=int, default=5, help="steps every rank makes first")
    p.add_argument("--steady", type=float, default=8.0, help="CPU window before the fault, s")
    p.add_argument("--linger", type=float, default=7.0, help="wait after recovery for the"
                   " ledgers, s")
    p.add_argument("--wait", type=float, default=90.0, help="give up on a recovery after, s")
    p.add_argument("--no-torchrun-alone", dest="alone", action="store_false",
                   help="skip the torchrun-alone baseline")
    p.add_argument("--torchrun-alone", dest="alone", action="store_true", default=True)
    p.add_argument("--alone-store", choices=("shared", "own"), default="shared",
                   help="torchrun alone: its default shared rendezvous store, or"
                   " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as trainwatch sets it")
    p.add_argument("--what", default="crash,stopped,alone,single",
                   help="which measurements, comma-separated (default all)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folders")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trials < 1 or args.ranks < 1:
        print("bench_multihost: --trials and --ranks must be at least 1", file=sys.stderr)
        return 2
    print(f"bench_multihost: 2 hosts x {args.ranks} rank(s), {args.trials} trials")
    print(machine_line())
    crash: list[dict[str, Any]] = []
    stop: list[dict[str, Any]] = []
    alone: list[dict[str, Any]] = []
    single: list[float] = []
    t_start = time.monotonic()
    steps: dict[str, Callable[[], None]] = {
        "crash": lambda: crash.append(trial_trainwatch(signal.SIGKILL, args)),
        "stopped": lambda: stop.append(trial_trainwatch(signal.SIGSTOP, args)),
        "alone": lambda: alone.append(trial_alone(args)),
        "single": lambda: single.append(trial_single(args)),
    }
    chosen = [w for w in steps if w in args.what.split(",") and (w != "alone" or args.alone)]
    for n in range(args.trials):
        for what in chosen:
            t = time.monotonic()
            steps[what]()
            print(f"  trial {n + 1} {what}: {time.monotonic() - t:.0f} s", flush=True)
    print(f"({time.monotonic() - t_start:.0f} s in all; {machine_line()})")
    out: dict[str, Any] = {"machine": machine(), "ranks": args.ranks}
    if crash:
        out["crash"] = report("crash (SIGKILL of host B's rank)", crash, CRASH_GOAL_S)
    if stop:
        out["stopped"] = report("stopped rank (SIGSTOP of host B's rank, heartbeat timeout 3 s)",
                                stop, STOP_GOAL_S)
    if alone:
        out["alone"] = report(f"torchrun alone (--max-restarts=3, {args.alone_store} rendezvous"
                              " store, same SIGKILL; from step 0)", alone, None)
    per_host = [c for r in crash + stop for c in r["cpu"]]
    if not per_host or not single:
        write_json(args.json, out)
        return 0
    print("daemon CPU over the steady window (% of a core):")
    print(show("each 2-host daemon (hA, hB)", per_host, "%"))
    print(show("single-host job's daemon", single, "%"))
    med, ref = summarize(per_host).median, summarize(single).median
    print(f"  goal: no more than a single-host job's: {'meets' if med <= ref else 'misses'}"
          f" ({med:.2f} vs {ref:.2f} %)")
    out["cpu"] = {"per_host": per_host, "single": single}
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
