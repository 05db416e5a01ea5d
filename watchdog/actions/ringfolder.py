"""An ended attempt's ring folder (``run_dir/jobs/<job>.attempt-N.rings``) removed,
and its flight recorder's (``.fr``, whose dumps its incidents have copied).

The folder is the job's user's: its ranks write their rings there, and may fill
it with anything (600,000 planted names took 5 s to remove, as root, in the
loop). What it holds is deleted in the job's hand, as its user, from a thread
of its own, so that neither root's rights nor the loop's time are spent on it;
root then removes the folder itself, once empty, from its own ``run_dir``. What
cannot be emptied stays, said in one line.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
from typing import TYPE_CHECKING

from trainwatch.actions import background
from trainwatch.privsep.hand import Hand, HandError

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts

log = logging.getLogger("trainwatch")

EMPTY_TIMEOUT = 300.0  # the hand's deadline for emptying one folder
_BATCH = 4096  # names read per pass (the folder is read again until empty)


def empty_in_hand(path: str) -> int:
    """In the hand: remove everything in ``path`` (a link is removed, never
    followed); how many entries. Stops when a pass removes nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    removed = 0
    try:
        while True:
            with os.scandir(fd) as it:
                names = [e.name for e in itertools.islice(it, _BATCH)]
            gone = 0
            for name in names:
                try:
                    os.unlink(name, dir_fd=fd)
                except IsADirectoryError:
                    shutil.rmtree(os.path.join(path, name), ignore_errors=True)
                    if os.path.lexists(os.path.join(path, name)):
                        continue  # not all the user's to remove: left, the folder too
                except OSError:
                    continue
                gone += 1
            removed += gone
            if gone == 0:
                return removed
    finally:
        os.close(fd)


def _remove(hand: Hand, path: str, job: str) -> None:
    try:
        hand.call(empty_in_hand, path, timeout=EMPTY_TIMEOUT)
        os.rmdir(path)
    except FileNotFoundError:
        return
    except (HandError, OSError) as e:
        log.warning("job %s: the ring folder %s of an ended attempt is left in place: %s",
                    job, path, e)


def remove(r: JobParts, path: str) -> threading.Thread:
    """Remove the folder ``path`` of ``r``'s ended attempt, in the background."""
    hand, job = r.hands.removal, r.job.name
    return background.start(r, lambda: _remove(hand, path, job), "trainwatch-rings")
