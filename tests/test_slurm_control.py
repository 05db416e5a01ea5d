"""trainwatch.slurm without a Slurm: the checks of what goes into a Slurm command,
the parsers of what comes out (Slurm 22.05's real output, and garbage), the
rules (when a requeued job may start, whose drain is resumed), the judging of an
exit, and running a command: argv only, a deadline, the environment from Slurm."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from trainwatch.slurm import actions
from trainwatch.slurm.command import MESSAGE_CHARS, Outcome, Result, Slurm, judge, run
from trainwatch.slurm.parse import (
    MAX_REASON,
    ExitCode,
    JobInfo,
    ListedPid,
    NodeInfo,
    Parsed,
    after_requeue,
    bad_delay,
    bad_job,
    bad_node,
    drain_reason,
    judge_drain,
    judge_resume,
    parse_job,
    parse_listpids,
    parse_node,
    start_not_before,
)

# --- what goes in ---


@pytest.mark.parametrize(("job", "ok"), [
    (1, True), (4242, True), (0xFFFFFFFD, True),
    (0, False), (-3, False), (0xFFFFFFFE, False), (2**40, False),
    (True, False), (1.0, False), ("5", False), (None, False),
])
def test_a_job_id_is_a_positive_int_within_slurms_range(job: object, ok: bool) -> None:
    """Only a positive int below Slurm's NO_VAL is a job id; a bool, float or str is not."""
    assert (bad_job(job) is None) is ok


@pytest.mark.parametrize(("node", "ok"), [
    ("n1", True), ("gpu-node-17", True), ("a.b_c", True), ("X" * 64, True),
    ("", False), ("X" * 65, False), ("-n1", False), (".n1", False), ("n[1-2]", False),
    ("n1,n2", False), ("n 1", False), ("n1\n", False), ("n1=", False), ("n1;id", False),
    ("ALL", False), ("all", False), ("All", False), ("nœud", False), (7, False),
])
def test_a_node_name_is_one_strict_name_never_a_list_or_all(node: object, ok: bool) -> None:
    """One node name of letters, digits, '_', '.', '-' (not first): no hostlist, no
    list, no option, no space or newline, and not ALL (any case), which Slurm's
    `update NodeName=` applies to every node."""
    assert (bad_node(node) is None) is ok


@pytest.mark.parametrize(("delay", "ok"), [
    (0, True), (0.0, True), (2.5, True),
    (-1, False), (float("nan"), False), (float("inf"), False), (True, False), ("1", False),
])
def test_a_start_delay_is_finite_seconds_not_negative(delay: object, ok: bool) -> None:
    """A requeue's start delay is a finite number of seconds >= 0."""
    assert (bad_delay(delay) is None) is ok


@pytest.mark.parametrize(("why", "reason"), [
    ("Xid 79 on GPU 3", "trainwatch: Xid 79 on GPU 3"),
    ("Xid 79\non GPU 3\r\n", "trainwatch: Xid 79 on GPU 3"),
    ("a\tb\x00c\x1b[31m", "trainwatch: a b c [31m"),
    ('said "bad"', "trainwatch: said 'bad'"),
    ("", "trainwatch: no reason given"),
    (" \n ", "trainwatch: no reason given"),
    ("trainwatch: ecc", "trainwatch: ecc"),
])
def test_a_drain_reason_is_one_line_starting_trainwatch(why: str, reason: str) -> None:
    """The reason is `trainwatch: ` and the why on one line of printable characters,
    whitespace collapsed, no double quote, never empty, never prefixed twice."""
    assert drain_reason(why) == reason


def test_a_long_drain_reason_is_capped() -> None:
    """A why of any length gives a reason of at most MAX_REASON characters."""
    reason = drain_reason("x" * 5000)
    assert len(reason) == MAX_REASON
    assert reason.startswith("trainwatch: xxx") and reason.endswith("...")


# --- what comes out ---

LISTPIDS_N1 = """\
PID      JOBID    STEPID   LOCALID GLOBALID
26353    5        0        0       0       
26326    5        batch    0       0       
26331    5        batch    -       -       
"""  # noqa: W291  (scontrol pads its columns; the real output has these spaces)


@pytest.mark.parametrize(("text", "rows"), [
    (LISTPIDS_N1, (ListedPid(26353, 5, "0", 0, 0), ListedPid(26326, 5, "batch", 0, 0),
                   ListedPid(26331, 5, "batch", None, None))),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 5 0 0 1\n", (ListedPid(26351, 5, "0", 0, 1),)),
    ("PID JOBID STEPID LOCALID GLOBALID\n19346 5 extern - -\n",
     (ListedPid(19346, 5, "extern", None, None),)),
    ("PID      JOBID    STEPID   LOCALID GLOBALID\n", ()),
    ("", None),
    ("garbage\n26351 5 0 0 1\n", None),
    ("PID JOBID STEPID LOCALID\n26351 5 0 0\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 5 0 0\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 5 0 0 1 9\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\nabc 5 0 0 1\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n0 5 0 0 1\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n-4 5 0 0 1\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 5 0 x 1\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 5 0 0 \u0661\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n26351 6 0 0 1\n", None),
    ("PID JOBID STEPID LOCALID GLOBALID\n99999999999 5 0 0 1\n", None),
    ("\x00\xff\ufffd" * 50, None),
])
def test_listpids_rows_parse_and_anything_else_gives_nothing(
        text: str, rows: tuple[ListedPid, ...] | None) -> None:
    """`scontrol listpids 5 <node>`: the header, then one row per pid (a '-' id is
    None); a missing header, a malformed row or a row of another job makes the
    whole listing unusable, with a reason, never an exception."""
    parsed = parse_listpids(text, 5)
    assert parsed.value == rows
    assert (parsed.why == "") is (rows is not None)


SHOW_JOB = ("JobId=7 JobName=train.sh UserId=root(0) GroupId=root(0) MCS_label=N/A "
            "Priority=4294901757 Nice=0 Account=(null) QOS=(null) JobState=RUNNING "
            "Reason=None Dependency=(null) Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 "
            "ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A "
            "Command=/tmp/my jobs/train.sh WorkDir=/tmp/my jobs StdOut=/tmp/my jobs/7.out "
            "Power=")


OK = ExitCode(0, 0)


@pytest.mark.parametrize(("text", "info"), [
    (SHOW_JOB + "\n", JobInfo(7, "RUNNING", 2, OK)),
    (SHOW_JOB.replace("JobState=RUNNING", "JobState=PENDING"), JobInfo(7, "PENDING", 2, OK)),
    (SHOW_JOB.replace("Restarts=2", "Restarts=0"), JobInfo(7, "RUNNING", 0, OK)),
    ("JobId=70 JobState=RUNNING Restarts=1\n" + SHOW_JOB, None),
    # A job name with a line break: the real fields go to the next line.
    (SHOW_JOB.replace("JobName=train.sh", "JobName=x JobState=PENDING Restarts=7\nrest"), None),
    (SHOW_JOB.replace("Restarts=2 ", ""), None),
    (SHOW_JOB.replace("Restarts=2", "Restarts=x"), None),
    (SHOW_JOB.replace("Restarts=2", "Restarts="), None),
    (SHOW_JOB.replace("JobState=RUNNING", "JobState=running;rm"), None),
    (SHOW_JOB.replace("JobName=train.sh", "JobName=a Restarts=0"), None),
    (SHOW_JOB.replace("/tmp/my jobs/7.out", "/tmp/x JobState=PENDING"), None),
    (SHOW_JOB + "\n" + SHOW_JOB, None),
    (SHOW_JOB.replace("JobId=7", "JobId=70"), None),
    ("", None),
    ("slurm_load_jobs error: Invalid job id specified", None),
    ("\x00" * 100, None),
])
def test_show_job_gives_state_and_restarts_and_never_a_forged_field(
        text: str, info: JobInfo | None) -> None:
    """`scontrol show job -o 7`: JobState and Restarts of the line of job 7. A key
    that appears twice (a job name or path that holds ` Restarts=0`), a missing or
    odd value, more than the job's one line (a job name with a line break) or none
    give nothing, with a reason."""
    parsed = parse_job(text, 7)
    assert parsed.value == info
    assert (parsed.why == "") is (info is not None)


ENDED = SHOW_JOB.replace("JobState=RUNNING", "JobState=FAILED")


@pytest.mark.parametrize(("code", "exit_code"), [
    ("ExitCode=0:0", ExitCode(0, 0)),
    ("ExitCode=3:0", ExitCode(3, 0)),
    ("ExitCode=255:0", ExitCode(255, 0)),
    ("ExitCode=0:9", ExitCode(0, 9)),
    ("ExitCode=0:127", ExitCode(0, 127)),
    # --details adds DerivedExitCode= (the steps' highest): not the job's.
    ("ExitCode=1:0 DerivedExitCode=0:9", ExitCode(1, 0)),
    ("DerivedExitCode=0:9", None),
    ("", None),
    ("ExitCode=", None),
    ("ExitCode=3", None),
    ("ExitCode=3:", None),
    ("ExitCode=:9", None),
    ("ExitCode=3:0:1", None),
    ("ExitCode=-1:0", None),
    ("ExitCode=256:0", None),
    ("ExitCode=0:128", None),
    ("ExitCode=1000:0", None),
    ("ExitCode=x:y", None),
    ("ExitCode=0:0 JobName2=a ExitCode=0:0", None),
])
def test_show_job_gives_the_exit_code_or_none_and_still_the_rest(
        code: str, exit_code: ExitCode | None) -> None:
    """`ExitCode=A:B` of an ended job: status A (0-255) and signal B (0-127). A
    missing, odd or out-of-range value, or a second `ExitCode=` (a forged one),
    gives no exit code, and JobState and Restarts are believed all the same."""
    text = ENDED.replace("ExitCode=0:0", code)
    assert parse_job(text, 7) == Parsed(JobInfo(7, "FAILED", 2, exit_code))


def test_a_job_name_that_forges_an_exit_code_gives_none() -> None:
    """A job named `x ExitCode=0:0` that failed with 3: two ExitCode= fields, neither
    believed (the name's comes first)."""
    text = ENDED.replace("ExitCode=0:0", "ExitCode=3:0").replace(
        "JobName=train.sh", "JobName=x ExitCode=0:0")
    assert parse_job(text, 7).value == JobInfo(7, "FAILED", 2, None)


@pytest.mark.parametrize(("code", "returncode"), [
    (ExitCode(0, 0), 0), (ExitCode(3, 0), 3), (ExitCode(0, 9), -9), (ExitCode(0, 15), -15),
])
def test_an_exit_code_reads_as_a_returncode(code: ExitCode, returncode: int) -> None:
    """As subprocess's returncode: the exit status, or minus the signal."""
    assert code.returncode == returncode


@pytest.mark.parametrize(("text", "info"), [
    ("n2|idle+drain|trainwatch: Xid 79\n", NodeInfo("n2", "idle+drain", "trainwatch: Xid 79")),
    ("n2|allocated+drain|maintenance\n", NodeInfo("n2", "allocated+drain", "maintenance")),
    ("n2|idle|none\n", NodeInfo("n2", "idle", "")),
    ("n2|idle+drain|trainwatch: a|b State=IDLE\n",
     NodeInfo("n2", "idle+drain", "trainwatch: a|b State=IDLE")),
    ("n2|IDLE+DRAIN*|x\n", NodeInfo("n2", "idle+drain", "x")),
    ("n2|mixed+drain|trainwatch: x\nn2|mixed+drain|trainwatch: x\n",
     NodeInfo("n2", "mixed+drain", "trainwatch: x")),
    ("n1|idle+drain|trainwatch: x\n", None),
    ("n22|idle+drain|trainwatch: x\n", None),
    ("n2|idle\n", None),
    ("n2|idle drain|x\n", None),
    ("n2||x\n", None),
    ("", None),
    ("NODELIST STATE\nn2 idle\n", None),
])
def test_sinfo_gives_state_and_reason_of_that_node_only(text: str, info: NodeInfo | None) -> None:
    """`sinfo -N -n n2 -O NodeList:|,StateComplete:|,Reason:`: the state flags and the
    reason (which may hold '|' and ` State=`; sinfo's "none" is no reason); another
    node's line, a missing field or an odd state give nothing, with a reason."""
    parsed = parse_node(text, "n2")
    assert parsed.value == info
    assert (parsed.why == "") is (info is not None)


# --- rules ---

@pytest.mark.parametrize(("requeued_at", "delay", "start"), [
    (100.0, 0, 101.1), (100.2, 0, 101.1), (100.99, 0, 101.1),
    (100.2, 0.5, 101.1), (100.2, 5, 105.2), (100.99, 0.2, 101.19),
])
def test_a_requeued_job_starts_after_the_delay_never_in_the_requeues_second(
        requeued_at: float, delay: float, start: float) -> None:
    """The start is sent after the delay and never within the whole second of the
    requeue (slurmd refuses a credential made in the second it revoked the old one)."""
    assert start_not_before(requeued_at, delay) == pytest.approx(start)


@pytest.mark.parametrize(("state", "step"), [
    ("COMPLETING", "wait"), ("REQUEUED", "wait"), ("SIGNALING", "wait"), ("STAGE_OUT", "wait"),
    ("PENDING", "start"),
    ("RUNNING", "leave"), ("CONFIGURING", "leave"), ("COMPLETED", "leave"),
    ("CANCELLED", "leave"), ("REQUEUE_HOLD", "leave"), ("SPECIAL_EXIT", "leave"), ("", "leave"),
])
def test_a_requeued_job_is_started_only_once_it_is_pending_again(state: str, step: str) -> None:
    """While a requeued job completes, a start would be undone (Slurm sets its
    BeginTime when it has completed): wait; start it once PENDING; leave a job that
    runs again, is held or has ended."""
    assert after_requeue(state) == step


@pytest.mark.parametrize(("state", "reason", "resume"), [
    ("idle+drain", "trainwatch: Xid 79", True),
    ("allocated+drain", "trainwatch: Xid 79", True),
    ("mixed+drain+not_responding", "trainwatch:x", True),
    ("down+drain", "trainwatch: ecc", True),
    ("idle+drain", "maintenance", False),
    ("idle+drain", "", False),
    ("idle+drain", "Trainwatch: x", False),
    ("idle+drain", " trainwatch: x", False),
    ("idle+drain", "NHC: trainwatch: x", False),
    ("idle", "trainwatch: x", False),
    ("down", "trainwatch: x", False),
    ("allocated", "", False),
])
def test_only_a_drain_whose_reason_is_still_trainwatchs_is_resumed(
        state: str, reason: str, resume: bool) -> None:
    """Resume only a drained/draining node whose reason starts with `trainwatch:`;
    an operator's reason, an empty one, or a node not drained is left alone."""
    go, why = judge_resume(NodeInfo("n2", state, reason))
    assert go is resume
    assert "n2" in why


@pytest.mark.parametrize(("state", "reason", "drain"), [
    ("idle", "", True),
    ("allocated", "", True),
    ("idle+drain", "trainwatch: old", True),
    ("idle", "stale", True),
    ("idle+drain", "maintenance", False),
    ("allocated+drain", "", False),
    ("down", "Not responding", False),
    ("idle+fail", "bad psu", False),
])
def test_a_drain_never_overwrites_another_out_of_service_mark(
        state: str, reason: str, drain: bool) -> None:
    """A node already drained, down or failed with a reason that is not trainwatch's
    keeps that reason (overwritten, resume_if_ours would later undo it)."""
    assert judge_drain(NodeInfo("n2", state, reason))[0] is drain


# --- judging an exit ---

@pytest.mark.parametrize(("rc", "out", "err", "outcome", "message"), [
    (0, "out\n", "", Outcome.OK, ""),
    (1, "", "Requested operation is presently disabled for job 4\n", Outcome.REFUSED,
     "Requested operation is presently disabled for job 4"),
    (1, "", "Only batch jobs are accepted or processed for job 2\n", Outcome.REFUSED,
     "Only batch jobs are accepted or processed for job 2"),
    (1, "", "Job is pending execution for job 1\n", Outcome.REFUSED,
     "Job is pending execution for job 1"),
    (1, "", "Invalid job id specified for job 99\n", Outcome.REFUSED,
     "Invalid job id specified for job 99"),
    (1, "", "slurm_update error: Access/permission denied\n", Outcome.REFUSED,
     "slurm_update error: Access/permission denied"),
    (1, "Node nX not found\n", "", Outcome.REFUSED, "Node nX not found"),
    (1, "PID JOBID STEPID LOCALID GLOBALID\n", "JobId=99 does not exist on node n1.\n",
     Outcome.REFUSED, "JobId=99 does not exist on node n1."),
    (1, "", "slurm_load_node error: Unable to contact slurm controller (connect failure)\n",
     Outcome.FAILED, "slurm_load_node error: Unable to contact slurm controller "
     "(connect failure)"),
    (1, "", "slurm_load_node error: Socket timed out on send/recv operation\n",
     Outcome.FAILED, "slurm_load_node error: Socket timed out on send/recv operation"),
    (1, "", "scontrol: error: fetch_config: DNS SRV lookup failed\n"
     "scontrol: fatal: Could not establish a configuration source\n", Outcome.FAILED,
     "scontrol: fatal: Could not establish a configuration source"),
    (1, "", "Job can not be altered now, try again later for job 3", Outcome.FAILED,
     "Job can not be altered now, try again later for job 3"),
    (1, "", "", Outcome.FAILED, "scontrol exited 1 without a message"),
    (1, "\n  \n", " \n", Outcome.FAILED, "scontrol exited 1 without a message"),
    (-9, "", "", Outcome.FAILED, "scontrol was killed by signal 9"),
])
def test_an_exit_is_ok_refused_with_slurms_reason_or_failed(
        rc: int, out: str, err: str, outcome: Outcome, message: str) -> None:
    """Exit 0 is ok; a non-zero exit whose last line is one of Slurm's answers to the
    request is refused, anything else (no controller, a timeout, no message, a
    signal) failed; the message is Slurm's own last line."""
    r = judge("scontrol", rc, out, err)
    assert (r.outcome, r.message) == (outcome, message)
    assert r.value == (out if outcome is Outcome.OK else None)


def test_slurms_message_line_is_capped() -> None:
    """A message line of any length is cut to MESSAGE_CHARS."""
    assert len(judge("scontrol", 1, "", "y" * 10_000).message) == MESSAGE_CHARS


# --- running a command ---


def test_run_passes_argv_as_is_never_through_a_shell() -> None:
    """Each argument reaches the command as one argument: `;` and `$(...)` stay text."""
    r = run(Slurm(), ["echo", "a; echo b", "$(id)"])
    assert r.ok and r.value == "a; echo b $(id)\n"


def test_run_gives_slurm_conf_and_none_of_the_daemons_slurm_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's environment is SLURM_CONF, PATH, LC_ALL and what Slurm.env adds:
    none of the daemon's SLURM_* or SINFO_FORMAT, which change what Slurm prints."""
    monkeypatch.setenv("SINFO_FORMAT", "%all")
    monkeypatch.setenv("SLURM_CONF", "/etc/wrong.conf")
    r = run(Slurm(conf="/x/slurm.conf", env={"MUNGE_X": "1"}), ["env"])
    assert r.ok and r.value is not None
    env = dict(line.split("=", 1) for line in r.value.splitlines())
    assert env["SLURM_CONF"] == "/x/slurm.conf"
    assert env["MUNGE_X"] == "1"
    assert "SINFO_FORMAT" not in env
    assert set(env) <= {"SLURM_CONF", "PATH", "LC_ALL", "MUNGE_X", "PWD", "SHLVL", "_"}


def test_run_kills_a_command_past_its_deadline_and_fails(tmp_path: Path) -> None:
    """A command that does not answer is killed at the deadline, with what it
    started, and gives failed, saying so, not a hang."""
    pidfile = tmp_path / "child.pid"
    began = time.monotonic()
    r = run(Slurm(timeout=1), ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; sleep 60"])
    assert time.monotonic() - began < 20
    assert r.outcome is Outcome.FAILED
    assert "no answer within 1s" in r.message
    child = int(pidfile.read_text())
    wait_for(lambda: _gone(child), what=f"the command's child {child} to be killed")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_run_of_a_missing_command_fails() -> None:
    """A Slurm command not on the path gives failed, not an exception."""
    r = run(Slurm(path="/nonexistent"), ["scontrol", "ping"])
    assert r.outcome is Outcome.FAILED
    assert "scontrol cannot be run" in r.message


def test_a_timeout_that_is_not_positive_is_a_config_error() -> None:
    """Slurm(timeout=0) raises at construction: no command could ever answer."""
    with pytest.raises(ValueError, match="timeout"):
        Slurm(timeout=0)


@pytest.mark.parametrize("call", [
    lambda s: actions.requeue(0, slurm=s),
    lambda s: actions.requeue(5, slurm=s, start_delay=-1),
    lambda s: actions.restart_count(-1, slurm=s),
    lambda s: actions.drain("n[1-2]", "x", slurm=s),
    lambda s: actions.drain("ALL", "x", slurm=s),
    lambda s: actions.resume_if_ours("n1;reboot", slurm=s),
    lambda s: actions.listpids(5, "-n1", slurm=s),
    lambda s: actions.listpids(True, "n1", slurm=s),
])
def test_an_invalid_input_is_refused_before_anything_runs(
        call: Callable[[Slurm], Result[Any]]) -> None:
    """A bad job id, node name or delay is refused with why, and no command runs
    (with no scontrol on the path, running one would fail instead)."""
    r = call(Slurm(path="/nonexistent"))
    assert r.outcome is Outcome.REFUSED
    assert r.message.startswith("not run: ")
    assert r.done == ()
