"""The YAML config: every mistake is one exact line naming the file, the field,
what was expected and what was found; good configs get the documented defaults
and paths resolved against the config file's folder; the example in config/
is valid, complete and commented; `trainwatch check-config` exits 2 or 0."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainwatch.config import (
    MAX_SOCKET_PATH,
    ConfigError,
    load,
    parse_duration,
)
from trainwatch.detectors.losssettings import LossSettings
from trainwatch.types import DETECTED_KINDS, Action, FaultKind

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "trainwatch.yaml"
JOB = "jobs: [{name: train, command: [python, train.py]}]\n"
NAME_RULE = "a name of letters, digits, '_', '.', '-' (at most 63)"
COMMAND_RULE = "a non-empty list of strings (the command and its arguments)"
DURATION_RULE = "a duration > 0 such as 30s, 5m or 24h (at most 10 years)"
TOP_KEYS = ("admin_group, gpu, host, jobs, metrics, observe_only, policies, removed_jobs,"
            " run_dir, slurm, state_dir")
DETECTED = ", ".join(sorted(k.value for k in DETECTED_KINDS))
ALL_ACTIONS = "alert, restart, rollback, restart_exclude_gpu, exec, stop"
LONG_RUN_DIR = "/" + "r" * 100  # 101 bytes; /jobs/train.sock makes it 117 > 107


def _job(**fields: str) -> str:
    """A one-job config whose job has these extra flow-style fields."""
    extra = "".join(f", {k}: {v}" for k, v in fields.items())
    return f"jobs: [{{name: train, command: [python, train.py]{extra}}}]\n"


# (file content, expected message with "<file>" for the file's path).
# None as content: no file at all. Bytes: written as they are.
BAD: list[object] = [
    pytest.param(
        "- a\n- b\n", "<file>: top level: expected a mapping, got ['a', 'b']", id="not-a-mapping"
    ),
    pytest.param(
        "just words\n",
        "<file>: top level: expected a mapping, got 'just words'",
        id="scalar-document",
    ),
    pytest.param(
        JOB + "slurm: {job: {command: [python, train.py]}}\n",
        "<file>: slurm.job.command: expected one of anomalies, checkpoints, evidence, gpus, "
        "heartbeat, logs, policy, stall, got an unknown key",
        id="slurm-job-with-a-command",
    ),
    pytest.param(
        JOB + "slurm: {node: 'n[1-2]'}\n",
        "<file>: slurm.node: expected a host name of 1-64 letters, digits, '.', '_', '-', "
        "got 'n[1-2]'",
        id="slurm-node-list",
    ),
    pytest.param(
        JOB + "jobz: []\n",
        f"<file>: jobz: expected one of {TOP_KEYS}, got an unknown key",
        id="unknown-top-level-key",
    ),
    pytest.param(
        "state_dir: /var/lib/trainwatch\n",
        "<file>: jobs: expected a list of jobs (`jobs: []` for none yet), got nothing",
        id="missing-jobs",
    ),
    pytest.param(
        JOB + "admin_group: [gpu-admins]\n",
        "<file>: admin_group: expected a non-empty string, got ['gpu-admins']",
        id="admin-group-a-list",
    ),
    pytest.param(
        JOB + "admin_group: '99999999999999999999'\n",
        "<file>: admin_group: expected a group name, or a gid from 0 to 4294967294,"
        " got '99999999999999999999'",
        id="admin-group-gid-too-large",
    ),
    pytest.param(
        "", "<file>: jobs: expected a list of jobs (`jobs: []` for none yet), got nothing",
        id="empty-file"
    ),
    pytest.param(
        "jobs: {}\n", "<file>: jobs: expected a list of jobs (`jobs: []` for none yet), got {}",
        id="jobs-empty-mapping"
    ),
    pytest.param(
        "jobs: {train: {command: [x]}}\n",
        "<file>: jobs: expected a list of jobs (`jobs: []` for none yet), "
        "got {'train': {'command': ['x']}}",
        id="jobs-not-a-list",
    ),
    pytest.param(
        "jobs: [train]\n",
        "<file>: jobs[0]: expected a mapping, got 'train'",
        id="job-not-a-mapping",
    ),
    pytest.param(
        "jobs: [{}]\n",
        "<file>: jobs[0]: expected a mapping with name and command, got {}",
        id="job-empty-mapping",
    ),
    pytest.param(
        "jobs: [{command: [python, train.py]}]\n",
        f"<file>: jobs[0].name: expected {NAME_RULE}, got nothing",
        id="job-missing-name",
    ),
    pytest.param(
        "jobs: [{name: train}]\n",
        f"<file>: jobs.train.command: expected {COMMAND_RULE}, got nothing",
        id="job-missing-command",
    ),
    pytest.param(
        "jobs: [{name: 'my job', command: [x]}]\n",
        f"<file>: jobs[0].name: expected {NAME_RULE}, got 'my job'",
        id="job-name-with-space",
    ),
    pytest.param(
        "jobs: [{name: -train, command: [x]}]\n",
        f"<file>: jobs[0].name: expected {NAME_RULE}, got '-train'",
        id="job-name-leading-dash",
    ),
    pytest.param(
        "jobs: [{name: ../etc, command: [x]}]\n",
        f"<file>: jobs[0].name: expected {NAME_RULE}, got '../etc'",
        id="job-name-with-slash",
    ),
    pytest.param(
        "jobs: [{name: " + "a" * 64 + ", command: [x]}]\n",
        f"<file>: jobs[0].name: expected {NAME_RULE}, got '{'a' * 56}...",
        id="job-name-too-long",
    ),
    pytest.param(
        _job().replace("[python, train.py]", "python train.py"),
        f"<file>: jobs.train.command: expected {COMMAND_RULE}, got 'python train.py'",
        id="command-not-a-list",
    ),
    pytest.param(
        _job().replace("[python, train.py]", "[]"),
        f"<file>: jobs.train.command: expected {COMMAND_RULE}, got []",
        id="command-empty",
    ),
    pytest.param(
        _job().replace("[python, train.py]", "[python, {a: 1}]"),
        "<file>: jobs.train.command[1]: expected a string or a number, got {'a': 1}",
        id="command-with-a-mapping",
    ),
    pytest.param(
        "jobs: [{name: train, command: [a]}, {name: train, command: [b]}]\n",
        "<file>: jobs[1].name: expected a name used by one job only, got 'train'",
        id="duplicate-job-names",
    ),
    pytest.param(
        _job(heartbeat="{timeout: 5 minutes}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got '5 minutes'",
        id="duration-in-words",
    ),
    pytest.param(
        _job(heartbeat="{timeout: -3}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got -3",
        id="duration-negative",
    ),
    pytest.param(
        _job(heartbeat="{timeout: true}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got True",
        id="duration-boolean",
    ),
    pytest.param(
        _job(heartbeat="{timeout: 0}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got 0",
        id="duration-zero",
    ),
    pytest.param(
        _job(heartbeat="{timeout: .nan}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got nan",
        id="duration-nan",
    ),
    pytest.param(
        _job(heartbeat="{timeout: null}"),
        f"<file>: jobs.train.heartbeat.timeout: expected {DURATION_RULE}, got None",
        id="timeout-null",
    ),
    pytest.param(
        JOB + "policies: {default: {window: forever}}\n",
        f"<file>: policies.default.window: expected {DURATION_RULE}, got 'forever'",
        id="window-not-a-duration",
    ),
    pytest.param(
        _job(policy="fast"),
        "<file>: jobs.train.policy: expected a policy defined under policies (default), got 'fast'",
        id="unknown-policy-referenced",
    ),
    pytest.param(
        JOB + "policies: {default: {retries: 3}}\n",
        "<file>: policies.default.retries: expected one of actions, backoff, escalate, exec,"
        " kill_grace, max_restarts, rollback, window, xid_actions, got an unknown key",
        id="unknown-policy-key",
    ),
    pytest.param(
        JOB + "policies: {default: {actions: {ooom: restart}}}\n",
        f"<file>: policies.default.actions.ooom: expected one of {DETECTED}, got an unknown key",
        id="unknown-fault-kind",
    ),
    pytest.param(
        JOB + "policies: {default: {actions: {crash: reboot}}}\n",
        f"<file>: policies.default.actions.crash: expected one of {ALL_ACTIONS}, got 'reboot'",
        id="unknown-action",
    ),
    pytest.param(
        "jobs: [{name: j, command: [t], anomalies: {alert_z: 8, act_z: 4}}]\n",
        "<file>: jobs.j.anomalies: expected settings that agree (need 0 < alert_z <= act_z),"
        " got alert_z: 8, act_z: 4",
        id="anomalies-act-below-alert",
    ),
    pytest.param(
        "jobs: [{name: j, command: [t], anomalies: {margin: 100}}]\n",
        "<file>: jobs.j.anomalies.margin: expected policies.<the job's policy>.rollback.before"
        " (the setting moved there), got anomalies.margin",
        id="anomalies-margin-moved-to-the-policy",
    ),
    pytest.param(
        JOB + "policies: {default: {rollback: {max_widenings: -1}}}\n",
        "<file>: policies.default.rollback.max_widenings: expected an integer >= 0, got -1",
        id="rollback-negative-widenings",
    ),
    pytest.param(
        "jobs: [{name: j, command: [t], anomalies: {window: -3}}]\n",
        "<file>: jobs.j.anomalies.window: expected an integer >= 0, got -3",
        id="anomalies-negative-window",
    ),
    pytest.param(
        "jobs: [{name: j, command: [t], gpus: {devices: [0, 1], min: 3}}]\n",
        "<file>: jobs.j.gpus.min: expected at most the 2 devices listed, got 3",
        id="gpus-min-above-devices",
    ),
    pytest.param(
        JOB + "policies: {default: {max_restarts: -1}}\n",
        "<file>: policies.default.max_restarts: expected an integer >= 0, got -1",
        id="max-restarts-negative",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {initial: 5m, max: 1m}}}\n",
        "<file>: policies.default.backoff.max: expected at least initial (300s), got '1m'",
        id="backoff-max-below-initial",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {initial: 20m}}}\n",
        "<file>: policies.default.backoff.max: expected at least initial (1200s),"
        " got the default 600s",
        id="backoff-default-max-below-initial",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {jitter: 1.0}}}\n",
        "<file>: policies.default.backoff.jitter: expected a fraction 0 <= x < 1, got 1.0",
        id="jitter-one",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {jitter: -0.1}}}\n",
        "<file>: policies.default.backoff.jitter: expected a fraction 0 <= x < 1, got -0.1",
        id="jitter-negative",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {factor: 0.5}}}\n",
        "<file>: policies.default.backoff.factor: expected a number from 1 to 1000, got 0.5",
        id="factor-below-one",
    ),
    pytest.param(
        JOB + "metrics: {port: 70000}\n",
        "<file>: metrics.port: expected a port number 1-65535, or 0 for off, got 70000",
        id="port-too-high",
    ),
    pytest.param(
        JOB + "metrics: {port: -1}\n",
        "<file>: metrics.port: expected a port number 1-65535, or 0 for off, got -1",
        id="port-negative",
    ),
    pytest.param(
        JOB + "metrics: {port: '9445'}\n",
        "<file>: metrics.port: expected a port number 1-65535, or 0 for off, got '9445'",
        id="port-quoted",
    ),
    pytest.param(
        JOB + "gpu: {backend: cuda}\n",
        "<file>: gpu.backend: expected auto, nvml, sim or off, got 'cuda'",
        id="gpu-backend-invalid",
    ),
    pytest.param(
        _job(checkpoints="{pattern: latest.pt}"),
        "<file>: jobs.train.checkpoints.pattern: expected a file name pattern with one"
        " {step} and no '/', got 'latest.pt'",
        id="pattern-without-step",
    ),
    pytest.param(
        _job(checkpoints="{pattern: 'ckpt/step_{step}'}"),
        "<file>: jobs.train.checkpoints.pattern: expected a file name pattern with one"
        " {step} and no '/', got 'ckpt/step_{step}'",
        id="pattern-with-slash",
    ),
    pytest.param(
        _job(checkpoints="{layout: orbax}"),
        "<file>: jobs.train.checkpoints.layout: expected one of auto, generic, fixed, hf,"
        " lightning, dcp, megatron, deepspeed, trainwatch, got 'orbax'",
        id="checkpoint-layout-unknown",
    ),
    pytest.param(
        _job(resume_args="[--resume-from]"),
        "<file>: jobs.train.resume_args: expected an argument containing {checkpoint},"
        " got ['--resume-from']",
        id="resume-args-without-checkpoint",
    ),
    pytest.param(
        _job(env="{NCCL_DEBUG: {level: WARN}}"),
        "<file>: jobs.train.env.NCCL_DEBUG: expected a string, number or true/false,"
        " got {'level': 'WARN'}",
        id="env-nested-value",
    ),
    pytest.param(
        _job(env="{'A=B': 1}"),
        "<file>: jobs.train.env: expected variable names without '=' or NUL bytes, got 'A=B'",
        id="env-name-with-equals",
    ),
    pytest.param(
        _job(heartbeat="{interval: 5s}"),
        "<file>: jobs.train.heartbeat.interval: expected one of learned, ranks, required,"
        " startup_timeout, timeout, got an unknown key",
        id="unknown-heartbeat-key",
    ),
    pytest.param(
        JOB + "observe_only: yes please\n",
        "<file>: observe_only: expected true or false, got 'yes please'",
        id="observe-only-not-boolean",
    ),
    pytest.param(
        "jobs: [{name: train, command: [x]\n",
        "<file>: line 2, column 1: expected valid YAML, got an error: while parsing a"
        " flow mapping, expected ',' or '}', but got '<stream end>'",
        id="invalid-yaml-unclosed",
    ),
    pytest.param(
        "jobs:\n\t- name: train\n",
        "<file>: line 2, column 1: expected valid YAML, got an error: while scanning"
        " for the next token, found character '\\t' that cannot start any token",
        id="invalid-yaml-tab",
    ),
    pytest.param(
        JOB + JOB,
        "<file>: line 2, column 1: expected each key once, got 'jobs' again",
        id="duplicate-yaml-key",
    ),
    pytest.param(
        b"\xffjobs: []\n", "<file>: byte 0: expected UTF-8 text, got b'\\xff'", id="not-utf8"
    ),
    pytest.param(None, "<file>: cannot read: No such file or directory", id="missing-file"),
    pytest.param(
        f"run_dir: {LONG_RUN_DIR}\n" + JOB,
        f"<file>: run_dir: expected a path of at most {MAX_SOCKET_PATH - 16} bytes, so"
        f" that job train's socket jobs/train.sock fits an AF_UNIX address ({MAX_SOCKET_PATH}"
        f" bytes), got 101 bytes: '{LONG_RUN_DIR}'",
        id="run-dir-too-long-for-socket",
    ),
]


def _write(tmp_path: Path, content: str | bytes | None, name: str = "trainwatch.yaml") -> Path:
    """Write a config file (or, for None, leave its path empty) and return its path."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    return path


@pytest.mark.parametrize(("content", "message"), BAD)
def test_bad_config_is_refused_with_one_exact_line(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    """Each mistake raises ConfigError whose text is exactly the expected one line."""
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == message.replace("<file>", str(path))
    assert "\n" not in str(caught.value)


def test_relative_run_dir_is_measured_once_resolved(tmp_path: Path) -> None:
    """A short relative run_dir that is too long once resolved against the file is refused."""
    rel = "r" * 90
    path = _write(tmp_path, f"run_dir: {rel}\n" + JOB)
    resolved = str(tmp_path.resolve() / rel)
    assert len(resolved) + len("/jobs/train.sock") > MAX_SOCKET_PATH  # the premise
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: run_dir: expected a path of at most ")
    assert str(caught.value).endswith(f"got {len(resolved)} bytes: {resolved!r}")


def test_null_startup_timeout_is_accepted_as_off(tmp_path: Path) -> None:
    """startup_timeout: null is valid and means armed by the first beat only."""
    config = load(_write(tmp_path, _job(heartbeat="{timeout: 2m, startup_timeout: null}")))
    assert config.jobs[0].heartbeat.timeout == 120.0
    assert config.jobs[0].heartbeat.startup_timeout is None


@pytest.mark.parametrize(("line", "group"), [
    ("", "trainwatch"),  # trainwatch.privsep.access.GROUP, the group make install creates
    ("admin_group: gpu-admins\n", "gpu-admins"),
    ("admin_group: '1001'\n", "1001"),  # a gid, quoted as for a job's group
])
def test_admin_group_names_the_group_that_acts_on_every_job(
        tmp_path: Path, line: str, group: str) -> None:
    """admin_group: the control socket's admin group, a name or a gid; trainwatch unless set."""
    assert load(_write(tmp_path, JOB + line)).admin_group == group


def test_minimal_job_gets_documented_defaults(tmp_path: Path) -> None:
    """A job with only name and command gets the defaults DESIGN.md and the example state."""
    config = load(_write(tmp_path, JOB))
    job = config.jobs[0]
    assert job.name == "train"
    assert job.command == ("python", "train.py")
    assert job.heartbeat.timeout == 300.0
    assert job.heartbeat.startup_timeout is None
    assert job.heartbeat.learned is None
    assert job.checkpoints.dir is None
    assert job.checkpoints.pattern == "step_{step}"
    assert job.resume_args == ()
    assert dict(job.env) == {}
    assert job.policy == "default"
    policy = config.policy_for(job)
    assert policy.max_restarts == 10
    assert policy.window == 86400.0
    assert (policy.backoff.initial, policy.backoff.factor, policy.backoff.max) == (10, 2, 600)
    assert policy.kill_grace == 30.0
    assert policy.action_for(FaultKind.CRASH) is Action.RESTART
    assert policy.action_for(FaultKind.HANG) is Action.RESTART
    assert policy.action_for(FaultKind.NAN_LOSS) is Action.ROLLBACK
    rb = policy.rollback
    assert (rb.before, rb.skip_before, rb.skip_after, rb.max_widenings) == (1, 0, 0, 3)
    assert job.anomalies.detect == LossSettings()
    assert (config.metrics.address, config.metrics.port) == ("127.0.0.1", 9445)
    assert (job.heartbeat.required, job.heartbeat.ranks, job.heartbeat.max_ranks) == (
        False, None, 1024)
    assert job.group is None
    assert config.gpu.backend == "auto"
    assert config.observe_only is False


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("24h", 86400.0),
        ("1.5h", 5400.0),
        ("2d", 172800.0),
        (" 45 ", 45.0),
        ("0s", 0.0),
        (45, 45.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_converts_to_seconds(text: str | float, seconds: float) -> None:
    """parse_duration reads plain numbers and ms/s/m/h/d strings as seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    ["5 minutes", "1h30m", "5M", "-3s", "", "soon", -3, True, None, math.nan, math.inf, [30]],
)
def test_parse_duration_refuses_non_durations(value: object) -> None:
    """parse_duration raises ValueError for words, negatives, booleans and non-finite numbers."""
    with pytest.raises(ValueError):
        parse_duration(value)


def test_env_values_are_kept_as_text(tmp_path: Path) -> None:
    """Numbers and booleans in env become the strings a process environment holds."""
    config = load(_write(tmp_path, _job(env="{OMP_NUM_THREADS: 8, X: true, Y: 1.5, Z: ''}")))
    assert dict(config.jobs[0].env) == {"OMP_NUM_THREADS": "8", "X": "true", "Y": "1.5", "Z": ""}


def test_relative_paths_resolve_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """state_dir, run_dir and workdir are relative to the file's folder, not the cwd."""
    folder = tmp_path / "etc"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)  # somewhere else than the file's folder
    text = "state_dir: state\nrun_dir: ../run\n" + _job(workdir="work/llama")
    config = load(_write(folder, text))
    base = folder.resolve()
    assert config.state_dir == str(base / "state")
    assert config.run_dir == str(tmp_path.resolve() / "run")
    assert config.jobs[0].workdir == str(base / "work" / "llama")


def test_checkpoint_dir_resolves_against_workdir(tmp_path: Path) -> None:
    """A relative checkpoints.dir is relative to the job's workdir when it has one."""
    text = (
        "jobs:\n"
        "  - {name: a, command: [x], workdir: /data/llama, checkpoints: {dir: ckpt}}\n"
        "  - {name: b, command: [x], workdir: work, checkpoints: {dir: ../ckpt}}\n"
        "  - {name: c, command: [x], checkpoints: {dir: ckpt}}\n"
        "  - {name: d, command: [x], workdir: work, checkpoints: {dir: /abs/ckpt}}\n"
    )
    config = load(_write(tmp_path, text))
    base = tmp_path.resolve()
    dirs = [j.checkpoints.dir for j in config.jobs]
    assert dirs == ["/data/llama/ckpt", str(base / "ckpt"), str(base / "ckpt"), "/abs/ckpt"]


def test_example_config_loads_with_its_documented_values() -> None:
    """config/trainwatch.yaml is valid and says what its comments say."""
    config = load(EXAMPLE)
    assert config.state_dir == "/var/lib/trainwatch"
    assert config.run_dir == "/run/trainwatch"
    (job,) = config.jobs
    assert job.command[0] == "torchrun"
    assert job.workdir == "/data/llama"
    assert job.checkpoints.dir == "/data/llama/ckpt"
    assert "{checkpoint}" in " ".join(job.resume_args)
    policy = config.policy_for(job)
    assert policy.action_for(FaultKind.CRASH) is Action.RESTART
    # every detected kind is shown; gpu_xid only in a comment, so each Xid's class decides
    assert set(policy.actions) == DETECTED_KINDS - {FaultKind.GPU_XID}
    assert set(policy.actions.values()) <= {Action.ALERT, Action.RESTART, Action.STOP,
                                             Action.RESTART_EXCLUDE_GPU, Action.ROLLBACK}
    assert policy.xid_actions[63] is Action.ALERT and job.gpus.min == 6


def test_example_config_shows_every_key_with_a_comment() -> None:
    """Every key config.py accepts appears in the example, and every setting line is commented."""
    keys = {
        "state_dir",
        "run_dir",
        "observe_only",
        "admin_group",
        "metrics",
        "address",
        "port",
        "gpu",
        "backend",
        "count",
        "jobs",
        "name",
        "command",
        "workdir",
        "user",
        "group",
        "env",
        "resume_args",
        "checkpoints",
        "dir",
        "layout",
        "pattern",
        "marker",
        "quiet_for",
        "bad_after",
        "heartbeat",
        "timeout",
        "required",
        "ranks",
        "startup_timeout",
        "learned",
        "factor",
        "floor",
        "min_samples",
        "policy",
        "policies",
        "max_restarts",
        "window",
        "kill_grace",
        "backoff",
        "initial",
        "max",
        "jitter",
        "reset_after",
        "actions",
        "anomalies",
        "rollback",
        "before",
        "skip_before",
        "skip_after",
        "max_widenings",
        *(f.name for f in dataclasses.fields(LossSettings)),
        "stall", "ceiling", "silence", "idle_cpu",
        "evidence", "kinds", "native", "log_lines", "flight_recorder",
        "verify", "verify_timeout", "keep", "last", "every", "pinned", "min_free_bytes",
        "slurm", "node", "conf", "forget_after", "job",
    }
    lines = EXAMPLE.read_text().splitlines()
    shown = {m.group(1) for line in lines if (m := re.match(r"\s*(?:- )?(\w+):", line))}
    assert keys <= shown, f"not in the example: {sorted(keys - shown)}"
    for number, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert " # " in line or line.rstrip().endswith("#"), f"line {number} has no comment"
    assert "rollback" in EXAMPLE.read_text()


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    """Run the real `trainwatch check-config PATH` (the console script when installed)."""
    script = Path(sys.executable).with_name("trainwatch")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "trainwatch.cli"]
    return subprocess.run(
        [*argv, "check-config", str(path)], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    "content",
    [JOB + "policies: {default: {actions: {crash: reboot}}}\n", "jobs: [{name: a\n", None],
    ids=["bad-value", "bad-yaml", "missing-file"],
)
def test_check_config_cli_rejects_bad_file_with_one_line(
    tmp_path: Path, content: str | None
) -> None:
    """check-config on a bad file exits 2 with one `trainwatch: ` line and no traceback."""
    path = _write(tmp_path, content)
    result = _check_config(path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"trainwatch: {path}: ")


def test_check_config_cli_accepts_the_example() -> None:
    """check-config on config/trainwatch.yaml exits 0 and names its job (its folders and
    user are not on this machine: only warnings of what it cannot tell here are said)."""
    result = _check_config(EXAMPLE)
    assert result.returncode == 0, result.stderr
    # and what this host cannot tell of a job for another (its user, workdir, program)
    assert all(".checkpoints.dir: /data/llama/ckpt is not a folder here" in line
               or "no user or group 'alice' here" in line
               or ".workdir: /data/llama is not a folder here" in line
               or line.endswith("(on this host)")
               for line in result.stderr.splitlines()), result.stderr
    assert result.stdout.strip() == f"{EXAMPLE}: ok (1 job(s): llama-pretrain)"


def test_the_admin_groups_default_is_the_one_the_control_socket_judges_by() -> None:
    from trainwatch.config.schema import Config
    from trainwatch.privsep.access import GROUP

    assert Config.admin_group == GROUP
