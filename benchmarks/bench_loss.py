"""Loss and grad-norm anomaly detectors (``trainwatch.detectors.loss``) on a
labelled suite: precision and recall per class, onset error, false positives
per 100,000 clean steps, and the cost per observation.

The suite:
- synthetic curves (seeded, ``--seed``): a power-law loss with a warm-up ramp,
  then one of cosine decay, step LR drops, warm restarts (the loss rises
  10-25 % for ~100 steps), a plateau; log-normal noise of 1-8 % or a Student
  t(4) tail; some beaten every 10th step only. Clean ones have no event; the
  others carry one labelled event: a transient loss spike (x2-6 for 2-8 steps,
  grad norm with it), a lone grad-norm outlier (x5-20 for 2-3 steps), a
  divergence (log-loss rising 0.003-0.03 per step, or a x3 jump that stays),
  or a NaN/inf in the loss or grad norm (one step, or to the end).
- real curves from ``benchmarks/curves/`` (``record_curves.py``: a tiny GPT-2
  trained with ``transformers`` on CPU): a cosine run and a step-drop + warm
  restart run (clean), and a run whose learning rate was set to 0.3 at step
  400 (labelled divergence, onset 401).

Matching: a detection matches an event when its kind is one the event may
raise (a divergence also raises loss_spike and grad_norm_outlier; a loss spike
also raises grad_norm_outlier) and it overlaps the event (noticed at or after
onset - 5, began at or before the event's last step + 5). Recall of a class:
events of it found by a detection of that very kind. Onset error: that first
detection's onset minus the labelled onset, in steps. Anything unmatched is a
false positive; the clean steps are the steps outside every event.

Goals (issue 11): 0 false positives per 100,000 clean steps; <= 5 us per
observation (median). Run: ``.venv/bin/python benchmarks/bench_loss.py``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line
from trainwatch.detectors.loss import Anomaly, LossWatch
from trainwatch.detectors.losssettings import LossSettings

CURVES = Path(__file__).resolve().parent / "curves"
TOL = 5
KINDS = ("nan_loss", "loss_spike", "grad_norm_outlier", "divergence")
ACCEPTS = {
    "nan_loss": {"nan_loss"},
    "loss_spike": {"loss_spike", "grad_norm_outlier"},
    "grad_norm_outlier": {"grad_norm_outlier"},
    "divergence": {"divergence", "loss_spike", "grad_norm_outlier"},
}
Obs = tuple[int, float | None, float | None]


@dataclass
class Event:
    kind: str
    onset: int
    end: int  # last step it affects
    transient: bool = False  # a spike that recovers by itself: must never act


@dataclass
class Curve:
    name: str
    family: str
    obs: list[Obs]
    events: list[Event] = field(default_factory=list)


# --- synthetic curves ------------------------------------------------------------


def _schedule(rng: random.Random, kind: str, n: int) -> tuple[list[float], list[float]]:
    """Log-loss and log-grad-norm without noise: power-law decay plus what the
    schedule does to it."""
    l0, linf = math.log(rng.uniform(6, 11)), math.log(rng.uniform(1.5, 3.0))
    tau, alpha = rng.uniform(20, 80), rng.uniform(0.5, 1.0)
    g0 = math.log(rng.uniform(0.3, 2.0))
    drops = sorted(rng.sample(range(n // 4, n - 100), 2)) if kind == "steps" else []
    restarts = list(range(n // 3, n, n // 3))[:2] if kind == "restarts" else []
    ll, lg = [], []
    for t in range(n):
        base = linf + (l0 - linf) * (1 + t / tau) ** -alpha
        if kind == "cosine":
            base -= 0.15 * (1 - math.cos(math.pi * t / n)) / 2  # faster fall as the LR decays
        if kind == "plateau":
            base = max(base, linf + 0.3)
        for d in drops:  # an LR drop: the loss falls ~5 % over ~30 steps
            if t >= d:
                base -= 0.05 * (1 - math.exp(-(t - d) / 10))
        g = g0 + 1.5 * math.exp(-t / 30) + 0.2 * t / n  # high at first, slow drift up
        for r in restarts:  # warm restart: +10-25 % loss, x1.5 grad norm, recovering
            if t >= r:
                k = math.exp(-(t - r) / 60)
                base += rng.uniform(0.10, 0.22) * k * min(1.0, (t - r + 1) / 5)
                g += 0.4 * k
        ll.append(base)
        lg.append(g)
    return ll, lg


def synthetic(seed: int, n_clean: int, n_event: int) -> list[Curve]:
    rng = random.Random(seed)
    out: list[Curve] = []
    scheds = ("cosine", "steps", "restarts", "plateau", "const")
    events = ("loss_spike", "grad_norm_outlier", "divergence", "divergence_jump", "nan_loss",
              "nan_grad", "nan_once")
    for i in range(n_clean + n_event):
        sched = scheds[i % len(scheds)]
        n = 3000
        ll, lg = _schedule(rng, sched, n)
        sigma = rng.choice((0.01, 0.02, 0.04, 0.08))
        heavy = i % 3 == 0
        stride = 10 if i % 7 == 0 else 1
        loss: list[float | None] = []
        grad: list[float | None] = []
        for t in range(n):
            e = rng.gauss(0, 1) if not heavy else rng.gauss(0, 1) / math.sqrt(
                rng.gammavariate(2, 2) / 4)  # Student t(4)
            loss.append(math.exp(ll[t] + sigma * e))
            grad.append(math.exp(lg[t] + 0.15 * rng.gauss(0, 1)))
        evs: list[Event] = []
        family = f"clean/{sched}"
        if i >= n_clean:
            kind = events[(i - n_clean) % len(events)]
            t0 = rng.randrange(600, n - 400)
            t0 -= t0 % stride
            family = f"{kind}/{sched}"
            if kind == "loss_spike":
                d, f = rng.randint(2, 8) * stride, rng.uniform(2, 6)
                for t in range(t0, t0 + d):
                    loss[t] = (loss[t] or 0) * f
                    grad[t] = (grad[t] or 0) * f
                evs.append(Event("loss_spike", t0, t0 + d - 1, transient=True))
            elif kind == "grad_norm_outlier":
                d, f = rng.randint(2, 3) * stride, rng.uniform(5, 20)
                for t in range(t0, t0 + d):
                    grad[t] = (grad[t] or 0) * f
                evs.append(Event("grad_norm_outlier", t0, t0 + d - 1, transient=True))
            elif kind == "divergence":
                rate = rng.uniform(0.003, 0.03)
                for t in range(t0, n):
                    rise = min(1.5, rate * (t - t0 + 1))
                    loss[t] = (loss[t] or 0) * math.exp(rise)
                    grad[t] = (grad[t] or 0) * math.exp(rise)
                evs.append(Event("divergence", t0, n - 1))
            elif kind == "divergence_jump":
                for t in range(t0, n):
                    loss[t] = (loss[t] or 0) * 3
                    grad[t] = (grad[t] or 0) * 4
                evs.append(Event("divergence", t0, n - 1))
            elif kind in ("nan_loss", "nan_grad"):
                bad = float("nan") if rng.random() < 0.5 else float("inf")
                for t in range(t0, n):
                    if kind == "nan_loss":
                        loss[t] = bad
                    grad[t] = bad
                evs.append(Event("nan_loss", t0, n - 1))
            else:  # one NaN, then the run goes on (a skipped bad batch)
                loss[t0] = float("nan")
                evs.append(Event("nan_loss", t0, t0))
        obs = [(t, loss[t], grad[t]) for t in range(0, n, stride)]
        out.append(Curve(f"syn{i:03d}", family, obs, evs))
    return out


def real_curves() -> list[Curve]:
    labels = json.loads((CURVES / "labels.json").read_text())
    out = []
    for name, evs in sorted(labels.items()):
        with gzip.open(CURVES / f"{name}.csv.gz", "rt") as f:
            obs: list[Obs] = [(int(r["step"]), float(r["loss"]), float(r["grad_norm"]))
                              for r in csv.DictReader(f)]
        last = obs[-1][0]
        events = [Event(e["kind"], int(e["onset"]), last) for e in evs]
        out.append(Curve(f"real/{name}", "real/" + ("clean" if not evs else "divergence"),
                         obs, events))
    return out


# --- scoring ---------------------------------------------------------------------


def run(curve: Curve, settings: LossSettings) -> tuple[list[Anomaly], list[float]]:
    w = LossWatch(settings)
    pc = time.perf_counter_ns
    found: list[Anomaly] = []
    cost: list[float] = []
    observe = w.observe
    for step, loss, grad in curve.obs:
        t0 = pc()
        a = observe(step, loss, grad)
        t1 = pc()
        cost.append((t1 - t0) / 1000)
        found.extend(a)
    return found, cost


def _matches(a: Anomaly, e: Event) -> bool:
    return a.kind in ACCEPTS[e.kind] and a.step >= e.onset - TOL and a.onset <= e.end + TOL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--clean", type=int, default=60, help="clean synthetic curves (3,000 steps)")
    ap.add_argument("--events", type=int, default=70, help="synthetic curves with one event")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    settings = LossSettings()
    curves = synthetic(args.seed, args.clean, args.events) + real_curves()
    tp = dict.fromkeys(KINDS, 0)
    det = dict.fromkeys(KINDS, 0)
    n_ev = dict.fromkeys(KINDS, 0)
    hit = dict.fromkeys(KINDS, 0)
    acted = dict.fromkeys(KINDS, 0)
    errs: dict[str, list[int]] = {k: [] for k in KINDS}
    fp: list[tuple[str, Anomaly]] = []
    clean_steps = 0
    transient, transient_acted = 0, 0
    cost: list[float] = []
    for c in curves:
        found, cs = run(c, settings)
        cost.extend(cs)
        covered = {s for s, _, _ in c.obs for e in c.events if e.onset <= s <= e.end}
        clean_steps += len(c.obs) - len(covered)
        for a in found:
            det[a.kind] += 1
            if any(_matches(a, e) for e in c.events):
                tp[a.kind] += 1
            else:
                fp.append((c.name, a))
        for e in c.events:
            n_ev[e.kind] += 1
            own = [a for a in found if a.kind == e.kind and _matches(a, e)]
            if own:
                hit[e.kind] += 1
                errs[e.kind].append(own[0].onset - e.onset)
            if any(a.level == "act" for a in found if _matches(a, e)):
                acted[e.kind] += 1
            if e.transient:
                transient += 1
                transient_acted += any(a.level == "act" for a in found if _matches(a, e))
            if args.verbose and not own:
                print(f"  missed {c.name} {c.family} {e}")
    print(machine_line())
    print(f"suite: {len(curves)} curves ({args.clean} clean + {args.events} with an event, seed "
          f"{args.seed}; + {len(real_curves())} real), {sum(len(c.obs) for c in curves):,} "
          f"observations, {clean_steps:,} clean")
    print(f"settings: {settings}")
    print()
    print(f"{'class':<18} {'events':>6} {'found':>6} {'recall':>7} {'detections':>10} "
          f"{'precision':>9} {'acted':>6} {'onset err median':>16} {'max':>5}")
    for k in KINDS:
        rec = hit[k] / n_ev[k] if n_ev[k] else float("nan")
        prec = tp[k] / det[k] if det[k] else float("nan")
        med = statistics.median(errs[k]) if errs[k] else float("nan")
        mx = max(errs[k], key=abs) if errs[k] else float("nan")
        print(f"{k:<18} {n_ev[k]:>6} {hit[k]:>6} {rec:>7.3f} {det[k]:>10} {prec:>9.3f} "
              f"{acted[k]:>6} {med:>16} {mx:>5}")
    print()
    print(f"false positives: {len(fp)} in {clean_steps:,} clean steps = "
          f"{len(fp) / clean_steps * 1e5:.2f} per 100,000 (goal 0)")
    for name, a in fp[:10]:
        print(f"  FP {name}: {a.kind} {a.level} onset {a.onset} step {a.step} {a.evidence}")
    print(f"transient spikes acted on: {transient_acted} of {transient} (by design 0)")
    for c in curves:
        if c.name.startswith("real/"):
            found, _ = run(c, settings)
            first: dict[tuple[str, str], Anomaly] = {}
            for a in found:
                first.setdefault((a.kind, a.level), a)
            got = ", ".join(f"{k}/{lv} onset {a.onset} at {a.step}"
                            for (k, lv), a in first.items()) or "nothing"
            print(f"{c.name} ({len(c.obs)} steps, events {[(e.kind, e.onset) for e in c.events]}):"
                  f" {got}")
    cost.sort()
    print(f"cost per observation: median {statistics.median(cost):.2f} us, "
          f"p99 {cost[int(len(cost) * 0.99)]:.2f} us, n={len(cost):,} (goal median <= 5 us)")


if __name__ == "__main__":
    main()
