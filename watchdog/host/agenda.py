"""Which jobs the supervisor's loop ticks in a round: those whose own next wake
has come, and those an event was for, not every job at every wake.

The loop wakes for any job's reason (its deadline, a datagram on its socket,
an exit, a GPU sample); a tick of a job with nothing due costs its watchers
and detectors all the same, so with N jobs each wake cost N ticks. Each job
registers its descriptors through a ``JobSelector`` of its own (a view of the
loop's one selector): an event on one of them marks that job for this round.
What reaches a job by another path (an operator's command, a GPU fault, a
stop, a reload) marks it with ``poke`` or ``poke_all``. A job's next wake is
asked after each of its ticks, so a job not ticked keeps the one it had; every
job still ticks at least once per grid step (job.py: its ``next_wake`` is never
later)."""

from __future__ import annotations

import selectors
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwatch.lifecycle.job import JobRunner

_FileObj = Any  # selectors' FileDescriptorLike: an fd or an object with fileno()


class JobSelector(selectors.BaseSelector):
    """The loop's selector as one job sees it: what the job registers calls back
    through a mark that the job has an event this round."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.poked = True  # a new job ticks at once
        self.due = 0.0
        self.fds: set[int] = set()  # what the job has registered: gone with the job

    def _marking(self, data: Any) -> Any:
        if not callable(data):
            return data

        def ready(fd: int) -> object:
            self.poked = True  # first: a handler that raises still gets its tick
            return data(fd)
        return ready

    def register(self, fileobj: _FileObj, events: int, data: Any = None) -> selectors.SelectorKey:
        key = self.sel.register(fileobj, events, self._marking(data))
        self.fds.add(key.fd)
        return key

    def unregister(self, fileobj: _FileObj) -> selectors.SelectorKey:
        key = self.sel.unregister(fileobj)
        self.fds.discard(key.fd)
        return key

    def forget(self) -> None:
        """The job is gone: what it left registered (an attempt released to run on
        keeps its pidfd's number only until the next open) leaves the loop's
        selector, whose next registration of that number would fail."""
        for fd in list(self.fds):
            if fd in self.sel.get_map():
                self.sel.unregister(fd)  # a closed fd: the epoll set dropped it already
        self.fds.clear()

    def modify(self, fileobj: _FileObj, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.sel.modify(fileobj, events, self._marking(data))

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        raise NotImplementedError("only the supervisor's loop selects")

    def get_map(self) -> Mapping[_FileObj, selectors.SelectorKey]:
        return self.sel.get_map()

    def close(self) -> None:
        """The loop's selector is the supervisor's to close."""


class Agenda:
    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self._of: dict[JobRunner, JobSelector] = {}

    def selector(self) -> JobSelector:
        """For a new job's runner: registering through it marks the job."""
        return JobSelector(self.sel)

    def add(self, r: JobRunner) -> JobRunner:
        assert isinstance(r.sel, JobSelector), "a runner made with Agenda.selector()"
        self._of[r] = r.sel
        return r

    def discard(self, r: JobRunner) -> None:
        js = self._of.pop(r, None)
        if js is not None:
            js.forget()

    def poke(self, r: JobRunner) -> None:
        """Something reached the job by a path of its own: tick it this round."""
        js = self._of.get(r)
        if js is not None:
            js.poked = True

    def poke_all(self) -> None:
        for js in self._of.values():
            js.poked = True

    def due(self, now: float) -> Iterator[JobRunner]:
        """The jobs to tick now, each unmarked as it is handed out."""
        for r, js in list(self._of.items()):
            if js.poked or now >= js.due:
                js.poked = False
                yield r

    def planned(self, r: JobRunner, wake: float) -> None:
        js = self._of.get(r)
        if js is not None:
            js.due = wake

    def next_wake(self, now: float) -> float:
        """The earliest wake of any job; ``now`` when one is marked."""
        soonest = float("inf")
        for js in self._of.values():
            if js.poked:
                return now
            soonest = min(soonest, js.due)
        return soonest
