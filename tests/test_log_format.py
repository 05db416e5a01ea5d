"""`--log-format json`: trainwatch's own log as one JSON object per line (time, level,
job, event, fields), for hosts without journald; text stays the default, unchanged.
End to end through a real `trainwatch run` and `trainwatch daemon` of the test job
(tests/jobs/worker.py) crashed once; the formatter itself through a real logger."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import Workspace, wait_for
from trainwatch.export.logformat import JsonFormatter

KEYS = {"time", "level", "logger", "job", "event", "fields"}
# ISO 8601 in UTC with milliseconds, as the text format's timestamp.
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$")
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d trainwatch: ")


def _objects(out: str) -> list[dict[str, Any]]:
    """Every line of ``out`` as a JSON object with the contract's keys."""
    lines = out.splitlines()
    assert lines, "no log output"
    objects = []
    for line in lines:
        obj = json.loads(line)  # every line, or the test fails here naming it
        assert isinstance(obj, dict) and set(obj) >= KEYS, line
        assert TIME.match(obj["time"]), line
        assert obj["level"] in {"debug", "info", "warning", "error", "critical"}, line
        assert isinstance(obj["event"], str) and obj["event"], line
        assert isinstance(obj["fields"], dict), line
        assert obj["job"] is None or isinstance(obj["job"], str), line
        objects.append(obj)
    return objects


def _run(ws: Workspace, config: Path, *extra: str) -> tuple[int, str, str]:
    """A real `trainwatch run` with stdout and stderr apart; its exit and both."""
    p = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "run", "--config", str(config),
         "--no-passthrough", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ws.procs.append(p)  # killed by the fixture if left running
    out, err = p.communicate(timeout=60)
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def test_run_json_log_is_one_object_per_line_with_the_job_and_its_crash(ws: Workspace) -> None:
    """A job crashed once under `trainwatch run --log-format json`: every line it logs
    (stdout and stderr) is a JSON object with time, level, job, event and fields; the
    crash and the relaunch are lines of job "job", their "job job: " prefix taken off."""
    cfg = ws.config({"command": ws.worker("--steps", "20", "--crash-at", "12")})
    rc, out, err = _run(ws, cfg, "--log-format", "json")
    assert rc == 0, err[-3000:]
    [inc] = ws.incidents()
    assert inc["kind"] == "crash"
    assert out == ""  # trainwatch logs to stderr only
    objects = _objects(err)
    about = [o for o in objects if o["job"] == "job"]
    assert about, err
    assert not any(o["event"].startswith("job ") for o in about), err
    crash = [o for o in about if o["event"].startswith("crash ")]
    assert len(crash) == 1 and crash[0]["level"] == "warning", err
    assert any("-> starting: relaunch: attempt 1" in o["event"] for o in about), err
    assert about[-1]["event"].endswith("-> exited: the job finished (exit 0)"), err


def test_run_text_log_is_the_default_and_unchanged(ws: Workspace) -> None:
    """Without --log-format (or with text) the lines are as before:
    `<local ISO time> trainwatch: job NAME: ...`, no JSON."""
    cfg = ws.config({"command": ws.worker("--steps", "5")})
    for extra in ((), ("--log-format", "text")):
        rc, out, err = _run(ws, cfg, *extra)
        assert rc == 0 and out == "", err[-3000:]
        lines = err.splitlines()
        assert lines and all(TEXT_LINE.match(x) for x in lines), err
        assert any(" trainwatch: job job: " in x for x in lines), err


def test_a_bad_log_format_is_a_usage_error(ws: Workspace) -> None:
    """An unknown format is one line and exit 2, before anything starts."""
    cfg = ws.config({"command": ws.worker("--steps", "5")})
    rc, _, err = _run(ws, cfg, "--log-format", "xml")
    assert rc == 2 and "--log-format" in err and len(err.splitlines()) == 1, err
    assert not ws.state.exists()


def test_daemon_json_log_to_stderr(ws: Workspace) -> None:
    """`trainwatch daemon --log-format json` (no journald): a job crashed once and
    finished, SIGTERM; every line of the daemon's output is a JSON object."""
    cfg = ws.config({"command": ws.worker("--steps", "20", "--crash-at", "12")})
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                          str(cfg), "--log-format", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ws.status().get("state") == "exited", 60, "the job to finish")
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err[-3000:]
    assert out == ""
    objects = _objects(err)
    assert any(o["job"] == "job" and o["event"].startswith("crash ") for o in objects), err
    assert any(o["job"] is None for o in objects), err  # the daemon's own lines


def _format(**kwargs: Any) -> dict[str, Any]:
    """One record through a real logger and handler with the JSON formatter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("trainwatch.test_log_format")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        msg = kwargs.pop("msg")
        args = kwargs.pop("args", ())
        logger.warning(msg, *args, **kwargs)
    finally:
        logger.removeHandler(handler)
    [line] = stream.getvalue().splitlines()
    obj: dict[str, Any] = json.loads(line)
    return obj


def test_an_explicit_job_and_extras_become_job_and_fields() -> None:
    """extra={"job": ...} names the job without a prefix; other extras are fields, made
    JSON-safe (NaN as "nan", a path as its str), so a strict parser reads the line."""
    obj = _format(msg="dropped %d datagrams", args=(3,),
                  extra={"job": "llama", "loss": float("nan"), "path": Path("/x"),
                         "ranks": (0, 1)})
    assert obj["job"] == "llama" and obj["event"] == "dropped 3 datagrams"
    assert obj["fields"] == {"loss": "nan", "path": "/x", "ranks": [0, 1]}
    assert obj["level"] == "warning" and obj["logger"] == "trainwatch.test_log_format"
    assert TIME.match(obj["time"])


def test_a_prefix_naming_another_job_than_the_extra_is_kept_in_the_event() -> None:
    """The explicit job wins; a message about another job keeps its text whole."""
    obj = _format(msg="job b: moved", extra={"job": "a"})
    assert obj["job"] == "a" and obj["event"] == "job b: moved"
    plain = _format(msg="no job here")
    assert plain["job"] is None and plain["event"] == "no job here" and plain["fields"] == {}


def test_a_multi_line_message_and_its_traceback_stay_on_one_line() -> None:
    """A newline in a message, and an exception's traceback, are escaped in one object."""
    try:
        raise ValueError("boom")
    except ValueError:
        obj = _format(msg="job j: two\nlines", exc_info=True)
    assert obj["job"] == "j" and obj["event"] == "two\nlines"
    assert "ValueError: boom" in obj["exc"]


FORGED = "2026-12-02T01:00:00.000+00:00 trainwatch: job victim: FORGED restart budget spent"


def test_a_users_text_never_starts_a_line_of_the_text_log(ws: Workspace) -> None:
    """A job reports a checkpoint whose path carries a newline and a forged line of
    trainwatch's, then one with nothing there: the text log (the default) has neither
    as a line of its own nor as a complete checkpoint (both were: the forged line as a
    line of root's); both are refused as missing, the first shown escaped on the
    refusal's line. A real one is still taken."""
    script = ws.root / "forger.py"
    script.write_text(
        "import os, sys\nfrom trainwatch import client\n"
        "ck = sys.argv[1]\nhb = client.connect()\nhb.beat(1)\n"
        f"hb.checkpoint(5, ck + '/step_5\\n{FORGED} \\x1b[2J')\n"
        "hb.checkpoint(6, ck + '/step_6')\n"
        "open(ck + '/step_7', 'w').write('7')\nhb.checkpoint(7, ck + '/step_7')\nhb.beat(8)\n")
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt)],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}})
    rc, out, err = _run(ws, cfg)
    assert rc == 0 and out == "", err[-3000:]
    lines = err.splitlines()
    assert all(TEXT_LINE.match(x) for x in lines), err
    assert not any(x.startswith(FORGED[:29]) or "\x1b" in x for x in lines), err
    assert "checkpoint step 5 complete" not in err and "checkpoint step 6 complete" not in err
    assert "checkpoint step 7 complete" in err, err
    # Refused as missing (the first of a reason is said, the rest counted): step 6 too.
    assert any("refused a checkpoint report (nothing there, looked for as the job's user): "
               f"step 5, {ws.ckpt}/step_5\\n{FORGED} \\x1b[2J;" in x for x in lines), err


def test_the_text_format_shows_control_characters_as_escapes() -> None:
    """cescape: C0 and C1 controls, DEL and the Unicode line separators, one line."""
    from trainwatch.export.logformat import IsoFormatter, cescape

    assert cescape("a\nb\rc\td\x1b[31me\x7ff\x85g\u2028h\u2029i") == \
        "a\\nb\\rc\\td\\x1b[31me\\x7ff\\x85g\\u2028h\\u2029i"
    assert cescape("plain: /ck/step_5 (ünïcode)") == "plain: /ck/step_5 (ünïcode)"
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, "job %s: host %s", ("j", "h\nX"),
                               None)
    line = IsoFormatter("%(asctime)s trainwatch: %(message)s").format(record)
    assert "\n" not in line and line.endswith("trainwatch: job j: host h\\nX"), line
