"""Named instants where the crash-table tests kill a snapshot writer.

``at(name)`` SIGKILLs this process when the environment variable
TRAINWATCH_SNAPSHOT_CRASH_AT equals ``name`` (read once, at import), or, for
``name@k``, at the k-th time ``name`` is reached (k from 1). In production the
cost is one compare with None. SIGKILL, not an exception: no ``finally``, no
atexit, no flush runs, as when the process is killed for real.
"""

from __future__ import annotations

import os
import signal

ENV = "TRAINWATCH_SNAPSHOT_CRASH_AT"


def _parse(raw: str | None) -> tuple[str | None, int]:
    if not raw:
        return None, 0
    name, _, k = raw.partition("@")
    return name, int(k) if k.isdigit() else 1


_target, _nth = _parse(os.environ.get(ENV))
_seen = 0


def at(name: str) -> None:
    global _seen
    if _target is not None and name == _target:
        _seen += 1
        if _seen == _nth:
            os.kill(os.getpid(), signal.SIGKILL)
