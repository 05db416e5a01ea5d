"""The Prometheus exporter (prometheus-client).

State is read at scrape time by one collector (client_python's custom
``Collector``): job states, steps, heartbeat ages, the GPUs' last samples,
the sources' health. It reads under the supervisor loop's lock, so a scrape
sees one consistent instant and never a half-applied event. What *happens*
(faults, relaunches, their latencies, the work they cost) is counted as it
happens, in prometheus-client counters and histograms held by ``Events``
(events.py), which this registers.

Naming follows DESIGN: prefix ``trainwatch_``, base units, ``_total`` on
counters, labels of bounded cardinality only (never a step, a path or a
message). docs/reference.md documents every family; a test compares that list with
a live scrape.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from trainwatch import __version__
from trainwatch.export import gpumetrics, handmetrics
from trainwatch.export.events import Events
from trainwatch.export.families import counter as _counter
from trainwatch.export.families import gauge as _gauge
from trainwatch.export.incidentpages import IncidentPages
from trainwatch.export.jobusage import JobUsageCollector
from trainwatch.export.metricsserver import MetricsServer
from trainwatch.privsep.access import Peers
from trainwatch.state import statewrites
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.export.scraped import Scraped
    from trainwatch.lifecycle.runner import Runner

# A live attempt: its ranks' heartbeat ages are shown.
_LIVE = (JobState.STARTING, JobState.RUNNING)


class StateCollector(Collector):
    """Everything trainwatch knows, read from the supervisor at scrape time."""

    def __init__(self, supervisor: Scraped, lock_timeout: float = 2.0) -> None:
        self.sup = supervisor
        self.lock_timeout = lock_timeout

    def collect(self) -> Iterator[Metric]:
        build = _gauge("trainwatch_build_info", "trainwatch's version; always 1.",
                       ["version", "python"])
        build.add_metric([__version__, platform.python_version()], 1)
        yield build
        # A loop that does not let go of its lock is stuck: say so rather than block.
        if not self.sup.lock.acquire(timeout=self.lock_timeout):
            stuck = _gauge("trainwatch_source_up", "1 if the source's last read worked.",
                           ["source"])
            stuck.add_metric(["loop"], 0)
            yield stuck
            return
        try:
            yield from self._sources()
            yield from gpumetrics.families(self.sup)
            yield from handmetrics.families(self.sup.runners)
            yield from self._jobs()
        finally:
            self.sup.lock.release()

    # --- sources ------------------------------------------------------------------

    def _sources(self) -> Iterator[Metric]:
        up = _gauge("trainwatch_source_up",
                    "1 if the source's last read of the world worked.", ["source"])
        took = _gauge("trainwatch_source_scrape_duration_seconds",
                      "How long the source's last read took.", ["source"])
        errors = _counter("trainwatch_source_errors", "Failed reads, by source.", ["source"])
        sup = self.sup
        up.add_metric(["loop"], 1)
        errors.add_metric(["loop"], sup.loop_errors)
        w = sup.gpus
        if w is not None:
            for src in w.sources():
                up.add_metric([src.name], 1 if src.up else 0)
                errors.add_metric([src.name], src.errors)
                if src.duration is not None:
                    took.add_metric([src.name], src.duration)
        hb = [r.socket for r in sup.runners]
        up.add_metric(["heartbeat"], 1 if all(s.open for s in hb) else 0)
        errors.add_metric(["heartbeat"], sum(s.counters.errors for s in hb))
        drained = [s.last_drain for s in hb if s.last_drain is not None]
        if drained:
            took.add_metric(["heartbeat"], max(drained))
        up.add_metric(["control"], 1 if sup.control is not None else 0)
        yield from (up, took, errors)
        ledger = _counter("trainwatch_ledger_write_errors",
                          "Ledger writes that failed and were survived.")
        ledger.add_metric([], sup.ledger.errors)
        yield ledger
        if sup.control is not None:
            c = sup.control.counters
            control = _counter("trainwatch_control_requests",
                               "Requests on the control socket, by outcome: answered, refused "
                               "(not the sender's to make), dropped (the sender past its "
                               "rate), malformed, failed.", ["outcome"])
            answered = c.requests - c.refused - c.throttled - c.malformed - c.failed
            for outcome, n in (("answered", answered), ("refused", c.refused),
                               ("dropped", c.throttled), ("malformed", c.malformed),
                               ("failed", c.failed)):
                control.add_metric([outcome], n)
            yield control
        writes = _counter("trainwatch_state_write_errors",
                          "Writes of trainwatch's own files that failed and were survived, "
                          "by file: ledger, status, catalog, log, gpus.", ["file"])
        for kind, n in statewrites.counts().items():
            writes.add_metric([kind], n)
        yield writes

    # --- jobs -----------------------------------------------------------------------

    def _jobs(self) -> Iterator[Metric]:
        j = ["job"]
        state = _gauge("trainwatch_job_state", "1 for the job's current state.", ["job", "state"])
        attempts = _counter("trainwatch_job_attempts", "Attempts launched by this trainwatch.", j)
        started = _gauge("trainwatch_job_attempt_start_time_seconds",
                         "Unix time the current attempt started.", j)
        step = _gauge("trainwatch_job_step", "Newest step the current attempt reached (its "
                      "resume step until the first heartbeat).", j)
        loss = _gauge("trainwatch_job_loss", "Last loss reported (lowest rank reporting one).", j)
        grad = _gauge("trainwatch_job_grad_norm", "Last gradient norm reported.", j)
        loss_step = _gauge("trainwatch_job_loss_step", "Step of the last loss reported.", j)
        grad_step = _gauge("trainwatch_job_grad_norm_step",
                           "Step of the last gradient norm reported.", j)
        nranks = _gauge("trainwatch_job_ranks", "Ranks heard from in this attempt.", j)
        gpus = _gauge("trainwatch_job_gpu", "1 for each GPU the current attempt was given.",
                      ["job", "gpu"])
        timeout = _gauge("trainwatch_job_heartbeat_timeout_seconds",
                         "The hang detector's per-rank heartbeat timeout.", j)
        age = _gauge("trainwatch_rank_heartbeat_age_seconds",
                     "Seconds since the rank's last heartbeat (while starting or running).",
                     ["job", "rank"])
        rstep = _gauge("trainwatch_rank_step", "Step of the rank's last heartbeat.",
                       ["job", "rank"])
        goodput = _gauge("trainwatch_job_goodput_ratio",
                         "1 - seconds lost to faults / seconds supervised.", j)
        cp_step = _gauge("trainwatch_job_last_good_checkpoint_step",
                         "Step of the newest complete, valid checkpoint.", j)
        cp_time = _gauge("trainwatch_job_last_good_checkpoint_timestamp_seconds",
                         "Modification time of the newest good checkpoint (Unix seconds).", j)
        cps = _gauge("trainwatch_job_checkpoints", "Checkpoints on disk by verdict.",
                     ["job", "state"])
        received = _counter("trainwatch_heartbeat_datagrams",
                            "Datagrams received on the job's heartbeat socket.", j)
        values = _counter("trainwatch_heartbeat_ring_values",
                          "Heartbeats (step, loss, grad norm) read from the ranks' rings.", j)
        dropped = _counter("trainwatch_heartbeat_dropped",
                           "Heartbeats dropped, by reason: datagrams malformed, oversized, "
                           "foreign or over_cap; ring values lapped (overwritten unread).",
                           ["job", "reason"])
        output = _counter("trainwatch_job_output_dropped_bytes",
                          "Bytes of the job's output not logged or passed through (a full "
                          "disk, a stalled reader of trainwatch's output).", j)
        for r in self.sup.runners:
            name = r.job.name
            now = r.clock()
            for st in JobState:
                state.add_metric([name, st.value], 1 if r.state is st else 0)
            attempts.add_metric([name], r.number + 1)
            timeout.add_metric([name], r.job.heartbeat.timeout)
            a = r.attempt
            if a is not None:
                started.add_metric([name], a.started_wall)
                for g in a.gpus or ():
                    gpus.add_metric([name, str(g)], 1)
            if r.last_step is not None:
                step.add_metric([name], r.last_step)
            _last_values(r, name, {"loss": loss, "grad_norm": grad, "loss_step": loss_step,
                                   "grad_norm_step": grad_step})
            nranks.add_metric([name], len(r.ranks.ranks))
            for rank, rv in sorted(r.ranks.ranks.items()):
                rstep.add_metric([name, str(rank)], rv.step)
                if r.state in _LIVE:
                    age.add_metric([name, str(rank)], max(0.0, now - rv.last_beat))
            ratio = r.goodput(now)
            if ratio is not None:
                goodput.add_metric([name], ratio)
            cp = r.checkpoints
            if cp.last_good is not None:
                cp_step.add_metric([name], cp.last_good.step)
                if cp.last_good_mtime is not None:
                    cp_time.add_metric([name], cp.last_good_mtime)
            for verdict, n in cp.counts.items():
                cps.add_metric([name, verdict], n)
            c = r.socket.counters
            received.add_metric([name], c.received)
            for reason in ("malformed", "oversized", "foreign"):
                dropped.add_metric([name, reason], getattr(c, reason))
            dropped.add_metric([name, "over_cap"], r.ranks_over_cap)
            values.add_metric([name], r.intake.ring_values)
            dropped.add_metric([name, "lapped"], r.intake.rings_lapped)
            output.add_metric([name], r.output_dropped)
        yield from (state, attempts, started, step, loss, grad, loss_step, grad_step, nranks,
                    gpus, timeout, age, rstep, goodput, cp_step, cp_time, cps, received,
                    values, dropped, output)


def _last_values(r: Runner, name: str, families: dict[str, GaugeMetricFamily]) -> None:
    """The lowest rank's last loss and gradient norm (what rank 0 logs), and the
    step each was reported at: a beat without one keeps the last."""
    for attr in ("loss", "grad_norm"):
        for _rank, rv in sorted(r.ranks.ranks.items()):
            v = getattr(rv, attr)
            if v is not None:
                families[attr].add_metric([name], v)
                families[f"{attr}_step"].add_metric([name], getattr(rv, f"{attr}_step"))
                break


class ServerCollector(Collector):
    """The /metrics server's own connections, read at scrape time."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Metric]:
        server = self.exporter.server
        live = _gauge("trainwatch_metrics_connections",
                      "Connections to the metrics port being served now.")
        dropped = _counter("trainwatch_metrics_connections_dropped",
                           "Connections to the metrics port closed by trainwatch, by reason: "
                           "over_limit, timeout, error.", ["reason"])
        live.add_metric([], server.open_connections if server is not None else 0)
        for reason in ("over_limit", "timeout", "error"):
            dropped.add_metric([reason], getattr(server.dropped, reason) if server else 0)
        yield from (live, dropped)


class Exporter:
    """The registry and, once started, the HTTP server on ``address:port``."""

    def __init__(self, supervisor: Scraped) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.events = Events(self.registry)
        self.registry.register(StateCollector(supervisor))
        self.registry.register(ServerCollector(self))
        self.registry.register(JobUsageCollector(supervisor))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.server: MetricsServer | None = None
        self._thread: threading.Thread | None = None
        # The incident pages served beside /metrics (export/incidentpages.py).
        self.pages = IncidentPages(supervisor.config.state_dir, lambda: {
            r.job.name: r.job.user for r in list(supervisor.runners)},
            peers=Peers(supervisor.config.admin_group))

    def start(self, address: str, port: int) -> None:
        """Raises OSError when the port cannot be bound."""
        self.server = MetricsServer(address, port, self.registry, pages=self.pages)
        self._thread = self.server.start()

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
