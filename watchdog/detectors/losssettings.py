"""The loss and gradient-norm detectors' settings (``anomalies.detect``), per job:
what loss.py's LossWatch judges with, and config/sections.py reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossSettings:
    """Per job. Every kind can be switched off; the defaults were chosen on the
    labelled suite of ``benchmarks/bench_loss.py`` (0 false positives on its
    clean curves, real ones included)."""

    nan_loss: bool = True
    loss_spike: bool = True
    grad_norm_outlier: bool = True
    divergence: bool = True
    # Finite observations of a series before any statistical verdict on it:
    # covers the warm-up ramp and the steep, noisy first steps.
    warmup_steps: int = 100
    # Observations in the rolling baseline (median and IQR). 200 is long enough
    # for a stable IQR at 1 % outliers, short enough to follow a cosine decay.
    window: int = 200
    # Robust z (log space) from which an observation is an outlier. 6 sigma:
    # a real per-step LM loss (noise ~7 %) must rise ~1.5 x; Gaussian noise
    # never gets there, a t(4) tail about once in 10^4 (min_run handles that).
    alert_z: float = 6.0
    # Robust z of an extreme excursion; ``act_run`` of them in a row act.
    act_z: float = 10.0
    # And an outlier must be at least this many times its baseline. Without it a
    # smooth curve (noise ~1 %) makes a warm restart's +15 % a 15-sigma event;
    # real spikes are 1.5 x and more (PaLM's, OPT's, the lr_blowup run's).
    min_ratio: float = 1.3
    # Consecutive outliers before an alert (2: one value alone may be a tail).
    min_run: int = 2
    # Consecutive observations at z >= act_z before ``act``: a spike that has
    # not recovered after this many is not transient (PaLM rolled back for it).
    act_run: int = 10
    # Floor of the noise (relative, i.e. log units): a flat or smoothed curve
    # must not make a 1 % wiggle a 6-sigma event.
    min_noise: float = 0.01
    # Raw losses in the divergence median; transient spikes shorter than half
    # of it never count.
    divergence_window: int = 50
    # The recent median over the best median seen that is a divergence (1.3:
    # a warm restart raises it ~10 %, a real divergence doubles it).
    divergence_ratio: float = 1.3

    def __post_init__(self) -> None:
        if self.window < 8 or self.divergence_window < 4:
            raise ValueError("window must be >= 8 and divergence_window >= 4")
        if not 0 < self.alert_z <= self.act_z:
            raise ValueError("need 0 < alert_z <= act_z")
        if self.min_run < 1 or self.act_run < 1 or self.warmup_steps < 0:
            raise ValueError("min_run and act_run must be >= 1, warmup_steps >= 0")
        if self.divergence_ratio <= 1 or self.min_ratio < 1 or self.min_noise <= 0:
            raise ValueError("need divergence_ratio > 1, min_ratio >= 1, min_noise > 0")
