"""Loss and gradient-norm anomalies: ``nan_loss``, ``loss_spike``,
``grad_norm_outlier`` and ``divergence``, from one job's (one attempt's)
per-step values, fed in step order. Pure: no I/O, stdlib only.

The statistic (and why). Both series are positive and their noise scales with
their level (a loss of 6 jitters more than a loss of 2), so every test is made
on ``log(x)``: a spike is a *ratio* to the baseline, the same at any level, and
the multiplicative noise becomes additive. The baseline is the median of the
last ``window`` accepted values and the noise is their inter-quartile range
/ 1.349 (a robust sigma), kept in a sorted list (bisect: O(log W) compares, a
2 KB memmove). z = (log x - median) / max(sigma, min_noise).
- Against the prior art: a mean and standard deviation (OLMo's 7 sigma over
  1,000, llm.c's z over 128, ZClip's EMA) are moved by the very outliers they
  look for and by heavy-tailed noise; the median and IQR are not (25 %
  breakdown). ZClip's EMA (alpha 0.97) remembers ~33 steps, so a slow rise
  teaches it the new level; Megatron's 10 x the recent maximum is robust but
  blind to anything under an order of magnitude. All four are poisoned by a
  NaN in their window; here a non-finite value never enters any state.
- One-sided: only values *above* the baseline count. A learning-rate drop, a
  cosine decay or a warm-up ramp only lowers the loss, and a falling loss
  leaves the trailing median above the current value (z < 0): no verdict.
- Outliers enter the window clipped to the alert threshold (winsorized, as
  ZClip clips on a spike): a spike cannot inflate its own baseline, while a
  real, lasting change of level (a warm restart, a new data mix) is still
  learnt, a little per step.
- An outlier must also be ``min_ratio`` x its baseline: on a smooth curve a
  warm restart's moderate rise is many sigma, but no real spike is small.
- Levels: ``min_run`` consecutive outliers (z >= alert_z) give one ``alert``
  with onset = the first of them (a lone value cannot be told from a heavy
  tail); ``act`` needs the excursion to be sustained: ``act_run`` consecutive
  observations at z >= act_z. A transient spike that recovers by itself is
  an alert, never an act.
- ``divergence`` (loss only): the median of the last ``divergence_window``
  raw losses reaches ``divergence_ratio`` x the lowest such median seen so
  far. A median needs half its window elevated, so a transient spike shorter
  than that never counts. Onset is a change point: the last step at which an
  upward CUSUM of log-loss against (best median + noise) was zero.
- Warm-up: no statistical verdict before ``warmup_steps`` finite
  observations of that series (noisy early steps, the warm-up ramp).

Observations are counted, not steps: a client beating every k steps gets
windows of W observations. A step at or below the last one is ignored. A
value <= 0 (a loss that is not a cross-entropy) is not tested statistically;
non-finite values still are ``nan_loss``.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainwatch.detectors.losssettings import LossSettings

STATE_VERSION = 1
_IQR_SIGMA = 1.349  # IQR of a unit normal: IQR / 1.349 estimates sigma


@dataclass(frozen=True)
class Anomaly:
    kind: str  # "nan_loss" | "loss_spike" | "grad_norm_outlier" | "divergence" (FaultKind values)
    level: str  # "alert" | "act"
    onset: int  # the step where it began (first outlier of the run, or the change point)
    step: int  # the step at which it was noticed
    value: float  # the value that decided it
    evidence: dict[str, float | int | str] = field(default_factory=dict)


class _Window:
    """The last ``size`` values in arrival order and sorted: median and IQR in O(1)."""

    __slots__ = ("order", "size", "sorted")

    def __init__(self, size: int, values: list[float] | None = None) -> None:
        self.size = size
        self.order: deque[float] = deque(values[-size:] if values else ())
        self.sorted = sorted(self.order)

    def push(self, y: float) -> None:
        if len(self.order) >= self.size:
            del self.sorted[bisect_left(self.sorted, self.order.popleft())]
        self.order.append(y)
        insort(self.sorted, y)

    def median(self) -> float:
        s = self.sorted
        n = len(s)
        return s[n >> 1] if n & 1 else (s[(n >> 1) - 1] + s[n >> 1]) * 0.5

    def sigma(self) -> float:
        s = self.sorted
        n = len(s)
        return (s[(3 * n) >> 2] - s[n >> 2]) / _IQR_SIGMA


class _Spikes:
    """Robust z-score of one series against its rolling baseline, and the run of outliers."""

    __slots__ = ("acted", "alerted", "hot", "kind", "log_ratio", "n", "run", "sig", "start", "win")

    def __init__(self, kind: str, window: int, min_ratio: float) -> None:
        self.kind = kind
        self.log_ratio = math.log(min_ratio)
        self.win = _Window(window)
        self.n = 0  # finite positive observations
        self.run = 0  # consecutive outliers
        self.hot = 0  # consecutive observations at z >= act_z
        self.start = -1  # step of the run's first outlier
        self.sig = 0.0  # the last robust noise (log units), for the divergence CUSUM
        self.alerted = False
        self.acted = False

    def observe(self, s: LossSettings, step: int, x: float, on: bool) -> Anomaly | None:
        """Feed a finite value; an anomaly when one is decided (hot path: kept inline)."""
        if x <= 0.0:
            return None
        y = math.log(x)
        win = self.win
        order, srt = win.order, win.sorted
        self.n += 1
        n = len(srt)
        if self.n <= s.warmup_steps or n < 8:
            win.push(y)
            return None
        med = srt[n >> 1] if n & 1 else (srt[(n >> 1) - 1] + srt[n >> 1]) * 0.5
        sig = (srt[(3 * n) >> 2] - srt[n >> 2]) / _IQR_SIGMA
        if sig < s.min_noise:
            sig = s.min_noise
        self.sig = sig
        z = (y - med) / sig
        out = z >= s.alert_z and y - med >= self.log_ratio
        if out:
            y = med + s.alert_z * sig  # winsorized: a spike does not raise its own baseline
        if n >= win.size:
            del srt[bisect_left(srt, order.popleft())]
        order.append(y)
        insort(srt, y)
        if not out:
            if self.run:
                self.run = self.hot = 0
                self.alerted = self.acted = False
            return None
        if self.run == 0:
            self.start = step
        self.run += 1
        self.hot = self.hot + 1 if z >= s.act_z else 0
        if not on:
            return None
        level = ""
        if not self.acted and self.hot >= s.act_run:
            self.acted = self.alerted = True
            level = "act"
        elif not self.alerted and self.run >= s.min_run:
            self.alerted = True
            level = "alert"
        if not level:
            return None
        return Anomaly(self.kind, level, self.start, step, x, {
            "series": "loss" if self.kind == "loss_spike" else "grad_norm",
            "z": round(z, 3), "alert_z": s.alert_z, "act_z": s.act_z,
            "baseline": math.exp(med), "ratio": round(x / math.exp(med), 4),
            "noise": round(sig, 5), "run": self.run,
            "window": len(order),
        })

    def to_json(self) -> dict[str, Any]:
        return {"values": list(self.win.order), "n": self.n, "run": self.run, "hot": self.hot,
                "start": self.start, "alerted": self.alerted, "acted": self.acted}

    def load(self, d: dict[str, Any]) -> None:
        self.win = _Window(self.win.size, [float(v) for v in d["values"]])
        self.n, self.run, self.hot, self.start = (int(d[k]) for k in ("n", "run", "hot", "start"))
        self.alerted, self.acted = bool(d["alerted"]), bool(d["acted"])


class _Divergence:
    """The median of the last D raw log-losses against the lowest such median seen."""

    __slots__ = ("best", "best_step", "cusum", "fired", "win", "zero_step")

    def __init__(self, window: int) -> None:
        self.win = _Window(window)
        self.best = math.inf  # lowest median of a full window
        self.best_step = -1
        self.cusum = 0.0  # upward CUSUM of log-loss over best + noise
        self.zero_step = -1  # the last step at which the CUSUM was zero
        self.fired = False

    def observe(self, s: LossSettings, step: int, x: float, noise: float, seen: int,
                on: bool) -> Anomaly | None:
        """Feed a finite loss; ``noise``: the spike baseline's robust sigma; ``seen``:
        finite losses so far (warm-up)."""
        if x <= 0.0:
            return None
        y = math.log(x)
        win = self.win
        order, srt = win.order, win.sorted
        if len(srt) >= win.size:
            del srt[bisect_left(srt, order.popleft())]
        order.append(y)
        insort(srt, y)
        n = len(srt)
        if n < win.size:
            return None
        med = srt[n >> 1] if n & 1 else (srt[(n >> 1) - 1] + srt[n >> 1]) * 0.5
        if med < self.best:
            self.best, self.best_step = med, step
        c = self.cusum + y - self.best - (noise if noise > s.min_noise else s.min_noise)
        if c <= 0.0:
            c = 0.0
            self.zero_step = step
        self.cusum = c
        rise = med - self.best
        if rise < math.log(s.divergence_ratio):
            self.fired = False
            return None
        if self.fired or not on or seen <= s.warmup_steps:
            return None
        self.fired = True
        onset = self.zero_step + 1 if self.zero_step >= 0 else step
        return Anomaly("divergence", "act", min(onset, step), step, math.exp(med), {
            "median": math.exp(med), "best_median": math.exp(self.best),
            "best_step": self.best_step, "ratio": round(math.exp(rise), 4),
            "threshold": s.divergence_ratio, "window": win.size,
        })

    def to_json(self) -> dict[str, Any]:
        return {"values": list(self.win.order), "best": self.best if self.best < math.inf else None,
                "best_step": self.best_step, "cusum": self.cusum, "zero_step": self.zero_step,
                "fired": self.fired}

    def load(self, d: dict[str, Any]) -> None:
        self.win = _Window(self.win.size, [float(v) for v in d["values"]])
        self.best = math.inf if d["best"] is None else float(d["best"])
        self.best_step, self.zero_step = int(d["best_step"]), int(d["zero_step"])
        self.cusum, self.fired = float(d["cusum"]), bool(d["fired"])


class LossWatch:
    """Per-job (per attempt) state; feed it every observation in step order."""

    def __init__(self, settings: LossSettings) -> None:
        self.settings = settings
        self.last_step: int | None = None
        self._loss = _Spikes("loss_spike", settings.window, settings.min_ratio)
        self._grad = _Spikes("grad_norm_outlier", settings.window, settings.min_ratio)
        self._div = _Divergence(settings.divergence_window)
        self._in_nan = False  # inside a run of non-finite observations (one nan_loss per run)
        self.last_outlier_step: int | None = None
        self.last_nonfinite_step: int | None = None
        self.outliers = 0  # observations with a z >= alert_z in either series

    def observe(self, step: int, loss: float | None, grad_norm: float | None) -> list[Anomaly]:
        """The anomalies decided by this observation (usually none)."""
        if self.last_step is not None and step <= self.last_step:
            return []  # a repeat or a late duplicate
        self.last_step = step
        s = self.settings
        out: list[Anomaly] = []
        lok = loss is not None and math.isfinite(loss)
        gok = grad_norm is not None and math.isfinite(grad_norm)
        if (loss is None or lok) and (grad_norm is None or gok):
            self._in_nan = False
        else:
            self.last_nonfinite_step = step
            if not self._in_nan and s.nan_loss:
                name, v = ("grad_norm", grad_norm) if loss is None or lok else ("loss", loss)
                assert v is not None
                out.append(Anomaly("nan_loss", "act", step, step, v,
                                   {"series": name, "value": repr(v)}))
            self._in_nan = True
        # Each finite value still feeds its series: the loss of a step whose
        # grad norm is NaN was computed before that update, and is real.
        if lok:
            assert loss is not None
            self._spike(self._loss, step, loss, s.loss_spike, out)
            d = self._div.observe(s, step, loss, self._loss.sig, self._loss.n, s.divergence)
            if d is not None:
                out.append(d)
        if gok:
            assert grad_norm is not None
            self._spike(self._grad, step, grad_norm, s.grad_norm_outlier, out)
        return out

    def _spike(self, sp: _Spikes, step: int, x: float, on: bool, out: list[Anomaly]) -> None:
        a = sp.observe(self.settings, step, x, on)
        if sp.run:
            self._outlier(step)
        if a is not None:
            out.append(a)

    def _outlier(self, step: int) -> None:
        if self.last_outlier_step != step:
            self.outliers += 1
        self.last_outlier_step = step

    def health(self) -> dict[str, float | int | None]:
        """The statistics now, for the catalog to record at a checkpoint's step:
        median and robust relative noise of each baseline window, its mean and
        standard deviation (outliers clipped), counts and the last bad steps."""
        h: dict[str, float | int | None] = {}
        for name, sp in (("loss", self._loss), ("grad_norm", self._grad)):
            w = sp.win
            h[f"{name}_n"] = sp.n
            if len(w.order) >= 8:
                vals = [math.exp(v) for v in w.order]
                mean = math.fsum(vals) / len(vals)
                h[f"{name}_median"] = math.exp(w.median())
                h[f"{name}_noise"] = w.sigma()
                h[f"{name}_mean"] = mean
                h[f"{name}_std"] = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / len(vals))
            else:
                for k in ("median", "noise", "mean", "std"):
                    h[f"{name}_{k}"] = None
        dw = self._div.win
        h["loss_recent_median"] = math.exp(dw.median()) if dw.order else None
        h["loss_best_median"] = math.exp(self._div.best) if self._div.best < math.inf else None
        h["outliers"] = self.outliers
        h["last_outlier_step"] = self.last_outlier_step
        h["last_nonfinite_step"] = self.last_nonfinite_step
        h["last_step"] = self.last_step
        return h

    def to_json(self) -> dict[str, Any]:
        """The whole state, JSON-safe and bounded (window + divergence_window floats per series)."""
        return {"v": STATE_VERSION, "last_step": self.last_step, "in_nan": self._in_nan,
                "loss": self._loss.to_json(), "grad_norm": self._grad.to_json(),
                "divergence": self._div.to_json(), "outliers": self.outliers,
                "last_outlier_step": self.last_outlier_step,
                "last_nonfinite_step": self.last_nonfinite_step}

    @classmethod
    def from_json(cls, settings: LossSettings, d: dict[str, Any]) -> LossWatch:
        """A watch that continues where ``to_json`` left off. Windows longer than the
        settings' (changed since) keep their newest values. ValueError if malformed."""
        w = cls(settings)
        try:
            if d.get("v") != STATE_VERSION:
                raise ValueError(f"version {d.get('v')!r}, expected {STATE_VERSION}")
            w.last_step = None if d["last_step"] is None else int(d["last_step"])
            w._in_nan = bool(d["in_nan"])
            w._loss.load(d["loss"])
            w._grad.load(d["grad_norm"])
            w._div.load(d["divergence"])
            w.outliers = int(d["outliers"])
            los, lns = d["last_outlier_step"], d["last_nonfinite_step"]
            w.last_outlier_step = None if los is None else int(los)
            w.last_nonfinite_step = None if lns is None else int(lns)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"loss watch state: {e!r}") from None
        return w
