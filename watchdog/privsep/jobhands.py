"""The hands of one job: one for short calls the loop waits on (listing and
judging its checkpoints, the quick part of retention's deletions), one for long
calls that run in threads of their own (hashing, pulls), one for the evidence
of an incident (the flight recorder's dumps), and one for removals that take
long (an ended attempt's ring folder, retention's tombstones, the store's GC),
so that a long hash never makes a listing miss its deadline, nor an incident's
evidence or a relaunch's verification wait for it or for a removal."""

from __future__ import annotations

import logging
import os
import stat
import sysconfig
from dataclasses import dataclass

from trainwatch.privsep import credentials
from trainwatch.privsep.credentials import Identity
from trainwatch.privsep.hand import Hand

log = logging.getLogger("trainwatch")

# The field names, as the metrics label them.
NAMES = ("quick", "bulk", "evidence", "removal")


@dataclass
class JobHands:
    quick: Hand
    bulk: Hand
    evidence: Hand
    removal: Hand

    def all(self) -> tuple[Hand, ...]:
        return tuple(getattr(self, n) for n in NAMES)

    def close(self) -> None:
        for h in self.all():
            h.close()

    def follow(self, name: str, user: str | None, group: str | None) -> None:
        """A reload changed the job: its hands act as its user and group now (they
        would go on as the old ones, root's where the job had no user)."""
        try:
            ident = credentials.resolve(user, group)
        except (KeyError, OSError, ValueError) as e:
            log.error("job %s: cannot resolve its user %s: nothing is done in its folders "
                      "until it can", name, e)
            for h in self.all():
                h.refuse(f"the job's user cannot be resolved: {e}")
            return
        for h in self.all():
            h.rebind(ident)


def unreadable(paths: tuple[str, ...]) -> str | None:
    """The first folder above (or at) one of ``paths`` that other users may not
    traverse; None when every one is reachable."""
    for p in paths:
        d = os.path.abspath(p)
        while True:
            try:
                if not os.stat(d).st_mode & stat.S_IXOTH:
                    return d
            except OSError:
                return d
            up = os.path.dirname(d)
            if up == d:
                break
            d = up
    return None


_said = False


def _check_install(ident: Identity | None) -> None:
    """Once: a hand as another user loads what it lacks from our install (a module
    imported late, botocore's data for a pull): say so loudly if it cannot."""
    global _said
    if _said or ident is None or ident.uid == os.geteuid():
        return
    _said = True
    import trainwatch

    where = unreadable((os.path.dirname(trainwatch.__file__), sysconfig.get_paths()["purelib"]))
    if where is not None:
        log.error("trainwatch's install is not reachable by other users (%s): a job's hands, "
                  "which run as its user, cannot load what they lack from it (a pull from "
                  "checkpoints.remote fails); install it where every user may read it "
                  "(make install does)", where)


def for_job(name: str, ident: Identity | None) -> JobHands:
    """``ident``: the job's user (None: the job runs as we do; its hands too)."""
    _check_install(ident)
    return JobHands(Hand(f"job {name}", ident), Hand(f"job {name} (hashing)", ident),
                    Hand(f"job {name} (evidence)", ident), Hand(f"job {name} (removal)", ident))
