"""A group restart's records, kept in the job's checkpoint folder, which every
host of a multi-host job sees (training shares it anyway):

    <checkpoints.dir>/.trainwatch/restart-00000003/
        decision.json        where every rank resumes: the checkpoint, the skip window
        claim-<host>.json    each host that saw a fault of its own: what, which rank, when
    <checkpoints.dir>/.trainwatch/known-<host>.json
                             the checkpoints reported to each host (known.py)
    <checkpoints.dir>/.trainwatch/resume-from
                             the newest decision's checkpoint path (empty: from scratch),
                             one line, for a job without the client (as Megatron's tracker)

A Slurm job's records live in a scope of their own, ``scope`` =
``slurm-<job id>``: ``<checkpoints.dir>/.trainwatch/slurm-<job id>/restart-N/``,
so that a new sbatch of the same training (a new job id, restarts from 0 again)
never reads an old job's restart-N; the ``resume-from`` tracker stays where it
is, one per checkpoint folder. Without a scope (None), the layout above.

The first host to act on a fault makes the restart's folder with its decision
in it (made aside and renamed into place: of many hosts acting at once, one
wins, and none sees the folder without its decision); every host that
saw a fault of its own adds its claim, so that where the restart began is the
earliest claim, not whichever host was quickest to write. The number is the
group's restart count, which every host reads and so agrees on.

These functions run in the job's hand (privsep), as the job's user: the
folder is the user's. What comes back to root is checked and bounded like
anything a user wrote (``parse``)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

# Stdlib only at import: every rank of a group job imports this module as it starts
# (client.resume_from), while the new round waits for it; the hands' module pulls in
# the config and YAML (~0.14 s of a rank's start), and only the daemon needs it (call).
if TYPE_CHECKING:
    from trainwatch.config import Job
    from trainwatch.privsep.jobhands import JobHands


class Holder(Protocol):
    """What ``call`` needs of a job (its runner): its entry and its hands."""

    @property
    def job(self) -> Job: ...
    @property
    def hands(self) -> JobHands: ...

log = logging.getLogger("trainwatch")

FOLDER = ".trainwatch"
_NAME = re.compile(r"restart-(\d{8})")
_CLAIM = re.compile(r"claim-([A-Za-z0-9._-]{1,64})\.json")
_STACKS = re.compile(r"stacks-([A-Za-z0-9._-]{1,64})\.json")
# A scope is one name in the folder: no separator, never "." or ".." (nor a
# hidden name, such as write's temporary files), none of the default layout's.
_SCOPE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
TRACKER = "resume-from"
MAX_NAMES = 4096  # names read from the folder per look
MAX_CLAIMS = 64  # claims read from one restart's folder
MAX_BYTES = 16 * 1024  # one record
TIMEOUT = 5.0  # one hand call on the shared folder
# Every host's claim is in by then: where a restart began is read again (the host
# that made it may have read only its own claim, a victim's).
SETTLE = 2.0


def bad_scope(scope: object) -> str | None:
    """Why `scope` is not a scope's name; None when it is one."""
    if not isinstance(scope, str) or not _SCOPE.fullmatch(scope) or ".." in scope \
            or _NAME.fullmatch(scope) or scope == TRACKER:
        return (f"a records scope is one name of 1 to 64 letters, digits, '_', '.' or '-' "
                f"(no dot first, no '..', not restart-N or {TRACKER}), got {scope!r:.80}")
    return None


def folder(root: str, scope: str | None = None) -> str:
    """Where the restarts' folders are: ``<root>/.trainwatch``, or the scope's
    folder in it. A scope that is not one name raises ValueError."""
    if scope is None:
        return os.path.join(root, FOLDER)
    if problem := bad_scope(scope):
        raise ValueError(problem)
    return os.path.join(root, FOLDER, scope)


def write(d: str, name: str, body: dict[str, Any] | str) -> None:
    """Atomically: a temporary file renamed over the name, fsynced. The temporary
    name is a fresh one (mkstemp, O_EXCL): the folder is shared by every host, and
    two hosts' hands may have the same pid."""
    data = (body if isinstance(body, str)
            else json.dumps(body, separators=(",", ":"), sort_keys=True)).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=d)
    try:
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(d, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _newest(base: str, after: int) -> int | None:
    """The highest restart number in ``base`` above ``after`` (at most MAX_NAMES read)."""
    best = None
    try:
        with os.scandir(base) as it:
            for i, e in enumerate(it):
                if i >= MAX_NAMES:
                    break
                m = _NAME.fullmatch(e.name)
                if m and int(m.group(1)) > after and (best is None or int(m.group(1)) > best):
                    best = int(m.group(1))
    except OSError:
        return None
    return best


def _restart(base: str, gen: int) -> dict[str, Any]:
    d = os.path.join(base, f"restart-{gen:08d}")
    claims: list[dict[str, Any]] = []
    shared: list[dict[str, Any]] = []
    try:
        with os.scandir(d) as it:
            for e in it:
                for pattern, into in ((_CLAIM, claims), (_STACKS, shared)):
                    if pattern.fullmatch(e.name) and len(into) < MAX_CLAIMS:
                        c = read(os.path.join(d, e.name))
                        if c is not None:
                            into.append(c)
    except OSError:
        pass
    return {"gen": gen, "decision": read(os.path.join(d, "decision.json")), "claims": claims,
            "stacks": shared}


def _make(base: str, d: str, decision: dict[str, Any]) -> bool:
    """Restart folder ``d`` made with its decision in it, or False: another host's
    was there first. Made aside and renamed into place, so that it never shows
    without its decision: made in place and then written, a host that lost the race
    read it in between (the write's fsync, on a loaded host) and, finding no
    decision, restarted with no record of it (its incident not the group's)."""
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(d)}.", suffix=".tmp", dir=base)
    try:
        os.chmod(tmp, 0o755)
        write(tmp, "decision.json", decision)
        try:
            os.rename(tmp, d)  # over an empty folder only: never over another's decision
            return True
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return False
    finally:
        if os.path.isdir(tmp):
            with contextlib.suppress(OSError):
                for name in os.listdir(tmp):
                    os.unlink(os.path.join(tmp, name))
                os.rmdir(tmp)


def begin_in_hand(root: str, gen: int, host: str, decision: dict[str, Any],
                  claim: dict[str, Any] | None, scope: str | None = None) -> dict[str, Any]:
    """Restart ``gen`` (of ``scope``): made here (``won``) with this decision, or
    made already by another host (its record comes back); this host's claim added
    either way. The tracker is written in ``<root>/.trainwatch`` in any scope."""
    base = folder(root, scope)
    os.makedirs(base, mode=0o755, exist_ok=True)
    d = os.path.join(base, f"restart-{gen:08d}")
    won = _make(base, d, {**decision, "host": host, "gen": gen})
    if won:
        path = decision.get("resume_path")
        write(folder(root), TRACKER, f"{path if isinstance(path, str) else ''}\n")
    if claim is not None:
        write(d, f"claim-{host}.json", {**claim, "host": host})
    return {"won": won, **_restart(base, gen)}


def claim_in_hand(root: str, gen: int, host: str, claim: dict[str, Any],
                  scope: str | None = None) -> None:
    """This host saw a fault of its own in restart ``gen``, made by another."""
    d = os.path.join(folder(root, scope), f"restart-{gen:08d}")
    if os.path.isdir(d):
        write(d, f"claim-{host}.json", {**claim, "host": host})


def stacks_in_hand(root: str, gen: int, host: str, ranks: list[dict[str, Any]],
                   scope: str | None = None) -> None:
    """This host's ranks' stacks (multihost/stackshare.py), taken in restart ``gen``."""
    d = os.path.join(folder(root, scope), f"restart-{gen:08d}")
    if os.path.isdir(d):
        write(d, f"stacks-{host}.json", {"host": host, "ranks": ranks})


def newest_in_hand(root: str, after: int, scope: str | None = None) -> dict[str, Any] | None:
    """The newest restart of ``scope`` above ``after``, or None."""
    base = folder(root, scope)
    gen = _newest(base, after)
    return None if gen is None else _restart(base, gen)


def decision_after(base: str, after: int) -> dict[str, Any] | None:
    """The newest restart's decision above ``after`` in ``base`` (the client's
    side: TRAINWATCH_GROUP_DIR, TRAINWATCH_GROUP_GEN), or None."""
    gen = _newest(base, after)
    if gen is None:
        return None
    return read(os.path.join(base, f"restart-{gen:08d}", "decision.json"))


def call(r: Holder, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in the job's quick hand, as its user; None (said) when it fails."""
    from trainwatch.privsep.hand import HandError  # the daemon's side only: see above

    try:
        return answered(r, fn, *args)
    except HandError as e:
        _said(r, e)
        return None


def answered(r: Holder, fn: Any, *args: Any) -> Any:
    """As ``call``, but a hand that did not answer (down, timed out, aborted) raises:
    the caller waits for it (decision.py). One that answered a failure is said: None."""
    from trainwatch.privsep.hand import HandAborted, HandDown, HandError, HandTimeout

    try:
        return r.hands.quick.call(fn, *args, timeout=TIMEOUT)
    except (HandDown, HandTimeout, HandAborted):
        raise
    except HandError as e:
        _said(r, e)
        return None


def _said(r: Holder, e: Exception) -> None:
    log.error("job %s: the group's records in %s: %s", r.job.name,
              folder(r.job.checkpoints.dir or "?"), e)


def current_in_hand(root: str, scope: str | None = None) -> int:
    """The newest restart's number (of ``scope``), 0 when there is none."""
    return _newest(folder(root, scope), 0) or 0


@dataclass(frozen=True)
class Restart:
    """One group restart as root believes it: every field checked."""

    gen: int
    host: str  # the host that made it
    resume_step: int | None
    resume_path: str | None
    skip: tuple[int, int] | None
    kind: str  # the fault's, where the restart began
    began_host: str
    began_rank: int | None
    began_at: float | None  # wall time of the earliest claim
    charged: bool = True  # to the budget (False: a rollback's widening, a join)
    # A host whose GPUs failed leaves the group; it joins again after its
    # pre-flight (multihost/leave.py).
    leaves: str | None = None
    joins: str | None = None
    # Every host's claim, earliest first: (host, kind, rank, wall time).
    claims: tuple[tuple[str, str, int | None, float], ...] = ()
    # Every host's shared stack lines (host, line), as stackshare.judge takes them.
    stacks: tuple[tuple[str, dict[str, Any]], ...] = ()
    # The newest step any claiming host's ranks had reached: steps lost are counted
    # from it on every host (a host whose rank stopped early counted from its own).
    reached: int | None = None

    def claimed(self) -> list[dict[str, object]]:
        """The claims as an incident records them."""
        return [{"host": h, "kind": k, "rank": rk, "at": round(t, 3)}
                for h, k, rk, t in self.claims]

    @property
    def began(self) -> str:
        rank = f" rank {self.began_rank}" if self.began_rank is not None else ""
        return f"{self.began_host}{rank}"


def _str(x: object, n: int = 256) -> str | None:
    return x if isinstance(x, str) and len(x) <= n else None  # never a cut path


_HOST = re.compile(r"[A-Za-z0-9._-]{1,64}")  # as config's host: (fields.HOST_RE)


def host_of(x: object) -> str | None:
    """A host's name as config takes one: a record's is the user's text (a newline in
    it made a line of root's log of its own)."""
    return x if isinstance(x, str) and _HOST.fullmatch(x) else None


_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")  # a fault kind's name (types.FaultKind)


def _kind(x: object) -> str | None:
    return x if isinstance(x, str) and _KIND.fullmatch(x) else None


def _int(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 else None


def _time(x: object) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None  # type: ignore[arg-type]


def _shared(raw: object) -> tuple[tuple[str, dict[str, Any]], ...]:
    out: list[tuple[str, dict[str, Any]]] = []
    for s in raw if isinstance(raw, list) else []:
        host = host_of(s.get("host")) if isinstance(s, dict) else None
        ranks = s.get("ranks") if isinstance(s, dict) else None
        if host is not None and isinstance(ranks, list):
            out += [(host, line) for line in ranks[:64] if isinstance(line, dict)]
    return tuple(out)


def parse(raw: object) -> Restart | None:
    """A restart read in the hand, as root believes it; None without a decision."""
    if not isinstance(raw, dict):
        return None
    gen, decision = _int(raw.get("gen")), raw.get("decision")
    if gen is None or not isinstance(decision, dict):
        return None
    skip = decision.get("skip")
    window = None
    if isinstance(skip, list) and len(skip) == 2 and all(_int(s) is not None for s in skip):
        window = (int(skip[0]), int(skip[1]))
    host = host_of(decision.get("host")) or "?"
    claims = [c for c in raw.get("claims") or [] if isinstance(c, dict)]
    claims = [c for c in claims if _time(c.get("at")) is not None]
    # A claim of a rank that failed because another did is no place to begin.
    causes = [c for c in claims if c.get("victim") is not True] or claims
    first = min(causes, key=lambda c: _time(c.get("at")) or 0.0) if causes else decision
    return Restart(
        gen=gen, host=host,
        resume_step=_int(decision.get("resume_step")),
        resume_path=_str(decision.get("resume_path"), 4096),
        skip=window,
        kind=_kind(first.get("kind")) or _kind(decision.get("kind")) or "?",
        began_host=host_of(first.get("host")) or host,
        began_rank=_int(first.get("rank")),
        began_at=_time(first.get("at")),
        charged=decision.get("charged") is not False,
        stacks=_shared(raw.get("stacks")),
        leaves=host_of(decision.get("leaves")),
        joins=host_of(decision.get("joins")),
        reached=max((n for c in claims if (n := _int(c.get("reached"))) is not None),
                    default=None),
        claims=tuple(sorted(
            ((host_of(c.get("host")) or "?", _kind(c.get("kind")) or "?",
              _int(c.get("rank")), _time(c.get("at")) or 0.0) for c in claims),
            key=lambda c: c[3])),
    )
