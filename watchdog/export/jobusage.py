"""Each job's CPU and memory, read from its current attempt's cgroup at scrape time.

A collector of its own (node_exporter's habit: one source, one collector), so
that a cgroup read that goes wrong cannot take the other families down. It
reads no state of the supervisor loop but the runners' current attempts (one
attribute each), so it needs not the loop's lock: a stuck loop does not hide
what the job is using.

Counters (CPU seconds, OOM kills) are the job's, not the attempt's: the kernel
counts per cgroup and every attempt has a new one, so the collector adds the
attempts it followed before (their last reading, or the one ``close()`` took
as the cgroup was removed) to the current one. A label per attempt would make
the series unbounded (an attempt number grows for ever), which DESIGN's
metric rules forbid, and would leave ``rate()`` to stitch series together.
Where the job's attempt has no cgroup (cgroup v2 not ours to write: membership
falls back to the process tree), its series are absent, never 0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from trainwatch.actions.cgroup import AttemptCgroup, Usage

if TYPE_CHECKING:
    from trainwatch.export.scraped import Scraped

_ABSENT = " Absent while the job's attempt has no cgroup of its own (cgroup v2 not writable)."
_NO_MEMCG = " Absent also where the memory controller is not enabled for the attempt's cgroup."


@dataclass
class _Totals:
    """One job's counters carried over its attempts."""

    cgroup: AttemptCgroup | None = None  # the attempt being followed
    cpu_usec_before: int = 0  # the attempts before it
    oom_kills_before: int = 0
    cpu_usec: int = 0  # the most seen of the one followed (a counter never goes back)
    oom_kills: int | None = None

    def follow(self, cgroup: AttemptCgroup) -> None:
        """A new attempt: what the one followed used, to the end, goes into the totals."""
        old = self.cgroup
        if old is not None:
            self.see(old.usage() or old.final)
            self.cpu_usec_before += self.cpu_usec
            self.oom_kills_before += self.oom_kills or 0
        self.cgroup, self.cpu_usec, self.oom_kills = cgroup, 0, None

    def see(self, u: Usage | None) -> None:
        if u is None:
            return
        self.cpu_usec = max(self.cpu_usec, u.cpu_usec)
        if u.oom_kills is not None:
            self.oom_kills = max(self.oom_kills or 0, u.oom_kills)


class JobUsageCollector(Collector):
    """trainwatch_job_cpu_seconds_total, memory and OOM kills, per job."""

    def __init__(self, supervisor: Scraped) -> None:
        self.sup = supervisor
        self._totals: dict[str, _Totals] = {}
        self._lock = threading.Lock()  # concurrent scrapes update the totals

    def collect(self) -> Iterator[Metric]:
        j = ["job"]
        cpu = CounterMetricFamily(
            "trainwatch_job_cpu_seconds",
            "CPU time (user and system) used by the job's processes: its attempt cgroup's "
            "cpu.stat usage_usec, plus that of the attempts before it that this trainwatch "
            "saw." + _ABSENT, labels=j)
        resident = GaugeMetricFamily(
            "trainwatch_job_resident_memory_bytes",
            "Sum of the resident set sizes of the processes in the job's attempt cgroup "
            "(a page shared by several is counted once per process)." + _ABSENT, labels=j)
        memory = GaugeMetricFamily(
            "trainwatch_job_memory_usage_bytes",
            "Memory charged to the job's attempt cgroup now (memory.current: page cache and "
            "kernel memory included)." + _ABSENT + _NO_MEMCG, labels=j)
        peak = GaugeMetricFamily(
            "trainwatch_job_memory_peak_bytes",
            "The most memory charged to the job's current attempt cgroup (memory.peak, "
            "Linux 5.19+)." + _ABSENT + _NO_MEMCG, labels=j)
        ooms = CounterMetricFamily(
            "trainwatch_job_oom_kills",
            "Processes of the job killed by an OOM killer (memory.events oom_kill), over the "
            "attempts this trainwatch saw." + _ABSENT + _NO_MEMCG, labels=j)
        with self._lock:
            seen = set()
            for r in list(self.sup.runners):  # a copy: a reload may change the list
                name = r.job.name
                seen.add(name)
                a = r.attempt
                cg = a.cgroup if a is not None else None
                if cg is None:
                    continue
                t = self._totals.setdefault(name, _Totals())
                if t.cgroup is not cg:
                    t.follow(cg)
                u = cg.usage()
                t.see(u or cg.final)
                cpu.add_metric([name], (t.cpu_usec_before + t.cpu_usec) / 1e6)
                if t.oom_kills is not None:
                    ooms.add_metric([name], t.oom_kills_before + t.oom_kills)
                if u is None:
                    continue  # gone: nothing is using memory in it now
                resident.add_metric([name], u.resident_bytes)
                if u.memory_bytes is not None:
                    memory.add_metric([name], u.memory_bytes)
                if u.memory_peak_bytes is not None:
                    peak.add_metric([name], u.memory_peak_bytes)
            for gone in self._totals.keys() - seen:  # a job removed by a reload
                del self._totals[gone]
        yield from (cpu, resident, memory, peak, ooms)
