"""A rank of a Slurm job step attaches itself to its node's trainwatch daemon
(DESIGN.md "Jobs across hosts"): trainwatch did not launch it, so the rank
says which job, step and rank it is (a claim, from SLURM_JOB_ID, SLURM_STEP_ID
and SLURM_PROCID), the daemon proves the claim through Slurm, and the answer
(the heartbeat socket, the attempt, the checkpoint to resume from) goes into
``os.environ`` as the variables a launched job gets, so that
``client.connect()``, ``client.resume_from()`` and the integrations work
unchanged.

Two callers: ``client.connect()`` (lazily, once per process, when
TRAINWATCH_SOCKET is unset in a Slurm step) and ``trainwatch attach -- CMD``
(``run``: attach, then exec CMD, so that the trainer keeps the pid and start
time the daemon proved).

The request is the control socket's ``attach`` op, sent as
``trainwatch.host.control.request`` sends one: a datagram to
``<run_dir>/control.sock`` from an abstract address bound for the reply, not
connected, with SO_PASSCRED; a reply is believed only when the kernel says
it comes from the socket file's owner. While Slurm is asked the daemon
answers "pending" (ask again after ``retry`` seconds); when Slurm gave no
answer, "failed" (ask again after ``retry``); a refusal is final. Every
request is a new one, until the deadline (TRAINWATCH_ATTACH_TIMEOUT, 10 s).

Standard library only, and nothing of trainwatch (control.py is not: the
training side must import cleanly anywhere), hence the few lines here that
repeat control.py's; tests check that the two agree. ``attach`` never raises
and never waits past its deadline: what goes wrong is one line on stderr,
``trainwatch: attach: <why>``, and None.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["DEFAULT_RUN_DIR", "DEFAULT_TIMEOUT", "attach", "claim", "control_path", "run"]

DEFAULT_RUN_DIR = "/run/trainwatch"
DEFAULT_TIMEOUT = 10.0  # seconds, unless TRAINWATCH_ATTACH_TIMEOUT says otherwise
CLAIM_ENV = (("job", "SLURM_JOB_ID"), ("step", "SLURM_STEP_ID"), ("rank", "SLURM_PROCID"))
OFF_ENV = "TRAINWATCH_ATTACH"  # "0": client.connect() does not attach
PENDING_RETRY = 0.2  # seconds before asking again, when the reply names none
FAILED_RETRY = 1.0
AGAIN_PAUSE = 0.2  # seconds before asking again after nothing listened or the queue was full
ASK_WAIT = 2.0  # seconds one request waits for its reply before it is sent anew
RETRY_MAX = 5.0  # the longest pause a reply's ``retry`` may ask for
# As in trainwatch.host.control (tests check that they agree):
MAX_REQUEST = 4096
MAX_REPLY = 65536
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_ID = re.compile(r"[0-9]{1,19}")  # what Slurm writes: digits only
_LINE_MAX = 300  # characters of a reason taken from a reply


class _Stop(Exception):
    """Give up: one line saying why."""


class _Again(Exception):
    """This request went nowhere; a later one may: why, for the last line."""


def control_path(run_dir: str) -> str:
    return os.path.join(run_dir, "control.sock")


def claim(env: Mapping[str, str] = os.environ) -> dict[str, int] | None:
    """The claim of this process's Slurm step ({"job", "step", "rank"}), or
    None when it is not in one (a variable unset or not a number)."""
    out: dict[str, int] = {}
    for key, name in CLAIM_ENV:
        raw = env.get(name, "")
        if not _ID.fullmatch(raw):
            return None
        out[key] = int(raw)
    return out


def _say(why: str) -> None:
    try:
        sys.stderr.write(f"trainwatch: attach: {why}\n")
        sys.stderr.flush()
    except Exception:  # no stderr, or a closed one: nowhere to say it
        pass


def _one_line(text: object) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= _LINE_MAX else line[: _LINE_MAX - 3] + "..."


def _run_dir(run_dir: str | None, env: Mapping[str, str]) -> str:
    d = run_dir or env.get("TRAINWATCH_RUN_DIR") or DEFAULT_RUN_DIR
    if not isinstance(d, str):
        raise _Stop(f"run_dir: expected a path, got {d!r}")
    if "{node}" in d:
        node = env.get("SLURMD_NODENAME", "")
        if not node or "/" in node:
            raise _Stop(f"run_dir {d} names {{node}}, but SLURMD_NODENAME is "
                        f"{'unset' if not node else repr(node)}")
        d = d.replace("{node}", node)
    if "\0" in d:
        raise _Stop(f"run_dir: expected a path, got {d!r}")
    return d


def _timeout(timeout: float | None, env: Mapping[str, str]) -> float:
    raw: object = timeout
    where = "timeout"
    if raw is None:
        raw = env.get("TRAINWATCH_ATTACH_TIMEOUT") or DEFAULT_TIMEOUT
        where = "TRAINWATCH_ATTACH_TIMEOUT"
    try:
        t = float(raw)  # type: ignore[arg-type]  # bad input is the ValueError below
    except (TypeError, ValueError):
        t = math.nan
    if isinstance(raw, bool) or not (math.isfinite(t) and t > 0):
        raise _Stop(f"{where}: expected a number of seconds > 0, got {raw!r}")
    return t


def _pause(reply: Mapping[str, Any], default: float) -> float:
    r = reply.get("retry")
    if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
        return default
    return min(max(float(r), 0.01), RETRY_MAX)


def _reply_from(s: socket.socket, uid: int, deadline: float) -> bytes | None:
    """The first datagram the kernel says uid sent (others are ignored), or
    None at the deadline."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        s.settimeout(left)
        try:
            raw, anc, _flags, _addr = s.recvmsg(MAX_REPLY, _ANC_SIZE)
        except TimeoutError:
            continue
        for level, typ, cdata in anc:
            if (level, typ) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS) \
                    and len(cdata) >= _CREDS.size and _CREDS.unpack_from(cdata)[1] == uid:
                return raw


def _ask(path: str, data: bytes, until: float) -> dict[str, Any] | None:
    """One request and its reply; None when no believable reply came by
    ``until`` (time.monotonic()). Raises _Stop or _Again."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        # An abstract address (no file to clean up) for the reply; not connected:
        # the reply's sender is checked instead (control.py's docstring).
        s.bind(f"\0trainwatch-attach-{os.getpid()}-{os.urandom(8).hex()}".encode())
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        s.settimeout(max(until - time.monotonic(), 0.001))  # a full queue: not past until
        try:
            owner = os.stat(path).st_uid  # the daemon's own file: its uid replies
            s.sendto(data, path)
        except FileNotFoundError:
            raise _Stop(f"no trainwatch daemon here: {path} does not exist (is trainwatch "
                        "running with this run_dir? TRAINWATCH_RUN_DIR)") from None
        except ConnectionRefusedError:
            raise _Again(f"nothing is listening at {path} (trainwatch stopped or "
                         "restarting?)") from None
        except PermissionError:
            raise _Stop(f"{path}: permission denied (run_dir is not open to this "
                        "user)") from None
        except (BlockingIOError, TimeoutError):
            raise _Again(f"{path}: trainwatch is busy (its queue stayed full)") from None
        except OSError as e:
            raise _Stop(f"{path}: cannot send: {e.strerror or e}") from None
        try:
            raw = _reply_from(s, owner, until)
        except OSError as e:
            raise _Stop(f"{path}: cannot receive: {e.strerror or e}") from None
    finally:
        s.close()
    if raw is None:
        return None
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise _Stop(f"{path}: malformed reply from trainwatch")
    return reply


def _text(reply: Mapping[str, Any], key: str, optional: bool) -> str | None:
    v = reply.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or "\0" in v:
        raise _Stop(f"malformed reply from trainwatch: {key} is {_one_line(repr(v))}")
    return v


def _export(reply: Mapping[str, Any], claimed: Mapping[str, int],
            env: MutableMapping[str, str]) -> None:
    """The proof's answer into ``env``: every field is checked before any is set."""
    for key, want in claimed.items():
        got = reply.get(key, want)
        if got != want:
            raise _Stop(f"malformed reply from trainwatch: {key} {got!r}, claimed {want}")
    sock = _text(reply, "socket", False)
    name = _text(reply, "name", False)
    ring = _text(reply, "ring_dir", True)
    resume = _text(reply, "resume_from", True)
    attempt = reply.get("attempt")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise _Stop(f"malformed reply from trainwatch: attempt is {_one_line(repr(attempt))}")
    assert sock is not None and name is not None  # not optional: _text raised otherwise
    env["TRAINWATCH_SOCKET"] = sock
    env["TRAINWATCH_JOB"] = name
    env["TRAINWATCH_ATTEMPT"] = str(attempt)
    # Null: none for this job (no ring reader; a fresh start), whatever was inherited.
    for var, value in (("TRAINWATCH_RING_DIR", ring), ("TRAINWATCH_RESUME_FROM", resume)):
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    env.setdefault("RANK", str(claimed["rank"]))


def _prove(path: str, data: bytes, timeout: float) -> dict[str, Any]:
    """Ask until proven (the reply), refused or past the deadline (_Stop)."""
    deadline = time.monotonic() + timeout
    why = "no reply"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Stop(f"not attached within {timeout:g}s: {why}")
        pause = 0.0
        try:
            reply = _ask(path, data, time.monotonic() + min(left, ASK_WAIT))
        except _Again as e:
            why, pause = str(e), AGAIN_PAUSE
        else:
            if reply is None:
                why = f"no reply from {path} (is trainwatch's loop stuck?)"
            elif not reply["ok"]:
                err = _one_line(reply.get("error") or "no reason given")
                raise _Stop(f"refused: {err.removeprefix('attach: ')}")
            elif reply.get("proven") is True:
                return reply
            elif reply.get("pending") is True:
                why = "the proof through Slurm is still pending"
                pause = _pause(reply, PENDING_RETRY)
            else:
                err = _one_line(reply.get("error") or "not proven")
                why = f"not proven: {err.removeprefix('attach: ')}"
                pause = _pause(reply, FAILED_RETRY)
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def attach(run_dir: str | None = None, timeout: float | None = None,
           checkpoints_dir: str | None = None,
           argv0: str | None = None) -> dict[str, Any] | None:
    """Register this Slurm step's rank with the node's trainwatch daemon and,
    once the daemon has proved it, put the job's variables into os.environ
    (TRAINWATCH_SOCKET, _JOB, _ATTEMPT, _RING_DIR, _RESUME_FROM; RANK when
    unset); ``checkpoints_dir`` defaults to TRAINWATCH_CHECKPOINT_DIR. Returns
    the daemon's reply, or None: quietly when this is not a Slurm step, else
    after one line on stderr. Never raises; returns by the deadline
    (``timeout``, else TRAINWATCH_ATTACH_TIMEOUT, else 10 s)."""
    env = os.environ
    claimed = claim(env)
    if claimed is None:
        return None
    try:
        t = _timeout(timeout, env)
        path = control_path(_run_dir(run_dir, env))
        args: dict[str, Any] = dict(claimed)
        # Where the job writes its checkpoints: each node's daemon judges them
        # there, and a requeue's decision (where every rank resumes) is kept there.
        checkpoints_dir = checkpoints_dir or env.get("TRAINWATCH_CHECKPOINT_DIR")
        if checkpoints_dir:
            args["checkpoints_dir"] = os.path.abspath(os.fspath(checkpoints_dir))
        if argv0:
            args["argv0"] = os.fspath(argv0)
        data = json.dumps({"v": 1, "op": "attach", "args": args}, allow_nan=False).encode()
        if len(data) > MAX_REQUEST:
            raise _Stop(f"request larger than {MAX_REQUEST} bytes (checkpoints_dir, argv0)")
        reply = _prove(path, data, t)
        _export(reply, claimed, env)
        return reply
    except _Stop as e:
        _say(str(e))
    except Exception as e:  # never into the caller: the job runs, unwatched
        _say(f"failed: {_one_line(f'{type(e).__name__}: {e}')}")
    return None


def run(command: Sequence[str], run_dir: str | None = None,
        checkpoints_dir: str | None = None, timeout: float | None = None) -> int:
    """``trainwatch attach -- CMD``: attach, then exec CMD in this process (the
    pid the daemon proved); unwatched, with TRAINWATCH_ATTACH=0 so that its
    client does not ask again, when the attach failed. Returns only when
    there is nothing to exec: 2 without a command, 127 when it cannot be run."""
    if not command:
        print("trainwatch attach: expected a command after --, got nothing", file=sys.stderr)
        return 2
    cmd = list(command)
    if claim() is None:
        _say("not a Slurm job step (SLURM_JOB_ID, SLURM_STEP_ID and SLURM_PROCID must all"
             " be set; run it on the srun line): running the command unwatched")
        reply = None
    else:
        reply = attach(run_dir, timeout, checkpoints_dir, argv0=cmd[0])
    if reply is None:
        os.environ[OFF_ENV] = "0"
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed: nothing buffered to lose
            stream.flush()
    try:
        os.execvpe(cmd[0], cmd, os.environ)
    except OSError as e:
        print(f"trainwatch attach: {cmd[0]}: {e.strerror or e}", file=sys.stderr)
    return 127
