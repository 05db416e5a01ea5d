"""trainwatch.slurm.register: the daemon's side of a rank's attach request. A real
thread pool runs an injected ``prove`` that waits on an Event the test opens and
returns real Result and Proven objects; the peers are this test process (or a
real child process), read in the real /proc."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from trainwatch.actions import tree
from trainwatch.privsep.access import Peer, Refused
from trainwatch.slurm import register
from trainwatch.slurm.command import Outcome, Result
from trainwatch.slurm.proof import Claim, Proven
from trainwatch.slurm.register import Registry, parse_claim, prover

NODE = "node-a"
WAIT = 30.0  # seconds a poll may take on a busy machine before the test fails
ARGS = {"job": 42, "step": 0, "rank": 3}


def until(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll `check` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout:g}s: {what}")


class Prover:
    """A prove() that blocks until `gate` is set, then answers with `outcome`
    (OK: a Proven for the claim; else a Result with `message`)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[tuple[Claim, int, int, str]] = []
        self.outcome = Outcome.OK
        self.message = ""
        self.error: Exception | None = None
        self.start_of: Callable[[int], int | None] = tree.start_time
        self._lock = threading.Lock()

    def __call__(self, claim: Claim, pid: int, uid: int, node: str) -> Result[Proven]:
        with self._lock:
            self.calls.append((claim, pid, uid, node))
        self.gate.wait()
        if self.error is not None:
            raise self.error
        if self.outcome is not Outcome.OK:
            return Result(self.outcome, self.message)
        start = self.start_of(pid) or 0  # the proof's own read, as the kernel says now
        return Result(Outcome.OK, f"pid {pid} is rank {claim.rank}",
                      value=Proven(claim.job, claim.step, claim.rank, node, pid, uid,
                                   task_pid=pid - 1 if pid > 2 else pid, local_id=0,
                                   restarts=2, start=start, task_start=start))

    def count(self) -> int:
        with self._lock:
            return len(self.calls)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def prove() -> Prover:
    return Prover()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def shift() -> list[int]:
    """Added to every start time the registry reads: [1] says the kernel gave
    the pid to a new process."""
    return [0]


@pytest.fixture
def reg(prove: Prover, clock: Clock, shift: list[int]) -> Iterator[Registry]:
    def start_time(pid: int) -> int | None:
        start = tree.start_time(pid)
        return None if start is None else start + shift[0]

    prove.start_of = start_time
    r = Registry(NODE, prove, clock=clock, start_time=start_time)
    try:
        yield r
    finally:
        prove.gate.set()  # let the pool's threads end before the next test
        r.close()


def me(uid: int | None = None) -> Peer:
    """This test process as a control socket's sender (another uid: as another
    user's process would be keyed)."""
    return Peer(os.getpid(), os.getuid() if uid is None else uid, os.getgid(), None, False)


def settled(reg: Registry, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    """The answer once it is no longer pending (a refusal raises)."""
    def ask() -> dict[str, Any] | None:
        reply = reg.answer(args, peer)
        return None if reply.get("pending") else reply
    result: dict[str, Any] = until(ask, "the proof's answer")
    return result


def test_a_claim_is_pending_until_its_proof_is_in_then_proven_with_the_proofs_fields(
        reg: Registry, prove: Prover) -> None:
    """The first request and its repeats while the proof runs are answered pending
    (one proof runs); once it is in, the reply is proven with the Proven's fields."""
    assert reg.answer(ARGS, me()) == {"pending": True, "retry": register.RETRY}
    until(prove.count, "the proof started")
    assert reg.answer(dict(ARGS), me()) == {"pending": True, "retry": register.RETRY}
    assert prove.calls == [(Claim(42, 0, 3), os.getpid(), os.getuid(), NODE)]
    prove.gate.set()
    reply = settled(reg, ARGS, me())
    assert reply == {"proven": True, "pending": False, "job": 42, "step": 0, "rank": 3,
                     "node": NODE, "pid": os.getpid(), "uid": os.getuid(),
                     "task_pid": os.getpid() - 1, "local_id": 0, "restarts": 2,
                     "start": tree.start_time(os.getpid()),
                     "task_start": tree.start_time(os.getpid())}
    assert reg.answer(ARGS, me()) == reply
    assert prove.count() == 1
    assert reg.counts == {"proven": 1, "refused": 0, "failed": 0, "capped": 0, "cached": 1}


def test_a_refused_claim_raises_refused_with_the_proofs_line_and_is_cached(
        reg: Registry, prove: Prover) -> None:
    """A refusal raises access.Refused('<check>: ...'), and the same request
    again gets it from the cache without a second proof."""
    prove.outcome, prove.message = Outcome.REFUSED, "rank: pid 7's task is global id 1"
    prove.gate.set()
    reg.answer(ARGS, me())
    with pytest.raises(Refused, match=r"^rank: pid 7's task is global id 1$"):
        settled(reg, ARGS, me())
    with pytest.raises(Refused, match=r"^rank: "):
        reg.answer(ARGS, me())
    assert prove.count() == 1
    assert reg.counts["refused"] == 1 and reg.counts["cached"] == 1


def test_a_failure_is_told_once_not_cached_and_the_next_request_proves_again(
        reg: Registry, prove: Prover) -> None:
    """Slurm with no usable answer: the reply says so (not pending, an error, when
    to try again); the next request runs a new proof, which may hold."""
    prove.outcome, prove.message = Outcome.FAILED, "job: scontrol had no answer within 15s"
    prove.gate.set()
    reg.answer(ARGS, me())
    assert settled(reg, ARGS, me()) == {
        "proven": False, "pending": False, "retry": register.FAILED_RETRY,
        "error": "attach: job: scontrol had no answer within 15s"}
    prove.outcome = Outcome.OK
    assert reg.answer(ARGS, me())["pending"] is True
    assert settled(reg, ARGS, me())["proven"] is True
    assert prove.count() == 2
    assert reg.counts["failed"] == 1 and reg.counts["proven"] == 1


def test_a_proof_that_raises_is_a_failure_and_not_pending_forever(
        reg: Registry, prove: Prover) -> None:
    """An exception out of prove is answered as a failure naming it."""
    prove.error = OSError("no such file")
    prove.gate.set()
    reg.answer(ARGS, me())
    reply = settled(reg, ARGS, me())
    assert reply["proven"] is False and "OSError: no such file" in reply["error"]
    assert reg.counts["failed"] == 1


@pytest.mark.parametrize(("args", "says"), [
    ({"step": 0, "rank": 3}, "lacks job"),
    ({"job": 42}, "lacks step, rank"),
    ({**ARGS, "job": True}, "job id"),
    ({**ARGS, "job": 0}, "job id"),
    ({**ARGS, "job": 1 << 40}, "job id"),
    ({**ARGS, "job": "42"}, "job id"),
    ({**ARGS, "step": -1}, "step"),
    ({**ARGS, "step": 1 << 32}, "step"),
    ({**ARGS, "rank": False}, "rank"),
    ({**ARGS, "rank": 3.0}, "rank"),
    ({**ARGS, "rank": [3]}, "rank"),
    ({**ARGS, "rank": 10 ** 30}, "rank"),
])
def test_a_malformed_claim_is_one_value_error_line_and_proves_nothing(
        reg: Registry, prove: Prover, args: dict[str, Any], says: str) -> None:
    """A field missing, a bool, a negative, a huge or a non-int one: ValueError,
    one line (the control socket puts 'attach: ' before it), and no proof is run."""
    with pytest.raises(ValueError, match=r"^[^\n]*" + says) as e:
        reg.answer(args, me())
    assert "\n" not in str(e.value)
    assert prove.count() == 0 and reg.pending() == 0


def test_parse_claim_ignores_the_optional_keys() -> None:
    """checkpoints_dir, gpus and argv0 ride along with a claim and do not change it."""
    assert parse_claim({**ARGS, "gpus": "0,1", "argv0": "python",
                        "checkpoints_dir": "/ckpt"}) == Claim(42, 0, 3)


def test_a_uid_over_its_pending_claims_is_told_to_ask_again(
        reg: Registry, prove: Prover) -> None:
    """The claim past PENDING_PER_UID of one uid is not taken but answered as a failure
    (asked again later: a node's later ranks must get in), counted; another uid is not
    held up; once the proofs are in, the uid may claim again."""
    n = register.PENDING_PER_UID
    for rank in range(n):
        assert reg.answer({**ARGS, "rank": rank}, me())["pending"] is True
    capped = reg.answer({**ARGS, "rank": n}, me())
    assert capped["pending"] is False and capped["proven"] is False and capped["retry"] > 0
    assert capped["error"].startswith(f"attach: too many pending claims ({n} of uid ")
    assert reg.answer(ARGS, me())["pending"] is True  # already pending: not a new one
    assert reg.answer({**ARGS, "rank": n}, me(uid=4242))["pending"] is True
    assert reg.counts["capped"] == 1
    prove.gate.set()
    until(lambda: reg.pending() == 0, "the proofs are in")
    assert reg.answer({**ARGS, "rank": n + 1}, me())["pending"] is True


def test_at_most_sixty_four_claims_are_pending_in_all(reg: Registry, prove: Prover) -> None:
    """Uids with claims pending fill the registry at PENDING_MAX: one more uid's first
    claim is told to ask again."""
    per = register.PENDING_MAX // 8
    for uid in range(5000, 5008):
        for rank in range(per):
            assert reg.answer({**ARGS, "rank": rank}, me(uid))["pending"] is True
    assert reg.pending() == register.PENDING_MAX
    capped = reg.answer(ARGS, me(uid=6000))
    assert capped["pending"] is False
    assert capped["error"].startswith("attach: too many pending claims (64 in all")
    assert reg.counts["capped"] == 1


def test_one_uids_flood_of_claims_pushes_out_only_its_own_answers(
        reg: Registry, prove: Prover) -> None:
    """Another uid's proven answer, not yet read, outlives one uid's many finished
    claims: a uid keeps at most CACHE_PER_UID answers, its oldest dropped first."""
    prove.gate.set()
    reg.answer(ARGS, me(uid=8000))
    until(lambda: reg.pending() == 0, "the other uid's proof is in")
    n = register.CACHE_PER_UID + 10
    for rank in range(n):
        reg.answer({**ARGS, "rank": rank}, me(uid=8001))
        until(lambda: reg.pending() == 0, "the proof is in")
    reg.answer({**ARGS, "rank": n}, me(uid=8001))  # takes in the last one
    until(lambda: reg.pending() == 0, "the proof is in")
    assert reg.answer(ARGS, me(uid=8000))["proven"] is True
    assert prove.count() == n + 2  # the other uid's answer came from the cache
    assert reg.answer({**ARGS, "rank": 0}, me(uid=8001))["pending"] is True  # dropped


def test_a_cached_answer_expires_after_30_s(reg: Registry, prove: Prover,
                                            clock: Clock) -> None:
    """A proven answer is given from the cache for 30 s after it came in; then the
    entry is dropped and the same request proves again."""
    prove.gate.set()
    reg.answer(ARGS, me())
    until(lambda: reg.pending() == 0, "the proof is in")
    assert reg.answer(ARGS, me())["proven"] is True  # taken in at 1000.0
    clock.now += register.TTL - 0.5
    assert reg.answer(ARGS, me())["proven"] is True
    assert prove.count() == 1
    clock.now += 1.0
    assert reg.answer(ARGS, me())["pending"] is True
    until(lambda: prove.count() == 2, "a second proof")


def test_a_new_process_with_the_same_pid_is_a_new_request(
        reg: Registry, prove: Prover, shift: list[int]) -> None:
    """Once the pid's start time differs (the pid went to another process), the
    proven answer of the old one is not given: the claim is proved anew."""
    prove.gate.set()
    reg.answer(ARGS, me())
    assert settled(reg, ARGS, me())["proven"] is True
    prove.gate.clear()
    shift[0] = 1
    assert reg.answer(ARGS, me()) == {"pending": True, "retry": register.RETRY}
    until(lambda: prove.count() == 2, "a second proof")
    prove.gate.set()
    assert settled(reg, ARGS, me())["proven"] is True
    assert reg.counts["cached"] == 0


def test_a_pid_replaced_while_its_claim_is_checked_is_refused(
        reg: Registry, prove: Prover, shift: list[int]) -> None:
    """A proof that held, for a pid whose start time changed while it ran, is not
    the asker's: refused (peer), and not given to the new process either."""
    reg.answer(ARGS, me())
    until(prove.count, "the proof started")
    shift[0] = 1
    prove.gate.set()
    until(lambda: reg.pending() == 0, "the proof is in")
    assert reg.answer(ARGS, me())["pending"] is True  # the new process: its own proof
    shift[0] = 0
    with pytest.raises(Refused, match=r"^peer: pid \d+ exited or was replaced"):
        reg.answer(ARGS, me())


def test_a_peer_that_exited_is_refused_and_never_gets_its_answer(
        reg: Registry, prove: Prover) -> None:
    """A real child's claim is proven; once the child has exited and been reaped
    the same request is refused (its pid has no start time)."""
    child = subprocess.Popen(["sleep", "300"])
    try:
        peer = Peer(child.pid, os.getuid(), os.getgid(), None, False)
        prove.gate.set()
        reg.answer(ARGS, peer)
        assert settled(reg, ARGS, peer)["pid"] == child.pid
    finally:
        child.kill()
        child.wait()
    with pytest.raises(Refused, match=rf"^peer: pid {child.pid} has exited$"):
        reg.answer(ARGS, peer)


def test_close_returns_promptly_while_a_proof_is_blocked(prove: Prover) -> None:
    """close() does not wait for proofs blocked in Slurm: it returns while they
    still run, queued ones never start, and no request is taken after it."""
    reg = Registry(NODE, prove, workers=2)
    try:
        for rank in range(6):
            reg.answer({**ARGS, "rank": rank}, me(uid=7000 + rank))
        until(lambda: prove.count() == 2, "two proofs running")
        closer = threading.Thread(target=reg.close)
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive(), "close() waited for a blocked proof"
        with pytest.raises(ValueError, match="stopping"):
            reg.answer(ARGS, me())
    finally:
        prove.gate.set()
        reg.close()
    for t in reg._threads:  # every worker has ended: a queued proof would have run first
        assert t.daemon  # never joined at exit: a proof stuck in scontrol holds nothing
        t.join(WAIT)
        assert not t.is_alive()
    assert prove.count() == 2


def test_the_first_of_each_kind_is_logged_once(
        reg: Registry, prove: Prover, caplog: pytest.LogCaptureFixture) -> None:
    """Two refusals: both counted, one log line."""
    prove.outcome, prove.message = Outcome.REFUSED, "owner: job 42 is uid 1's"
    prove.gate.set()
    caplog.set_level(logging.INFO, logger="trainwatch")
    for rank in (1, 2):
        reg.answer({**ARGS, "rank": rank}, me())
        until(lambda: reg.pending() == 0, "the proof is in")
        with pytest.raises(Refused):
            reg.answer({**ARGS, "rank": rank}, me())
    assert reg.counts["refused"] == 2
    lines = [r.getMessage() for r in caplog.records if "owner: job 42" in r.getMessage()]
    assert len(lines) == 1 and "later ones are counted" in lines[0]


def test_prover_runs_the_real_proof_which_refuses_a_bad_node_before_slurm() -> None:
    """The default adapter is proof.prove with Slurm bound: an invalid node name
    is refused by its 'claim' check without running scontrol."""
    reg = Registry("not a node!", prover())
    try:
        reg.answer(ARGS, me())
        with pytest.raises(Refused, match=r"^claim: not run: a node name"):
            settled(reg, ARGS, me())
    finally:
        reg.close()
