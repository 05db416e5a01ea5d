"""The stall detector (detectors/stall.py) as a table of cases: when it fires,
which rank it names and by which evidence, and what it leaves alone."""

from __future__ import annotations

import pytest
from trainwatch.detectors.stall import (
    IDLE_IO,
    Proc,
    SilentView,
    StackProbe,
    StallSettings,
    StallView,
    detect,
    detect_silent,
    next_deadline,
    stall_timeout,
)
from trainwatch.types import Fault, FaultKind, RankView

S = StallSettings(factor=3.0, floor=5.0, ceiling=30.0)


def ranks(*spec: tuple[int, int, float]) -> tuple[RankView, ...]:
    """(rank, step, advanced_at) each, beaten many times."""
    return tuple(RankView(r, advanced_at, step, 50, advanced_at) for r, step, advanced_at in spec)


def procs(*spec: tuple[int, str, float | None]) -> dict[int, Proc]:
    return {r: Proc(1000 + r, state, cpu) for r, state, cpu in spec}


@pytest.mark.parametrize("p99, expected", [
    (None, 30.0),  # not learned yet: the ceiling
    (0.05, 5.0),  # fast steps: the floor
    (4.0, 12.0),  # 3 x p99
    (20.0, 30.0),  # slow steps: never past the ceiling
])
def test_the_stall_timeout_is_learned_within_floor_and_ceiling(p99: float | None,
                                                              expected: float) -> None:
    """factor x p99 step time, clamped to [floor, ceiling]; the ceiling before it is learned."""
    assert stall_timeout(p99, S) == expected


CASES = [
    # name, ranks, procs, now, expected (kind, rank, decided_by) or None
    ("one rank alone, silent, is no stall", ranks((0, 10, 0.0)), {}, 100.0, None),
    ("one rank alone, idle, is no stall", ranks((0, 10, 0.0)), procs((0, "S", 0.0)), 100.0,
     None),
    ("one rank alone, in D, is no stall", ranks((0, 10, 0.0)), procs((0, "D", 0.0)), 100.0,
     None),
    ("one rank alone, traced (a debugger), is no stall", ranks((0, 10, 0.0)),
     procs((0, "t", 0.0)), 100.0, None),
    ("one rank alone, stopped, within the timeout", ranks((0, 10, 0.0)), procs((0, "T", 0.0)),
     4.0, None),
    ("one rank alone, stopped past the timeout, is a hang", ranks((0, 10, 0.0)),
     procs((0, "T", 0.0)), 31.0, (FaultKind.HANG, 0, "process_state")),
    ("a rank advanced within the timeout", ranks((0, 10, 0.0), (1, 10, 96.0)), {}, 100.0, None),
    ("the rank behind the others is named", ranks((0, 11, 0.0), (1, 10, 0.0), (2, 11, 0.0)),
     {}, 6.0, (FaultKind.NCCL_STALL, 1, "step")),
    ("the stopped rank is named", ranks((0, 10, 0.0), (1, 10, 0.0)),
     procs((0, "S", 0.0), (1, "T", 0.0)), 6.0, (FaultKind.NCCL_STALL, 1, "process_state")),
    ("the stopped rank is named by its state though its beat lags a step",
     ranks((0, 11, 0.0), (1, 10, 0.0)), procs((0, "S", 0.0), (1, "T", 0.0)), 6.0,
     (FaultKind.NCCL_STALL, 1, "process_state")),
    ("a stopped rank ahead of a slow beater is still the one named",
     ranks((0, 11, 0.0), (1, 10, 0.0)), procs((0, "T", 0.0), (1, "S", 0.0)), 6.0,
     (FaultKind.NCCL_STALL, 0, "process_state")),
    ("the rank behind is named before one in D (rank 0 saving)",
     ranks((0, 11, 0.0), (1, 10, 0.0)), procs((0, "D", 0.0), (1, "S", 0.0)), 6.0,
     (FaultKind.NCCL_STALL, 1, "step")),
    ("a stopped rank is named before one in D (a busy disk)", ranks((0, 10, 0.0), (1, 10, 0.0)),
     procs((0, "D", 0.0), (1, "T", 0.0)), 6.0, (FaultKind.NCCL_STALL, 1, "process_state")),
    ("a rank in D state is named", ranks((0, 10, 0.0), (1, 10, 0.0), (2, 10, 0.0)),
     procs((0, "R", 1.0), (1, "R", 1.0), (2, "D", 0.0)), 6.0,
     (FaultKind.NCCL_STALL, 2, "process_state")),
    ("the idle rank among spinning ones is named",
     ranks((0, 10, 0.0), (1, 10, 0.0), (2, 10, 0.0), (3, 10, 0.0)),
     procs((0, "R", 1.0), (1, "R", 0.98), (2, "S", 0.0), (3, "R", 1.0)), 6.0,
     (FaultKind.NCCL_STALL, 2, "cpu")),
    ("all idle, none odd: a stall with no rank named", ranks((0, 10, 0.0), (1, 10, 0.0)),
     procs((0, "S", 0.0), (1, "S", 0.0)), 6.0, (FaultKind.NCCL_STALL, None, "none")),
    ("all busy, none odd: a long phase, not yet a stall", ranks((0, 10, 0.0), (1, 10, 0.0)),
     procs((0, "R", 1.0), (1, "R", 1.0)), 6.0, None),
    ("all busy past the ceiling: a stall", ranks((0, 10, 0.0), (1, 10, 0.0)),
     procs((0, "R", 1.0), (1, "R", 1.0)), 31.0, (FaultKind.NCCL_STALL, None, "none")),
    # Runnable but starved on a loaded host, its rate reads low: it works, it is no
    # idle rank among spinning ones (was named by "cpu").
    ("a rank in R with a low rate is busy, not the idle one",
     ranks((0, 10, 0.0), (1, 10, 0.0), (2, 10, 0.0), (3, 10, 0.0)),
     procs((0, "R", 1.0), (1, "R", 0.98), (2, "R", 0.01), (3, "R", 1.0)), 6.0, None),
    ("two stopped ranks: neither named by state", ranks((0, 10, 0.0), (1, 10, 0.0), (2, 10, 0.0)),
     procs((0, "T", 0.0), (1, "T", 0.0), (2, "S", 0.0)), 6.0, (FaultKind.NCCL_STALL, None, "none")),
]


@pytest.mark.parametrize("name, rs, ps, now, expected", CASES, ids=[c[0] for c in CASES])
def test_stall_cases(name: str, rs: tuple[RankView, ...], ps: dict[int, Proc], now: float,
                     expected: tuple[FaultKind, int | None, str] | None) -> None:
    """Each case: fires or not, the kind, the rank named and the evidence that named it."""
    f = detect("j", StallView(now, rs, 0.05, ps), S)
    if expected is None:
        assert f is None
        return
    assert f is not None
    assert (f.kind, f.rank, f.evidence["decided_by"]) == expected
    assert f.onset == max(r.advanced_at for r in rs)  # the stall began at the last advance


ENDED = [
    # name, procs, ranks whose process ended, now, expected (kind, rank, decided_by) or None
    ("every rank's process ended: the launcher lingers (its exit barrier), no stall",
     {}, {0, 1}, 6.0, None),
    ("every rank ended, long past the ceiling: still none", {}, {0, 1}, 300.0, None),
    ("zombies waiting for their launcher have ended too",
     procs((0, "Z", None), (1, "Z", None)), {0, 1}, 6.0, None),
    ("one ended, the other idle: given until the ceiling (winding down after it)",
     procs((1, "S", 0.0)), {0}, 6.0, None),
    ("one ended, the other idle past the ceiling: it waits on a peer that left",
     procs((1, "S", 0.0)), {0}, 31.0, (FaultKind.NCCL_STALL, 1, "step")),
]


@pytest.mark.parametrize("name, ps, ended, now, expected", ENDED, ids=[c[0] for c in ENDED])
def test_a_rank_whose_process_ended_is_not_stalled(
        name: str, ps: dict[int, Proc], ended: set[int], now: float,
        expected: tuple[FaultKind, int | None, str] | None) -> None:
    """Both ranks beat their last step and exited: their quiet is no stall (it was one
    5 s in, while torchrun's agent finished on a loaded host: a second incident)."""
    rs = ranks((0, 200, 0.0), (1, 199, 0.0)) if expected else ranks((0, 200, 0.0), (1, 200, 0.0))
    f = detect("j", StallView(now, rs, 0.05, ps, ended=frozenset(ended)), S)
    if expected is None:
        assert f is None
        return
    assert f is not None
    assert (f.kind, f.rank, f.evidence["decided_by"]) == expected
    assert f.evidence["ranks_ended"] == sorted(ended)


def test_a_gpu_fault_in_the_window_classes_the_stall_as_that_fault() -> None:
    """An Xid on the job's GPU while the ranks freeze: the incident is gpu_xid, the stall inside."""
    xid = Fault(FaultKind.GPU_XID, "j", 0.5, {"xid": 79}, gpu=3)
    v = StallView(6.0, ranks((0, 10, 0.0), (1, 10, 0.0)), 0.05,
                  procs((0, "S", 0.0), (1, "T", 0.0)), (xid,), {0: 2, 1: 3})
    f = detect("j", v, S)
    assert f is not None and f.kind is FaultKind.GPU_XID and f.gpu == 3 and f.rank == 1
    assert f.evidence["xid"] == 79 and f.evidence["stall"]["decided_by"] == "process_state"


def test_an_old_gpu_fault_does_not_class_a_later_stall() -> None:
    """A GPU fault long before the freeze is not its cause."""
    old = Fault(FaultKind.GPU_XID, "j", 10.0, {"xid": 13}, gpu=0)
    v = StallView(106.0, ranks((0, 10, 100.0), (1, 10, 100.0)), 0.05,
                  procs((0, "S", 0.0), (1, "T", 0.0)), (old,), {0: 0, 1: 1})
    f = detect("j", v, S)
    assert f is not None and f.kind is FaultKind.NCCL_STALL and f.gpu == 1


def test_the_deadline_is_the_last_advance_plus_the_timeout() -> None:
    """The loop wakes exactly when a stall could first be decided."""
    v = StallView(0.0, ranks((0, 10, 3.0), (1, 10, 4.0)), 2.0)
    assert next_deadline(v, S) == 4.0 + 6.0
    # One rank alone: when a stopped one could be named (detect's _stopped_alone).
    assert next_deadline(StallView(0.0, ranks((0, 1, 3.0)), 2.0), S) == 3.0 + 6.0
    assert next_deadline(StallView(0.0, (), 2.0), S) is None


SILENT = StallSettings(silence=20.0)


@pytest.mark.parametrize("silent_for, ps, expected", [
    (None, procs((0, "S", 0.0)), None),  # no log: unknown, never judged
    (10.0, procs((0, "S", 0.0), (1, "S", 0.0)), None),  # not silent long enough
    (25.0, procs((0, "S", 0.0), (1, "R", 0.9)), None),  # silent but working
    (25.0, procs((0, "S", 0.0), (1, "T", 0.0), (-77, "S", 0.01)), 1),  # the stopped rank
    (25.0, procs((0, "S", 0.0), (1, "S", 0.0)), None),  # stuck, no rank named (rank None)
    # Only rank 0 known as a rank (the other process not yet readable as one): idle
    # "while the others spin" needs others, so nobody is named.
    (25.0, procs((0, "S", 0.0), (-77, "T", 0.0)), None),
    # In R, a rate that reads idle (starved, or carried over from a sample it slept
    # through) is no evidence: a rank importing torch under load, or the launcher
    # alone winding down once its workers exited, was taken for a stuck job.
    (25.0, procs((0, "S", 0.0), (1, "R", 0.01)), None),
    (25.0, procs((-77, "R", 0.0)), None),
    # In D but busy a moment ago (a rank exiting, or reading a busy disk): working;
    # in D and idle (a hung file system): stuck, and the one halted is named.
    (25.0, procs((0, "D", 0.21), (-77, "S", 0.0)), None),
    (25.0, procs((0, "D", 0.0), (1, "S", 0.0), (-77, "S", 0.0)), 0),
])
def test_silence_and_idle_cpu_stand_in_for_the_client(silent_for: float | None,
                                                      ps: dict[int, Proc],
                                                      expected: int | None) -> None:
    """Without beats: silent and idle for `silence` is a stall; the stopped rank is named."""
    quiet_for = (silent_for or 0.0) / 2  # idle at every sample, from half the silence on
    f = detect_silent("j", SilentView(100.0, silent_for, ps, 60.0, quiet_for), SILENT)
    fires = silent_for is not None and silent_for >= 20 and all(
        p.state == "T" or (p.state != "R" and (p.cpu_rate or 0) < 0.05) for p in ps.values())
    assert (f is not None) == fires
    if f is not None:
        assert f.kind is FaultKind.NCCL_STALL and f.rank == expected
        assert f.evidence["client"] is False


@pytest.mark.parametrize("io, fires", [
    (8 * 1024 * 1024.0, False),  # a checkpoint going to a slow disk at 0.01 cores: working
    (IDLE_IO, False),
    (IDLE_IO - 1, True),  # a trickle (a metrics thread): idle
    (0.0, True),
    (None, True),  # not readable: its CPU alone says
])
def test_a_rank_moving_bytes_is_working_whatever_its_cpu(io: float | None, fires: bool) -> None:
    ps = {0: Proc(1000, "S", 0.01, io), 1: Proc(1001, "S", 0.0, 0.0)}
    f = detect_silent("j", SilentView(1e4, 400.0, ps, 1e4, 400.0), StallSettings())
    assert (f is not None) == fires


def test_silence_is_on_by_default_at_five_minutes() -> None:
    """Without the client, silent and idle for 5 minutes is a stall by default (PyTorch's
    own NCCL timeout is 10); 4 minutes is not, and silence None turns it off."""
    assert StallSettings().silence == 300.0
    idle = procs((0, "S", 0.0))
    assert detect_silent("j", SilentView(1e4, 300.0, idle, 1e4, 150.0),
                         StallSettings()) is not None
    assert detect_silent("j", SilentView(1e4, 240.0, idle, 1e4, 120.0), StallSettings()) is None
    off = StallSettings(silence=None)
    assert detect_silent("j", SilentView(1e4, 1e6, idle, 1e6, 1e6), off) is None


def test_one_idle_moment_of_a_silent_busy_job_is_not_a_stall() -> None:
    """Idle or stopped at every sample over the second half of the silence is a stall;
    idle at one sample only is not (a loaded run: every rank of a torchrun job that was
    silent for 18 s importing torch went into D on a stalled disk for a second)."""
    ps = procs((0, "D", 0.01), (1, "D", 0.0), (-77, "S", 0.0))
    assert detect_silent("j", SilentView(100.0, 20.0, ps, 60.0, 1.0), SILENT) is None
    assert detect_silent("j", SilentView(100.0, 20.0, ps, 60.0, 10.0), SILENT) is not None


def test_the_quiet_stretch_begins_at_the_sample_its_rates_start_from() -> None:
    """StallWatch: the stretch is broken by any busy sample, begins at the sample before
    the first quiet one (its rates run from there), and is forgotten when the job speaks."""
    from trainwatch.watch.state import StallWatch

    w = StallWatch(StallSettings(silence=4.0))
    busy, idle = procs((0, "R", 0.19), (1, "R", 0.2)), procs((0, "D", 0.01), (1, "S", 0.0))
    unknown = procs((0, "S", None), (1, "T", None))
    assert w.quiet_for(10.0, busy) == 0.0
    assert w.quiet_for(11.0, idle) == 1.0  # rates over [10, 11]
    assert w.quiet_for(12.0, idle) == 2.0
    assert w.quiet_for(13.0, busy) == 0.0  # broken
    w.loud()
    assert w.quiet_for(20.0, unknown) == 0.0  # first sample: rates not known, not broken
    assert w.quiet_for(21.0, idle) == 1.0


@pytest.mark.parametrize("section, value, where", [
    ("stall", {"floor": "40s"}, "jobs.j.stall.floor"),  # above the 30 s ceiling
    ("stall", {"factor": 0}, "jobs.j.stall.factor"),
    ("stall", {"silence": "soon"}, "jobs.j.stall.silence"),
    ("evidence", {"kinds": ["stall"]}, "jobs.j.evidence.kinds"),
    ("evidence", {"timeout": -1}, "jobs.j.evidence.timeout"),
])
def test_bad_stall_and_evidence_settings_are_one_config_error(section: str, value: object,
                                                              where: str) -> None:
    """Each mistake is a ConfigError of one line naming the field."""
    from trainwatch.config import ConfigError, from_mapping

    with pytest.raises(ConfigError) as e:
        from_mapping({"jobs": [{"name": "j", "command": ["x"], section: value}]}, "c.yaml")
    assert str(e.value).startswith(f"c.yaml: {where}: expected") and "\n" not in str(e.value)


@pytest.mark.parametrize("silent_for, ps, stopped_for, expected", [
    (6.0, procs((0, "S", 0.0), (1, "T", 0.0)), {1: 5.0}, 1),  # stopped the floor: named
    (6.0, procs((0, "S", 0.0), (1, "T", 0.0)), {1: 4.0}, None),  # not stopped long enough
    (4.0, procs((0, "S", 0.0), (1, "T", 0.0)), {1: 5.0}, None),  # the output spoke since
    (6.0, procs((0, "T", 0.0), (1, "T", 0.0)), {0: 6.0, 1: 6.0}, None),  # all: a pause
    (6.0, procs((0, "R", 0.9), (1, "T", 0.0)), {1: 5.5}, 1),  # the other spins: still named
    (6.0, procs((0, "S", 0.0), (-77, "T", 0.0)), {}, None),  # the launcher is no rank
    # A host's one rank of a job across hosts, its launcher running: its peers wait on
    # other hosts. Launcher and rank both stopped: a pause. One process alone: stuck.
    (6.0, procs((0, "T", 0.0), (-77, "S", 0.0)), {0: 5.0}, 0),
    (6.0, procs((0, "T", 0.0), (-77, "T", 0.0)), {0: 6.0}, None),
    (6.0, procs((0, "T", 0.0)), {0: 5.0}, 0),
    (6.0, procs((0, "S", 0.0), (1, "t", 0.0)), {}, None),  # traced: a debugger's, not stuck
])
def test_a_stopped_rank_without_the_client_is_named_within_the_floor(
        silent_for: float, ps: dict[int, Proc], stopped_for: dict[int, float],
        expected: int | None) -> None:
    """Without beats: one rank stopped at every sample for the floor (5 s), the output
    silent as long, is a stall long before `silence` (300 s by default)."""
    v = SilentView(100.0, silent_for, ps, 60.0, 0.0, stopped_for)
    f = detect_silent("j", v, StallSettings())
    assert (f.rank if f is not None else None) == expected
    if f is not None:
        assert f.kind is FaultKind.NCCL_STALL and f.evidence["decided_by"] == "process_state"
        assert f.evidence["client"] is False


_IN = ((("all_reduce", "distributed_c10d.py"), ("main", "train.py")), True)
_OUT = ((("load", "data.py"), ("main", "train.py")), False)
_ELSE = ((("eval", "train.py"), ("main", "train.py")), False)


def _probe(at: float, **ranks: tuple[tuple[tuple[str, str], ...], bool]) -> StackProbe:
    return StackProbe(at, {int(k[1:]): v for k, v in ranks.items()})


@pytest.mark.parametrize("probes, quiet_for, expected", [
    ((_probe(0.0, r0=_IN, r1=_OUT), _probe(2.0, r0=_IN, r1=_OUT)), 6.0, 1),  # it waits on it
    ((_probe(0.0, r0=_IN, r1=_OUT),), 6.0, None),  # one read: a moment, no more
    ((_probe(0.0, r0=_IN, r1=_OUT), _probe(0.5, r0=_IN, r1=_OUT)), 6.0, None),  # too close
    ((_probe(0.0, r0=_IN, r1=_OUT), _probe(2.0, r0=_IN, r1=_ELSE)), 6.0, None),  # it moved
    ((_probe(0.0, r0=_OUT, r1=_IN), _probe(2.0, r0=_IN, r1=_OUT)), 6.0, None),  # not the same
    ((_probe(0.0, r0=_IN, r1=_IN), _probe(2.0, r0=_IN, r1=_IN)), 6.0, None),  # all wait: elsewhere
    ((_probe(0.0, r0=_OUT, r1=_OUT), _probe(2.0, r0=_OUT, r1=_OUT)), 6.0, None),  # none waits
    ((_probe(0.0, r0=_IN, r1=_OUT, r2=_IN), _probe(2.0, r0=_IN, r1=_OUT, r2=_IN)), 6.0, 1),
    ((_probe(0.0, r0=_IN, r1=_OUT), _probe(2.0, r0=_IN, r1=_OUT, r2=_IN)), 6.0, None),
    ((_probe(0.0, r0=_IN, r1=_OUT), _probe(2.0, r0=_IN, r1=_OUT)), 4.0, None),  # not idle long
], ids=["named", "one-read", "too-close", "moved", "swapped", "all-in", "all-out", "three",
        "ranks-differ", "not-quiet"])
def test_a_rank_that_does_nothing_while_the_others_wait_in_a_collective_is_named(
        probes: tuple[StackProbe, ...], quiet_for: float, expected: int | None) -> None:
    """Without the client, every process idle for the floor: two reads of the stacks,
    a second or more apart, that keep one rank outside any collective (the same stack)
    and every other inside one name it."""
    ps = procs((0, "S", 0.0), (1, "S", 0.0))
    v = SilentView(100.0, 8.0, ps, 60.0, quiet_for, {}, probes)
    f = detect_silent("j", v, StallSettings())
    assert (f.rank if f is not None else None) == expected
    if f is not None:
        assert f.kind is FaultKind.NCCL_STALL and f.evidence["decided_by"] == "stacks"
        assert f.evidence["stack"] == ["load (data.py)", "main (train.py)"]


def test_a_rank_whose_gpu_works_is_not_named_by_its_stacks() -> None:
    """Its CPU idle outside any collective, but its GPU busy at the last poll: an
    evaluation waiting on its kernels (blocking sync), not a wedged rank."""
    probes = (_probe(0.0, r0=_IN, r1=_OUT), _probe(2.0, r0=_IN, r1=_OUT))
    ps = procs((0, "S", 0.0), (1, "S", 0.0))
    busy = SilentView(100.0, 8.0, ps, 60.0, 6.0, {}, probes, frozenset({1}))
    assert detect_silent("j", busy, StallSettings()) is None
    idle = SilentView(100.0, 8.0, ps, 60.0, 6.0, {}, probes, frozenset({0}))
    assert detect_silent("j", idle, StallSettings()) is not None


@pytest.mark.parametrize("peers, expected", [
    ({0: True}, 1),  # the other host's rank waits in a collective: this host's is named
    ({0: True, 2: True}, 1),
    ({0: True, 2: False}, None),  # another host's rank is outside too: not this one's alone
    ({}, None),  # nothing to compare with
])
def test_a_hosts_one_idle_rank_is_named_when_the_other_hosts_ranks_wait(
        peers: dict[int, bool], expected: int | None) -> None:
    probes = (_probe(0.0, r1=_OUT), _probe(2.0, r1=_OUT))
    v = SilentView(100.0, 8.0, procs((1, "S", 0.0)), 60.0, 6.0, {}, probes, frozenset(), peers)
    f = detect_silent("j", v, StallSettings())
    assert (f.rank if f is not None else None) == expected
