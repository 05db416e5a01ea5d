"""The requests ``faultinject`` sends on the control socket, as the daemon
answers them: a drill notice (a crash or hang it is about to inject, so that
the fault is marked injected), a loss drill (NaN or a gradient spike injected
into the job's loss feed), and the GPU drills (``gpu-xid``, ``gpu-lost``,
``ecc``, ``thermal``, ``gpu-clear``), handled exactly like the real fault.

A drill on a job is the job's owner's or an admin's to run; a GPU drill
touches every job on that GPU and is an admin's alone (access.py). Both are
checked before anything is looked at or changed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainwatch.lifecycle import respond
from trainwatch.privsep import access
from trainwatch.privsep.access import Peer
from trainwatch.watch import anomalies

if TYPE_CHECKING:
    from trainwatch.host.supervisor import Supervisor
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

GPU_OPS = frozenset({"gpu-xid", "gpu-lost", "ecc", "thermal", "gpu-clear"})
_KINDS = ("crash", "hang", "nccl_stall", "log_line")


def answer(sup: Supervisor, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    if op == "drill":
        return drill(sup, args, peer)
    if op not in GPU_OPS:
        raise ValueError(f"unknown op {op!r}")
    access.admin_only(peer, f"the GPU drill {op}", sup.config.admin_group)
    if sup.gpus is None:
        raise ValueError("GPU monitoring is off (gpu.backend: off)")
    gpu = args.get("gpu")
    if not isinstance(gpu, int) or isinstance(gpu, bool):
        raise ValueError(f"expected a GPU index, got {gpu!r}")
    if op == "gpu-xid":
        xid = args.get("xid")
        if not isinstance(xid, int) or isinstance(xid, bool) or xid <= 0:
            raise ValueError(f"expected an Xid number, got {xid!r}")
        sup.gpus.inject_xid(gpu, xid, str(args.get("message") or ""))
    elif op == "gpu-clear":  # the operator: this GPU is fine again
        if gpu not in sup.gpus.health.excluded():
            raise ValueError(f"GPU {gpu} is not excluded")
        sup.gpus.clear(gpu)
        log.warning("GPU %d cleared by the operator: back in service", gpu)
        return {"cleared": gpu}
    else:
        sup.gpus.inject(op.removeprefix("gpu-"), gpu, bool(args.get("uncorrected")))
    return {"injected": op, "gpu": gpu}


def drill(sup: Supervisor, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    """A crash or hang faultinject is about to inject (noted, so that the fault
    is marked injected), or a loss drill, injected into the job's loss feed."""
    job, kind, pids = args.get("job"), args.get("kind"), args.get("pids", [])
    r = _job(sup, job)
    access.check(peer, r.job.name, r.job.user)
    if kind in ("nan", "grad-spike"):
        beats = anomalies.drill(r, kind, args.get("scale"), args.get("steps"))
        found = respond.act_on(r, anomalies.check(r, beats, drill=True))
        return {"job": r.job.name, "kind": kind, "steps": [beats[0].step, beats[-1].step],
                "found": anomalies.said(found)}
    if kind not in _KINDS:
        raise ValueError("expected kind crash, hang, nccl_stall, log_line, nan or "
                         f"grad-spike, got {kind!r}")
    if not isinstance(pids, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in pids):
        raise ValueError("expected pids as a list of integers")
    r.expect_drill(kind, pids)
    return {"job": job, "kind": kind}


def _job(sup: Supervisor, name: object) -> Runner:
    for r in sup.runners:
        if r.job.name == name:
            return r
    raise ValueError(f"no job named {name!r} here")
