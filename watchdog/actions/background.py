"""Work a job's runner leaves to threads of their own (an ended attempt's ring
folder emptied, retention's removals and the store's GC, each in the job's
hand), so that the loop never waits for it; waited for, bounded, when the
runner closes (``trainwatch run`` ends right after its job's last attempt)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts

CLOSE_WAIT = 10.0  # a runner closing waits this long for its work, in all

# The work under way, by job (a weak map: no field on the runner for it).
_pending: weakref.WeakKeyDictionary[JobParts, list[threading.Thread]] = (
    weakref.WeakKeyDictionary())


def start(r: JobParts, work: Callable[[], None], name: str) -> threading.Thread:
    """Run ``work`` in a thread of its own, kept for ``wait``."""
    t = threading.Thread(target=work, name=name, daemon=True)
    t.start()
    _pending[r] = [*(x for x in _pending.get(r, []) if x.is_alive()), t]
    return t


def busy(r: JobParts, name: str) -> bool:
    """Some work of that name is still under way for ``r``."""
    return any(t.is_alive() and t.name == name for t in _pending.get(r, []))


def wait(r: JobParts, timeout: float | None = None) -> None:
    """Before the runner's hands close: its work finishes, within ``timeout`` in
    all (``CLOSE_WAIT``; what is left is then ended with the hands)."""
    end = time.monotonic() + (CLOSE_WAIT if timeout is None else timeout)
    for t in _pending.pop(r, []):
        t.join(max(0.0, end - time.monotonic()))
