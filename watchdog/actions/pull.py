"""Pulling a snapshot from the job's remote store (``checkpoints.remote``)
before a launch: the newest one when no good checkpoint is on local disk (a
relaunch on a fresh host), or the step an operator's rollback names when only
the remote holds it.

The pull (trainwatch.snapshot.remote.pull: fsspec, claims capped, hashes
checked, the newest intact snapshot published into ``checkpoints.dir`` through
staging) runs in a hand of the job's own (privsep): a process as the job's
user, in the job's environment, so that it reaches the remote with the
credentials the job's own uploads use (its ``env:``, its user's HOME), never
the daemon's, and writes in the job's folder with the job's rights (what it
makes is the job's; nothing is chowned, a link planted there is the user's to
follow). A thread waits for it, so the supervisor's loop never waits on the
network: the launch waits in BACKOFF, polled, as it waits for a verification
(actions/verify.py).

A pull that fails (or a remote that cannot be listed) never lets a run start
fresh over a remote that may hold snapshots: its uploads would replace some of
the old run's manifests and leave the rest, two runs mixed in one prefix.
``checkpoints.on_pull_failure`` says what happens instead: ``stop`` (the
default) makes the job fatal with one loud line and the exec hook (kind
``pull_failed``); ``retire`` retires the remote's manifests (renamed
``*.json.retired``, chunks kept) and then starts fresh, said loudly, or stops
when the retirement fails too. A rollback whose pull failed resumes from the
newest good local checkpoint before its step when there is one. fsspec and
s3fs are imported only in that thread: a daemon without remotes never loads them.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainwatch.actions import hook, jobenv
from trainwatch.privsep import credentials
from trainwatch.privsep.hand import Hand, HandError, HandTimeout, OpFailed
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

# A pull is the network's pace: bounded all the same (a hand that hangs is killed).
PULL_TIMEOUT = 6 * 3600.0
# What the pull's hand imports before it drops to the job's user, who may not be
# able to read our install. fsspec.implementations.chained: url_to_fs imports it at
# every call, never at fsspec's import (a clean 0700 clone failed every pull and
# listing as the job's user before it reached the remote, unless the daemon had
# happened to import it itself).
PRELOAD = ("trainwatch.snapshot.remote", "trainwatch.snapshot.fetch", "fsspec",
           "fsspec.implementations.chained", "s3fs", "aiobotocore.session",
           "botocore.session", "aiohttp", "certifi", "zstandard", "xml.etree.ElementTree",
           "email.utils", "http.client", "ssl", "hmac", "uuid")

POLL = 0.1  # how often a launch waiting for a pull looks again
# Where the launch cannot wait in BACKOFF (an operator's start of a PAUSED job):
# the loop waits at most this long, as it does for a verification.
WAIT_MAX = 60.0
# An operator's rollback to a step not on local disk: the loop waits at most this
# long for the remote's listing, so that a step it lacks is refused before the job
# is touched (one request; a hung network costs the operator's command, bounded).
LIST_MAX = 10.0
# The listing's hand starts first (a fork, the imports above, the drop to the job's
# user: seconds on a loaded host), bounded apart: LIST_MAX is the remote's alone.
START_MAX = 10.0


@dataclass
class Pull:
    url: str
    root: str
    step: int | None  # None: the newest on the remote
    reason: str  # the launch's, kept across the wait in BACKOFF
    ident: credentials.Identity | None = None  # the job's user (None: as we run)
    # The environment whose credentials reach the remote: the job's.
    env: dict[str, str] | None = field(default=None, repr=False)
    # Failed, the launch would start fresh (no good local checkpoint to fall back
    # on), and checkpoints.on_pull_failure is retire: retire the remote's manifests.
    retire: bool = False
    result: str | None = None  # the local folder pulled; None: the remote holds none
    skipped: tuple[tuple[int, str], ...] = ()  # newer snapshots skipped as damaged
    error: str | None = None
    retired: list[int] | None = None  # the steps retired after a failure
    retire_error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)
    refused: str | None = None  # why it may not run at all (its user not resolved)
    hand: Hand | None = field(default=None, repr=False)
    # Set by cancel: also before the hand is forked, when there is no socket to shut.
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="trainwatch-pull", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.refused is not None:
            self.error = self.refused
            return
        hand = self.hand = Hand(f"pull of {self.root}", self.ident, env=self.env,
                                preload=PRELOAD)
        try:
            if self.cancelled.is_set():
                raise HandError("cancelled before it began")
            # should_stop: a cancel that came before the fork (abort had no socket to
            # shut) still ends the call, within the hand's poll.
            got = hand.call(pull_in_hand, self.url, self.root, self.step, self.retire,
                            timeout=PULL_TIMEOUT, should_stop=self.cancelled.is_set)
        except HandError as e:
            self.error = f"no answer as the job's user: {e}"
            return
        finally:
            hand.close()
        if not isinstance(got, dict):
            self.error = "the job's hand answered nonsense"
            return
        result, skipped = got.get("result"), got.get("skipped")
        self.result = result if isinstance(result, str) else None
        self.skipped = tuple((int(x[0]), str(x[1])[:300]) for x in skipped
                             if isinstance(x, list) and len(x) == 2 and isinstance(x[0], int)
                             ) if isinstance(skipped, list) else ()
        for name in ("error", "retire_error"):
            v = got.get(name)
            setattr(self, name, str(v)[:300] if v is not None else None)
        retired = got.get("retired")
        self.retired = [int(x) for x in retired if isinstance(x, int)] \
            if isinstance(retired, list) else None

    def cancel(self) -> None:
        """Its job is gone (removed by a reload, the daemon stopping): the pull's
        hand ends now rather than pull on for hours into an unwatched folder."""
        self.cancelled.set()
        if self.hand is not None:
            self.hand.abort()

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    @property
    def what(self) -> str:
        return "the newest snapshot" if self.step is None else f"the snapshot of step {self.step}"


def pull_in_hand(url: str, root: str, step: int | None, retire: bool) -> dict[str, Any]:
    """In the job's hand, as its user, in its environment: the pull, and (failed,
    ``retire`` set) the remote's retirement. A fresh host's checkpoint folder is
    made here, the job's from the start."""
    from trainwatch.snapshot import remote

    out: dict[str, Any] = {"result": None, "skipped": [], "error": None, "retired": None,
                           "retire_error": None}
    env = dict(os.environ)
    try:
        os.makedirs(root, exist_ok=True)
        got = remote.pull(url, root, step, env)
        out["result"], out["skipped"] = got.folder, [list(x) for x in got.skipped]
    except Exception as e:  # anything from the network or the store: one line
        out["error"] = _one_line(e)
    if out["error"] is None or not retire:
        return out
    try:
        out["retired"] = remote.retire(url, env)
    except Exception as e:  # the same: one line, and the job stops
        out["retire_error"] = _one_line(e)
    return out


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def steps_in_hand(url: str) -> list[int]:
    """In the job's hand, as its user, in its environment: the remote's steps."""
    from trainwatch.snapshot import remote

    return remote.steps(url, dict(os.environ))


def steps(url: str, timeout: float = LIST_MAX, env: dict[str, str] | None = None,
          ident: credentials.Identity | None = None) -> list[int]:
    """The steps of the snapshots ``url`` holds, listed in a hand as ``ident`` (the
    job's user) in ``env`` (its environment: its credentials, its HOME), as the
    pull is: botocore reads the config files ``env`` names and runs a
    ``credential_process`` written there, which must never run as root. At most
    ``timeout`` once the hand serves (its start has START_MAX of its own); a
    ValueError of one line when it cannot."""
    hand = Hand(f"listing of {url}", ident, env=env, preload=PRELOAD)
    try:
        try:
            hand.start(START_MAX)
        except HandTimeout:
            raise ValueError(f"cannot list the snapshots of {url}: no hand as the job's user "
                             f"within {START_MAX:g}s") from None
        got = hand.call(steps_in_hand, url, timeout=timeout)
    except HandTimeout:
        raise ValueError(f"{url} did not list its snapshots within {timeout:g}s") from None
    except OpFailed as e:
        said = f"{e.kind}: {e.text}".splitlines()[0][:300]
        raise ValueError(f"cannot list the snapshots of {url}: {said}") from None
    except HandError as e:
        raise ValueError(f"cannot list the snapshots of {url}: no answer as the job's "
                         f"user: {e}") from None
    finally:
        hand.close()
    if not isinstance(got, list):
        raise ValueError(f"cannot list the snapshots of {url}: the job's hand answered nonsense")
    return sorted({s for s in got if isinstance(s, int)})


# The pull a job's launch waits for (a weak map: no field on the runner for it).
_pulls: weakref.WeakKeyDictionary[Runner, Pull] = weakref.WeakKeyDictionary()


# The attempt number each job last pulled the newest snapshot for: once per
# launch, so that a pulled snapshot judged bad is not pulled again and again.
_tried: weakref.WeakKeyDictionary[Runner, int] = weakref.WeakKeyDictionary()


def cancel(r: Runner) -> None:
    """The job's runner closes: its pull, if one is under way, ends."""
    p = _pulls.pop(r, None)
    if p is not None:
        p.cancel()


def pending(r: Runner) -> bool:
    return r in _pulls


def newest(r: Runner, reason: str) -> None:
    """No good checkpoint on local disk: pull the newest remote snapshot, once
    per launch."""
    if r.job.checkpoints.remote is None or _tried.get(r) == r.number:
        return
    _tried[r] = r.number
    begin(r, None, reason)


def job_ident(r: Runner) -> credentials.Identity | None:
    """The job's user (None: it names none and runs as we do). A ValueError when it
    names one that cannot be resolved now (a user removed, a directory service
    down): never root's rights instead, in a folder that user may write."""
    try:
        return credentials.resolve(r.job.user, r.job.group)
    except (KeyError, OSError) as e:
        who = r.job.user if r.job.user is not None else f"group {r.job.group}"
        raise ValueError(f"cannot resolve the job's user {who}: {e}") from None


def environment(r: Runner, ident: credentials.Identity | None = None) -> dict[str, str]:
    """The environment the job's attempts get, but trainwatch's own variables:
    whose AWS credentials, endpoint and HOME its uploads use (actions/jobenv.py)."""
    if ident is None:
        ident = job_ident(r)
    env = jobenv.base(r.job, ident, r.die_with_parent, os.environ)
    env.update(r.job.env)
    return env


def begin(r: Runner, step: int | None, reason: str) -> None:
    """Start pulling (no-op when a pull is already under way for ``r``)."""
    spec = r.job.checkpoints
    if r in _pulls or spec.remote is None or spec.dir is None:
        return
    refused: str | None = None
    try:
        ident = job_ident(r)
        env: dict[str, str] | None = environment(r, ident)
    except ValueError as e:  # the pull fails, as one that could not reach the remote
        ident, env, refused = None, None, str(e)
    # Failed, would the launch start fresh? Always for the newest; for a rollback's
    # step, when no good local checkpoint before it is there to resume from.
    fresh = step is None or r.catalog.last_good(before_step=step, fresh=False) is None
    p = Pull(spec.remote, r.catalog.spec.dir or spec.dir, step, reason, ident, env,
             fresh and spec.on_pull_failure == "retire", refused=refused)
    log.info("job %s: pulling %s from %s", r.job.name, p.what, spec.remote)
    p.start()
    _pulls[r] = p


def wait(r: Runner, reason: str) -> str | None:
    """The launch's turn: None while the pull runs (the launch is retried
    shortly, the job waiting in BACKOFF); else the launch's reason, once the
    pull is done and its outcome said."""
    p = _pulls.get(r)
    if p is None:
        return reason
    if not p.done and r.state is not None and r.state is not JobState.BACKOFF:
        # An operator's start of a PAUSED job (PAUSED -> BACKOFF is not a transition).
        assert p.thread is not None
        p.thread.join(WAIT_MAX)
    if not p.done:
        if r.state is None:  # the first launch: it waits for the pull like a relaunch
            r.to(JobState.BACKOFF, f"{reason}: waiting for {p.what} from {p.url}")
        if r.state is JobState.BACKOFF:
            r.relaunch_at = r.clock() + POLL
            return None
        # Never launched fresh meanwhile: its uploads would go over the remote's
        # snapshots. The pull goes on; the operator's next start finds it on disk.
        log.error("job %s: %s from %s not pulled in %gs: not launching (the job stays %s); "
                  "start it again once the pull is done", r.job.name, p.what, p.url, WAIT_MAX,
                  r.state.value if r.state else "-")
        return None
    del _pulls[r]
    if p.error is not None:
        return _failed(r, p)
    if p.result is None:
        log.warning("job %s: %s holds no %s: %s", r.job.name, p.url,
                    "snapshot" if p.step is None else f"snapshot of step {p.step}",
                    "starting fresh" if p.step is None else "resuming from the newest good "
                    "checkpoint before it")
    elif p.skipped:
        said = "; ".join(f"step {s}: {why}" for s, why in p.skipped)
        log.warning("job %s: pulled an older snapshot from %s into %s: the newer one(s) are "
                    "damaged (%s)", r.job.name, p.url, p.result, said)
    else:
        log.info("job %s: pulled %s from %s into %s", r.job.name, p.what, p.url, p.result)
    return p.reason


def _failed(r: Runner, p: Pull) -> str | None:
    """The pull failed: the launch's reason when it may go on (from an older local
    checkpoint, or fresh over a remote whose manifests were just retired); None
    when the job stops instead of starting fresh over the remote's snapshots."""
    name, spec = r.job.name, r.job.checkpoints
    if p.step is not None and r.catalog.last_good(before_step=p.step, fresh=False) is not None:
        log.error("job %s: pulling %s from %s failed (%s): resuming from the newest good "
                  "checkpoint before step %d", name, p.what, p.url, p.error, p.step)
        return p.reason
    r.events.fresh_starts.labels(name).inc()
    if p.retired is not None:
        log.error("job %s: pulling %s from %s failed (%s); checkpoints.on_pull_failure is "
                  "retire: retired the remote's snapshots of steps %s (renamed *.json.retired, "
                  "chunks kept): starting fresh", name, p.what, p.url, p.error,
                  p.retired or "none")
        return p.reason
    why = f"pulling {p.what} from {p.url} failed ({p.error})"
    if p.retire_error is not None:
        why += f"; retiring its snapshots failed too ({p.retire_error})"
    why += (": not starting fresh over a remote that may hold snapshots (checkpoints."
            f"on_pull_failure: {spec.on_pull_failure}; fix the remote or its credentials in "
            "the job's env, or set it to retire to start over)")
    log.error("job %s: %s", name, why)
    _tried.pop(r, None)  # an operator's start tries the pull again
    hook.run(r.policy.exec, r.job.name, "pull_failed", None, r.umask)
    if r.state is None or r.state is JobState.BACKOFF:
        r.to(JobState.FATAL, why)
    return None
