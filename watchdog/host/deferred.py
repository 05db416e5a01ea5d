"""Replies that wait for work the loop must not: a control request whose answer
needs a job's hand (listing a remote store, as the job's user, with up to
``pull.LIST_MAX`` to answer) returns a ``Later`` instead of its reply. Its
``work`` runs in a thread of its own; once done, the loop is woken and
``then`` gets its result on the loop (where the job's state may be changed)
and returns the reply, which the control socket sends. A request arriving
while ``MAX_PENDING`` are under way is refused at once, not queued."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_PENDING = 4  # deferred requests under way at once, for every sender together


@dataclass
class Later:
    """The work (off the loop, bounded by itself) and what the loop does with
    its result; an exception ``work`` raised is raised again into ``then``'s
    caller, and becomes the error reply."""

    work: Callable[[], Any]
    then: Callable[[Any], dict[str, Any]]


@dataclass
class _Running:
    later: Later
    reply: Callable[[Callable[[], dict[str, Any]]], None]  # answers with what the loop does
    thread: threading.Thread | None = None
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Deferrals:
    """The deferred requests under way; ``settle()`` on the loop answers those
    whose work is done. ``wake`` is called from the worker thread when it is."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self._running: list[_Running] = []

    def __len__(self) -> int:
        return len(self._running)

    def start(self, later: Later, name: str,
              reply: Callable[[Callable[[], dict[str, Any]]], None]) -> None:
        """Start ``later``'s work; ``reply`` is called on the loop, in ``settle()``,
        with the callable that makes the reply. A ValueError when too many are
        under way."""
        if len(self._running) >= MAX_PENDING:
            raise ValueError(f"busy: {len(self._running)} requests are waiting for a "
                             "job's hand; try again in a few seconds")
        run = _Running(later, reply)

        def work() -> None:
            try:
                run.result = later.work()
            except BaseException as e:  # handed to the loop, raised again there
                run.error = e
            finally:
                run.done.set()
                self.wake()

        run.thread = threading.Thread(target=work, name=f"control: {name}", daemon=True)
        self._running.append(run)
        run.thread.start()

    def settle(self) -> int:
        """Answer every request whose work is done; how many were."""
        done = [run for run in self._running if run.done.is_set()]
        for run in done:
            self._running.remove(run)
            run.reply(functools.partial(_then, run))
        return len(done)


def _then(run: _Running) -> dict[str, Any]:
    if run.error is not None:
        raise run.error
    return run.later.then(run.result)
