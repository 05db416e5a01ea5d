"""check-config looks the job's program up as a daemon launch would: in the job's
PATH, as the job's user. A program that cannot start is one line and exit 2 now,
not a job that fails at every launch."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import local_user, run_name

BOB = run_name("bob")


def _check(tmp_path: Path, job: dict[str, object],
           path: str | None = None) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "trainwatch.yaml"
    cfg.write_text(yaml.safe_dump({"jobs": [{"name": "train", **job}]}))
    env = {**os.environ, "PATH": path if path is not None else os.environ.get("PATH", "")}
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", "check-config", str(cfg)],
                          capture_output=True, text=True, timeout=60, check=False, env=env)


def _program(folder: Path, name: str, mode: int = 0o755) -> Path:
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    p = folder / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(mode)
    return p


def test_a_program_not_in_the_jobs_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = _check(tmp_path, {"command": ["no-such-trainer-xyz", "--lr=3"]})
    assert r.returncode == 2, r
    assert r.stdout == ""
    [line] = r.stderr.splitlines()
    assert line.startswith(f"trainwatch: {tmp_path / 'trainwatch.yaml'}: jobs.train.command: "
                           "no-such-trainer-xyz: cannot start"), line
    assert "in the job's PATH /usr/local/sbin" in line, line


def test_a_program_in_the_jobs_own_path_is_ok(tmp_path: Path) -> None:
    _program(tmp_path / "bin", "trainer")
    r = _check(tmp_path, {"command": ["trainer"], "env": {"PATH": str(tmp_path / "bin")}})
    assert (r.returncode, r.stderr) == (0, ""), r
    assert r.stdout.startswith(f"{tmp_path / 'trainwatch.yaml'}: ok (1 job(s): train)")


def test_a_program_only_in_the_callers_path_is_a_warning_naming_both(tmp_path: Path) -> None:
    """`trainwatch run` finds it; the daemon, whose jobs get a PATH of their own, does not."""
    found = _program(tmp_path / "mine", "trainer")
    r = _check(tmp_path, {"command": ["trainer"]}, path=f"{tmp_path / 'mine'}:/usr/bin:/bin")
    assert r.returncode == 0, r
    [line] = r.stderr.splitlines()
    assert f"trainer is found in your PATH ({found}), not in a daemon job's" in line, line


def test_a_relative_program_is_looked_up_in_the_jobs_workdir(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    _program(work, "train.sh")
    assert _check(tmp_path, {"command": ["./train.sh"], "workdir": str(work)}).returncode == 0
    r = _check(tmp_path, {"command": ["./absent.sh"], "workdir": str(work)})
    assert r.returncode == 2 and "./absent.sh: cannot start" in r.stderr, r


def test_a_program_the_jobs_user_may_not_execute_is_refused_though_root_may(
        open_tmp: Path) -> None:
    """Mode 0700, root's: root executes it, the job's user does not; looked up as the user."""
    local_user(BOB)
    _program(open_tmp / "bin", "trainer", mode=0o700)
    job = {"command": ["trainer"], "env": {"PATH": str(open_tmp / "bin")}, "user": BOB}
    r = _check(open_tmp, job)
    assert r.returncode == 2, r
    assert f"trainer: cannot start as {BOB}" in r.stderr, r.stderr
    (open_tmp / "bin" / "trainer").chmod(0o755)
    r = _check(open_tmp, job)
    assert (r.returncode, r.stderr) == (0, ""), r


def test_a_user_this_host_lacks_is_a_warning_and_the_program_is_looked_up_as_you(
        tmp_path: Path) -> None:
    _program(tmp_path / "bin", "trainer")
    r = _check(tmp_path, {"command": ["trainer"], "env": {"PATH": str(tmp_path / "bin")},
                          "user": "no-such-user-xyz"})
    assert r.returncode == 0, r
    [line] = r.stderr.splitlines()
    assert "no user or group 'no-such-user-xyz' here" in line, line
    assert stat.S_IMODE((tmp_path / "bin" / "trainer").stat().st_mode) == 0o755


def test_a_config_for_another_host_warns_of_a_program_it_cannot_find_here(
        tmp_path: Path) -> None:
    """No such user or workdir here: the config may be another host's; the program
    not found is a warning naming this host, and the config is ok."""
    r = _check(tmp_path, {"command": ["no-such-trainer-xyz"], "user": "no-such-user-xyz",
                          "workdir": "/no/such/dir"})
    assert r.returncode == 0, r
    lines = r.stderr.splitlines()
    assert len(lines) == 3 and lines[2].endswith("(on this host)"), lines
