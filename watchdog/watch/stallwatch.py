"""A job's ranks against the stall detector (detectors/stall.py): the ranks'
steps from their beats, their processes' state and CPU (sources/procs.py,
sampled only while no rank advances, so a healthy job costs nothing), the GPU
faults of the job's GPUs; and, for a job without the client, its output's
silence and its processes' CPU. A stall is a fault for respond.py like any
other; the evidence taken before the kill is actions/evidence.py's."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainwatch.detectors import stall
from trainwatch.detectors.stall import SilentView, StallView
from trainwatch.lifecycle.policy import choose
from trainwatch.types import Action, Fault, FaultKind, Finding, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

_SAMPLE_AFTER = 1.0  # no rank advanced this long: sample the processes (for CPU rates)
_MIN_SAMPLES = 20  # step intervals before the stall timeout is learned
GPU_BUSY = 0.05  # utilisation from which a rank's GPU is working


def _view(r: Runner, now: float, sample: bool) -> StallView:
    w = r.stall
    snap = r.ranks.snapshot(now, _MIN_SAMPLES)
    pids = r.ranks.pids()
    procs = w.sampler.sample(pids) if sample else {}
    gpus = r.attempt.gpus if r.attempt is not None else None
    by_rank = {rank: gpus[rank % len(gpus)] for rank in pids} if gpus else {}
    # A sample leaves out a process that is gone; a zombie waits for its launcher.
    ended = frozenset(rank for rank in pids if sample and (
        rank not in procs or procs[rank].state in ("Z", "X")))
    return StallView(now, snap.ranks, snap.intervals_p99, procs, tuple(w.gpu_faults), by_rank,
                     ended)


def _newest_advance(r: Runner) -> float | None:
    """The last time any rank that beat twice advanced; None: not armed. Straight
    from the ranks: this runs at every turn of the loop."""
    judges = [x.advanced_at for x in r.ranks.ranks.values() if x.beats >= 2]
    return max(judges) if judges else None


def deadline(r: Runner, now: float) -> float | None:
    """When a stall could next be decided (for the loop's sleep)."""
    w = r.stall
    if not r.ranks.beaten:  # a probe of the stacks is collected as soon as it is done
        return now + (0.05 if w.prober.running else 1.0) if w.settings.silence is not None \
            else None
    newest = _newest_advance(r)
    if newest is None:
        return None
    d = newest + stall.stall_timeout(r.ranks.learned_p99(_MIN_SAMPLES), w.settings)
    if w.sampled:
        d = min(d, now + 1.0)  # keep sampling while the ranks are quiet
    return d


def check(r: Runner, now: float) -> Iterator[Finding]:
    """Judge the job's ranks now; a stall is found for respond.py."""
    w, a = r.stall, r.attempt
    if a is None or r.state not in (JobState.STARTING, JobState.RUNNING):
        return
    if not r.ranks.beaten:
        yield from _check_silent(r, now)
        return
    newest = _newest_advance(r)
    if newest is None:
        return
    d = newest + stall.stall_timeout(r.ranks.learned_p99(_MIN_SAMPLES), w.settings)
    w.sampled = now - newest >= _SAMPLE_AFTER
    if not w.sampled:
        return
    if now < d:
        w.sampler.sample(r.ranks.pids())  # the CPU rates at judgement are over a second
        return
    r.intake.drain()  # a beat may be queued: read it before judging
    fault = stall.detect(r.job.name, _view(r, now, sample=True), w.settings)
    if fault is not None:
        yield from _found(r, fault)


def _check_silent(r: Runner, now: float) -> Iterator[Finding]:
    w, a = r.stall, r.attempt
    assert a is not None
    if w.settings.silence is None or a.closed or str(a.log_path) == os.devnull:
        return  # no output to be silent: an attached job's is Slurm's
    try:
        silent_for: float | None = max(0.0, time.time() - os.stat(a.log_path).st_mtime)
    except OSError:
        silent_for = None
    # Sampled from a second of silence on, as the ranks of a job with the client
    # are: a stopped rank is named at the floor after its stop, not after twice it.
    if silent_for is None or silent_for < min(_SAMPLE_AFTER, w.settings.silence / 2):
        w.sampled = False
        w.loud()
        return
    procs = w.sampler.sample(w.sampler.by_rank(a.tree.scan()))
    w.sampled = True
    quiet, stopped = w.quiet_for(now, procs), w.stopped_for(now, procs)
    ranks = {k: p for k, p in procs.items() if k >= 0}
    floor = w.settings.floor
    # Idle a second, none stopped (that rule needs no stacks): read the ranks' stacks,
    # where there are others to compare with, here or on other hosts; two reads are
    # in hand when the stretch reaches the floor, and the rule judges then.
    if quiet >= _SAMPLE_AFTER and silent_for >= floor \
            and not any(p.state in "Tt" for p in ranks.values()) \
            and (len(ranks) >= 2 or (ranks and r.group is not None)):
        probe = w.prober.tick({k: p.pid for k, p in ranks.items()},
                              {k: p.state for k, p in ranks.items()})
        if probe is not None:  # the other hosts' ranks may be the ones waiting
            w.prober.peers = dict(r.engine.probed(r, {k: s[1] for k, s in probe.ranks.items()}))
    else:
        w.prober.reset()
    util, gpus = _gpu_utilization(r), a.gpus
    busy = frozenset(k for k in ranks if gpus and util.get(str(gpus[k % len(gpus)]), 0.0)
                     >= GPU_BUSY)
    v = SilentView(now, silent_for, procs, now - a.started, quiet, stopped,
                   tuple(w.prober.probes), busy, w.prober.peers)
    fault = stall.detect_silent(r.job.name, v, w.settings)
    if fault is not None:
        yield from _found(r, fault)


def _gpu_utilization(r: Runner) -> dict[str, float]:
    """The last utilisation polled of each of the attempt's GPUs (a stalled
    collective leaves them idle; a stuck kernel keeps one busy)."""
    w, a = r.gpuwatch, r.attempt
    if w is None or a is None or not a.gpus:
        return {}
    out = {}
    for gpu in a.gpus:
        g = w.health.gpus.get(gpu)
        u = g.last.utilization_ratio if g is not None and g.last is not None else None
        if u is not None:
            out[str(gpu)] = round(u, 3)
    return out


def _found(r: Runner, fault: Fault) -> Iterator[Finding]:
    if r.engine.held(r, fault, r.clock()):
        return  # a multi-host job: the host with the stopped rank names it
    extra: dict[str, object] = {}
    if r.take_drill("nccl_stall", "hang") is not None:
        extra["source"] = "drill"
    util = _gpu_utilization(r)
    if util:
        extra["gpu_utilization"] = util
    if extra:
        fault = dataclasses.replace(fault, evidence={**fault.evidence, **extra})
    action = choose(r.policy, fault, r.xids_seen)
    if fault.kind is not FaultKind.NCCL_STALL and action is Action.ALERT:
        # The GPU fault alone was only worth an alert; with the job stuck on it,
        # the stall's action applies.
        action = r.policy.action_for(FaultKind.NCCL_STALL)
    yield Finding(fault, action)
