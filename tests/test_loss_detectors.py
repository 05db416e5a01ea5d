"""Loss and grad-norm anomaly detectors (trainwatch.detectors.loss): tables of
labelled curves that must stay quiet and that must fire, with kind, level and onset."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from trainwatch.detectors.loss import Anomaly, LossWatch
from trainwatch.detectors.losssettings import LossSettings
from trainwatch.types import FaultKind

Obs = tuple[int, float | None, float | None]
Curve = list[Obs]
NAN, INF = float("nan"), float("inf")


def curve(n: int = 2000, *, seed: int = 0, sched: str = "cosine", sigma: float = 0.03,
          heavy: bool = False, stride: int = 1) -> Curve:
    """A power-law loss with a warm-up (high, steep first steps) and a schedule,
    multiplicative noise; a grad norm high at first that drifts slowly up."""
    rng = random.Random(seed)
    out: Curve = []
    for t in range(0, n, stride):
        ll = math.log(2.0) + (math.log(9.0) - math.log(2.0)) * (1 + t / 40) ** -0.7
        if sched == "cosine":
            ll -= 0.2 * (1 - math.cos(math.pi * t / n)) / 2
        elif sched == "steps":  # LR x0.1 at 800 and 1400: the loss falls faster
            ll -= sum(0.08 * (1 - math.exp(-(t - d) / 8)) for d in (800, 1400) if t >= d)
        elif sched == "restarts":  # SGDR: +20 % for ~60 steps at 700 and 1400
            ll += sum(0.18 * math.exp(-(t - r) / 60) for r in (700, 1400) if t >= r)
        elif sched == "plateau":
            ll = max(ll, math.log(2.6))
        e = rng.gauss(0, 1)
        if heavy:  # Student t(4)
            e /= math.sqrt(rng.gammavariate(2, 2) / 4)
        lg = math.log(0.8) + 1.2 * math.exp(-t / 30) + 0.3 * t / n + 0.15 * rng.gauss(0, 1)
        lg += sum(0.4 * math.exp(-(t - r) / 60) for r in (700, 1400)
                  if sched == "restarts" and t >= r)
        out.append((t, math.exp(ll + sigma * e), math.exp(lg)))
    return out


def scale(c: Curve, start: int, stop: int, loss: float = 1.0, grad: float = 1.0) -> Curve:
    """Multiply loss and grad norm of steps in [start, stop)."""
    return [(s, lo * loss if start <= s < stop and lo is not None else lo,
             g * grad if start <= s < stop and g is not None else g) for s, lo, g in c]


def replace(c: Curve, start: int, stop: int, loss: float | None = None,
            grad: float | None = None) -> Curve:
    return [(s, loss if start <= s < stop and loss is not None else lo,
             grad if start <= s < stop and grad is not None else g) for s, lo, g in c]


def diverge(c: Curve, start: int, rate: float) -> Curve:
    """From ``start`` the log-loss rises ``rate`` per step (capped at x5)."""
    return [(s, lo * math.exp(min(1.6, rate * (s - start + 1))) if s >= start and lo else lo, g)
            for s, lo, g in c]


def feed(c: Curve, settings: LossSettings | None = None) -> list[Anomaly]:
    w = LossWatch(settings or LossSettings())
    return [a for s, lo, g in c for a in w.observe(s, lo, g)]


CLEAN: dict[str, Callable[[], Curve]] = {
    "warm-up ramp then cosine decay": lambda: curve(seed=1),
    "cosine decay, 8 % noise": lambda: curve(seed=2, sigma=0.08),
    "cosine decay, 1 % noise": lambda: curve(seed=3, sigma=0.01),
    "step LR drops": lambda: curve(seed=4, sched="steps"),
    "step LR drops, smooth": lambda: curve(seed=5, sched="steps", sigma=0.005),
    "warm restarts": lambda: curve(seed=6, sched="restarts"),
    "warm restarts, smooth": lambda: curve(seed=7, sched="restarts", sigma=0.01),
    "heavy-tailed noise t(4)": lambda: curve(seed=8, sigma=0.05, heavy=True),
    "loss plateau": lambda: curve(seed=9, sched="plateau", sigma=0.02),
    "skipped steps (every 10th)": lambda: curve(20000, seed=10, stride=10),
    "noisy early steps": lambda: scale(curve(seed=11), 0, 60, loss=1.8, grad=4.0),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_curves_do_not_fire(name: str) -> None:
    """Warm-up, decay, LR drops, restarts, heavy tails, plateaus, skipped steps: nothing."""
    assert feed(CLEAN[name]()) == []


# (name, curve, [(kind, level, onset, tolerance)], kinds that must not appear)
FIRE: list[tuple[str, Callable[[], Curve], list[tuple[str, str, int, int]], set[str]]] = [
    ("transient loss spike x3 for 4 steps", lambda: scale(curve(seed=20), 900, 904, loss=3),
     [("loss_spike", "alert", 900, 0)], {"divergence"}),
    ("sustained spike x4 for 40 steps", lambda: scale(curve(seed=21), 900, 940, loss=4),
     [("loss_spike", "alert", 900, 0), ("loss_spike", "act", 900, 0)], set()),
    ("grad-norm outlier x10 for 2 steps", lambda: scale(curve(seed=22), 900, 902, grad=10),
     [("grad_norm_outlier", "alert", 900, 0)], {"loss_spike", "divergence"}),
    ("grad-norm outlier under skipped steps", lambda: scale(
        curve(20000, seed=23, stride=10), 9000, 9020, grad=10),
     [("grad_norm_outlier", "alert", 9000, 0)], {"loss_spike"}),
    ("slow divergence", lambda: diverge(curve(seed=24), 1000, 0.01),
     [("divergence", "act", 1000, 30)], set()),
    ("divergence by a jump that stays", lambda: scale(curve(seed=25), 1000, 2000, 3, 3),
     [("divergence", "act", 1000, 0), ("loss_spike", "act", 1000, 0)], set()),
    ("NaN loss", lambda: replace(curve(seed=26), 1200, 2000, loss=NAN, grad=NAN),
     [("nan_loss", "act", 1200, 0)], set()),
    ("inf loss", lambda: replace(curve(seed=27), 1200, 1201, loss=INF),
     [("nan_loss", "act", 1200, 0)], set()),
    ("inf grad norm, finite loss", lambda: replace(curve(seed=28), 1200, 1201, grad=INF),
     [("nan_loss", "act", 1200, 0)], set()),
    ("NaN during the warm-up", lambda: replace(curve(seed=29), 10, 11, loss=NAN),
     [("nan_loss", "act", 10, 0)], set()),
]


@pytest.mark.parametrize("name", [f[0] for f in FIRE])
def test_anomalies_fire_with_kind_level_and_onset(name: str) -> None:
    """Spikes, outliers, divergences and NaN/inf fire with the expected kind, level and onset."""
    _, make, expected, absent = next(f for f in FIRE if f[0] == name)
    found = feed(make())
    for kind, level, onset, tol in expected:
        first = next((a for a in found if a.kind == kind and a.level == level), None)
        assert first is not None, f"no {kind}/{level} in {found}"
        assert abs(first.onset - onset) <= tol, first
        assert first.onset <= first.step
        assert FaultKind(first.kind)  # a FaultKind value, for the lead's Fault
    assert not [a for a in found if a.kind in absent]


def test_transient_spike_is_alert_only() -> None:
    """A spike that recovers within act_run observations alerts once and never acts."""
    found = feed(scale(curve(seed=30), 900, 908, loss=5, grad=5))
    assert {(a.kind, a.level) for a in found} == {("loss_spike", "alert"),
                                                  ("grad_norm_outlier", "alert")}
    assert len(found) == 2


def test_drop_never_fires() -> None:
    """A sudden fall of the loss (x0.3) is one-sided down: nothing."""
    assert feed(scale(curve(seed=31), 900, 2000, loss=0.3, grad=0.3)) == []


def test_nan_does_not_blind_later_detection() -> None:
    """After a NaN (one step, in loss and grad norm) a later spike is still found, on time."""
    c = replace(curve(seed=32), 800, 801, loss=NAN, grad=NAN)
    c = scale(c, 1000, 1004, loss=3, grad=3)
    found = feed(c)
    assert [(a.kind, a.onset) for a in found if a.level == "act"] == [("nan_loss", 800)]
    assert ("loss_spike", 1000) in [(a.kind, a.onset) for a in found]
    assert ("grad_norm_outlier", 1000) in [(a.kind, a.onset) for a in found]


def test_one_nan_loss_per_run_of_nonfinite_values() -> None:
    """NaN for 100 steps is one nan_loss; a NaN after finite steps is a new one."""
    c = replace(curve(seed=33), 800, 900, loss=NAN)
    c = replace(c, 950, 951, grad=NAN)
    found = [a for a in feed(c) if a.kind == "nan_loss"]
    assert [(a.onset, a.evidence["series"]) for a in found] == [(800, "loss"), (950, "grad_norm")]


def test_health_stays_finite_after_nan() -> None:
    """The statistics the catalog records ignore non-finite values."""
    w = LossWatch(LossSettings())
    for s, lo, g in replace(curve(seed=34), 500, 510, loss=NAN, grad=INF):
        w.observe(s, lo, g)
    h = w.health()
    assert h["last_nonfinite_step"] == 509 and h["last_step"] == 1999
    for k in ("loss_median", "loss_mean", "loss_std", "grad_norm_median", "loss_best_median"):
        v = h[k]
        assert v is not None and math.isfinite(v), k
    loss_median = h["loss_median"]
    assert loss_median is not None and 1.4 < loss_median < 2.2


def test_repeated_and_older_steps_are_ignored() -> None:
    """A step at or below the last one changes nothing, even when it carries a NaN."""
    w = LossWatch(LossSettings())
    for s, lo, g in curve(500, seed=35):
        w.observe(s, lo, g)
    before = json.dumps(w.to_json())
    assert w.observe(499, NAN, NAN) == [] and w.observe(10, 100.0, 100.0) == []
    assert json.dumps(w.to_json()) == before


def test_disabled_kinds_stay_quiet_and_keep_learning() -> None:
    """Each kind can be off; the others still fire."""
    c = replace(scale(curve(seed=36), 900, 940, loss=4, grad=4), 1500, 1501, loss=NAN)
    off = LossSettings(loss_spike=False, grad_norm_outlier=False, divergence=False)
    assert [(a.kind, a.onset) for a in feed(c, off)] == [("nan_loss", 1500)]
    only_nan_off = LossSettings(nan_loss=False)
    kinds = {a.kind for a in feed(c, only_nan_off)}
    assert "nan_loss" not in kinds and "loss_spike" in kinds


def test_state_round_trip_continues_identically() -> None:
    """to_json -> JSON text -> from_json mid-run, then both continue to the same anomalies."""
    c = replace(scale(diverge(curve(seed=37), 1500, 0.02), 1000, 1003, loss=3), 1200, 1201,
                loss=NAN)
    s = LossSettings()
    a, half = LossWatch(s), [x for x in c if x[0] < 1001]  # cut inside the spike
    for x in half:
        a.observe(*x)
    b = LossWatch.from_json(s, json.loads(json.dumps(a.to_json())))
    rest = [x for x in c if x[0] >= 1001]
    out_a = [y for x in rest for y in a.observe(*x)]
    out_b = [y for x in rest for y in b.observe(*x)]
    assert out_a == out_b and {y.kind for y in out_a} >= {"loss_spike", "nan_loss", "divergence"}
    assert a.to_json() == b.to_json() and a.health() == b.health()


def test_state_is_bounded() -> None:
    """The saved state holds at most window + divergence_window values per series."""
    s = LossSettings()
    w = LossWatch(s)
    for x in curve(20000, seed=38):
        w.observe(*x)
    d = w.to_json()
    assert len(d["loss"]["values"]) == s.window == len(d["grad_norm"]["values"])
    assert len(d["divergence"]["values"]) == s.divergence_window
    assert len(json.dumps(d)) < 40 * (2 * s.window + s.divergence_window)


@pytest.mark.parametrize("bad", [{}, {"v": 99}, {"v": 1, "last_step": "x"}, {"v": 1, "loss": 3}])
def test_malformed_state_is_a_value_error(bad: dict[str, object]) -> None:
    """A corrupt saved state is one ValueError, never another exception."""
    with pytest.raises(ValueError, match="loss watch state"):
        LossWatch.from_json(LossSettings(), bad)


@pytest.mark.parametrize("kw", [{"window": 2}, {"alert_z": 8.0, "act_z": 6.0}, {"min_run": 0},
                                {"divergence_ratio": 1.0}, {"min_noise": 0.0},
                                {"min_ratio": 0.5}, {"warmup_steps": -1}])
def test_settings_are_checked(kw: dict[str, Any]) -> None:
    """Settings that cannot work are refused when built."""
    with pytest.raises(ValueError):
        LossSettings(**kw)


def test_positive_values_only_are_tested_statistically() -> None:
    """A loss <= 0 (not a cross-entropy) is neither a spike nor a NaN."""
    c = [(s, lo - 3.0 if lo else lo, g) for s, lo, g in curve(seed=39)]
    assert [a for a in feed(c) if a.kind != "grad_norm_outlier"] == []
