"""A config file or flag written by an attacker or an unlucky operator: each is one
line naming the file, the field, what was expected and what was found, exit 2,
quickly and without a traceback, from `check-config` and `run --config` alike;
what the user obviously meant (numbers in a command, 1e-06, backoff 0) is taken."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainwatch import cli
from trainwatch.cli import runconfig
from trainwatch.config import ConfigError, Job, from_mapping, load, parse_duration
from trainwatch.detectors.xid import Immediate
from trainwatch.host.supervisor import check_command
from trainwatch.types import DETECTED_KINDS, FaultKind

JOB = "jobs: [{name: j, command: [python, train.py]}]\n"
DUR = "a duration > 0 such as 30s, 5m or 24h (at most 10 years)"
NUL = "a string without NUL bytes"

# A billion laughs in a checked field: nine lists of nine references to the one
# before, 9**9 "lol"s once expanded (what a repr of the value would expand).
LAUGHS = "jobs: [{name: j, command: [" + ", ".join(
    f"&l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 10)
).replace("*l0", "lol") + "]}]\n"

# An 800 KB string anchored in env and aliased 61,950 times in command: a file just
# under 1 MiB that expands to 50 GB of command line.
ALIASED_MB = ("jobs: [{name: j, env: {A: &s " + "x" * 800_000 + "}, command: [true, "
              + ", ".join(["*s"] * 61_950) + "]}]\n")


def _job(**fields: str) -> str:
    """A one-job config (job `j`) whose job has these extra flow-style fields."""
    extra = "".join(f", {k}: {v}" for k, v in fields.items())
    return f"jobs: [{{name: j, command: [python, train.py]{extra}}}]\n"


def _cmd(*args: str) -> str:
    """A one-job config whose command is `python` and these (YAML flow) arguments."""
    return f"jobs: [{{name: j, command: [python, {', '.join(args)}]}}]\n"


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "trainwatch.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# (content, the exact message after "<file>: ").
HOSTILE: list[object] = [
    pytest.param(
        LAUGHS,
        "line 1, column 1: expected at most 100000 values with aliases expanded, got more",
        id="billion-laughs",
    ),
    pytest.param(
        "jobs: " + "[" * 100_000 + "]" * 100_000 + "\n",
        "line 1, column 70: expected nesting at most 64 deep, got deeper",
        id="nesting-100000-deep",
    ),
    pytest.param(
        "jobs: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n",
        "line 1, column 256: expected nesting at most 64 deep, got deeper",
        id="mapping-nesting-100000-deep",
    ),
    pytest.param(
        "x: &x [*x]\n" + JOB,
        "line 1, column 4: expected at most 100000 values with aliases expanded, got an alias"
        " inside its own anchor (endless)",
        id="recursive-alias",
    ),
    pytest.param(
        JOB + "#" + " " * (1 << 20) + "\n",
        "expected a config file of at most 1 MiB (1048576 bytes), got a larger one",
        id="file-over-1-MiB",
    ),
    pytest.param(
        _job(heartbeat="{timeout: " + "9" * 5000 + "}"),
        "line 1, column 68: expected an integer of at most 4300 digits, got one of 5000"
        " characters",
        id="integer-of-5000-digits",
    ),
    pytest.param(
        _job(workdir="2024-13-45"),
        "line 1, column 56: expected a valid timestamp, got '2024-13-45' (month must be in"
        " 1..12)",
        id="impossible-timestamp",
    ),
    pytest.param(
        _job(workdir="!!bool maybe"),
        "line 1, column 56: expected a valid bool, got 'maybe' ('maybe')",
        id="tagged-bool-not-a-bool",
    ),
    pytest.param(
        _cmd('"a\\0b"'),
        f"jobs.j.command[1]: expected {NUL}, got 'a\\x00b'",
        id="nul-in-command",
    ),
    pytest.param(
        _cmd("train.py", "--epochs", "3", '"x\\0"'),
        f"jobs.j.command[4]: expected {NUL}, got 'x\\x00'",
        id="nul-in-command-names-the-element",
    ),
    pytest.param(
        _job(resume_args='[--resume, "{checkpoint}\\0"]'),
        f"jobs.j.resume_args[1]: expected {NUL}, got '{{checkpoint}}\\x00'",
        id="nul-in-resume-args",
    ),
    pytest.param(
        _job(workdir='"/data\\0/x"'),
        f"jobs.j.workdir: expected {NUL}, got '/data\\x00/x'",
        id="nul-in-workdir",
    ),
    pytest.param(
        _job(user='"alice\\0"'), f"jobs.j.user: expected {NUL}, got 'alice\\x00'", id="nul-in-user"
    ),
    pytest.param(
        _job(group='"staff\\0"'),
        f"jobs.j.group: expected {NUL}, got 'staff\\x00'",
        id="nul-in-group",
    ),
    pytest.param(
        _job(env='{A: "x\\0y"}'), f"jobs.j.env.A: expected {NUL}, got 'x\\x00y'", id="nul-in-env"
    ),
    pytest.param(
        _job(env='{"A\\0": x}'),
        "jobs.j.env: expected variable names without '=' or NUL bytes, got 'A\\x00'",
        id="nul-in-env-name",
    ),
    pytest.param(
        _job(checkpoints='{dir: "/ck\\0"}'),
        f"jobs.j.checkpoints.dir: expected {NUL}, got '/ck\\x00'",
        id="nul-in-checkpoint-dir",
    ),
    pytest.param(
        'state_dir: "/var\\0"\n' + JOB, f"state_dir: expected {NUL}, got '/var\\x00'",
        id="nul-in-state-dir",
    ),
    pytest.param(
        'run_dir: "/run\\0"\n' + JOB, f"run_dir: expected {NUL}, got '/run\\x00'",
        id="nul-in-run-dir",
    ),
    pytest.param(
        JOB + 'policies: {default: {exec: [/bin/drain, "{job}\\0"]}}\n',
        f"policies.default.exec[1]: expected {NUL}, got '{{job}}\\x00'",
        id="nul-in-exec",
    ),
    pytest.param(
        JOB + 'gpu: {kmsg: "/dev/kmsg\\0"}\n',
        f"gpu.kmsg: expected {NUL}, got '/dev/kmsg\\x00'",
        id="nul-in-kmsg",
    ),
    pytest.param(
        _job(retries="3"),
        "jobs.j.retries: expected one of anomalies, checkpoints, command, env, env_passthrough,"
        " evidence, gpus,"
        " group, heartbeat, logs, name, nodes, policy, resume_args, stall, user, workdir, got an"
        " unknown key",
        id="unknown-job-key-named-by-job",
    ),
    pytest.param(
        "jobs: [{name: 'my job', command: [x], retries: 3}]\n",
        "jobs[0].retries: expected one of anomalies, checkpoints, command, env, env_passthrough,"
        " evidence, gpus,"
        " group, heartbeat, logs, name, nodes, policy, resume_args, stall, user, workdir, got an"
        " unknown key",
        id="unknown-job-key-by-index-without-a-usable-name",
    ),
    pytest.param(
        _job(heartbeat="{timeout: " + "9" * 400 + "}"),
        f"jobs.j.heartbeat.timeout: expected {DUR}, got an integer of 400 digits",
        id="duration-of-400-digits",
    ),
    pytest.param(
        _job(heartbeat="{timeout: '" + "9" * 400 + "s'}"),
        f"jobs.j.heartbeat.timeout: expected {DUR}, got '{'9' * 56}...",
        id="duration-text-of-400-digits",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {max: .inf}}}\n",
        f"policies.default.backoff.max: expected {DUR}, got inf",
        id="duration-infinite",
    ),
    pytest.param(
        JOB + "policies: {default: {window: 3651d}}\n",
        f"policies.default.window: expected {DUR}, got '3651d'",
        id="duration-over-10-years",
    ),
    pytest.param(
        JOB + "policies: {default: {kill_grace: 1.0e+400}}\n",
        f"policies.default.kill_grace: expected {DUR}, got inf",
        id="duration-float-overflow",
    ),
    pytest.param(
        _job(heartbeat="{timeout: 0}"),
        f"jobs.j.heartbeat.timeout: expected {DUR}, got 0",
        id="zero-timeout-says-the-bound",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {initial: -1}}}\n",
        "policies.default.backoff.initial: expected a duration >= 0 such as 0, 30s or 5m"
        " (at most 10 years), got -1",
        id="negative-backoff-says-the-bound",
    ),
    pytest.param(
        JOB + "policies: {default: {backoff: {factor: " + "9" * 400 + "}}}\n",
        "policies.default.backoff.factor: expected a number from 1 to 1000, got an integer"
        " of 400 digits",
        id="factor-of-400-digits",
    ),
    pytest.param(
        _job(env="{A: &s " + "x" * 100_000 + "}",
             resume_args="[--resume, '{checkpoint}', " + ", ".join(["*s"] * 50) + "]"),
        "line 1, column 1: expected at most 4 MiB (4194304 bytes) of text with aliases"
        " expanded, got more",
        id="aliases-of-one-long-string",
    ),
    pytest.param(
        _cmd("&s " + "x" * 120_000, *["*s"] * 9),
        "jobs.j.command: expected a command and env of at most 1 MiB (1048576 bytes)"
        " together, what exec accepts, got 1200017 bytes",
        id="command-beyond-what-exec-accepts",
    ),
    pytest.param(
        _job(env="{V0: &s " + "x" * 120_000 + ", " + ", ".join(f"V{n}: *s" for n in range(1, 9))
             + "}"),
        "jobs.j.env: expected a command and env of at most 1 MiB (1048576 bytes) together,"
        " what exec accepts, got 1080052 bytes",
        id="env-beyond-what-exec-accepts",
    ),
    pytest.param(
        _cmd("x" * 200_000),
        "jobs.j.command[1]: expected an argument of at most 131071 bytes (what exec"
        " accepts), got one of 200000 bytes",
        id="argument-beyond-what-exec-accepts",
    ),
    pytest.param(
        _job(env="{A: " + "x" * 200_000 + "}"),
        "jobs.j.env.A: expected a variable of at most 131071 bytes as NAME=value (what exec"
        " accepts), got one of 200002 bytes",
        id="variable-beyond-what-exec-accepts",
    ),
    pytest.param(
        _job(group="'99999999999999999999'"),
        "jobs.j.group: expected a group name, or a gid from 0 to 4294967294, got"
        " '99999999999999999999'",
        id="gid-beyond-gid_t",
    ),
    pytest.param(
        _job(user="'4294967295'"),
        "jobs.j.user: expected a user name, or a uid from 0 to 4294967294, got '4294967295'",
        id="uid-that-is-uid_t-minus-one",
    ),
    pytest.param(
        _job(user="'" + "9" * 5000 + "'"),
        f"jobs.j.user: expected a user name, or a uid from 0 to 4294967294, got '{'9' * 56}...",
        id="uid-of-5000-digits",
    ),
    pytest.param(
        JOB + "policies: {default: {xid_actions: {'²': restart}}}\n",
        "policies.default.xid_actions.'²': expected an Xid number or a class"
        f" ({', '.join(sorted(c.value for c in Immediate))}), got '²'",
        id="xid-of-a-unicode-digit",
    ),
    pytest.param(
        _cmd("[" + ", ".join(["x"] * 40) + "]"),
        "jobs.j.command[1]: expected a string or a number, got a list of 40 items",
        id="large-value-described-not-repr",
    ),
]


@pytest.mark.parametrize(("content", "message"), HOSTILE)
def test_hostile_config_is_one_exact_line(tmp_path: Path, content: str, message: str) -> None:
    """Each hostile or broken file raises ConfigError with exactly this line, in < 5 s."""
    path = _write(tmp_path, content)
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == f"{path}: {message}"
    assert time.monotonic() - start < 5  # a hang shows as a failure, not a stuck suite


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (LAUGHS, "aliases expanded"),
        ("jobs: " + "[" * 100_000 + "]" * 100_000 + "\n", "nesting"),
        (_cmd('"a\\0b"'), "command[1]: expected a string without NUL bytes"),
        (_job(heartbeat="{timeout: " + "9" * 400 + "}"), "at most 10 years"),
        (JOB + "#" + " " * (1 << 20) + "\n", "at most 1 MiB"),
        (_job(heartbeat="{timeout: " + "9" * 5000 + "}"), "at most 4300 digits"),
        (_job(heartbeat="{startup_timeout: 20s}"), "declared to beat"),
        ("jobs: [{name: j, command: [torchrun, '--nproc-per-node={num_gpus}']}]\n"
         "gpu: {backend: off}\n", "{num_gpus}"),
        (ALIASED_MB, "expected at most 4 MiB (4194304 bytes) of text with aliases expanded"),
        (_cmd("&s " + "x" * 120_000, *["*s"] * 9), "jobs.j.command: expected a command and"
         " env of at most 1 MiB"),
        (JOB + "policies: {default: {xid_actions: {'²': restart}}}\n",
         "expected an Xid number or a class"),
        (_job(group="'99999999999999999999'"), "jobs.j.group: expected a group name, or a gid"),
    ],
    ids=["billion-laughs", "deep", "nul", "400-digits", "over-1-MiB", "5000-digits",
         "startup-without-required", "num-gpus-without-gpus", "aliases-of-800-KB",
         "command-beyond-exec", "xid-unicode-digit", "gid-beyond-gid_t"],
)
@pytest.mark.parametrize("verb", ["check-config", "run"])
def test_cli_refuses_hostile_config_with_one_line_and_exit_2(
    tmp_path: Path, content: str, says: str, verb: str
) -> None:
    """`check-config FILE` and `run --config FILE` exit 2 with one line, no traceback, quickly."""
    path = _write(tmp_path, content)
    args = [verb, str(path)] if verb == "check-config" else [
        "run", "--config", str(path), "--state-dir", str(tmp_path / "s"),
        "--run-dir", str(tmp_path / "r"), "--metrics-port", "0"]
    start = time.monotonic()
    result = _cli(*args)
    assert time.monotonic() - start < 30
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"trainwatch: {path}: ")
    assert says in result.stderr and len(result.stderr) < 400


def test_billion_laughs_given_as_values_is_described_not_expanded() -> None:
    """from_mapping with a 10**9-element value in a checked field refuses it at once."""
    code = (
        "import time\n"
        "from trainwatch.config import ConfigError, from_mapping\n"
        "x = ['lol'] * 10\n"
        "for _ in range(9): x = [x] * 10\n"
        "t = time.monotonic()\n"
        "try: from_mapping({'jobs': [{'name': 'j', 'command': ['a', x]}]})\n"
        "except ConfigError as e: print(e, round(time.monotonic() - t, 3))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=20, check=True).stdout
    message, seconds = out.rsplit(" ", 1)
    assert message == ("<config>: jobs.j.command[1]: expected a string or a number,"
                       " got a list of 10 items")
    assert float(seconds) < 1.0


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["train.py", "--epochs", "3"], ("python", "train.py", "--epochs", "3")),
        (["--lr", "0.0001", "--n", "0x10", "--x", "1.50"],
         ("python", "--lr", "0.0001", "--n", "0x10", "--x", "1.50")),
        (["--flag", "on", "--other", "true"], ("python", "--flag", "on", "--other", "true")),
    ],
    ids=["int", "float-and-hex", "booleans"],
)
def test_numbers_in_a_command_are_kept_as_written(
    tmp_path: Path, args: list[str], command: tuple[str, ...]
) -> None:
    """YAML numbers and booleans in command become the text the user typed."""
    assert load(_write(tmp_path, _cmd(*args))).jobs[0].command == command


def test_numbers_in_resume_args_exec_and_env_are_kept_as_written(tmp_path: Path) -> None:
    """resume_args, a policy's exec and env values keep numbers as written (010 is not 8)."""
    text = (
        "jobs: [{name: j, command: [t], resume_args: [--resume, '{checkpoint}', --keep, 2],"
        " env: {OMP_NUM_THREADS: 010, X: yes}}]\n"
        "policies: {default: {exec: [/bin/requeue, '{job}', --priority, 5]}}\n"
    )
    config = load(_write(tmp_path, text))
    job = config.jobs[0]
    assert job.resume_args == ("--resume", "{checkpoint}", "--keep", "2")
    assert dict(job.env) == {"OMP_NUM_THREADS": "010", "X": "yes"}
    assert config.policies["default"].exec == ("/bin/requeue", "{job}", "--priority", "5")


def test_numbers_given_as_values_are_stringified() -> None:
    """from_mapping (no YAML text to keep) turns numbers and booleans into their text."""
    config = from_mapping({"jobs": [{"name": "j", "command": ["t", 3, 1.5, True]}]})
    assert config.jobs[0].command == ("t", "3", "1.5", "true")


def test_json_dumped_config_is_accepted(tmp_path: Path) -> None:
    """A config written by json.dump (1e-06, 1500.0, string keys) loads: JSON is YAML."""
    doc = {"jobs": [{"name": "j", "command": ["t"], "heartbeat": {"timeout": 1500.0}}],
           "policies": {"default": {"backoff": {"initial": 1e-06, "max": "1.5e3s"},
                                    "xid_actions": {"79": "restart"}}}}
    path = tmp_path / "trainwatch.json"
    path.write_text(json.dumps(doc))
    assert "1e-06" in path.read_text()  # the premise: YAML 1.1 reads this as text
    config = load(path)
    backoff = config.policies["default"].backoff
    assert (backoff.initial, backoff.max) == (1e-06, 1500.0)
    assert config.jobs[0].heartbeat.timeout == 1500.0


def test_backoff_initial_zero_means_relaunch_at_once(tmp_path: Path) -> None:
    """backoff: {initial: 0} is accepted as 0 s."""
    config = load(_write(tmp_path, JOB + "policies: {default: {backoff: {initial: 0}}}\n"))
    assert config.policies["default"].backoff.initial == 0.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("1e-06", 1e-06), ("1.5e3s", 1500.0), ("2E2ms", 0.2), (".5s", 0.5)],
)
def test_parse_duration_reads_exponents(value: object, seconds: float) -> None:
    """What json.dump writes (1e-06) and exponents with a unit are durations."""
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["9" * 400, 10**400, "3651d", 315360001])
def test_parse_duration_refuses_absurd_values(value: object) -> None:
    """Beyond 10 years or overflowing: ValueError, never inf."""
    with pytest.raises(ValueError):
        parse_duration(value)


def test_parse_duration_bound_is_exactly_ten_years() -> None:
    """10 years is a duration, a second more is not; overflow and junk stay refused."""
    assert parse_duration("3650d") == parse_duration(315360000) == 315360000.0
    for value in ("1e999", "1e400s", "x" * 10**5, 315360000.5 + 1):
        with pytest.raises(ValueError):
            parse_duration(value)


def test_actions_are_accepted_for_exactly_the_detected_kinds(tmp_path: Path) -> None:
    """Every kind DESIGN names is detected now (the log rules raise nccl_stall, oom and
    log_pattern) and takes an action; a kind DESIGN does not name is an unknown key."""
    acts = ", ".join(f"{k.value}: alert" for k in DETECTED_KINDS)
    config = load(_write(tmp_path, JOB + f"policies: {{default: {{actions: {{{acts}}}}}}}\n"))
    assert set(config.policies["default"].actions) == set(DETECTED_KINDS)
    assert set(FaultKind) == DETECTED_KINDS
    path = _write(tmp_path, JOB + "policies: {default: {actions: {gpu_melted: alert}}}\n")
    with pytest.raises(ConfigError, match="got an unknown key"):
        load(path)


def test_num_gpus_without_gpus_is_refused(tmp_path: Path) -> None:
    """{num_gpus} with gpu.backend: off has no value: refused naming the argument."""
    text = ("jobs: [{name: j, command: [torchrun, '--nproc-per-node={num_gpus}', t.py]}]\n"
            "gpu: {backend: off}\n")
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == (
        f"{path}: jobs.j.command[1]: expected no {{num_gpus}} with gpu.backend: off (no GPUs"
        " are counted, so it has no value), got '--nproc-per-node={num_gpus}'"
    )
    assert load(_write(tmp_path, text.replace("off", "auto"))).gpu.backend == "auto"


def test_yaml_words_that_are_booleans_are_read_as_written(tmp_path: Path) -> None:
    """`backend: off` (YAML 1.1's false) is the backend off, and `name: 2024` the name 2024."""
    config = load(_write(tmp_path, "jobs: [{name: 2024, command: [t]}]\ngpu: {backend: off}\n"))
    assert (config.gpu.backend, config.jobs[0].name) == ("off", "2024")


def test_heartbeat_required_ranks_and_group_are_read(tmp_path: Path) -> None:
    """heartbeat.required, heartbeat.ranks (the cap on ranks believed) and group parse."""
    text = _job(group="llama",
                heartbeat="{required: true, startup_timeout: 30m, ranks: 8}")
    job = load(_write(tmp_path, text)).jobs[0]
    assert job.group == "llama"
    hb = job.heartbeat
    assert (hb.required, hb.startup_timeout, hb.ranks, hb.max_ranks) == (True, 1800.0, 8, 8)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"heartbeat": "{startup_timeout: 30m}"},
         "jobs.j.heartbeat.startup_timeout: expected it only with heartbeat.required: true,"
         " got '30m' without it (a job that is not declared to beat cannot be judged by the"
         " absence of beats)"),
        ({"heartbeat": "{required: yes please}"},
         "jobs.j.heartbeat.required: expected true or false, got 'yes please'"),
        ({"heartbeat": "{ranks: 0}"},
         "jobs.j.heartbeat.ranks: expected an integer from 1 to 1048576 (the job's world"
         " size), or null, got 0"),
        ({"heartbeat": "{ranks: 2000000}"},
         "jobs.j.heartbeat.ranks: expected an integer from 1 to 1048576 (the job's world"
         " size), or null, got 2000000"),
        ({"group": "1000"}, "jobs.j.group: expected a non-empty string, got 1000"),
    ],
    ids=["startup-without-required", "required-not-boolean", "ranks-zero", "ranks-huge",
         "group-not-a-string"],
)
def test_new_heartbeat_and_group_keys_are_checked(
    tmp_path: Path, fields: dict[str, str], message: str
) -> None:
    """The new keys refuse what they cannot mean, in one line naming the field."""
    path = _write(tmp_path, _job(**fields))
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == f"{path}: {message}"


def _run_args(*extra: str) -> argparse.Namespace:
    args = cli.build_parser().parse_args(["run", "--state-dir", "/tmp/s", "--run-dir", "/tmp/r",
                                          *extra])
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return args


def test_run_flags_set_require_heartbeat_startup_timeout_and_metrics_address() -> None:
    """--require-heartbeat with --startup-timeout and --metrics-address reach the config."""
    config, job = runconfig.run_config(_run_args(
        "--require-heartbeat", "--startup-timeout", "20s", "--metrics-address", "0.0.0.0",
        "--", "true"))
    assert (job.heartbeat.required, job.heartbeat.startup_timeout) == (True, 20.0)
    assert config.metrics.address == "0.0.0.0"
    config, job = runconfig.run_config(_run_args("--", "true"))
    assert config.metrics.address == "127.0.0.1" and job.heartbeat.required is False


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--startup-timeout", "20s", "--", "true"],
         "trainwatch: --startup-timeout: expected it only with --require-heartbeat (or"
         " heartbeat.required: true), got 20s without it (a job that is not declared to beat"
         " cannot be judged by the absence of beats)"),
        (["--heartbeat-timeout", "0", "--", "true"],
         f"trainwatch run: argument --heartbeat-timeout: expected {DUR}, got '0' (see --help)"),
        (["--heartbeat-timeout", "9" * 400, "--", "true"],
         f"trainwatch run: argument --heartbeat-timeout: expected {DUR}, got '{'9' * 400}'"
         " (see --help)"),
        (["--name", "my job", "--", "true"],
         "trainwatch: --name: expected a name of letters, digits, '_', '.', '-' (at most 63),"
         " got 'my job'"),
        (["--run-dir", "/" + "r" * 100, "--", "true"],
         "trainwatch: --run-dir: expected a path of at most 93 bytes, so that job job's socket"
         " jobs/job.sock fits an AF_UNIX address (107 bytes), got 101 bytes:"
         f" '/{'r' * 100}'"),
    ],
    ids=["startup-without-require", "zero-timeout", "400-digit-timeout", "bad-name",
         "run-dir-too-long"],
)
def test_run_flag_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], expect: str
) -> None:
    """Bad `trainwatch run` flags: exit 2 and exactly this one line."""
    base = ["run", "--state-dir", str(tmp_path / "s"), "--metrics-port", "0"]
    if "--run-dir" not in args:
        base += ["--run-dir", str(tmp_path / "r")]
    result = _cli(*base, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr == expect + "\n"


def test_run_help_documents_every_exit_code() -> None:
    """`trainwatch run --help` lists 0, 1, 2, 129, 130 and 143 with what each means."""
    out = _cli("run", "--help").stdout
    codes = re.findall(r"^  (\d+)\s+\S", out, re.MULTILINE)
    assert codes == ["0", "1", "2", "129", "130", "143"]
    for signal_name in ("SIGHUP", "SIGINT", "SIGTERM"):
        assert signal_name in out


def test_log_lines_carry_iso_8601_milliseconds_and_utc_offset() -> None:
    """trainwatch's log timestamps are ISO 8601 with milliseconds and the UTC offset."""
    code = ("import logging\nfrom trainwatch.cli import _setup_logging\n_setup_logging()\n"
            "logging.getLogger('trainwatch.x').info('hello')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True, env={**os.environ, "TZ": "Asia/Kolkata"}
                         ).stderr
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+05:30 trainwatch: hello\n", err), err


def test_iso_formatter_formats_a_record_in_utc_offset_form() -> None:
    """The formatter renders a known instant with milliseconds and an explicit offset."""
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "m", None, None)
    record.created = 1_800_000_000.123
    stamp = cli.IsoFormatter("%(asctime)s").format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.123[+-]\d\d:\d\d", stamp), stamp


def test_shipped_config_passes_check_config_and_promises_nothing_missing() -> None:
    """config/trainwatch.yaml loads, passes check-config, names no absent DESIGN.md, and
    documents the new keys (log rules, the oom action)."""
    shipped = Path(__file__).resolve().parent.parent / "config" / "trainwatch.yaml"
    result = _cli("check-config", str(shipped))
    assert result.returncode == 0, result.stderr
    text = shipped.read_text()
    assert "DESIGN.md" not in text
    assert "logs:" in text and "rules:" in text  # log rules exist now and are shown
    assert re.search(r"^\s*oom: stop", text, re.MULTILINE)
    for key in ("required:", "ranks:", "group:", "address: 127.0.0.1", "0.0.0.0"):
        assert key in text, key
    job = load(shipped).jobs[0]
    assert job.heartbeat.required and job.heartbeat.startup_timeout is not None


def _run_cli(tmp_path: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return _cli("run", "--config", str(config), "--state-dir", str(tmp_path / "s"),
                "--run-dir", str(tmp_path / "r"), "--metrics-port", "0")


@pytest.mark.parametrize("user", ["²", "٣"], ids=["superscript-two", "arabic-indic-three"])
def test_a_user_of_unicode_digits_is_a_name_not_a_uid(tmp_path: Path, user: str) -> None:
    """`user: "٣"` is no uid 3 (sys) and `user: "²"` no crash: `run` says no such user."""
    assert len(user.encode()) > 1 and user.isdigit()  # the premise: str.isdigit() takes it
    path = _write(tmp_path, f"jobs: [{{name: j, command: [true], user: '{user}'}}]\n")
    assert _cli("check-config", str(path)).returncode == 0  # a name; no user need exist here
    result = _run_cli(tmp_path, path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"trainwatch: jobs.j.user: no such user {user!r}\n"


def test_an_id_beyond_uid_t_is_refused_by_run_too(tmp_path: Path) -> None:
    """`run --config` with a gid of 20 digits exits 2 with one line; the largest id loads."""
    path = _write(tmp_path, _job(group="'99999999999999999999'"))
    result = _run_cli(tmp_path, path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"trainwatch: {path}: jobs.j.group: expected a group name, or a"
                             " gid from 0 to 4294967294, got '99999999999999999999'\n")
    job = load(_write(tmp_path, _job(user="'4294967294'", group="'0'"))).jobs[0]
    assert (job.user, job.group) == ("4294967294", "0")


@pytest.mark.parametrize(("user", "group"), [(None, "99999999999999999999"),
                                             ("²", None),
                                             (None, "²"), ("٣", None)])
def test_check_command_refuses_any_unresolvable_id_in_one_line(
    user: str | None, group: str | None
) -> None:
    """A Job built without the config's checks (an id beyond uid_t, a Unicode digit)
    still gets a ConfigError from the pre-start check, never an OverflowError."""
    job = Job(name="j", command=("true",), user=user, group=group)
    with pytest.raises(ConfigError) as caught:
        check_command(job)
    where = "user" if user is not None else "group"
    assert str(caught.value).startswith(f"jobs.j.{where}: no such {where}")
