"""The hands of one job: one for short calls the loop waits on (listing and
judging its checkpoints, the quick part of retention's deletions), one for long
calls that run in threads of their own (hashing, pulls), one for the evidence
of an incident (the flight recorder's dumps), and one for removals that take
long (an ended attempt's ring folder, retention's tombstones, the store's GC),
so that a long hash never makes a listing miss its deadline, nor an incident's
evidence or a relaunch's verification wait for it or for a removal."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainwatch.actions import credentials
from trainwatch.actions.credentials import Identity
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


def for_job(name: str, ident: Identity | None) -> JobHands:
    """``ident``: the job's user (None: the job runs as we do; its hands too)."""
    return JobHands(Hand(f"job {name}", ident), Hand(f"job {name} (hashing)", ident),
                    Hand(f"job {name} (evidence)", ident), Hand(f"job {name} (removal)", ident))
