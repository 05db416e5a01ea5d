"""The ``trainwatch`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from trainwatch import __version__
from trainwatch.cli import parsers
from trainwatch.cli.runconfig import host_flag, run_config
from trainwatch.config import ConfigError, Job, fields, load, torchrun
from trainwatch.export.logformat import FORMATS as LOG_FORMATS
from trainwatch.export.logformat import IsoFormatter, JsonFormatter

DEFAULT_CONFIG = "/etc/trainwatch/trainwatch.yaml"
LAYOUTS = fields.LAYOUTS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


EXIT_CODES = """exit status:
  0    the job finished (exited 0)
  1    the job went fatal (restart budget spent, or it cannot be relaunched)
  2    a usage or config error, or trainwatch could not start
  129  stopped by SIGHUP (128 + 1): the terminal closed; the job was stopped too
  130  stopped by SIGINT (128 + 2, Ctrl-C), or the job was paused
  143  stopped by SIGTERM (128 + 15), e.g. systemctl stop or kill"""


def _duration(text: str) -> float:
    try:
        return fields.duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {fields.DUR}, got {text!r}") from None


def _duration_or_zero(text: str) -> float:
    try:
        return fields.duration_or_zero(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or {fields.DUR}, got {text!r}") from None


def _off_duration(text: str) -> float:
    """A duration, or 0.0 for 0 and off."""
    try:
        return fields.duration_or_off(text) or 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0, off or {fields.DUR}, got {text!r}") \
            from None


def _natural(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def _address(text: str) -> str:
    try:
        return fields.address(text)
    except (TypeError, ValueError) as e:
        why = e.expected if isinstance(e, fields.Refused) else fields.ADDRESS
        raise argparse.ArgumentTypeError(f"expected {why}, got {fields.show(text)}") from None


def _port(text: str) -> int:
    n = _natural(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return n


def _setup_logging(quiet: bool = False, log_format: str = "text") -> None:
    from trainwatch.actions.passthrough import LogHandler

    # Not a StreamHandler: a blocking write to a stalled stderr would stall the loop.
    handler = LogHandler(sys.stderr.fileno())
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else IsoFormatter("%(asctime)s trainwatch: %(message)s"))
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, handlers=[handler])


def _log_format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="trainwatch's own log lines: text (default) or json, one object"
                             " a line (time, level, logger, job, event, fields), for hosts"
                             " without journald")


def cmd_run(args: argparse.Namespace) -> int:
    from trainwatch.host.supervisor import Supervisor

    config, _job = run_config(args)
    _setup_logging(args.quiet, args.log_format)
    # A foreground wrapper: its job must not outlive it (the daemon adopts instead).
    return Supervisor(config, passthrough=not args.no_passthrough, die_with_parent=True).run()


def cmd_daemon(args: argparse.Namespace) -> int:
    from trainwatch.host.daemon import main as daemon_main
    from trainwatch.host.service import journal_handler

    load(args.config)  # a bad config: one line, before anything starts
    host = host_flag(args.host) if args.host is not None else None
    journal = journal_handler() if args.log_format == "text" else None
    if journal is not None:  # under systemd: structured fields (TRAINWATCH_JOB=...)
        logging.basicConfig(level=logging.INFO, handlers=[journal])
    else:  # --log-format json goes to stderr, journald or not: it was asked for
        _setup_logging(False, args.log_format)
    return daemon_main(args.config, host)


def cmd_clear_gpu(args: argparse.Namespace) -> int:
    from trainwatch.host.control import ControlError, request

    run_dir = args.run_dir or (load(args.config).run_dir if args.config else _default_run_dir())
    try:
        reply = request(run_dir, "gpu-clear", {"gpu": args.gpu})
    except ControlError as e:
        raise ConfigError(str(e)) from None
    if not reply.get("ok"):
        raise ConfigError(f"clear-gpu: {reply.get('error')}")
    print(f"GPU {args.gpu} is back in service")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from trainwatch.host.jobcheck import program_problems

    config = load(args.file)
    names = ", ".join(j.name for j in config.jobs)
    for j in config.jobs:  # a program that cannot start fails at every launch: one line now
        problem, warnings = program_problems(j)
        for w in warnings:
            print(f"trainwatch: warning: {args.file}: {w}", file=sys.stderr)
        if problem is not None:
            raise ConfigError(f"{args.file}: {problem}")
    for j in config.jobs:  # a warning, not an error: the job may make it
        folder = j.checkpoints.dir
        if folder is not None and not os.path.isdir(folder):
            print(f"trainwatch: warning: {args.file}: jobs.{j.name}.checkpoints.dir: {folder} "
                  "is not a folder here (mistyped? every relaunch would start from scratch)",
                  file=sys.stderr)
    print(f"{args.file}: ok ({len(config.jobs)} job(s): {names})")
    for j in config.jobs:
        if j.nodes is not None:
            _say_span(args.file, config.host, j, j.nodes)
    return 0


def _say_span(file: str, host: str, j: Job, nodes: tuple[int, int]) -> None:
    """A job across hosts: its span and the torchrun command trainwatch runs."""
    p = torchrun.plan(j.command, nodes, host, j.env)  # checked at load
    for w in p.warnings:
        print(f"trainwatch: warning: {file}: jobs.{j.name}.command: {w}", file=sys.stderr)
    env = {**p.env_defaults, **{k: j.env[k] for k in p.env_defaults if k in j.env}, **p.env}
    print(f"job {j.name}: spans {torchrun.span(nodes)} host{'' if nodes == (1, 1) else 's'} "
          f"(this one: {host}); runs "
          f"{shlex.join(p.argv)}; with " + " ".join(f"{k}={v}" for k, v in env.items()))


def _default_run_dir() -> str:
    from trainwatch.config import default_dirs

    return default_dirs()[1]


def cmd_demo(args: argparse.Namespace) -> int:
    from trainwatch.demo.drill import run_demo

    return run_demo(seed=args.seed, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trainwatch", description="A self-healing watchdog for GPU training runs.")
    p.add_argument("--version", action="version", version=f"trainwatch {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="a drill on a bundled trainer: faults detected and recovered")
    d.add_argument("--seed", type=int, default=7, help="where the faults land (default 7)")
    d.add_argument("--keep", action="store_true", help="keep the demo's temp dir")
    d.set_defaults(fn=cmd_demo)

    r = sub.add_parser("run", help="supervise one job in the foreground",
                       usage="trainwatch run [OPTIONS] -- CMD ...", epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--config", help="a YAML config (see config/trainwatch.yaml)")
    r.add_argument("--name", help="the job's name (with --config: which job)")
    r.add_argument("--host", help="this host's name (default: config's host, else the "
                   "hostname); for several \"hosts\" on one machine")
    r.add_argument("--state-dir", help="ledger, logs and state")
    r.add_argument("--run-dir", help="where the heartbeat socket lives")
    r.add_argument("--checkpoint-dir", help="where the job writes checkpoints")
    r.add_argument("--checkpoint-pattern", help="checkpoint names, e.g. 'step_{step}' (default)")
    r.add_argument("--layout", choices=LAYOUTS,
                   help="how the job writes checkpoints (default auto: recognises hf,"
                        " lightning, dcp, megatron and deepspeed, else learns the names)")
    r.add_argument("--checkpoint-marker", metavar="NAME",
                   help="a file whose presence inside (or beside) a checkpoint means complete")
    r.add_argument("--checkpoint-quiet-for", type=_duration, metavar="DURATION",
                   help="a checkpoint unchanged this long is complete (default off)")
    r.add_argument("--remote", metavar="URL",
                   help="a remote snapshot store, e.g. s3://bucket/prefix: with no good local"
                        " checkpoint, the newest snapshot is pulled from it before a launch"
                        " (credentials from the AWS environment or files only)")
    r.add_argument("--on-pull-failure", choices=("stop", "retire"),
                   help="when the pull from --remote fails: stop (default: the job goes fatal"
                        " rather than start fresh over the remote's snapshots) or retire (the"
                        " remote's snapshots renamed *.json.retired, then a fresh start)")
    r.add_argument("--resume-arg", action="append", metavar="ARG",
                   help="appended when resuming; repeat; e.g. --resume-arg=--resume "
                        "--resume-arg={checkpoint}")
    r.add_argument("--heartbeat-timeout", type=_duration, help="e.g. 5m (default 5m)")
    r.add_argument("--require-heartbeat", action="store_true",
                   help="the job uses trainwatch.client and must beat (heartbeat.required)")
    r.add_argument("--startup-timeout", type=_duration,
                   help="no first beat this long after a launch is a hang; needs"
                        " --require-heartbeat (default off)")
    r.add_argument("--stall-silence", type=_off_duration, metavar="DURATION",
                   help="without the client: no output and every process idle this long is a"
                        " stall, its stacks kept before the restart; 0 or off: never"
                        " (default 5m)")
    r.add_argument("--max-restarts", type=_natural, help="within the window (default 10 in 24h)")
    r.add_argument("--backoff", type=_duration_or_zero, metavar="DURATION",
                   help="the wait before the first relaunch, doubling after; 0: at once"
                        " (default 10s)")
    r.add_argument("--backoff-max", type=_duration, metavar="DURATION",
                   help="the longest wait before a relaunch (default 10m)")
    r.add_argument("--kill-grace", type=_duration, metavar="DURATION",
                   help="SIGTERM, then SIGKILL after this long (default 30s)")
    r.add_argument("--metrics-port", type=_port,
                   help="the Prometheus exporter's port (default 9445; 0: off)")
    r.add_argument("--metrics-address", type=_address,
                   help="the exporter's listen address (default 127.0.0.1; 0.0.0.0 for a"
                        " Prometheus on another host)")
    r.add_argument("--observe-only", action="store_true", help="record, never signal the job")
    r.add_argument("--no-passthrough", action="store_true", help="only log the job's output")
    r.add_argument("-q", "--quiet", action="store_true", help="only warnings from trainwatch")
    _log_format_option(r)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    r.set_defaults(fn=cmd_run)

    dm = sub.add_parser("daemon", help="supervise every job of a config (the service)")
    dm.add_argument("--config", default=DEFAULT_CONFIG, help=f"default {DEFAULT_CONFIG}")
    dm.add_argument("--host", help="this host's name (default: config's host, else the "
                    "hostname)")
    _log_format_option(dm)
    dm.set_defaults(fn=cmd_daemon)

    cg = sub.add_parser("clear-gpu", help="put an excluded GPU back in service")
    cg.add_argument("gpu", type=_natural, help="the GPU's index")
    cg.add_argument("--run-dir")
    cg.add_argument("--config")
    cg.set_defaults(fn=cmd_clear_gpu)

    c = sub.add_parser("check-config", help="validate a config file")
    c.add_argument("file")
    c.set_defaults(fn=cmd_check_config)

    parsers.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"trainwatch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"trainwatch: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
