"""The decision of a group restart (multihost/group.py): the checkpoint every rank
resumes from, judged and recorded in the job's quick hand (privsep), as its user.

A hand that does not answer (down for its cooldown after a call past its deadline,
as on a machine too busy to run it) can do neither: the checkpoints stay as last
judged, perhaps none yet, and a restart with no record has every rank resume from
what its launch was given, from scratch for a first launch. A stalled rank then
stalls again, round after round, until the budget is spent. So the restart waits,
its workers kept, and is decided again every ``RETRY`` seconds until the hand
answers: the way a relaunch waits for its checkpoints to be judged (actions/launch.py).
A call the hand answered with a failure (the shared folder not writable) does not
wait: it is said, and the restart goes on without a record, as before.

A record another host made is a claim, never an order: the folder is the job
user's, and so is every byte of it. Its checkpoint is taken only when it lies in
``checkpoints.dir`` and this host's catalog judges it good (``unbelieved``); else
this host says so in one line and decides the restart itself, a record of its own
after it. Whether it is charged is this host's own view (``charged``), never the
record's word: a user's 30 records of ``charged: false`` were 31 restarts charged
to nothing."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainwatch.actions import settle, verify
from trainwatch.multihost import known, records
from trainwatch.multihost.state import Waiting
from trainwatch.privsep.hand import HandError

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.multihost.state import Group
    from trainwatch.types import Fault

log = logging.getLogger("trainwatch")

RETRY = 1.0  # seconds between two tries while the hand does not answer
_VERIFY_WITHIN = 0.25  # seconds the loop waits on a checkpoint's check before deciding


@dataclass(frozen=True)
class Made:
    rec: records.Restart | None  # None: not recorded (said)
    won: bool  # decided here


def make(r: Runner, g: Group, fault: Fault, incident: int | None, charged: bool,
         wall: float, onset: float) -> Made | str:
    """Restart ``g.gen + 1`` decided and recorded; or why it must wait (the hand
    did not answer)."""
    # What the other hosts were told first (known.py): the ranks that report
    # checkpoints may be on any host. After a rollback's quarantine: before the
    # anomaly. Verified when its check is quick: else a corrupt one is every
    # round's decision until its deaths mark it bad.
    known.gather(r, None)
    cp = verify.checkpoint_now(r, _VERIFY_WITHIN)
    if r.catalog.unjudged is not None:  # the newest, perhaps every one, has no verdict
        return f"the job's hand did not answer: its checkpoints are not judged " \
               f"({r.catalog.unjudged})"
    if settle.waiting(r, cp):  # one only time keeps from complete: never from scratch
        return "no checkpoint is judged good yet, and the newest is being judged"
    decision = {"resume_step": cp.step if cp else None, "resume_path": cp.path if cp else None,
                "skip": list(r.skip[:2]) if r.skip else None, "kind": fault.kind.value,
                "at": wall, "charged": charged}
    claim = {"kind": fault.kind.value, "rank": fault.rank, "at": onset, "incident": incident,
             "victim": "peer_failure" in fault.evidence, "reached": r.last_step}
    try:
        raw = records.answered(r, records.begin_in_hand, g.root, g.gen + 1, g.host,
                               decision, claim)
    except HandError as e:
        return f"the restart is not recorded ({e})"
    rec = records.parse(raw)
    # A call past its deadline may have made it before the hand was killed: ours still.
    won = (isinstance(raw, dict) and raw.get("won") is True) or (
        rec is not None and rec.host == g.host and rec.gen == g.gen + 1)
    return Made(rec, won)


def wait(r: Runner, g: Group, w: Waiting, again: bool) -> None:
    """Keep the workers until the hand answers, or the newest checkpoint is judged;
    said once per restart (not ``again``)."""
    if not again:
        log.error("job %s: group restart %d waits: %s; its workers are "
                  "kept and it is decided again every %gs (never from scratch)",
                  r.job.name, g.gen + 1, w.why, RETRY)
    g.waiting = w
    r.hang_latched = True  # the workers kept are not a new hang


def waited(r: Runner, w: Waiting, rec: records.Restart | None) -> float:
    """Said once the restart is decided after waiting; the wall time from which the
    agent's workers are of the new round (those it started meanwhile may have read no
    decision, and end too)."""
    log.warning("job %s: group restart %s decided after %.1fs waiting",
                r.job.name, rec.gen if rec is not None else "?", r.clock() - w.since)
    return time.time()


def unbelieved(r: Runner, rec: records.Restart) -> str | None:
    """Why this host does not take ``rec``'s checkpoint; None when it does (or the
    record resumes from scratch). The catalog is asked as it stands, then listed
    again: another host's rank may have written it a moment ago."""
    path, step = rec.resume_path, rec.resume_step
    if path is None:
        return None
    root = r.job.checkpoints.dir
    if root is None or os.path.dirname(path) != root:
        return f"{path:.200} is not in checkpoints.dir {root}"
    why = f"step {step} at {path:.200} is no checkpoint this host knows"
    for turn in range(3):  # as listed; listed again; with what the other hosts were told
        if turn == 2 and not known.gather(r, None):
            break
        # Listed again after the claims: a claim taken is judged at the next listing
        # (a host that followed with its reports taken still found step 40 unsettled).
        listed = r.catalog.known() if turn == 0 else r.catalog.entries()
        e = next((e for e in listed if e.step == step and e.path == path), None)
        if e is not None and e.good:
            return None
        if e is not None:
            why = f"step {step} is {e.why:.200} here"
    return why


def followed_charged(r: Runner, g: Group, rec: records.Restart) -> bool:
    """Whether this host charges a peer's restart to its budget: once, unless its
    skip window widens the one this host last took part in (the same loss anomaly
    back, which a rollback charges once), at most rollback.max_widenings times in a
    row. The record's own ``charged`` is the user's text, never asked."""
    old, g.skip = g.skip, rec.skip
    widens = (rec.skip is not None and old is not None and rec.skip != old
              and rec.skip[0] <= old[0] and old[1] <= rec.skip[1])
    g.widenings = g.widenings + 1 if widens else 0
    return not widens or g.widenings > r.policy.rollback.max_widenings
