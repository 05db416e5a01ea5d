"""A silent job's stacks (watch/stackprobe.py), shared with the group's other
hosts. Without the client, a rank that does nothing while the others wait in a
collective is named by its stacks; across hosts, the others are on other hosts:
a host's one rank, idle outside any collective, is named by its host only when
the other hosts' ranks were read inside one, a moment ago.

So each host that reads its ranks' stacks in a quiet stretch writes, as the
job's user, beside the group's records (records.py):

    <checkpoints.dir>/.trainwatch/probe-<host>.json
        {"host": ..., "at": <wall time>, "ranks": {"<rank>": <inside a collective>}}

and reads every other host's in the same hand call. A peer's read counts for
``FRESH`` seconds; its ranks are the user's word, as a report is, and only
ever stop a host from naming its own rank, or let it."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainwatch.multihost import known, records

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

FRESH = 6.0  # seconds a peer's read of its ranks counts (three probes' worth)
MAX_RANKS = 1024  # ranks read from one peer's file
_PROBE = re.compile(r"probe-([A-Za-z0-9._-]{1,64})\.json")
_RANK = re.compile(r"\d{1,9}")


def exchange_in_hand(root: str, host: str, ranks: dict[str, bool]) -> list[dict[str, Any]]:
    """This host's read written where every host reads; every other host's back."""
    base = records.folder(root)
    os.makedirs(base, mode=0o755, exist_ok=True)
    records.write(base, f"probe-{host}.json", {"host": host, "at": time.time(), "ranks": ranks})
    return known.others(base, _PROBE, host)


def peers(raw: object, now: float, own: Mapping[int, bool]) -> dict[int, bool]:
    """Rank -> inside a collective, from the other hosts' fresh reads; a rank this
    host has, or a file that is not one host's well-formed read, is left out."""
    out: dict[int, bool] = {}
    for body in raw if isinstance(raw, list) else []:
        if not isinstance(body, dict) or records.host_of(body.get("host")) is None:
            continue
        at, ranks = body.get("at"), body.get("ranks")
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not isinstance(ranks, dict) \
                or not now - FRESH <= at <= now + 1.0:
            continue
        for k, v in list(ranks.items())[:MAX_RANKS]:
            if isinstance(k, str) and _RANK.fullmatch(k) and isinstance(v, bool) \
                    and int(k) not in own:
                out[int(k)] = v
    return out


def exchange(r: Runner, ranks: Mapping[int, bool]) -> dict[int, bool]:
    """This host's ranks' read shared; the other hosts' fresh ones."""
    root = r.job.checkpoints.dir
    if root is None or r.group is None:
        return {}
    raw = records.call(r, exchange_in_hand, root, r.config.host,
                       {str(k): v for k, v in ranks.items()})
    return peers(raw, time.time(), ranks)
