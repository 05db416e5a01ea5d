"""Run every benchmark and print a compact summary table (``make bench``).

How: runs ``bench_beat.py`` (headline first: beat() in a real job under
``trainwatch run``; then the isolated-reader figures), ``bench_recovery.py``,
``bench_supervisor.py``, ``bench_gpu.py`` and ``bench_metrics.py`` one after
another as subprocesses of this interpreter (so one cannot disturb the next),
each writing its figures as JSON to a temp file; their own output is shown as
it comes, then one table: median, p99 (or max where there are fewer than 50 samples), the number of
samples, the issue's goal and whether it is met. The machine (nproc, Python)
and the load average before and after are printed, with any other process
that was busy at the start, because the figures are only as quiet as the
machine. About 12 minutes with the defaults (the goodput drill: 2 minutes for
each of 3 systems).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line

HERE = Path(__file__).resolve().parent

Row = tuple[str, str, str, str, str, str]


def busy_others(sample_s: float = 1.0, threshold: float = 5.0) -> list[str]:
    """Processes other than ours using more than ``threshold`` % of a core."""
    me = os.getpid()
    procs = [p for p in psutil.process_iter(["pid", "name"]) if p.pid != me]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(sample_s)
    out = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
            if pct > threshold:
                cmd = " ".join(p.cmdline())[:80] or p.info["name"]
                out.append(f"pid {p.pid} {pct:.0f}% {cmd}")
        except psutil.Error:
            pass
    return out


def run_one(script: str, args: list[str], json_path: Path) -> dict[str, Any] | None:
    print(f"\n=== {script} {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, str(HERE / script), *args, "--json", str(json_path)])
    print(f"=== {script}: exit {rc}, {time.monotonic() - t0:.1f} s", flush=True)
    if rc != 0:
        return None
    try:
        data: dict[str, Any] = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return None
    return data


def cell(x: float, digits: int) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def stat_row(
    name: str, s: dict[str, float], unit: str, digits: int, goal: str, ok: bool | None
) -> Row:
    n = int(s["n"])
    tail = f"p99 {cell(s['p99'], digits)}" if n >= 50 else f"max {cell(s['max'], digits)}"
    verdict = "-" if ok is None else ("yes" if ok else "NO")
    return (name, f"{cell(s['median'], digits)} {unit}", f"{tail} {unit}", str(n), goal, verdict)


def _hz(period_s: float, kind: str = "sleep") -> str:
    hz = 1.0 / period_s
    rate = f"{hz / 1000:g} kHz" if hz >= 1000 else f"{hz:g} Hz"
    return rate + (", busy between" if kind == "busy" else "")


def job_beat_rows(j: dict[str, Any]) -> list[Row]:
    """The headline: beat() in a real job under `trainwatch run`."""
    rows: list[Row] = []
    name = j["name"].split("  ")[0]
    for i, ph in enumerate(j["phases"]):
        rate = _hz(ph["period_s"], ph.get("kind", "sleep"))
        where = "real job under trainwatch run" if i == 0 else "real job"
        label = f"{name} [{where}, {rate}]"
        if ph["dropped"]:
            label += f" ({ph['dropped']} of {ph['calls']} dropped)"
        if ph.get("skipped"):
            label += f" ({ph['skipped']} of {ph['calls']} skipped by the rate limit)"
        s = ph["per_call_us"]
        rows.append(stat_row(label, s, "µs", 2, "≤ 5 µs median", s["median"] <= 5.0))
        if i == 0:
            rows.append(
                (
                    f"  trainwatch meanwhile [real job, {rate}]",
                    f"{ph['supervisor_wakes_per_s']:.1f} wake-ups/s",
                    f"{ph['supervisor_cpu_pct']:.2f} % of a core",
                    "-",
                    "-",
                    "-",
                )
            )
    for c in j.get("controls", []):
        where = f"real job, {_hz(c['period_s'])}"
        for key, what in (
            ("format_us", "client's formatting alone, no send"),
            ("send_us", "plain sock.send() of the message"),
        ):
            rows.append(stat_row(f"  control: {what} [{where}]", c[key], "µs", 2, "-", None))
    return rows


def beat_rows(b: dict[str, Any]) -> list[Row]:
    rows: list[Row] = job_beat_rows(b["job"]) if "job" in b else []
    for mode, label in (("block", "isolated reader asleep"), ("poll", "isolated reader polling")):
        if mode not in b:
            continue
        for r in b[mode]["results"]:
            if r["mode"].startswith("batch"):
                continue
            if mode == "poll" and not r["mode"].startswith("paced"):
                continue
            goal, ok = "-", None
            if r["variant"] in ("full", "loss_none", "step_only"):
                goal, ok = "≤ 5 µs median", r["per_call_us"]["median"] <= 5.0
            name = f"{r['name'].split('  ')[0]} [{label}, {r['mode']}]"
            if r["dropped"]:
                name += f" ({r['dropped']} dropped)"
            rows.append(stat_row(name, r["per_call_us"], "µs", 2, goal, ok))
        share = b[mode].get("client_share_us", {}).get("full")
        if share is not None:
            rows.append(
                (
                    f"  client's share: full beat - raw send [{label}, paced]",
                    f"{share:.2f} µs",
                    "-",
                    "-",
                    "-",
                    "-",
                )
            )
    return rows


def recovery_rows(r: dict[str, Any]) -> list[Row]:
    c, h, t = r["crash"], r["hang"], r["timeout_s"]
    over = h["over_timeout_ms"]
    return [
        stat_row("crash -> incident", c["to_incident_ms"], "ms", 1, "-", None),
        stat_row(
            "crash -> new process (excl. backoff)",
            c["to_process_excl_backoff_ms"],
            "ms",
            1,
            "-",
            None,
        ),
        stat_row(
            "crash -> first beat of new attempt (excl. backoff)",
            c["to_first_beat_excl_backoff_ms"],
            "ms",
            1,
            "-",
            None,
        ),
        stat_row(
            "crash: ledger detection_latency_s", c["detection_latency_ms"], "ms", 3, "-", None
        ),
        stat_row(
            f"hang -> incident = timeout {t:g} s + X",
            over,
            "ms",
            1,
            "X ≤ 500 ms",
            over["max"] <= 500.0,
        ),
        stat_row("hang: ledger detection_latency_s", h["detection_latency_ms"], "ms", 1, "-", None),
        stat_row(
            "hang: incident -> new process (excl. backoff)",
            h["incident_to_process_excl_backoff_ms"],
            "ms",
            1,
            "-",
            None,
        ),
    ]


def supervisor_rows(s: dict[str, Any]) -> list[Row]:
    per = s["cpu_interval_pct"]
    whole = s["cpu_pct"]
    label = f"{s['ranks']} ranks x {1 / s['period_s']:g} Hz"
    return [
        (
            f"supervisor CPU, whole window [{label}]",
            f"{whole:.3f} %",
            "-",
            f"{s['window_s']:.0f} s",
            "≤ 1 % of a core",
            "yes" if whole <= 1.0 else "NO",
        ),
        stat_row(
            f"supervisor CPU per 1 s interval [{label}]",
            per,
            "%",
            3,
            "≤ 1 % of a core",
            per["median"] <= 1.0,
        ),
        stat_row("supervisor RSS", s["rss_mb"], "MB", 1, "≤ 60 MB", s["rss_mb"]["max"] <= 60.0),
        (
            f"supervisor wake-ups [{label}]",
            f"{s['wakes_per_s']:.1f} /s",
            f"{s['cpu_per_wake_us']:.0f} µs CPU each",
            "-",
            "-",
            "-",
        ),
    ]


def gpu_rows(g: dict[str, Any]) -> list[Row]:
    def both(s: dict[str, float], goal: float) -> bool:
        tail = s["p99"] if int(s["n"]) >= 50 else s["max"]
        return s["median"] <= goal and tail <= goal

    rows: list[Row] = []
    x = g.get("xid")
    if x:
        k, d = x["kmsg"], x["drill"]
        rows += [
            stat_row(
                "Xid -> incident, kernel-log file [trainwatch run, sim]",
                k["to_incident_ms"],
                "ms",
                1,
                "≤ 100 ms",
                both(k["to_incident_ms"], 100.0),
            ),
            stat_row(
                "  of which: Xid read -> incident (detection_latency_s)",
                k["detection_latency_ms"],
                "ms",
                2,
                "-",
                None,
            ),
            stat_row(
                "Xid -> incident, drill via control socket [trainwatch run]",
                d["to_incident_ms"],
                "ms",
                2,
                "≤ 100 ms",
                both(d["to_incident_ms"], 100.0),
            ),
        ]
    ev, lost, poll, cpu = g["events"], g["lost"], g["poll"], g["cpu"]
    rows += [
        stat_row(
            "NVML event -> callback [in-process, fake pynvml]",
            ev["to_callback_us"],
            "µs",
            1,
            "-",
            None,
        ),
        stat_row(
            "NVML event -> GpuWatch fault [in-process, queue + wake-up]",
            ev["to_fault_us"],
            "µs",
            1,
            "≤ 100 ms",
            both(ev["to_fault_us"], 100_000.0),
        ),
        stat_row(
            f"GPU lost -> fault [in-process, poll_interval {lost['poll_interval_s']:g} s]",
            lost["to_fault_ms"],
            "ms",
            0,
            f"≤ {lost['poll_interval_s']:g} s bound",
            lost["to_fault_ms"]["max"] <= lost["poll_interval_s"] * 1000.0 + 100.0,
        ),
        stat_row(
            f"one poll of {poll['gpus']} GPUs, per GPU [fake pynvml]",
            poll["per_gpu_us"],
            "µs",
            1,
            "-",
            None,
        ),
    ]
    for key, label in (
        ("off", "gpu.backend off (baseline)"),
        ("sim", "sim 8 GPUs at 1 Hz, kmsg null"),
        ("sim_kmsg", "sim 8 GPUs at 1 Hz + kernel-log file"),
    ):
        pct, sched = cpu[f"{key}_pct"], cpu[f"sched_{key}_pct"]
        ok = None if key == "off" else pct <= 0.5
        rows.append(
            (
                f"trainwatch run CPU, {label}",
                f"{pct:.3f} %",
                f"schedstat {sched:.3f} %",
                f"{cpu['runs'][0]['window_s']:.0f} s",
                "-" if key == "off" else "≤ 0.5 % of a core",
                "-" if ok is None else ("yes" if ok else "NO"),
            )
        )
    return rows


def metrics_rows(m: dict[str, Any]) -> list[Row]:
    setup = f"{m['gpus']} GPUs x {m['jobs']} jobs x {m['ranks']} ranks"
    s = m["scrape_ms"]
    return [
        stat_row(f"/metrics scrape over HTTP [{setup}]", s, "ms", 2, "≤ 10 ms median",
                 s["median"] <= 10.0),
        (f"  series in that exposition [{setup}]", f"{m['series']}",
         f"{m['series_trainwatch']} trainwatch_*", "-", "-", "-"),
    ]


def scrape_held_rows(h: dict[str, Any]) -> list[Row]:
    """bench_scrape_held.py: scrapes served while connections are held and reopened."""
    served = h["served_median"]
    return [(f"/metrics scrapes served, {h['held']} connections held and reopened",
             f"{served:g}/{h['scrapes']}", "-", f"{len(h['trials'])} trials", "≥ 19/20",
             "yes" if served >= 19 else "NO")]


def snapshot_rows(s: dict[str, Any]) -> list[Row]:
    """bench_snapshot.py: blocked per save, bytes per snapshot, restore, zstd."""
    rows: list[Row] = []
    b = s.get("blocked")
    if b:
        gb = f"{b['bytes'] / 1e9:.2f} GB"
        ts, tf = b["torch_save"]["median"], b["torch_save_fsync"]["median"]
        snap = b["snapshot"]["median"]
        rows += [
            stat_row(f"snapshot: blocked per save [{gb}, Snapshotter.maybe_save]",
                     b["snapshot"], "s", 3, "≤ 10 % of torch.save", snap <= 0.1 * ts),
            (f"  = {100 * snap / ts:.1f} % of torch.save, {100 * snap / tf:.1f} % of "
             "torch.save + fsync", "-", "-", "-", "-", "-"),
            stat_row("  torch.save, no fsync (not durable)", b["torch_save"], "s", 3, "-", None),
            stat_row("  torch.save + fsync", b["torch_save_fsync"], "s", 3, "-", None),
            stat_row("  DCP async_save (until it returns)", b["dcp_async"], "s", 3, "-", None),
            stat_row("  DCP async_save, stager kept across saves", b["dcp_async_kept"], "s", 3,
                     "-", None),
        ]
    for name in ("full-ft", "lora-attn", "lora-all"):
        m = s.get(name)
        if not m:
            continue
        full, inc = m["written_full"], m["written_incremental"]
        lora = name.startswith("lora")
        rows.append((f"snapshot: bytes written, incremental [{name}]",
                     f"{inc / 2**20:.2f} MiB", f"{100 * inc / full:.2f} % of full", "-",
                     "≤ 5 % of full" if lora else "-",
                     ("yes" if inc <= 0.05 * full else "NO") if lora else "-"))
        for k, where in (("restore_local_warm", "local, warm"), ("restore_s3", "from S3")):
            if k in m:
                rows.append(stat_row(f"  restore [{name}, {where}]", m[k], "s", 3, "-", None))
    for what, c in s.get("compress", {}).items():
        rows.append((f"snapshot: zstd ratio, {what}", f"{c['ratio']:.3f}",
                     f"{c['compress_cpu_s_per_gb']:.2f} CPU s/GB", "-", "-", "-"))
    return rows


def goodput_rows(g: dict[str, Any]) -> list[Row]:
    """goodput.py (the short drill): each system's effective training time ratio."""
    rows: list[Row] = []
    for name, runs in g["rows"].items():
        r = runs[0]
        goal = "≥ 0.95 of the limit" if name == "trainwatch" else "-"
        met = ("yes" if r["of_limit"] >= 0.95 else "NO") if name == "trainwatch" else "-"
        rows.append((f"goodput [{name}, {g['seconds'] / 60:g} min]: ratio, of the limit "
                     f"{g['limit']:.3f}", f"{r['ratio']:.3f}", f"{r['of_limit']:.3f}",
                     str(len(runs)), goal, met))
    return rows


def table(rows: list[Row]) -> str:
    head: Row = ("figure", "median", "p99 / max", "n", "goal", "met")
    all_rows = [head, *rows]
    w = [max(len(r[i]) for r in all_rows) for i in range(len(head))]
    lines = []
    for i, r in enumerate(all_rows):
        lines.append("  ".join(c.ljust(w[j]) for j, c in enumerate(r)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * x for x in w))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--only",
        default="beat,recovery,supervisor,gpu,metrics,flood,goodput",
        help="comma-separated subset of beat, recovery, supervisor, gpu, metrics, flood, "
        "goodput (the drill, 2 minutes per system), snapshot (not in the default: about 3 "
        "minutes and 2 GB of disk under build/)",
    )
    p.add_argument("--calls", type=int, default=20000, help="bench_beat: calls per variant")
    p.add_argument("--crashes", type=int, default=10, help="bench_recovery: SIGKILL drills")
    p.add_argument("--hangs", type=int, default=10, help="bench_recovery: SIGSTOP drills")
    p.add_argument(
        "--duration", type=float, default=20.0, help="bench_supervisor and bench_gpu: CPU window, s"
    )
    p.add_argument("--xids", type=int, default=100, help="bench_gpu: Xids per end-to-end path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    t0 = time.monotonic()
    print("run_all: trainwatch benchmarks")
    print(machine_line())
    others = busy_others()
    print("busy at the start: " + ("; ".join(others) if others else "no other process > 5 %"))
    rows: list[Row] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="twbench-") as tmp:
        d = Path(tmp)
        if "beat" in only:
            b = run_one("bench_beat.py", ["--calls", str(args.calls)], d / "beat.json")
            rows += beat_rows(b) if b else []
            failed += [] if b else ["bench_beat"]
            if b and b.get("job", {}).get("problems"):
                failed += [f"bench_beat: {p}" for p in b["job"]["problems"]]
        if "recovery" in only:
            r = run_one(
                "bench_recovery.py",
                ["--crashes", str(args.crashes), "--hangs", str(args.hangs)],
                d / "recovery.json",
            )
            rows += recovery_rows(r) if r else []
            failed += [] if r else ["bench_recovery"]
            if r and r.get("exit_code") != 130:
                failed.append(f"bench_recovery: trainwatch exited {r.get('exit_code')}")
        if "supervisor" in only:
            s = run_one(
                "bench_supervisor.py", ["--duration", f"{args.duration:g}"], d / "supervisor.json"
            )
            rows += supervisor_rows(s) if s else []
            failed += [] if s else ["bench_supervisor"]
            if s and s.get("problems"):
                failed += [f"bench_supervisor: {p}" for p in s["problems"]]
        if "gpu" in only:
            g = run_one(
                "bench_gpu.py",
                ["--xids", str(args.xids), "--cpu-duration", f"{args.duration:g}"],
                d / "gpu.json",
            )
            rows += gpu_rows(g) if g else []
            failed += [] if g else ["bench_gpu"]
            if g and g.get("problems"):
                failed += [f"bench_gpu: {p}" for p in g["problems"]]
        if "metrics" in only:
            m = run_one("bench_metrics.py", [], d / "metrics.json")
            rows += metrics_rows(m) if m else []
            failed += [] if m else ["bench_metrics"]
            h = run_one("bench_scrape_held.py", [], d / "scrape_held.json")
            rows += scrape_held_rows(h) if h else []
            failed += [] if h else ["bench_scrape_held"]
        if "snapshot" in only:
            n = run_one("bench_snapshot.py", [], d / "snapshot.json")
            rows += snapshot_rows(n) if n else []
            failed += [] if n else ["bench_snapshot"]
        if "flood" in only:
            # Its own table (trainwatch CPU and beats lost per 100,000 datagrams per sender).
            print("\n=== bench_flood.py", flush=True)
            if subprocess.call([sys.executable, str(HERE / "bench_flood.py"), "--runs", "3"]):
                failed.append("bench_flood")
        if "goodput" in only:
            g = run_one("goodput.py", ["--minutes", "2", "--trials", "1"], d / "goodput.json")
            rows += goodput_rows(g) if g else []
            failed += [] if g else ["goodput"]
    print(f"\n=== summary ({time.monotonic() - t0:.0f} s)")
    print(machine_line())
    print(table(rows))
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
