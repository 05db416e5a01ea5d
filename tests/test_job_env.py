"""A job's environment (issue 21, item A7): the daemon's jobs start from a clean
one built from their config, never the daemon's (where its credentials live);
`trainwatch run` in the foreground passes its user's environment on."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import Workspace, finish, local_user, need_root, run_name, wait_for

USER = run_name("envuser")  # this run's own user (conftest)
SECRET = "wJalrXUtnFEMI-not-for-jobs"


def _env_of(text: str) -> dict[str, str]:
    """`env -0` output: NAME=value records separated by NUL."""
    return dict(x.split("=", 1) for x in text.split("\0") if "=" in x)


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="twe", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _daemon_job_env(root: Path, job: dict[str, object], daemon_env: dict[str, str]) -> str:
    """Run `job` (which writes `env -0` to root/env.out) under a real daemon started
    with daemon_env; the job's file once it has exited."""
    out = root / "job" / "env.out"
    doc = {"state_dir": str(root / "state"), "run_dir": str(root / "run"),
           "metrics": {"port": 0}, "gpu": {"backend": "off", "kmsg": None},
           "jobs": [{"name": "job", "workdir": str(out.parent),
                     "command": ["sh", "-c", f"env -0 > {out}"], **job}],
           "policies": {"default": {"max_restarts": 0, "kill_grace": "2s"}}}
    config = root / "trainwatch.yaml"
    config.write_text(yaml.safe_dump(doc))
    with open(root / "daemon.out", "wb") as f:
        d = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                              str(config)], stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, env=daemon_env, start_new_session=True)
    try:
        status = root / "state" / "jobs" / "job" / "status.json"
        wait_for(lambda: (status.exists() and '"exited"' in status.read_text())
                 or d.poll() is not None, timeout=60, what="the job to exit")
        assert d.poll() is None, (root / "daemon.out").read_text()
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(timeout=30)
    return out.read_text()


def test_a_daemons_secret_never_reaches_a_user_job(root: Path) -> None:
    """A daemon with AWS_SECRET_ACCESS_KEY in its environment: its `user:` job gets PATH, the
    user's HOME/USER/LOGNAME/SHELL, the locale, its `env:` and what `env_passthrough` names;
    not the secret nor anything else of the daemon's."""
    need_root("a job that runs as another user")
    pw = local_user(USER)
    (root / "job").mkdir()
    os.chown(root / "job", pw.pw_uid, pw.pw_gid)  # the job writes its env.out here
    daemon_env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET, "DAEMON_ONLY": "x",
                  "NCCL_SOCKET_IFNAME": "eth7", "LANG": "C.UTF-8", "LC_TIME": "C"}
    env = _env_of(_daemon_job_env(root, {"user": USER, "env": {"NCCL_DEBUG": "WARN"},
                                         "env_passthrough": ["NCCL_SOCKET_IFNAME"]},
                                  daemon_env))
    assert SECRET not in "".join(env.values())
    assert "AWS_SECRET_ACCESS_KEY" not in env and "DAEMON_ONLY" not in env
    assert "/usr/bin" in env["PATH"].split(":")
    assert (env["HOME"], env["USER"], env["LOGNAME"], env["SHELL"]) == \
        (pw.pw_dir, USER, USER, pw.pw_shell)
    assert (env["LANG"], env["LC_TIME"]) == ("C.UTF-8", "C")
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] == "eth7"
    assert env["TRAINWATCH_JOB"] == "job" and env["TRAINWATCH_ATTEMPT"] == "0"


def test_the_daemon_gives_a_root_job_a_clean_environment_and_trainwatch_run_its_users(
        root: Path, ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """One shell's variables (NCCL_*, conda): a daemon job without `user:` gets root's account
    variables and none of them; the same job under `trainwatch run` in the foreground gets
    them all (but not systemd's NOTIFY_SOCKET), and `env:` wins in both."""
    shell = {"NCCL_SOCKET_IFNAME": "ib0", "CONDA_PREFIX": "/opt/conda/envs/x",
             "AWS_SECRET_ACCESS_KEY": SECRET, "OVERRIDDEN": "shell"}
    (root / "job").mkdir()
    env = _env_of(_daemon_job_env(root, {"env": {"OVERRIDDEN": "job"}},
                                  {**os.environ, **shell}))
    me = pwd.getpwuid(os.geteuid())
    assert not {"NCCL_SOCKET_IFNAME", "CONDA_PREFIX", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert env["USER"] == me.pw_name and env["HOME"] == me.pw_dir
    assert env["OVERRIDDEN"] == "job" and "TRAINWATCH_SOCKET" in env

    out = ws.root / "env.out"
    for k, v in {**shell, "NOTIFY_SOCKET": "/run/systemd/notify"}.items():
        monkeypatch.setenv(k, v)
    cfg = ws.config({"command": ["sh", "-c", f"env -0 > {out}"], "env": {"OVERRIDDEN": "job"}},
                    {"max_restarts": 0})
    rc, text = finish(ws.run(cfg), timeout=60)
    assert rc == 0, text
    env = _env_of(out.read_text())
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["CONDA_PREFIX"] == "/opt/conda/envs/x"
    assert env["OVERRIDDEN"] == "job" and "NOTIFY_SOCKET" not in env


def test_env_passthrough_must_be_a_list_of_names(ws: Workspace) -> None:
    """A bad env_passthrough is one line naming the field, exit 2."""
    cfg = ws.config({"command": ["true"], "env_passthrough": ["A=B"]})
    p = subprocess.run([sys.executable, "-m", "trainwatch.cli", "check-config", str(cfg)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "env_passthrough" in p.stderr
