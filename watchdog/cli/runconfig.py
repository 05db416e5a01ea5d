"""``trainwatch run``'s config: a config file's job, or one made from the flags
(``--checkpoint-dir``, ``--heartbeat-timeout``, ... ``-- CMD``), checked as the
config file's would be."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from trainwatch.config import (
    ConfigError,
    Job,
    check_command,
    fields,
    from_mapping,
    load,
    socket_problem,
    torchrun,
)
from trainwatch.config.sections import REMOTE_LAYOUTS


def run_config(args: argparse.Namespace) -> tuple[Any, Job]:
    """The config and the one job that ``trainwatch run`` supervises."""
    if args.config:
        config = load(args.config)
        job = config.job(args.name)
        if args.command:
            check_command(args.command, config.gpu.backend, lambda n: f"-- CMD: argument {n}")
            job = replace(job, command=tuple(args.command))
            if job.nodes is not None:  # the job spans hosts: torchrun, --nnodes as nodes
                try:
                    torchrun.plan(job.command, job.nodes, "", job.env)
                except torchrun.SpanError as e:
                    raise ConfigError(f"-- CMD: {e}") from None
    else:
        if not args.command:
            raise ConfigError("trainwatch run: expected a command after --, got nothing")
        if args.name is not None and not fields.NAME_RE.match(args.name):
            raise ConfigError(f"--name: expected {fields.NAME}, got {fields.show(args.name)}")
        config = from_mapping(
            {"jobs": [{"name": args.name or "job", "command": list(args.command)}]},
            "<flags>",
        )
        job = config.jobs[0]
    hb = job.heartbeat
    if args.heartbeat_timeout is not None:
        hb = replace(hb, timeout=args.heartbeat_timeout)
    if args.require_heartbeat:
        hb = replace(hb, required=True)
    if args.startup_timeout is not None:
        hb = replace(hb, startup_timeout=args.startup_timeout)
    if hb.startup_timeout is not None and not hb.required:
        # With --config, a YAML startup_timeout without required was refused at load.
        raise ConfigError(
            f"--startup-timeout: expected it only with --require-heartbeat (or"
            f" heartbeat.required: true), got {hb.startup_timeout:g}s without it (a job"
            " that is not declared to beat cannot be judged by the absence of beats)"
        )
    cp = job.checkpoints
    if args.checkpoint_dir is not None:
        cp = replace(cp, dir=args.checkpoint_dir)
    if args.checkpoint_marker is not None:
        if not args.checkpoint_marker or "/" in args.checkpoint_marker:
            raise ConfigError("--checkpoint-marker: expected a file name without '/', got "
                              f"{args.checkpoint_marker!r}")
        cp = replace(cp, marker=args.checkpoint_marker)
    if args.checkpoint_quiet_for is not None:
        cp = replace(cp, quiet_for=args.checkpoint_quiet_for)
    if args.layout is not None:
        cp = replace(cp, layout=args.layout)
    if args.checkpoint_pattern is not None:
        fixed = cp.layout == "fixed"
        if "/" in args.checkpoint_pattern or (
                ("{step}" in args.checkpoint_pattern) if fixed
                else args.checkpoint_pattern.count("{step}") != 1):
            want = ("the one file's name, without {step} or '/' (--layout fixed)" if fixed
                    else "a file name pattern with one {step} and no '/'")
            raise ConfigError(f"--checkpoint-pattern: expected {want}, got "
                              f"{args.checkpoint_pattern!r}")
        cp = replace(cp, pattern=args.checkpoint_pattern)
    elif cp.layout == "fixed" and args.layout is not None and not args.config:
        raise ConfigError("--layout fixed: expected --checkpoint-pattern naming the one file "
                          "(e.g. snapshot.pt), got none")
    if args.remote is not None:
        try:
            cp = replace(cp, remote=fields.remote(args.remote))
        except fields.Refused as e:
            raise ConfigError(f"--remote: expected {e.expected}, got {fields.show(e.got)}") \
                from None
        except ValueError:
            raise ConfigError(f"--remote: expected {fields.REMOTE}, got "
                              f"{fields.show(args.remote)}") from None
    if args.on_pull_failure is not None:
        cp = replace(cp, on_pull_failure=args.on_pull_failure)
    if cp.remote is not None:
        if cp.layout not in REMOTE_LAYOUTS:
            raise ConfigError(f"--remote: expected --layout trainwatch or auto (the remote holds "
                              f"trainwatch snapshots), got {cp.layout}")
        if cp.dir is None:
            raise ConfigError("--remote: expected --checkpoint-dir too (where a remote "
                              "snapshot is pulled to), got none")
    if args.resume_arg:
        if not any("{checkpoint}" in a for a in args.resume_arg):
            raise ConfigError("--resume-arg: expected an argument containing {checkpoint}")
        job = replace(job, resume_args=tuple(args.resume_arg))
    if args.stall_silence is not None:
        job = replace(job, stall=replace(job.stall, silence=args.stall_silence or None))
    job = replace(job, heartbeat=hb, checkpoints=cp)
    policies = dict(config.policies)
    pol = policies[job.policy]
    if args.max_restarts is not None:
        pol = replace(pol, max_restarts=args.max_restarts)
    if args.kill_grace is not None:
        pol = replace(pol, kill_grace=args.kill_grace)
    if args.backoff is not None or args.backoff_max is not None:
        b = pol.backoff
        b = replace(b, initial=args.backoff if args.backoff is not None else b.initial,
                    max=args.backoff_max if args.backoff_max is not None else b.max)
        if b.max < b.initial:
            raise ConfigError(f"--backoff-max: expected at least the backoff ({b.initial:g}s),"
                              f" got {b.max:g}s")
        pol = replace(pol, backoff=b)
    policies[job.policy] = pol
    config = replace(
        config,
        jobs=(job,),
        policies=policies,
        host=host_flag(args.host) if args.host is not None else config.host,
        state_dir=args.state_dir or config.state_dir,
        run_dir=args.run_dir or config.run_dir,
        observe_only=config.observe_only or args.observe_only,
    )
    if args.metrics_port is not None:
        config = replace(config, metrics=replace(config.metrics, port=args.metrics_port))
    if args.metrics_address is not None:
        config = replace(config, metrics=replace(config.metrics, address=args.metrics_address))
    problem = socket_problem(config.run_dir, job.name)
    if problem is not None:
        where = "--run-dir" if args.run_dir else f"{config.source}: run_dir"
        raise ConfigError(f"{where}: {problem}")
    return config, job


def host_flag(text: str) -> str:
    """--host: this host's name, as config's ``host:`` (two "hosts" on one machine)."""
    try:
        return fields.host(text)
    except ValueError:
        raise ConfigError(f"--host: expected {fields.HOST}, got {fields.show(text)}") from None
