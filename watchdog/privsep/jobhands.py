"""The hands of one job: one for short calls the loop waits on (listing and
judging its checkpoints, retention's deletions), one for long calls that run in
threads of their own (hashing, pulls), and one for the evidence of an incident
(the flight recorder's dumps), so that a long hash never makes a listing miss
its deadline, nor an incident's evidence wait for it."""

from __future__ import annotations

from dataclasses import dataclass

from trainwatch.actions.credentials import Identity
from trainwatch.privsep.hand import Hand


@dataclass
class JobHands:
    quick: Hand
    bulk: Hand
    evidence: Hand

    def close(self) -> None:
        for h in (self.quick, self.bulk, self.evidence):
            h.close()


def for_job(name: str, ident: Identity | None) -> JobHands:
    """``ident``: the job's user (None: the job runs as we do; its hands too)."""
    return JobHands(Hand(f"job {name}", ident), Hand(f"job {name} (hashing)", ident),
                    Hand(f"job {name} (evidence)", ident))
