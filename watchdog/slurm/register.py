"""The daemon's side of a rank's ``attach`` request: a ``Registry`` proves the
rank's claim (proof.py) off the daemon's loop and answers the rank when the
proof is in (DESIGN.md "Jobs across hosts"; the attach plan, "Registration").

A proof runs ``scontrol`` twice, each under Slurm's deadline, so ``answer`` (on
the daemon's loop) never waits for it: the first request submits the proof to a
pool of threads the registry owns and is answered ``{"pending": True, "retry":
0.2}``; the client sends the same request again until the answer is in:

- proven: ``{"proven": True, "pending": False, <the Proven's fields>}`` (job,
  step, rank, node, pid, uid, task_pid, local_id, restarts); cached.
- refused: ``access.Refused("<check>: <why>")``, the proof's own line (the
  control socket puts ``attach: `` before it, as before every op's error);
  cached.
- failed (Slurm gave no usable answer, or the proof raised): a reply, not an
  exception, so that the client can tell "try again" from "no":
  ``{"proven": False, "pending": False, "error": "attach: <check>: <why>",
  "retry": 1.0}``. Given once and not cached: the next request proves again.

A request is keyed by the peer's pid, its start time (``/proc/<pid>/stat``: a
pid taken by a new process is another key, so it never gets the old process's
answer), its uid and the claim. Bounds: at most ``PENDING_MAX`` proofs pending
in all and ``PENDING_PER_UID`` per uid (over them: a failure's reply, "too many
pending claims", so that the client asks again); answers cached ``TTL``
seconds, at most ``CACHE_MAX`` of them and ``CACHE_PER_UID`` of one uid's (a
uid's flood of claims pushes out only its own), expired ones dropped on each request.
Each kind of answer is counted in ``counts`` and the first of each kind is logged.

Not thread-safe: ``answer`` and ``close`` run on the daemon's loop; the pool's
threads run only ``prove`` and read ``/proc``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from trainwatch.actions import tree
from trainwatch.privsep.access import Peer, Refused
from trainwatch.slurm import actions, proof
from trainwatch.slurm.command import Outcome, Result, Slurm
from trainwatch.slurm.proof import Claim, Proven

log = logging.getLogger("trainwatch")

PENDING_MAX = 64  # proofs pending at once, in all
PENDING_PER_UID = 32  # proofs pending at once for one uid (16 ranks a node, two jobs)
TTL = 30.0  # seconds a proven or refused answer is kept
CACHE_MAX = 1024  # answers kept; the oldest are dropped past it
CACHE_PER_UID = 64  # answers kept for one uid; its oldest are dropped past it
RETRY = 0.2  # seconds the client waits before it asks again for a pending proof
FAILED_RETRY = 1.0  # seconds the client waits before it asks again after a failure
FIELDS = ("job", "step", "rank")  # of a claim: SLURM_JOB_ID, SLURM_STEP_ID, SLURM_PROCID
KINDS = ("proven", "refused", "failed", "capped", "cached")

Prove = Callable[[Claim, int, int, str], Result[Proven]]
"""proof.prove with its Slurm bound: (claim, peer pid, peer uid, node) -> Result."""
Key = tuple[int, int, int, Claim]  # the peer's pid, start time and uid, and its claim

__all__ = ["CACHE_MAX", "CACHE_PER_UID", "KINDS", "PENDING_MAX", "PENDING_PER_UID", "TTL",
           "Prove", "Registry", "parse_claim", "prover"]


def prover(slurm: Slurm = actions.DEFAULT, proc: str = "/proc") -> Prove:
    """The real ``prove`` for a Registry: proof.prove against `slurm`."""
    return functools.partial(proof.prove, slurm=slurm, proc=proc)


def parse_claim(args: dict[str, Any]) -> Claim:
    """The claim of an attach request's args; ValueError (one line) when it is
    not one. Other keys (checkpoints_dir, gpus, argv0) are not read here."""
    missing = [name for name in FIELDS if name not in args]
    if missing:
        raise ValueError(f"the claim lacks {', '.join(missing)} "
                         "(SLURM_JOB_ID, SLURM_STEP_ID, SLURM_PROCID)")
    claim = Claim(args["job"], args["step"], args["rank"])
    if problem := proof.bad_claim(claim):
        raise ValueError(f"not a claim: {problem}")
    return claim


class Registry:
    """Proves attach claims in a thread pool and answers each rank from the loop.

    ``prove`` is proof.prove with its Slurm bound (``prover(slurm)``); tests pass
    their own. ``start_time`` reads a pid's start time (``/proc/<pid>/stat``).
    ``counts``: proofs "proven", "refused" (and peers that exited before their
    claim was read), "failed"; requests "capped"; answers given again from the
    cache, "cached"."""

    def __init__(self, node: str, prove: Prove, clock: Callable[[], float] = time.monotonic,
                 workers: int = 4,
                 start_time: Callable[[int], int | None] = tree.start_time) -> None:
        self.node = node
        self.prove = prove
        self.clock = clock
        self.start_time = start_time
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        # Daemon threads over a queue, not a ThreadPoolExecutor: its threads are
        # joined at exit, and a proof stuck in scontrol would hold the daemon's.
        self._queue: queue.SimpleQueue[tuple[Key, Future[Result[Proven]]] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._work, name="trainwatch-attach",
                                          daemon=True) for _ in range(workers)]
        for t in self._threads:
            t.start()
        self._pending: dict[Key, Future[Result[Proven]]] = {}
        # Finished proofs: (expiry, result, told already), oldest first.
        self._answers: dict[Key, tuple[float, Result[Proven], bool]] = {}
        self._logged: set[str] = set()
        self._closed = False

    def answer(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """The reply to one attach request; never waits for Slurm. Raises
        ValueError for a malformed claim, Refused for a refused one or when
        the caps are reached."""
        if self._closed:
            raise ValueError("not taken: the daemon is stopping")
        claim = parse_claim(args)
        now = self.clock()
        self._collect(now)
        start = self.start_time(peer.pid)
        if start is None:
            self._count("refused", logging.WARNING, "pid %d (%s) exited before its claim "
                        "was read", peer.pid, peer)
            raise Refused(f"peer: pid {peer.pid} has exited")
        key: Key = (peer.pid, start, peer.uid, claim)
        if key in self._answers:
            expiry, result, told = self._answers[key]
            if result.outcome is Outcome.FAILED:
                del self._answers[key]  # a failure is told once, then proved again
            else:
                self._answers[key] = (expiry, result, True)
                if told:
                    self.counts["cached"] += 1
            return self._reply(result)
        if key not in self._pending and (capped := self._submit(key, peer)) is not None:
            return capped
        return {"pending": True, "retry": RETRY}

    def pending(self) -> int:
        """How many proofs are pending (queued or running)."""
        return sum(1 for f in self._pending.values() if not f.done())

    def close(self) -> None:
        """Stop taking requests; queued proofs are cancelled, running ones are not
        waited for (each ends within its Slurm deadlines)."""
        self._closed = True
        for future in self._pending.values():
            future.cancel()  # a queued one never starts; a running one ends on its own
        for _ in self._threads:
            self._queue.put(None)
        self._pending.clear()
        self._answers.clear()

    # --- the loop's side ------------------------------------------------------

    def _submit(self, key: Key, peer: Peer) -> dict[str, Any] | None:
        mine = sum(1 for k in self._pending if k[2] == peer.uid)
        if len(self._pending) >= PENDING_MAX or mine >= PENDING_PER_UID:
            limit = (f"{PENDING_MAX} in all" if len(self._pending) >= PENDING_MAX
                     else f"{PENDING_PER_UID} of uid {peer.uid}")
            self._count("capped", logging.WARNING, "claim of pid %d (%s) not taken: %s "
                        "pending already", peer.pid, peer, limit)
            # Not a "no": the client asks again, and a node's later ranks get in.
            return {"proven": False, "pending": False, "retry": FAILED_RETRY,
                    "error": f"attach: too many pending claims ({limit} already)"}
        future: Future[Result[Proven]] = Future()
        self._pending[key] = future
        self._queue.put((key, future))
        return None

    def _collect(self, now: float) -> None:
        """Drop expired answers; take in finished proofs (counted once each, asked
        for again or not), so neither the caps nor memory hold on to them."""
        while self._answers:
            oldest = next(iter(self._answers))
            if self._answers[oldest][0] > now:
                break
            del self._answers[oldest]
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            result = self._settle(key, future)
            mine = [k for k in self._answers if k[2] == key[2]]
            if len(mine) >= CACHE_PER_UID:  # one uid's many claims push out only its own
                del self._answers[mine[0]]
            self._answers[key] = (now + TTL, result, False)
        while len(self._answers) > CACHE_MAX:
            del self._answers[next(iter(self._answers))]

    def _settle(self, key: Key, future: Future[Result[Proven]]) -> Result[Proven]:
        """A finished proof's Result, counted and (the first of its kind) logged."""
        pid, _, uid, claim = key
        result = future.result()  # _prove never raises; a cancelled one was cleared
        if result.outcome is Outcome.OK:
            self._count("proven", logging.INFO, "pid %d (uid %d) is rank %d of job %d step "
                        "%d on %s", pid, uid, claim.rank, claim.job, claim.step, self.node)
        elif result.outcome is Outcome.REFUSED:
            self._count("refused", logging.WARNING, "pid %d (uid %d) claimed %s: %s", pid,
                        uid, claim, result.message)
        else:
            self._count("failed", logging.WARNING, "the claim of pid %d (uid %d) could not be "
                        "proved: %s", pid, uid, result.message)
        return result

    def _reply(self, result: Result[Proven]) -> dict[str, Any]:
        if result.outcome is Outcome.REFUSED:
            raise Refused(result.message)
        if result.outcome is Outcome.FAILED or result.value is None:
            return {"proven": False, "pending": False, "error": f"attach: {result.message}",
                    "retry": FAILED_RETRY}
        return {"proven": True, "pending": False, **dataclasses.asdict(result.value)}

    def _count(self, kind: str, level: int, msg: str, *args: object) -> None:
        self.counts[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.log(level, "attach: " + msg + " (the first %s claim: later ones are counted, "
                    "not logged)", *args, kind)

    # --- the pool's side ------------------------------------------------------

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            key, future = item
            if future.set_running_or_notify_cancel():  # False: cancelled by close()
                future.set_result(self._prove(key))

    def _prove(self, key: Key) -> Result[Proven]:
        """Runs in the pool: the proof of one request, refused if the peer's pid
        has been taken by another process by the end (the key's start time is
        the process that asked). Never raises: an error is a failure."""
        pid, start, uid, claim = key
        try:
            result = self.prove(claim, pid, uid, self.node)
        except Exception as e:  # a bug in prove must not leave the rank pending
            log.exception("attach: proving the claim of pid %d failed", pid)
            return Result(Outcome.FAILED, f"claim: the proof raised {type(e).__name__}: {e}")
        if result.outcome is Outcome.OK and result.value is None:
            return Result(Outcome.FAILED, "claim: the proof held but gave no Proven")
        if result.outcome is Outcome.OK and result.value is not None \
                and (result.value.start != start or self.start_time(pid) != start):
            return Result(Outcome.REFUSED, f"peer: pid {pid} exited or was replaced while "
                          "its claim was checked")
        return result
