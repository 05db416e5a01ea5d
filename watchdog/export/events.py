"""What happens to the jobs, counted as it happens: faults, relaunches, their
latencies and the work they cost, in prometheus-client counters and histograms
(``Events``, one set per registry). Each job holds its set; the exporter
(metrics.py) registers it. A module of its own so that a job needs not the
exporter, which reads the whole supervisor at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from trainwatch.state.catalog import REFUSALS
from trainwatch.types import DETECTED_KINDS

# ``_created`` series double the counters for nothing a dashboard uses.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

# Onset -> detection: an Xid in milliseconds, a hang after its timeout (a crash's onset
# is unknown: not observed).
DETECTION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
                     1800)
# Detection -> relaunch: kill grace plus backoff.
RELAUNCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Events:
    """What happened, counted as it happens; one set per registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.faults = Counter("trainwatch_job_faults", "Faults detected, whatever the action.",
                              ["job", "kind"], registry=r)
        self.restarts = Counter("trainwatch_job_restarts",
                                "Relaunches, by the kind of fault that caused them.",
                                ["job", "kind"], registry=r)
        self.detection = Histogram("trainwatch_job_detection_seconds",
                                   "Fault onset to detection.", ["job"],
                                   buckets=DETECTION_BUCKETS, registry=r)
        self.relaunch = Histogram("trainwatch_job_relaunch_seconds",
                                  "Detection to the relaunched process's start (kill and "
                                  "backoff included).", ["job"], buckets=RELAUNCH_BUCKETS,
                                  registry=r)
        self.steps_lost = Counter("trainwatch_job_steps_lost",
                                  "Steps redone after relaunches.", ["job"], registry=r)
        self.rollbacks = Counter("trainwatch_job_rollbacks",
                                 "Rollbacks past a loss anomaly, by whether the skip window is "
                                 "exact (the job's data order is a function of the step), "
                                 "approximate, or unverified (the job did not say).",
                                 ["job", "skip"], registry=r)
        self.skipped_steps = Counter("trainwatch_job_rollback_skipped_steps",
                                     "Steps whose data relaunches skip after rollbacks (a "
                                     "widening adds the steps it adds).", ["job"], registry=r)
        self.deletions = Counter("trainwatch_job_checkpoints_deleted",
                                 "Checkpoints retention deleted (outcome deleted) or tried "
                                 "to (failed).", ["job", "outcome"], registry=r)
        self.fresh_starts = Counter("trainwatch_job_fresh_starts_with_checkpoints",
                                    "Launches from scratch although checkpoints were on disk "
                                    "(none was judged good) or pulling the newest snapshot "
                                    "from the remote store failed.", ["job"], registry=r)
        self.reports_refused = Counter(
            "trainwatch_job_checkpoint_reports_refused",
            "Checkpoint reports from the job refused, by reason: outside_dir (not in "
            "checkpoints.dir), not_named (not a name its layout gives that step), "
            "quarantined, path_too_long.", ["job", "reason"], registry=r)
        self.seconds_lost = Counter("trainwatch_job_seconds_lost",
                                    "Seconds lost to faults: onset to the relaunch's first "
                                    "heartbeat, plus redoing the lost steps.", ["job"],
                                    registry=r)
        self.slurm_requeues = Counter(
            "trainwatch_slurm_requeues", "Requeues of attached Slurm jobs trainwatch asked "
            "for, by Slurm's answer: ok, refused (--no-requeue, not a batch job), failed.",
            ["job", "outcome"], registry=r)

    def add_job(self, job: str) -> None:
        """Every series of a job from zero, so that the first fault is an increase."""
        for kind in DETECTED_KINDS:
            self.faults.labels(job, kind.value)
            self.restarts.labels(job, kind.value)
        self.detection.labels(job)
        self.relaunch.labels(job)
        self.steps_lost.labels(job)
        for skip in ("exact", "approximate", "unverified"):
            self.rollbacks.labels(job, skip)
        self.skipped_steps.labels(job)
        self.seconds_lost.labels(job)
        for outcome in ("deleted", "failed"):
            self.deletions.labels(job, outcome)
        self.fresh_starts.labels(job)
        for reason in REFUSALS:
            self.reports_refused.labels(job, reason)
