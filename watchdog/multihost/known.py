"""What each host knows of a job's checkpoints, shared with the group: a report
reaches only the reporting rank's host, and the host that first sees a fault
decides where every rank resumes. Judged from its own catalog alone, a host that
was told of none judged the newest checkpoint unfinished (changed within
``quiet_for``) and had every rank start over, or resume a checkpoint older than
the newest any host knew.

So each host writes the checkpoints reported to it, as the job's user, beside
the group's records (records.py):

    <checkpoints.dir>/.trainwatch[/<scope>]/known-<host>.json
        {"host": ..., "reported": {"<step>": "<path>", ...}}   the newest KEEP

at each new report, and a host about to decide (or to judge another's decision)
reads every other host's first and takes each claim as it takes a report from its
own ranks (``catalog.report``: in ``checkpoints.dir``, named by the layout for its
step, there, not quarantined). That trusts a peer's file no more than a report,
which is the job's user's word too; a claim of a step this host judged bad is
still bad (verification and quarantine are this host's).

A claim is on disk a hand call after its report (milliseconds): a fault that
follows a checkpoint by more than that finds it; so the decision reads, never
waits."""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

from trainwatch.multihost import records

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

KEEP = 16  # the newest reports each host shares
MAX_HOSTS = 256  # files read per look
TAKE = 4  # the newest claims new to this host taken per look (each a look on disk)
_KNOWN = re.compile(r"known-([A-Za-z0-9._-]{1,64})\.json")
_STEP = re.compile(r"\d{1,18}")


def share_in_hand(root: str, host: str, reported: dict[str, str],
                  scope: str | None = None) -> None:
    """This host's newest reports, written where every host reads."""
    base = records.folder(root, scope)
    os.makedirs(base, mode=0o755, exist_ok=True)
    records.write(base, f"known-{host}.json", {"host": host, "reported": reported})


def others_in_hand(root: str, host: str, scope: str | None = None) -> list[dict[str, Any]]:
    """Every other host's file, each bounded as records.read bounds one."""
    return others(records.folder(root, scope), _KNOWN, host)


def others(base: str, name: re.Pattern[str], host: str) -> list[dict[str, Any]]:
    """The files in ``base`` whose name is ``name`` (its group: the host's name) of
    every host but ``host``: at most MAX_HOSTS of the first records.MAX_NAMES."""
    out: list[dict[str, Any]] = []
    try:
        with os.scandir(base) as it:
            for i, e in enumerate(it):
                if i >= records.MAX_NAMES or len(out) >= MAX_HOSTS:
                    break
                m = name.fullmatch(e.name)
                if m and m.group(1) != host and (body := records.read(e.path)) is not None:
                    out.append(body)
    except OSError:
        pass
    return out


def share(r: Runner, scope: str | None) -> None:
    """After a new report (and before a decision): this host's newest reports, those
    it has not judged bad, into its file."""
    root, cat = r.job.checkpoints.dir, r.catalog
    if root is None:
        return
    newest = sorted((s, p) for s, p in cat.reported.items() if s not in cat.bad)[-KEEP:]
    records.call(r, share_in_hand, root, r.config.host, {str(s): p for s, p in newest}, scope)


def claims(raw: object) -> list[tuple[int, str, str]]:
    """(step, path, host) of each well-formed claim, newest first; the rest dropped."""
    out: list[tuple[int, str, str]] = []
    for body in raw[:MAX_HOSTS] if isinstance(raw, list) else []:
        host = records.host_of(body.get("host")) if isinstance(body, dict) else None
        rep = body.get("reported") if isinstance(body, dict) else None
        if host is None or not isinstance(rep, dict):
            continue
        for k, v in list(rep.items())[:KEEP]:
            if isinstance(k, str) and _STEP.fullmatch(k) and isinstance(v, str) and len(v) <= 4096:
                out.append((int(k), v, host))
    return sorted(out, reverse=True)


def gather(r: Runner, scope: str | None) -> int:
    """The other hosts' claims taken into this host's catalog, newest first: how
    many were new to it and taken."""
    root, cat = r.job.checkpoints.dir, r.catalog
    if root is None:
        return 0
    raw = records.call(r, others_in_hand, root, r.config.host, scope)
    taken, looked = 0, 0
    for step, path, host in claims(raw):
        if cat.reported.get(step) == path or step in cat.bad:
            continue
        if looked >= TAKE:
            break
        looked += 1
        if cat.report(step, path):
            taken += 1
            log.info("job %s: checkpoint step %d complete, as host %s was told: %.200s",
                     r.job.name, step, host, path)
        else:
            log.info("job %s: host %s's checkpoint step %d not taken (%s): %.200s",
                     r.job.name, host, step, cat.refusal, path)
    if taken:
        r.checkpoints_at = 0.0  # the exporter's summary: refresh at the next tick
    return taken
