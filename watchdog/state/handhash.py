"""Manifests made and checked in the job's hand (privsep): the checkpoint's files
are read as the job's user, and only the manifest (JSON) comes back to root,
which stores it in its own folder. The digests of hard-linked files
(manifest.Known) live in the hand: a cache, lost with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from trainwatch.privsep import child
from trainwatch.privsep.hand import Hand, HandAborted, OpFailed
from trainwatch.state import manifest
from trainwatch.state.manifest import ChangedWhileHashed, Manifest, Stopped

# A read that blocks ends the hand here: long enough for the largest checkpoint
# from a slow disk, bounded all the same (the relaunch waits at most its own
# checkpoints.verify_timeout).
HASH_TIMEOUT = 3600.0
KNOWN_MAX = 16384


def make_in_hand(step: int, path: str, chunk: int) -> dict[str, Any]:
    known = child.kept.setdefault("known", OrderedDict())
    m = manifest.make(step, path, chunk=chunk, known=known)
    while len(known) > KNOWN_MAX:
        known.popitem(last=False)
    return m.to_json()


def check_in_hand(m: dict[str, Any], chunk: int) -> str | None:
    got = Manifest.from_json(m)
    if got is None:
        raise ValueError("not a manifest")
    return manifest.check(got, chunk=chunk)


def _raise(e: OpFailed) -> None:
    if e.kind == "ChangedWhileHashed":
        raise ChangedWhileHashed(e.errno or 11, e.text)
    if e.kind == "ValueError":
        raise ValueError(e.text)
    raise e.oserror()  # what could not be read, as the job's user


def _call(hand: Hand, should_stop: Callable[[], bool], fn: Callable[..., Any],
          *args: Any) -> Any:
    """``fn(*args)`` in the hand, its failures raised as manifest's own would be."""
    try:
        return hand.call(fn, *args, timeout=HASH_TIMEOUT, should_stop=should_stop)
    except HandAborted:
        raise Stopped() from None
    except OpFailed as e:
        _raise(e)
        raise


def make(hand: Hand, step: int, path: str, chunk: int,
         should_stop: Callable[[], bool]) -> Manifest:
    """manifest.make, in the hand. Raises as it does (OSError, Stopped), or
    HandError when the hand gave no answer."""
    m = Manifest.from_json(_call(hand, should_stop, make_in_hand, step, path, chunk))
    if m is None or (m.step, m.path) != (step, path):
        raise ValueError(f"the hand's manifest of {path} is not one")
    return m


def check(hand: Hand, m: Manifest, chunk: int, should_stop: Callable[[], bool]) -> str | None:
    """manifest.check, in the hand."""
    why = _call(hand, should_stop, check_in_hand, m.to_json(), chunk)
    return None if why is None else str(why)[:1000]
