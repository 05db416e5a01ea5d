"""Log rules on a real job's output under a real `trainwatch run`: the built-in
OOM rule stops the job (restarting into the same OOM is a loop), a rule of the
job's own alerts and lets it run, and a rule with a bad regex is a config
error naming it."""

from __future__ import annotations

import json
import sys
import textwrap

from conftest import Workspace, finish

# Prints its lines (argv[1], '|'-separated) one every 50 ms, then exits argv[2].
_JOB = textwrap.dedent(
    """
    import sys, time
    for line in sys.argv[1].split("|"):
        print(line, flush=True)
        time.sleep(0.05)
    time.sleep(1.5)  # the log is read at each tick: the lines are seen while it runs
    sys.exit(int(sys.argv[2]))
    """
)


def _config(ws: Workspace, lines: list[str], code: int, logs: dict[str, object] | None = None
            ) -> object:
    script = ws.root / "job.py"
    script.write_text(_JOB)
    job: dict[str, object] = {"command": [sys.executable, str(script), "|".join(lines), str(code)]}
    if logs is not None:
        job["logs"] = logs
    return ws.config(job)


def test_a_cuda_oom_line_stops_the_job_with_the_line_as_evidence(ws: Workspace) -> None:
    """The PyTorch OOM message in the job's output: an `oom` incident, action stop
    (no relaunch), the matched line and the one before it in the evidence."""
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a"
           " total capacity of 79.10 GiB of which 1.06 GiB is free.")
    cfg = _config(ws, ["step 1", "step 2", oom, "step 3"], 0)
    code, out = finish(ws.run(cfg))  # type: ignore[arg-type]
    assert code == 1, out
    [inc] = ws.incidents()
    assert (inc["kind"], inc["action"]) == ("oom", "stop"), inc
    ev = json.loads(inc["evidence"])
    assert ev["rule"] == "cuda_oom" and "CUDA out of memory" in ev["line"], ev
    assert ev["before"][-1] == "step 2", ev
    assert {e["attempt"] for e in ws.incidents()} == {0}


def test_a_rule_of_the_jobs_own_alerts_once_and_the_job_runs_on(ws: Workspace) -> None:
    """`logs.rules`: a line matched twice within the window (a repeated identical line
    counts once) alerts; the job is not touched and finishes."""
    rule = {"name": "loss-scale", "pattern": r"loss scale dropped to \d+", "count": 2}
    lines = ["loss scale dropped to 1024", "loss scale dropped to 1024",
             "loss scale dropped to 512", "done"]
    cfg = _config(ws, lines, 0, {"rules": [rule]})
    code, out = finish(ws.run(cfg))  # type: ignore[arg-type]
    assert code == 0, out
    [inc] = ws.incidents()
    assert (inc["kind"], inc["action"]) == ("log_pattern", "alert"), inc
    assert json.loads(inc["evidence"])["line"] == "loss scale dropped to 512"


def test_a_rule_with_a_bad_regex_is_a_config_error_naming_it(ws: Workspace) -> None:
    """check-config: one line naming the rule's pattern, exit 2."""
    import subprocess

    cfg = _config(ws, ["x"], 0, {"rules": [{"name": "broken", "pattern": "oom (at"}]})
    r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "check-config", str(cfg)],
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2, r
    [line] = r.stderr.splitlines()
    assert "jobs.job.logs.rules[0].pattern: expected a valid regular expression" in line, line
    assert "broken" in line, line
