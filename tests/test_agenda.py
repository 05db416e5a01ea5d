"""The loop's agenda (host/agenda.py): a round ticks the jobs an event was for and
those whose own wake has come, not every job at every wake."""

from __future__ import annotations

import os
import selectors
from typing import cast

from trainwatch.host.agenda import Agenda, JobSelector
from trainwatch.lifecycle.job import JobRunner


class _Job:
    """Stands in for a JobRunner: the agenda only reads its ``sel``."""

    def __init__(self, sel: JobSelector) -> None:
        self.sel = sel


def _job(agenda: Agenda) -> JobRunner:
    return agenda.add(cast(JobRunner, _Job(agenda.selector())))


def _dispatch(sel: selectors.BaseSelector) -> list[int]:
    seen = []
    for key, _ in sel.select(1.0):
        key.data(key.fd)
        seen.append(key.fd)
    return seen


def test_an_event_on_one_jobs_descriptor_ticks_that_job_alone() -> None:
    """A datagram (here a pipe) for job A marks A for the round; B, not due, is not ticked."""
    sel = selectors.DefaultSelector()
    agenda = Agenda(sel)
    a, b = _job(agenda), _job(agenda)
    assert list(agenda.due(0.0)) == [a, b]  # new jobs tick at once
    agenda.planned(a, 10.0)
    agenda.planned(b, 10.0)
    r, w = os.pipe()
    got: list[int] = []
    try:
        a.sel.register(r, selectors.EVENT_READ, lambda fd: got.append(os.read(fd, 1)[0]))
        assert agenda.next_wake(1.0) == 10.0
        os.write(w, b"\x07")
        assert _dispatch(sel) == [r]
        assert got == [7]  # the job's own handler ran
        assert agenda.next_wake(1.0) == 1.0  # a marked job: no sleep
        assert list(agenda.due(1.0)) == [a]
        assert list(agenda.due(1.0)) == []  # unmarked once handed out
        assert list(agenda.due(10.0)) == [a, b]  # both wakes come
    finally:
        a.sel.unregister(r)
        os.close(r)
        os.close(w)
        sel.close()


def test_a_poke_or_poke_all_ticks_jobs_reached_by_another_path() -> None:
    """A GPU fault marks its job; an operator's command marks all; a dropped job none."""
    sel = selectors.DefaultSelector()
    agenda = Agenda(sel)
    a, b = _job(agenda), _job(agenda)
    list(agenda.due(0.0))
    for j in (a, b):
        agenda.planned(j, 5.0)
    agenda.poke(b)
    assert list(agenda.due(1.0)) == [b]
    agenda.poke_all()
    assert list(agenda.due(1.0)) == [a, b]
    agenda.discard(a)
    agenda.poke_all()
    assert list(agenda.due(1.0)) == [b]
    sel.close()


def test_a_job_selector_leaves_data_that_is_not_a_callback_as_it_is() -> None:
    """Registering without a callback keeps the data; only the loop's selector selects."""
    sel = selectors.DefaultSelector()
    js = JobSelector(sel)
    r, w = os.pipe()
    try:
        key = js.register(r, selectors.EVENT_READ, "tag")
        assert key.data == "tag" and r in js.get_map()
        try:
            js.select(0)
        except NotImplementedError:
            pass
        else:
            raise AssertionError("a job's selector must not select")
        js.unregister(r)
        assert r not in sel.get_map()
    finally:
        os.close(r)
        os.close(w)
        sel.close()


def test_a_dropped_job_leaves_nothing_registered_so_its_fd_number_can_be_used_again() -> None:
    """A job removed by a reload releases its attempt (its pidfd closed, the job left
    running): the next descriptor given that number, another job's new pidfd, must
    register. A loaded daemon failed there, half-way through a launch, and started
    a second copy of the job at its next try."""
    sel = selectors.DefaultSelector()
    agenda = Agenda(sel)
    a, b = _job(agenda), _job(agenda)
    r, w = os.pipe()
    b.sel.register(r, selectors.EVENT_READ, lambda fd: None)
    os.close(r)  # released: closed without being unregistered
    agenda.discard(b)
    again, w2 = os.pipe()
    try:
        assert again == r  # the lowest free number: the one just closed
        a.sel.register(again, selectors.EVENT_READ, lambda fd: None)
        assert sel.get_map()[again].fd == again
        a.sel.unregister(again)
        assert not a.sel.fds  # forgotten once unregistered
    finally:
        for fd in (w, again, w2):
            os.close(fd)
        sel.close()
