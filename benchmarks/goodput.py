"""The goodput drill (issue 25): the share of wall time that became training which
counts, under seeded schedules of faults, for trainwatch, torchrun and NVIDIA's
ft_launcher, in one run.

How: the drill's trainer (benchmarks/goodput_drill/trainer.py: deterministic, one step
every --step-time s, a checkpoint every --every steps) runs for --minutes under each
system in turn (the order rotated per trial), fresh folders each time. Within a trial
the same faults are played against each at the same times after its first step, and
each trial draws its own (schedule.per_trial says why; schedule.py: a crash,
a SIGSTOPped rank, a rank stalled inside its step, a checkpoint corrupted on disk then a
crash, a NaN window in the data, an Xid 79 on a simulated GPU). What each system did is
read from outside: the trainer's progress log and when each rank process died.

Per system: the effective training time ratio (effective steps x step time / wall;
accounting.py says which steps count), the theoretical limit for the schedule
(1 - (start + sum over faults of detection floor + restart + half a checkpoint interval,
one more interval for a corrupted checkpoint) / wall, the start and restart measured
here as the trainer's cold start to its first step under torchrun, the detection floors
printed), the ratio to it, per fault the time to detect (the faulted ranks all gone)
and to recover (the next attempt's first step), the steps lost, and whether the final
checkpoint's weights are bit for bit those of a fault-free run that skips the same
steps (run here, unpaced). Medians over --trials.

Run: .venv/bin/python benchmarks/goodput.py [--minutes 10] [--trials 1]
       [--trainer ddp|single] [--systems trainwatch,torchrun,nvrx] [--json F] [--svg F]
       [--kinds crash:6,hang:6]  (other kinds than one of each: more samples of a few)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line
from goodput_drill import accounting, report, runner, schedule, systems

FLOORS = {"crash": 0.0, "corrupt": 0.0, "xid": 0.0, "nan": 0.0, "hang": 1.0, "stall": 1.0}
FLOORS_TEXT = ("detection floors: crash, corrupt (its crash), xid, nan 0 s (the kernel, the "
               "driver and the loss say so at once); hang and stall 1 s (10 steps of silence: "
               "less cannot tell a stop from a slow step)")


def startup_floor(d: Path, ranks: int, every: int, step_time: float, runs: int = 3) -> float:
    """The trainer's cold start to its first step under plain torchrun (median)."""
    out: list[float] = []
    tries = 0
    while len(out) < runs:
        # Up to 3 failed tries in all, as for the reference (a gloo rendezvous fails
        # now and then on a loaded machine; one ended a drill before it began).
        w = d / f"floor{len(out)}-{tries}"
        (w / "ckpt").mkdir(parents=True)
        rest = systems.trainer_args(w / "ckpt", w / "state", every, step_time, None)
        t0 = time.time()
        with open(w / "log", "wb") as log:
            rc = subprocess.run(systems.torchrun_argv(ranks, [*rest, "--until", "1"]),
                                env=systems.base_env("floor"), stdout=log,
                                stderr=subprocess.STDOUT, timeout=300, check=False).returncode
        first = next((r for r in runner.progress(w / "state" / "progress.jsonl") if "step" in r),
                     None)
        if rc == 0 and first is not None:
            out.append(float(first["t"]) - t0)
            continue
        tries += 1
        if tries == 3:
            raise SystemExit(f"goodput: the trainer's cold start failed 3 times under plain "
                             f"torchrun (last log: {w / 'log'})")
    return statistics.median(out)


def reference(d: Path, ranks: int, until: int, skip: tuple[int, int] | None,
              nan: tuple[int, int] | None, cache: dict[Any, str]) -> str:
    key = (until, skip, nan)
    if key not in cache:
        w = d / f"ref-{until}-{skip}-{nan}"
        (w / "ckpt").mkdir(parents=True)
        rest = systems.trainer_args(w / "ckpt", w / "state", 10**9, 0.0, nan)
        rest += ["--until", str(until), "--digest-to", str(w / "digest")]
        if skip:
            rest += ["--skip", f"{skip[0]}:{skip[1]}"]
        # Three tries: on a loaded machine gloo's rendezvous fails now and then, and a
        # reference that cannot be made is a missing comparison, said, not a crash.
        for _ in range(3):
            with open(w / "log", "ab") as log:
                rc = subprocess.run(systems.torchrun_argv(ranks, rest),
                                    env=systems.base_env("reference"), stdout=log,
                                    stderr=subprocess.STDOUT, timeout=600, check=False).returncode
            if rc == 0 and (w / "digest").exists():
                break
            shutil.rmtree(w / "ckpt")
            (w / "ckpt").mkdir()
        else:
            print(f"the fault-free reference run failed three times (log: {w / 'log'})",
                  file=sys.stderr)
            cache[key] = "no reference"
            return cache[key]
        cache[key] = (w / "digest").read_text()
    return cache[key]


def limit_of(faults: list[schedule.Fault], start: float, seconds: float, every: int,
             step_time: float) -> float:
    lost = start
    for f in faults:
        lost += FLOORS[f.kind] + start + every * step_time / 2
        if f.kind == "corrupt":
            lost += every * step_time
    return 1.0 - lost / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=25)
    p.add_argument("--trainer", choices=("ddp", "single"), default="ddp")
    p.add_argument("--systems", default="trainwatch,torchrun,nvrx")
    p.add_argument("--every", type=int, default=30, help="steps between checkpoints")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--json", type=Path)
    p.add_argument("--svg", type=Path)
    p.add_argument("--keep", type=Path, help="keep every run's folders and logs here")
    p.add_argument("--kinds", default=",".join(schedule.KINDS),
                   help="the faults of each schedule, KIND[:COUNT],... (default: one of each)")
    a = p.parse_args()
    names = [s for s in a.systems.split(",") if s]
    unknown = [s for s in names if s not in systems.LAUNCHERS]
    if unknown or not names:
        print(f"goodput: unknown system {unknown or a.systems!r} "
              f"(known: {', '.join(systems.LAUNCHERS)})", file=sys.stderr)
        return 2
    if a.minutes <= 0 or a.trials < 1 or a.every < 1 or not 0.01 <= a.step_time <= 10:
        print("goodput: --minutes > 0, --trials >= 1, --every >= 1 and --step-time in "
              "[0.01, 10] please", file=sys.stderr)
        return 2
    if "nvrx" in names and shutil.which("ft_launcher", path=str(systems.VENV_BIN)) is None:
        print("goodput: nvrx needs nvidia-resiliency-ext (ft_launcher) in this venv: "
              "pip install -e '.[dev]'", file=sys.stderr)
        return 2
    try:
        kinds = schedule.parse_kinds(a.kinds)
    except ValueError as e:
        print(f"goodput: --kinds: {e}", file=sys.stderr)
        return 2
    ranks = 2 if a.trainer == "ddp" else 1
    seconds = a.minutes * 60
    plans = schedule.per_trial(a.seed, a.trials, seconds, ranks, a.step_time, kinds)
    print(machine_line())
    print(f"trainer {a.trainer} ({ranks} rank{'s' if ranks > 1 else ''}), a step every "
          f"{a.step_time} s, a checkpoint every {a.every} steps; {a.minutes:g} min per system, "
          f"{a.trials} trial(s), seeds {a.seed}-{a.seed + a.trials - 1} (one per trial)")
    for t, faults in enumerate(plans):
        print(f"schedule of trial {t + 1}: " + "; ".join(
            f"{f.kind} at {f.at:.0f} s (rank {f.rank})" if f.kind != "nan"
            else f"nan in steps {f.steps[0]}-{f.steps[1]}"  # type: ignore[index]
            for f in faults))
    for n in names:
        print("  " + systems.settings(n))
    keep = a.keep
    root = Path(tempfile.mkdtemp(prefix="goodput-")) if keep is None else keep
    root.mkdir(parents=True, exist_ok=True)
    start = startup_floor(root, ranks, a.every, a.step_time)
    # The same kinds in every schedule, so one limit: it does not depend on the times.
    lim = limit_of(plans[0], start, seconds, a.every, a.step_time)
    print(f"  {FLOORS_TEXT}; start and restart {start:.2f} s (the trainer's cold start "
          f"to its first step, median of 3); limit {lim:.3f}")
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    curves: dict[str, list[tuple[float, int]]] = {}
    marks: list[tuple[str, float]] = []
    cache: dict[Any, str] = {}
    try:
        for trial, faults in enumerate(plans):
            nan = schedule.nan_window(faults)
            order = names[trial % len(names):] + names[:trial % len(names)]
            for n in order:
                d = root / f"t{trial}-{n}"
                print(f"\n-- trial {trial + 1}: {n} ({a.minutes:g} min)", flush=True)
                res = runner.run(n, d, ranks, faults, seconds, a.every, a.step_time, nan)
                res.extra["step_time"] = a.step_time
                rows[n].append(judge(res, faults, seconds, root, ranks, nan, cache, lim))
                r = rows[n][-1]
                print(f"   ratio {r['ratio']:.3f} ({r['effective']} steps), final step "
                      f"{r['final_step']}, weights {r['weights']}", flush=True)
                if trial == 0:
                    base = res.launched
                    curves[n] = [(t - base, s) for t, s in r["curve"]]
                    marks = [(h["kind"], h["at"] - base) for h in r["faults"]]
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    table(rows, lim, list(dict.fromkeys(f.kind for f in plans[0])))
    if a.svg:
        a.svg.write_text(report.svg(f"goodput drill, {a.trainer}, seed {a.seed}: effective "
                                    f"steps over wall time", curves, seconds, marks))
        print(f"chart: {a.svg}")
    if a.json:
        a.json.write_text(json.dumps({"limit": lim, "start_s": start, "seconds": seconds,
                                      "schedules": [[f.__dict__ for f in fs] for fs in plans],
                                      "rows": {n: [{k: v for k, v in r.items() if k != "curve"}
                                                   for r in rs] for n, rs in rows.items()}},
                                     indent=1, default=str))
    return 0


def judge(res: runner.Result, faults: list[schedule.Fault], seconds: float, root: Path,
          ranks: int, nan: tuple[int, int] | None, cache: dict[Any, str],
          lim: float) -> dict[str, Any]:
    w = accounting.worth(res)
    wall = res.stopped - res.launched
    ratio = w.effective * float(res.extra.get("step_time", 0.1)) / wall
    weights = "no checkpoint"
    if w.final_ckpt is not None:
        ref = reference(root, ranks, w.final_ckpt, w.skip or nan, nan, cache)
        weights = ("no reference" if ref == "no reference"
                   else "= fault-free" if ref == w.final_digest
                   else "NaN" if w.poisoned_at is not None and w.final_ckpt >= w.poisoned_at
                   else "differ")
    hs = accounting.handling(res, [])
    return {"ratio": ratio, "of_limit": ratio / lim, "effective": w.effective,
            "final_step": w.final_step, "final_ckpt": w.final_ckpt, "weights": weights,
            "skip": w.skip, "poisoned_at": w.poisoned_at, "curve": w.curve,
            "faults": [h.__dict__ for h in hs]}


def occurrences(hs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each fault a system met, keyed by (kind, n-th of that kind): a system that never
    reached the NaN window has one event fewer, so positions do not line up."""
    seen: dict[str, int] = {}
    out = {}
    for h in hs:
        n = seen[h["kind"]] = seen.get(h["kind"], -1) + 1
        out[(h["kind"], n)] = h
    return out


def table(rows: dict[str, list[dict[str, Any]]], lim: float, kinds: list[str]) -> None:
    """The ratios, then per fault kind (in the schedule's order) each system's detection,
    recovery and steps lost, medians over every fault of that kind in every trial:
    matched by kind, since a system that never met a fault (it never reached the NaN
    steps, no rank was up) has fewer of them."""
    med = statistics.median
    print(f"\n{'system':<11} {'ratio':>6} {'/limit':>7}  {'final weights':<14} "
          f"(limit {lim:.3f}; medians over trials)")
    for n, rs in rows.items():
        print(f"{n:<11} {med(r['ratio'] for r in rs):6.3f} {med(r['of_limit'] for r in rs):7.3f}"
              f"  {rs[0]['weights']:<14}")
    print(f"\n{'fault':<8} " + " ".join(f"{n:>26}" for n in rows))
    print(f"{'':<8} " + " ".join(f"{'detect / recover s, lost':>26}" for _ in rows))
    counts = {n: {k: [h for r in rs for h in r["faults"] if h["kind"] == k] for k in kinds}
              for n, rs in rows.items()}
    for k in kinds:
        cells = []
        for n in rows:
            hs = counts[n][k]
            det = [h["detected_s"] for h in hs if h["detected_s"] is not None]
            rec = [h["recovered_s"] for h in hs if h["recovered_s"] is not None]
            lost = [h["steps_lost"] for h in hs if h["steps_lost"] is not None]
            if not hs:
                cells.append(f"{'never met':>26}")
            elif not rec:
                cells.append(f"{'never handled':>26}" if not det else
                             f"{report.cell(med(det)):>7} / {'not relaunched':>16}")
            else:
                cells.append(f"{report.cell(med(det) if det else None):>7} / "
                             f"{report.cell(med(rec)):>6}, {med(lost):>5.0f} st")
        print(f"{k:<8} " + " ".join(cells))
    if any(len(hs) > len(rs) for n, rs in rows.items() for hs in counts[n].values()):
        print("(each cell the median over every fault of its kind in every trial; recovered "
              "of met: " + "; ".join(
                  f"{n} " + ", ".join(f"{k} {sum(h['recovered_s'] is not None for h in hs)}"
                                      f"/{len(hs)}" for k, hs in by.items())
                  for n, by in counts.items()) + ")")


if __name__ == "__main__":
    sys.exit(main())
