"""What each job's hands (privsep) did, read at scrape time: calls by outcome, and
the bounds hit in the job's folders. A hand that keeps timing out is a file in
the job's folders whose read blocks: its job's verdicts wait, nothing else."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric
from trainwatch.privsep import jobhands

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts

# Hand.counts keys -> the outcome label (calls is the total, ok is what is left).
_OUTCOMES = {"timeouts": "timeout", "died": "died", "aborted": "aborted", "failed": "failed",
             "down": "refused_cooling_down"}


def families(runners: Iterable[JobParts]) -> Iterator[Metric]:
    calls = CounterMetricFamily(
        "trainwatch_job_hand_calls",
        "Calls to the job's hands (processes as the job's user that read and change its "
        "folders), by hand and outcome.", labels=["job", "hand", "outcome"])
    limits = CounterMetricFamily(
        "trainwatch_job_folder_limits_hit",
        "Bounds hit in the job's folders, by limit: names (a listing read only the first "
        "names), checkpoints (only the newest were kept), rings (a ring folder scan cut).",
        labels=["job", "limit"])
    for r in runners:
        name = r.job.name
        for which in jobhands.NAMES:
            c = getattr(r.hands, which).counts
            bad = sum(c[k] for k in _OUTCOMES if k != "down")
            calls.add_metric([name, which, "ok"], max(0, c["calls"] - bad))
            for key, outcome in _OUTCOMES.items():
                calls.add_metric([name, which, outcome], c[key])
        disk = r.catalog.disk
        limits.add_metric([name, "names"], getattr(disk, "names_cut", 0))
        limits.add_metric([name, "checkpoints"], getattr(disk, "truncated", 0))
        limits.add_metric([name, "rings"], r.intake.scans_cut)
    yield calls
    yield limits
