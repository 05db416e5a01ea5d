"""The config file: read within limits, validated (trainwatch.config.read) into the
schema's frozen objects (trainwatch.config.schema), relative paths resolved.

The rest of trainwatch imports the config's names from here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from trainwatch.config import yamldoc
from trainwatch.config.command import MAX_ARG_BYTES, MAX_EXEC_BYTES, check_command
from trainwatch.config.fields import MAX_DURATION, Said, parse_duration, show
from trainwatch.config.read import MAX_SIM_GPUS, from_mapping
from trainwatch.config.reader import Reader
from trainwatch.config.schema import (
    DEFAULT_ACTIONS,
    DEFAULT_MAX_RANKS,
    MAX_SOCKET_PATH,
    Anomalies,
    Backoff,
    Checkpoints,
    Config,
    ConfigError,
    Escalate,
    Gpu,
    Gpus,
    Heartbeat,
    Job,
    Learned,
    Metrics,
    Policy,
    Rollback,
    check_socket_paths,
    default_dirs,
    socket_path,
    socket_problem,
    socket_room,
    with_job,
)

__all__ = [
    "DEFAULT_ACTIONS",
    "DEFAULT_MAX_RANKS",
    "MAX_ARG_BYTES",
    "MAX_DURATION",
    "MAX_EXEC_BYTES",
    "MAX_SIM_GPUS",
    "MAX_SOCKET_PATH",
    "Anomalies",
    "Backoff",
    "Checkpoints",
    "Config",
    "ConfigError",
    "Escalate",
    "Gpu",
    "Gpus",
    "Heartbeat",
    "Job",
    "Learned",
    "Metrics",
    "Policy",
    "Rollback",
    "check_command",
    "default_dirs",
    "from_mapping",
    "load",
    "parse_duration",
    "socket_path",
    "socket_problem",
    "socket_room",
    "with_job",
]

# Plain YAML scalars kept as the text the user wrote (`--epochs, 3`, `X: 010`,
# `backend: off`, which YAML 1.1 reads as false, `name: 2024`, `nodes: 2:4`, which
# YAML 1.1 reads as the base-60 number 124).
_AS_TEXT = (
    ("gpu", "backend"),
    ("host",),
    ("jobs", "*", "nodes"),
    ("jobs", "*", "name"),
    ("jobs", "*", "command", "*"),
    ("jobs", "*", "resume_args", "*"),
    ("jobs", "*", "env", "*"),
    ("policies", "*", "exec", "*"),
)


def _resolve(r: Reader, config: Config, base: Path) -> Config:
    """Relative paths in a file are relative to the file's folder; a job's
    checkpoint dir is relative to its workdir when it has one."""

    def absolute(p: str | None, root: Path, where: str) -> str | None:
        if p is None:
            return None
        try:
            return str((root / os.path.expanduser(p)).resolve())
        except (OSError, RuntimeError) as e:  # a symlink loop, say
            raise r.fail(where, "a path that resolves", Said(f"{show(p)}: {e}")) from None

    jobs = []
    for j in config.jobs:
        workdir = absolute(j.workdir, base, f"jobs.{j.name}.workdir")
        root = Path(workdir) if workdir else base
        cp = replace(j.checkpoints, dir=absolute(j.checkpoints.dir, root,
                                                 f"jobs.{j.name}.checkpoints.dir"))
        jobs.append(replace(j, workdir=workdir, checkpoints=cp))
    # trainwatch's own folders stay as written, made absolute only: each symlink in
    # them is judged as the folders are walked (state/ownership.py), not followed here
    # first (a user's link in /tmp above state_dir led root into a folder of its own).
    return replace(
        config,
        jobs=tuple(jobs),
        state_dir=os.path.normpath(base / os.path.expanduser(config.state_dir)),
        run_dir=os.path.normpath(base / os.path.expanduser(config.run_dir)),
    )


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file (at most 1 MiB, aliases bounded)."""
    p = Path(path)
    try:
        raw = yamldoc.read(p, _AS_TEXT)
    except yamldoc.DocumentError as e:
        raise ConfigError(f"{p}: {e}") from None
    r = Reader(str(p))
    try:
        config = _resolve(r, from_mapping(raw, str(p)), p.resolve().parent)
    except RecursionError:  # nothing above recurses on values; if it ever does: one line
        raise ConfigError(f"{p}: top level: expected nesting at most {yamldoc.MAX_DEPTH}"
                          " deep, got deeper") from None
    # A relative run_dir is only as long as it is once resolved.
    check_socket_paths(r.source, config.run_dir, config.jobs)
    return config

