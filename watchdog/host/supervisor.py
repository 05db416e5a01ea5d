"""The supervisor loop, written once for ``trainwatch run`` and ``trainwatch
daemon``: one thread, one selector over every job's heartbeat socket, leader
pidfd and output pipes, plus a wake-up pipe for signals. It sleeps until
something arrives or the next deadline (a heartbeat timeout, a backoff, a
kill grace) is due, so an idle supervisor costs nothing."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainwatch.actions import tree
from trainwatch.config import Config, ConfigError, Job
from trainwatch.export.metrics import Exporter
from trainwatch.host import operations
from trainwatch.host.agenda import Agenda
from trainwatch.host.control import ControlSocket, Later
from trainwatch.host.jobcheck import check_command
from trainwatch.lifecycle import gpufault
from trainwatch.lifecycle.job import GRID, JobRunner
from trainwatch.privsep import credentials
from trainwatch.privsep.access import Peer, Peers
from trainwatch.sources.heartbeat import SocketInUse
from trainwatch.state import joblock, ownership
from trainwatch.state.ledger import Ledger
from trainwatch.types import JobState
from trainwatch.watch.gpuwatch import GpuWatch

log = logging.getLogger("trainwatch")

_MAX_SLEEP = 1.0
_ERROR_PAUSE = 0.05  # the least sleep after a round in which a handler raised
_ERROR_LOG_EVERY = 10.0  # a place that keeps failing is logged this often
_REAP_EVERY = 5.0


class Supervisor:
    # Seconds between a beating job's ticks (lifecycle/job.py GRID): one job, watched
    # from a terminal or a batch script, gets its statistics every second.
    grid = GRID

    def __init__(
        self,
        config: Config,
        jobs: tuple[Job, ...] | None = None,
        passthrough: bool = False,
        clock: Callable[[], float] = time.monotonic,
        die_with_parent: bool = False,
    ) -> None:
        self.config = config
        self.die_with_parent = die_with_parent
        self.clock = clock
        self.started_wall = time.time()
        for j in jobs if jobs is not None else config.jobs:
            self.check_job(j)
        # Root's folders must let each job's user reach its own socket and logs (the
        # files inside are theirs alone); anyone else's are private to them.
        mode = 0o755 if os.geteuid() == 0 else 0o700
        try:
            ownership.private_dir(config.state_dir, mode)
            ownership.private_dir(config.run_dir, mode)
        except ownership.UnsafeDir as e:
            raise ConfigError(e.strerror or str(e)) from None
        # Nothing trainwatch creates is readable by others unless it says so; the
        # jobs get the umask trainwatch was started with.
        self.job_umask = os.umask(0o077)
        os.umask(self.job_umask | 0o077)
        try:
            self._open(config, jobs, passthrough, clock)
        except BaseException:
            os.umask(self.job_umask)
            raise

    def _open(self, config: Config, jobs: tuple[Job, ...] | None, passthrough: bool,
              clock: Callable[[], float]) -> None:
        # One supervisor per job and state_dir, whatever its run_dir: a flock there.
        self.locks: list[joblock.JobLock] = []
        try:
            for j in jobs if jobs is not None else config.jobs:
                ident = credentials.resolve(j.user, j.group)
                gid = ident.gid if ident is not None and os.geteuid() == 0 else -1
                self.locks.append(joblock.acquire(config.state_dir, j.name, gid))
        except BaseException:
            for lk in self.locks:
                lk.release()
            raise
        self.ledger = Ledger(config.state_dir)
        self.sel = selectors.DefaultSelector()
        self.agenda = Agenda(self.sel)  # which jobs a round ticks (agenda.py)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.gpus: GpuWatch | None = None
        if config.gpu.backend != "off":
            self.gpus = GpuWatch(config.gpu, config.state_dir, self.wake, clock)
        # Held by the loop whenever it is not waiting in select(): a scrape reads
        # between two events, never in the middle of one.
        self.lock = threading.Lock()
        self.exporter = Exporter(self)
        self.runners: list[JobRunner] = []
        self.passthrough = passthrough
        try:
            for j in jobs if jobs is not None else config.jobs:
                self.runners.append(self._runner(config, j))
        except (SocketInUse, ownership.UnsafeDir) as e:
            for r in self.runners:
                r.close()
            self.ledger.close()
            for lk in self.locks:
                lk.release()
            if isinstance(e, ownership.UnsafeDir):
                raise ConfigError(e.strerror or str(e)) from None
            raise ConfigError(f"{e}: is job {j.name!r} already supervised?") from None
        # Operator commands and drills; each request authorised from its sender (access.py).
        self.control: ControlSocket | None = None
        try:
            self.control = ControlSocket(config.run_dir, self._on_control,
                                         group=config.admin_group, quiet=operations.QUIET,
                                         wake=self.wake)
            self.sel.register(self.control, selectors.EVENT_READ,
                              lambda _fd: self.control and self.control.handle())
        except (SocketInUse, OSError) as e:
            log.warning("no control socket (GPU drills cannot reach this trainwatch): %s", e)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self.stop_signal: int | None = None
        self.loop_errors = 0  # exceptions in one job's handling, survived
        self._failed_at: dict[str, float] = {}  # where -> when its error was last logged
        self._failed_now = False  # an error this round: do not spin on it
        self._next_reap = 0.0
        self._stop_sent = False
        self._removing: list[JobRunner] = []  # removed by a reload, being stopped
        m = config.metrics  # last: a scrape may come at once, and reads all of the above
        if m.port:
            try:
                self.exporter.start(m.address, m.port)
            except OSError as e:
                self.close()
                raise ConfigError(f"metrics: cannot listen on {m.address}:{m.port}: "
                                  f"{e.strerror or e} (metrics.port, or --metrics-port; "
                                  "0 turns the exporter off)") from None

    def check_job(self, j: Job) -> None:
        check_command(j, foreground=self.die_with_parent)

    def _runner(self, config: Config, j: Job) -> JobRunner:
        return self.agenda.add(JobRunner(
            config, j, self.ledger, self.agenda.selector(), self.passthrough, self.clock,
            gpus=self.gpus, events=self.exporter.events,
            die_with_parent=self.die_with_parent, umask=self.job_umask, grid=self.grid))

    def add_runner(self, config: Config, j: Job) -> JobRunner:
        """A job added by a reload: its lock and socket, then its runner."""
        ident = credentials.resolve(j.user, j.group)
        gid = ident.gid if ident is not None and os.geteuid() == 0 else -1
        lock = joblock.acquire(config.state_dir, j.name, gid)
        try:
            r = self._runner(config, j)
        except (SocketInUse, ownership.UnsafeDir) as e:
            lock.release()
            raise ConfigError(f"job {j.name}: {e}") from None
        self.locks.append(lock)
        self.runners.append(r)
        return r

    def remove_runner(self, r: JobRunner, stop: bool) -> None:
        """A job removed by a reload: stopped (and waited for), or released to run on
        unwatched (a later config that brings it back adopts it)."""
        if stop and not r.done:
            r.stop("reload: the job was removed from the config")
            self._removing.append(r)
            return
        self._drop(r, release=True)

    def _drop(self, r: JobRunner, release: bool) -> None:
        r.close(release=release)
        self.runners.remove(r)
        self.agenda.discard(r)
        for lk in self.locks:
            if lk.path.parent.name == r.job.name:
                lk.release()
                self.locks.remove(lk)
                break

    def reload(self) -> dict[str, Any]:
        raise ValueError("only the daemon reloads its config (trainwatch daemon)")

    def set_admin_group(self, group: str) -> None:
        """Judge senders against another admin group from now on (a reload): on the
        control socket and on the incident pages."""
        if self.control is not None:
            self.control.set_group(group)
        self.exporter.pages.peers = Peers(group)  # one assignment: the page thread sees either

    # --- the loop's edges (trainwatch run; the daemon overrides them) -----------

    def _signals(self) -> tuple[int, ...]:
        # SIGHUP too: a closed terminal must not leave the job running unsupervised.
        return (signal.SIGINT.value, signal.SIGTERM.value, signal.SIGHUP.value)

    def begin(self) -> None:
        for r in self.runners:
            self._guarded(r.start)

    def keep_running(self) -> bool:
        if self.stop_signal is not None and not self._stop_sent:
            self._stop_sent = True
            name = signal.Signals(self.stop_signal).name
            self.agenda.poke_all()
            for r in self.runners:
                self._guarded(r.stop, f"operator: {name}")
        return not all(r.done for r in self.runners)

    def each_round(self, now: float) -> None:
        if now >= self._next_reap:  # the daemon reaps on its scheduler instead
            self._next_reap = now + _REAP_EVERY
            self.reap_strays()

    def finish(self) -> int:
        if self.stop_signal is not None and not all(r.state is JobState.EXITED
                                                    for r in self.runners):
            return 128 + self.stop_signal
        return max((r.exit_code for r in self.runners), default=0)

    def release_jobs(self) -> bool:
        """At close: leave the jobs running (the daemon) or kill what is left (run)."""
        return False

    def _on_wake(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 512)
        if self.control is not None and self.control.settle():
            self.agenda.poke_all()  # a deferred request may have changed any job

    def wake(self) -> None:
        """Wake the loop from another thread (a GPU source) or a signal handler."""
        with contextlib.suppress(OSError):
            if self._wake_w >= 0:  # not after close(): its number may be another file's
                os.write(self._wake_w, b"\0")

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop every job and return; safe from a signal handler or another thread."""
        self.stop_signal = signum
        self.wake()

    def _on_control(self, op: str, args: dict[str, Any], peer: Peer
                    ) -> dict[str, Any] | Later:
        """An operator's command (operations.py) or a drill from faultinject
        (drillrequests.py), from ``peer``: authorised there, per request."""
        self.agenda.poke_all()  # any job may be changed by it: each is ticked
        return operations.answer(self, op, args, peer)

    def reap_strays(self) -> None:
        """As a subreaper we inherit orphans that left the job's session; reap
        those that have exited. (A keeper's exit status is not the job's: the
        job's is in the keeper's exit file, so reaping a keeper here is harmless.)"""
        while True:
            try:
                if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG) is None:
                    return  # none has exited (waitid reaps one per call, no /proc scan)
            except ChildProcessError:
                return  # no children at all

    def _route_gpu_faults(self) -> None:
        if self.gpus is None:
            return
        for fault in self.gpus.drain():
            for r in self.runners:
                if not r.done and r.uses_gpu(fault.gpu):
                    self.agenda.poke(r)
                    gpufault.on_gpu_fault(r, fault)

    def _guarded(self, fn: Callable[..., object], *args: object) -> None:
        """One job's (or one source's) exception must not end the loop that
        supervises the others: log it (the first traceback per place), count it."""
        try:
            fn(*args)
        except Exception:
            owner = getattr(fn, "__self__", None)
            where = f"job {owner.job.name}" if isinstance(owner, JobRunner) else \
                getattr(fn, "__qualname__", repr(fn))
            self.loop_errors += 1
            self._failed_now = True
            now = time.monotonic()
            if where not in self._failed_at:
                log.exception("%s: an error in its handling (counted; supervision goes on)",
                              where)
            elif now - self._failed_at[where] >= _ERROR_LOG_EVERY:
                log.error("%s: errors in its handling go on (%d in all)", where,
                          self.loop_errors)
            else:
                return
            self._failed_at[where] = now

    def _next_wake(self, r: JobRunner, now: float) -> float:
        try:
            return r.next_wake(now)
        except Exception:
            self._guarded(r.next_wake, now)  # logged and counted there
            return now + _MAX_SLEEP

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        self.request_stop(signum)

    def run(self, install_signals: bool = True) -> int:
        """Supervise until every job has ended; the exit code for the CLI."""
        if not tree.become_subreaper():
            log.warning("could not become a child subreaper: escaped orphans go to init")
        old: dict[int, object] = {}
        if install_signals:
            for sig in self._signals():
                old[sig] = signal.signal(sig, self._handler)
        self.lock.acquire()
        try:
            if self.gpus is not None:
                self.gpus.start()
                self._route_gpu_faults()
            self.begin()
            while self.keep_running():
                now = self.clock()
                wake = min(now + _MAX_SLEEP, self.agenda.next_wake(now))
                sleep = max(0.0, wake - now)
                if self._failed_now:  # a handler that keeps failing must not spin the loop
                    self._failed_now, sleep = False, max(sleep, _ERROR_PAUSE)
                self.lock.release()  # the scrape's moment
                try:
                    ready = self.sel.select(sleep)
                finally:
                    self.lock.acquire()
                for key, _ in ready:
                    if self.sel.get_map().get(key.fd) is key:  # not closed by an earlier one
                        self._guarded(key.data, key.fd)
                self._guarded(self._route_gpu_faults)
                now = self.clock()
                for r in self.agenda.due(now):  # those whose wake came, or an event
                    self._guarded(r.tick, now)
                    self.agenda.planned(r, self._next_wake(r, self.clock()))
                for r in [r for r in self._removing if r.done]:
                    self._removing.remove(r)
                    self._guarded(self._drop, r, False)
                self._guarded(self.each_round, now)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self.close()
            self.lock.release()
        return self.finish()

    def close(self) -> None:
        self.exporter.close()
        if self.control is not None:
            self.sel.unregister(self.control)
            self.control.close()
        if self.gpus is not None:
            self.gpus.close()
        for r in self.runners:
            r.close(release=self.release_jobs())
        self.sel.unregister(self._wake_r)
        os.close(self._wake_r)
        # A thread may still finish its work and wake us (a deferred request, deferred.py).
        w, self._wake_w = self._wake_w, -1
        os.close(w)
        self.ledger.close()
        for lk in self.locks:
            lk.release()
        os.umask(self.job_umask)

