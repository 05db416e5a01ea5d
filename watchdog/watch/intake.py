"""A job's heartbeat intake: its socket, its ranks' beat rings, when to read
them, and what each message is handed to.

Two ways in. A client with ``TRAINWATCH_RING_DIR`` writes every step into a
ring of its own (sources/ring.py: shared memory, no syscall, no wake-up per
beat) and sends a datagram only for its first beat and for a non-finite
value; the rings of all jobs are read together on the loop's grid (every
``poll_every`` seconds: the runner's), and before any judgement (an exit, a
hang deadline). A client without rings sends every beat as a datagram
(sources/beatpoll.py decides when to read).

Only the job's tree is believed: the runner's ``believe(pid, uid)`` judges
every datagram's sender, and a ring is read only when the pid in its name and
header is in the tree (root's included: the pid is only claimed), in a folder
only the job's user (and root) can write to.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import time
from collections.abc import Callable, Sequence, Set

from trainwatch.sources import ring, ringreader
from trainwatch.sources.beatpoll import BeatPoller
from trainwatch.sources.heartbeat import BATCH, HeartbeatSocket
from trainwatch.types import Beat, CheckpointReport, DataOrder

log = logging.getLogger("trainwatch")

# Ring files refused are remembered (not opened again) up to this many; past it
# they are refused again at each scan, which ring.scan bounds.
_REFUSED_MAX = 4096

# Seconds between two reads of the rings (every job's in one round), unless the
# runner gives its own grid (lifecycle/job.py: 2 s under the daemon). A non-finite
# value comes at once as a datagram and a judgement reads the rings first, so
# this bounds only how stale steps/s and the statistics may be.
RING_POLL = 1.0
# Records read from one job's rings per poll, in all (16 of the client's
# 4,096-slot rings, full): rings are the job's files, and a thousand of them,
# kept full, must cost the loop a bounded time. Rings left for lack of budget are
# read first at the next turn (what their writers overwrite meanwhile is lapped).
RING_BUDGET = 65_536
_NO_UID = -1  # for believe(): a ring's writer has no uid the kernel vouches for
_STALE_DRAINS = 8  # socket reads of BATCH datagrams at most when an attempt ends
_EARLY_MAX = 64  # steps remembered per (pid, rank) that came as datagrams before its ring


class Intake:
    def __init__(self, job: str, path: str, selector: selectors.BaseSelector,
                 believe: Callable[[int, int], bool], clock: Callable[[], float],
                 owner: tuple[int, int] | None,
                 on_beats: Callable[[Sequence[Beat]], None],
                 on_report: Callable[[CheckpointReport], None],
                 max_rings: int = 1024, poll_every: float = RING_POLL) -> None:
        self.job, self.path = job, path
        self.poll_every = poll_every
        self.on_beats, self.on_report = on_beats, on_report
        self.believe, self.clock = believe, clock
        # Rings carry the writer's CLOCK_MONOTONIC, which is ours unless a test
        # drives the loop with a clock of its own.
        self._writer_clock = clock is time.monotonic
        # Only the job's user (and root) may reach its socket at all.
        self.socket = HeartbeatSocket(path, believe, clock, owner=owner)
        self.poller = BeatPoller(self.socket, selector, self._drain_socket, clock)
        self.ring_dir: str | None = None
        self._ended = False  # the attempt's processes are gone: see new_attempt
        self.readers: dict[str, ringreader.RingReader] = {}
        self.refused: set[str] = set()  # ring files not believed or not rings
        # Rings whose writer's pid could not be proven yet: looked at again at each
        # scan (a loaded loop may see a rank's ring before its first datagram, and
        # the rank gone already); counted refused until then.
        self.unproven: set[str] = set()
        self.max_rings = max_rings
        self.ring_values = 0  # records read from rings, every attempt
        self.rings_opened = 0  # rings read, every attempt
        self.rings_refused = 0  # ring files not believed or not rings, every attempt
        self.scans_cut = 0  # ring folder scans that stopped at ring.MAX_SCAN names
        self.rings_lapped_before = 0
        self._dir_seen: int | None = None
        self.data_order: DataOrder | None = None  # the job's last word on it
        self._ring_poll_at = 0.0
        self._budget, self._budget_until, self._turn = RING_BUDGET, 0.0, 0
        # A client with a ring sends some beats as datagrams too (its first, each
        # non-finite one), and each must be handed on once: a datagram from a ring
        # being read only makes the rings be read now (in order); one that came
        # before its ring was opened is handed on, its step skipped in the ring.
        self._early: dict[tuple[int, int], set[int]] = {}

    @property
    def rings_lapped(self) -> int:
        """Values a writer overwrote before they were read (or torn), every attempt."""
        return self.rings_lapped_before + sum(rd.lapped for rd in self.readers.values())

    def drain(self) -> None:
        """Read and act on everything queued on the socket and written to the rings."""
        self._drain_socket()
        self._read_rings(rescan=False)

    def _drain_socket(self) -> int:
        """Read and act on everything queued on the socket; how many datagrams
        (the poller's measure of how busy the socket is)."""
        c = self.socket.counters
        before = (c.malformed, c.oversized, c.foreign)
        observations = self.socket.drain()
        for what, old, new in zip(("malformed", "oversized", "foreign"), before,
                                  (c.malformed, c.oversized, c.foreign), strict=True):
            if old == 0 and new > 0:  # the first of its kind; the rest are only counted
                log.warning("job %s: dropped a %s datagram on %s", self.job, what, self.path)
        beaten: set[int] = set()  # the pids that beat
        rings = {(rd.pid, rd.rank) for rd in self.readers.values()} if self.readers else ()
        for obs in observations:
            if isinstance(obs, Beat):
                beaten.add(obs.pid)
                key = (obs.pid, obs.rank)
                if key in rings:
                    continue  # its ring holds it: read below
                if self.ring_dir is not None:
                    early = self._early.get(key)
                    if early is None and len(self._early) < self.max_rings:
                        early = self._early[key] = set()
                    if early is not None and len(early) < _EARLY_MAX:
                        early.add(obs.step)
                self.on_beats((obs,))
            elif isinstance(obs, CheckpointReport):
                self.on_report(obs)
            else:
                self._data_order(obs)
        if beaten:  # a client sends its first beat as a datagram once its ring exists
            self._read_rings(rescan=True, beaten=beaten)
        return len(observations) + c.malformed + c.oversized + c.foreign - sum(before)

    def _data_order(self, d: DataOrder) -> None:
        """Kept for the next rollback (actions/rollback.py), across attempts: an
        attempt that faults before saying it is judged by what the last one said."""
        old = self.data_order
        self.data_order = d
        if old is None or (old.order, old.why) != (d.order, d.why):
            log.info("job %s: data order %s (rank %d: %s)", self.job, d.order, d.rank,
                     d.why or "no reason given")

    def _read_rings(self, rescan: bool, beaten: Set[int] = frozenset()) -> int:
        d = self.ring_dir
        if d is None:
            return 0
        try:
            seen = os.stat(d).st_mtime_ns
        except OSError:
            seen = None
        if rescan or seen != self._dir_seen:
            self._dir_seen = seen
            self._discover(d, beaten)
        now = self.clock()
        n = 0
        writer_clock = self._writer_clock
        if now >= self._budget_until:
            self._budget, self._budget_until = RING_BUDGET, now + self.poll_every
        readers = list(self.readers.values())  # a beat may end the attempt (and clear them)
        first = self._turn % len(readers) if readers else 0
        for k, rd in enumerate(readers[first:] + readers[:first]):
            if self.ring_dir is None:
                break
            if self._budget <= 0:
                self._turn = first + k  # where the next turn starts
                break
            beats = rd.read_as(Beat, min(ring.SLOTS, self._budget), now)
            self._budget -= len(beats)
            n += len(beats)
            if beats and self._early:
                early = self._early.pop((rd.pid, rd.rank), None)
                if early:  # handed on as datagrams already
                    beats = [b for b in beats if b.step not in early]
            if beats:
                if not writer_clock:  # a test's clock: the writer's time is not on it
                    beats = [b._replace(at=now) for b in beats]
                self.on_beats(beats)
        self.ring_values += n
        return n

    def _discover(self, d: str, beaten: Set[int]) -> None:
        cut = ring.scans_cut
        try:
            found = ring.scan(d)
            if ring.scans_cut != cut:
                self.scans_cut += 1
                if self.scans_cut == 1:
                    log.warning("job %s: %s holds more than %d names: only the first are "
                                "looked at (counted in trainwatch_job_folder_limits_hit_total)",
                                self.job, d, ring.MAX_SCAN)
        except OSError as e:
            log.warning("job %s: cannot list %s: %s", self.job, d, e.strerror or e)
            return
        for rank, pid, path in found:
            if path in self.readers or path in self.refused \
                    or (path in self.unproven and pid not in beaten):
                continue  # an unproven one again once its pid has beaten
            why = None
            rd: ringreader.RingReader | None = None
            if len(self.readers) >= self.max_rings:
                why = f"more than {self.max_rings} rings"
            else:
                try:
                    rd = ringreader.RingReader(path)
                except (ringreader.RingError, OSError) as e:
                    why = str(e)
            # The pid is the writer's claim, not the kernel's word (as a datagram's
            # sender is): no exemption for root, the pid must be in the tree. An
            # attempt that ended unwatched has no tree left to prove it: its own
            # folder (its user's alone) speaks only of that user's job.
            if rd is not None and (rd.rank != rank or rd.pid != pid):
                why = f"pid {pid} is not the ring's writer (its header says {rd.pid})"
                rd.close()
                rd = None
            elif rd is not None and not (self._ended or self.believe(pid, _NO_UID)):
                rd.close()
                if path not in self.unproven and len(self.unproven) < _REFUSED_MAX:
                    self.unproven.add(path)
                    self._refuse(path, f"pid {pid} is not one of the job's processes")
                continue
            if rd is None:
                if len(self.refused) < _REFUSED_MAX:  # bounded: the folder is the job's
                    self.refused.add(path)
                self._refuse(path, why or "not a ring")
                continue
            if path in self.unproven:  # proven since (its datagram came): not refused
                self.unproven.discard(path)
                self.rings_refused -= 1
            self.readers[path] = rd
            self.rings_opened += 1

    def _refuse(self, path: str, why: str) -> None:
        self.rings_refused += 1
        if self.rings_refused == 1:  # the first; the rest are only counted
            log.warning("job %s: not reading the ring %s: %s", self.job, path, why)

    def tick(self, now: float) -> None:
        self.poller.tick(now)
        if self.ring_dir is not None and now >= self._ring_poll_at:
            # On a grid shared by every job: one wake-up reads them all.
            every = self.poll_every
            self._ring_poll_at = (math.floor(now / every) + 1) * every
            # The socket first: a checkpoint report sent before a step the rings
            # hold must be known before that step is judged (a rollback decided on a
            # ring's NaN resumed from 13, the reports of 14-18 still queued).
            self.drain()

    def next_wake(self) -> float | None:
        poll = self.poller.next_wake()
        if self.ring_dir is None:
            return poll
        return self._ring_poll_at if poll is None else min(poll, self._ring_poll_at)

    def new_attempt(self, ring_dir: str | None, ended: bool = False) -> None:
        """The attempt's processes are the ones to believe now, its rings the ones to read.
        ``ended``: an adopted attempt that ended while no daemon watched (adopt.py)."""
        self.socket.forget_senders()
        self._close_rings()
        self.ring_dir, self._dir_seen, self._ended = ring_dir, None, ended

    def end_attempt(self) -> None:
        """Its processes are gone: what they sent is all queued now, and is read
        now, as theirs. Left queued, it would be read in the next attempt, and
        root's datagrams are believed whoever sends them (a loaded run read a
        killed attempt's NaN as the next one's and widened its skip window)."""
        for _ in range(_STALE_DRAINS):  # bounded: a live flood from elsewhere cannot hold the loop
            if self._drain_socket() < BATCH:
                break
        self._close_rings()
        self.ring_dir = None

    def _close_rings(self) -> None:
        self.rings_lapped_before += sum(rd.lapped for rd in self.readers.values())
        for rd in self.readers.values():
            rd.close()
        self.readers.clear()
        self.refused.clear()
        self.unproven.clear()
        self._early.clear()

    def close(self) -> None:
        self.poller.close()
        self.socket.close()
        self._close_rings()
