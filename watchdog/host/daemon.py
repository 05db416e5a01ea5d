"""``trainwatch daemon``: the host service around the supervisor's loop.

It differs from ``trainwatch run`` in what it does at its edges:
- it runs until told to stop; a job that ends stays listed in its final state;
- on SIGTERM/SIGINT it leaves the jobs running (each has its own keeper
  process, actions/keeper.py) and the next daemon adopts them (adopt.py);
- SIGHUP reloads the config file: a bad one is one log line and the old one
  stays; unchanged jobs are untouched, new jobs start, changed jobs take the
  change at their next launch, removed jobs are released (left running,
  adopted again if they come back) or stopped if ``removed_jobs: stop``;
- periodic work runs on an APScheduler BackgroundScheduler (max_instances=1,
  coalesce=True), each run under the loop's lock;
- systemd: READY=1 once sockets are bound and jobs adopted or started,
  STATUS=, WATCHDOG=1 from the loop while it turns, RELOADING=1, STOPPING=1.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler  # type: ignore[import-untyped]
from trainwatch.config import Config, ConfigError, load
from trainwatch.host.deferred import Later
from trainwatch.host.service import Service
from trainwatch.host.supervisor import Supervisor
from trainwatch.lifecycle.job import JobRunner
from trainwatch.privsep.access import Peer
from trainwatch.slurm import attach, command, node, readopt, register
from trainwatch.types import JobState

log = logging.getLogger("trainwatch")
# APScheduler logs every run of every task at INFO: two lines a second, forever.
logging.getLogger("apscheduler").setLevel(logging.WARNING)

_STATUS_EVERY = 5.0  # seconds between STATUS= lines


class Daemon(Supervisor):
    # A host's many jobs tick every 2 s: at 1 s, 4 jobs x 8 ranks cost the daemon 0.06
    # points of a core more (docs/figures.md), and what waits for a tick is only
    # freshness, a log rule's match and the loss statistics (lifecycle/job.py).
    grid = 2.0

    def __init__(self, config: Config, host: str | None = None) -> None:
        self.service = Service()
        self._reload_asked = False
        self._host = host  # --host: it outlives a reload of the file
        if host is not None:
            config = replace(config, host=host)
        # Before the supervisor's start: one that fails (the exporter's address) closes
        # the daemon, and close() shuts the scheduler down.
        self.scheduler = BackgroundScheduler(
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
            timezone="UTC")
        self.registry = None
        super().__init__(config)
        self.scheduler.add_job(self._locked(self.reap_strays), "interval",
                               seconds=5.0, id="reap")
        self._status_at = 0.0
        self._ended_at: dict[str, float] = {}  # attached jobs that ended: when (forget_after)
        # Ranks of Slurm jobs attach over the control socket (slurm/attach.py).
        self.readopt: readopt.Readopt | None = None
        if config.slurm is not None:
            slurm = command.for_settings(config.slurm)
            self.registry = register.Registry(config.slurm.node, register.prover(slurm))
            self.readopt = readopt.Readopt(config.state_dir)  # ranks a daemon before joined
            health = node.NodeHealth(config.slurm.node, slurm, self.gpus, config.gpu.backend,
                                     self.lock)
            node.serve(health)  # told of a drain by a requeue (slurm/requeue.py)
            self.scheduler.add_job(health.tick, "interval", seconds=2.0, id="slurm-node")

    # --- the loop's edges ------------------------------------------------------

    def _on_control(self, op: str, args: dict[str, Any], peer: Peer
                    ) -> dict[str, Any] | Later:
        if op == "attach":  # a Slurm rank's: its proof is the authorisation (attach.py)
            self.agenda.poke_all()
            return attach.answer(self, args, peer)
        return super()._on_control(op, args, peer)

    def _signals(self) -> tuple[int, ...]:
        return (signal.SIGINT.value, signal.SIGTERM.value, signal.SIGHUP.value)

    def _handler(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            self._reload_asked = True
            self.wake()
        else:
            self.request_stop(signum)

    def begin(self) -> None:
        for r in self.runners:
            self._guarded(r.adopt_or_start)
        self.scheduler.start()
        self.service.ready(self._summary())

    def keep_running(self) -> bool:
        return self.stop_signal is None

    def each_round(self, now: float) -> None:
        if self._reload_asked:
            self._reload_asked = False
            self.agenda.poke_all()  # a reload may change any job: each ticks next round
            self.reload()
        self.service.watchdog(now)
        if self.readopt is not None:
            self.readopt.tick(self)
        if now >= self._status_at:
            self._status_at = now + _STATUS_EVERY
            self.service.status(self._summary())
            if self.config.slurm is not None:
                self._forget_ended(now, self.config.slurm.forget_after)

    def _forget_ended(self, now: float, after: float) -> None:
        """An attached Slurm job that ended is dropped ``after`` seconds later (its
        runner, socket and hands; its incidents stay in the ledger): a node runs
        thousands of jobs. A later run of it attaches anew."""
        for r in list(self.runners):
            if r.job.slurm is None or not ended(r):
                self._ended_at.pop(r.job.name, None)
                continue
            if now - self._ended_at.setdefault(r.job.name, now) >= after:
                del self._ended_at[r.job.name]
                log.info("job %s: %s %.0fs ago: forgotten (its incidents stay in the "
                         "ledger)", r.job.name, r.state.value if r.state else "-", after)
                self._guarded(self._drop, r, False)
                readopt.forget(self.config.state_dir, r.job.name)

    def finish(self) -> int:
        self.service.stopping()
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "-"
        log.info("stopping on %s: jobs left running, adopted at the next start", name)
        return 0

    def close(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        if self.registry is not None:
            self.registry.close()
        super().close()

    def release_jobs(self) -> bool:
        return True

    # --- periodic work (scheduler threads, under the loop's lock) -----------

    def _locked(self, fn: Any) -> Any:
        def run() -> None:
            with self.lock:
                self._guarded(fn)
        run.__qualname__ = fn.__qualname__
        return run

    def _summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.runners:
            s = r.state.value if r.state else "-"
            counts[s] = counts.get(s, 0) + 1
        jobs = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no jobs"
        return f"{len(self.runners)} jobs: {jobs}"

    # --- reload --------------------------------------------------------------

    def reload(self) -> dict[str, Any]:
        """Read the config file again and apply it; the old one stays on any error."""
        self.service.reloading()
        try:
            return self._reload()
        finally:
            self.service.ready(self._summary())

    def _reload(self) -> dict[str, Any]:
        source = self.config.source
        out: dict[str, Any] = {"reloaded": False, "error": None, "added": [], "changed": [],
                               "removed": [], "unchanged": []}
        try:
            new = load(source)
            if self._host is not None:
                new = replace(new, host=self._host)
            for j in new.jobs:
                self.check_job(j)
            if (new.state_dir, new.run_dir) != (self.config.state_dir, self.config.run_dir):
                raise ConfigError(f"{source}: state_dir and run_dir take effect only at a "
                                  "restart of the daemon")
        except ConfigError as e:
            log.error("reload refused, the old config stays in force: %s", e)
            out["error"] = str(e)
            return out
        old = {r.job.name: r for r in self.runners}
        names = {j.name for j in new.jobs}
        for r in list(self.runners):
            if r.job.name not in names and r.job.slurm is None:  # attached: Slurm's
                out["removed"].append(r.job.name)
                self.remove_runner(r, stop=new.removed_jobs == "stop")
        for j in new.jobs:
            known = old.get(j.name)
            if known is None:
                try:
                    added = self.add_runner(new, j)
                except ConfigError as e:
                    log.error("reload: job %s not started: %s", j.name, e)
                    continue
                out["added"].append(j.name)
                self._guarded(added.adopt_or_start)
            elif known.job != j or known.policy != new.policy_for(j):
                out["changed"].append(j.name)
                known.reconfigure(new, j)
            else:
                out["unchanged"].append(j.name)
                known.config = new
        if new.admin_group != self.config.admin_group:
            log.info("reload: the admin group is now %s (was %s)", new.admin_group,
                     self.config.admin_group)
            self.set_admin_group(new.admin_group)
        self.config = new
        out["reloaded"] = True
        log.info("reloaded %s: added %s, changed %s, removed %s, unchanged %d", source,
                 out["added"] or "none", out["changed"] or "none", out["removed"] or "none",
                 len(out["unchanged"]))
        return out


def ended(r: JobRunner) -> bool:
    return r.state in (JobState.EXITED, JobState.FATAL, JobState.PAUSED)


def main(config_path: str, host: str | None = None) -> int:
    config = load(config_path)
    started = time.monotonic()
    d = Daemon(config, host)
    log.info("trainwatch daemon: %d jobs from %s (%.0f ms to open)", len(d.runners),
             config.source, 1000 * (time.monotonic() - started))
    return d.run()
