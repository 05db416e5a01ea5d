"""A relaunch that finds no good checkpoint, but one that only time keeps from
being judged complete (ondisk.is_settling: nothing else is missing,
it changed within the quiet time), waits for that verdict rather than start
over: at most the quiet time, from when it began to wait. The job is stopped,
so nothing of it writes there any more, and the newest settles within that."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from trainwatch.state.numbered import QUIET_FOR
from trainwatch.state.ondisk import is_settling

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts
    from trainwatch.state.entry import Entry

log = logging.getLogger("trainwatch")


def waiting(r: JobParts, cp: Entry | None) -> bool:
    """Does the relaunch wait (``cp``: the good checkpoint it found, if any)?"""
    cat = r.catalog
    settling = [e for e in cat.known() if not e.bad and is_settling(e.why)]
    if cp is not None or not settling:
        cat.settling_since = None
        return False
    bound = cat.spec.quiet_for if cat.spec.quiet_for is not None else QUIET_FOR
    now = time.monotonic()
    if cat.settling_since is None:
        cat.settling_since = now
        e = settling[-1]
        log.warning("job %s: no good checkpoint yet; step %d %s: the relaunch waits for its "
                    "verdict (at most %gs) rather than start over", r.job.name, e.step,
                    e.why.split(" (")[0], bound)
    if now - cat.settling_since < bound:
        return True
    cat.settling_since = None
    return False
