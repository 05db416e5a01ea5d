"""The operator commands' arguments (``trainwatch status``, ``incidents``, ...):
each subcommand's parser, set to call its ``cmd_*`` (commands.py)."""

from __future__ import annotations

import argparse
import urllib.parse
from collections.abc import Callable

from trainwatch.cli.commands import (
    INCIDENT_LIMIT,
    Command,
    cmd_attach,
    cmd_checkpoints,
    cmd_incidents,
    cmd_pause,
    cmd_reload,
    cmd_resume,
    cmd_rollback,
    cmd_start,
    cmd_status,
    cmd_stop,
)
from trainwatch.config import fields


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return n

    return parse


def _base_url(text: str) -> str:
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment:
        raise argparse.ArgumentTypeError(
            f"expected Grafana's base URL (http[s]://host[:port][/path]), got {text!r}")
    return text.rstrip("/")


def _seconds(text: str) -> float:
    try:
        return fields.duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {fields.DUR}, got {text!r}") from None


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the operator commands to ``trainwatch``'s subcommands; each sets
    ``fn`` (cli.main's dispatch) to its ``cmd_*``."""

    def command(name: str, help: str, fn: Command) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help)
        p.add_argument("--config", help="the daemon's config (for its run_dir)")
        p.add_argument("--run-dir", help="the daemon's run_dir (control.sock)")
        p.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")
        p.set_defaults(fn=fn)
        return p

    command("status", "the daemon's jobs: state, step, heartbeat, restarts", cmd_status)

    i = command("incidents", "list recorded incidents (the ledger's, without a daemon)",
                cmd_incidents)
    i.add_argument("--state-dir", help="read this ledger directly")
    i.add_argument("--job", help="only this job's")
    i.add_argument("--limit", type=_count(1), default=INCIDENT_LIMIT,
                   help=f"the newest N (default {INCIDENT_LIMIT})")
    i.add_argument("--show", type=_count(1), metavar="N",
                   help="incident N in full: its evidence, each rank's stack, the rank "
                        "named and why (from the ledger)")
    i.add_argument("--html", metavar="FILE",
                   help="write a self-contained HTML page (nothing on it is fetched): with "
                        "--show, incident N's; else an index of the incidents (--job's) with "
                        "each job's goodput over time, and each listed incident's page beside "
                        "it (incident-N.html); - for stdout. Reads the ledger in --state-dir "
                        "(else the config's, else the default)")
    i.add_argument("--grafana", type=_base_url, metavar="URL",
                   help="with --html: link the job's Grafana dashboards for the incident's "
                        "window (Grafana's base URL, e.g. http://grafana:3000)")

    c = command("checkpoints", "a job's checkpoints and their verdicts", cmd_checkpoints)
    c.add_argument("job")
    c.add_argument("--state-dir",
                   help="read them from this state_dir, without a daemon (post-mortem; the"
                        " job's settings from --config when given, else from its state)")
    c.add_argument("--plan", action="store_true",
                   help="what retention (checkpoints.keep) would delete now, and why the "
                        "rest stays; deletes nothing")

    r = command("rollback", "relaunch a job from the checkpoint of a step", cmd_rollback)
    r.add_argument("job")
    r.add_argument("--to-step", type=_count(0), required=True, metavar="N",
                   help="the step of a good checkpoint")

    for name, help, fn in (
        ("pause", "stop acting on a job's faults (record only)", cmd_pause),
        ("resume", "act on a paused job's faults again", cmd_resume),
        ("stop", "stop a job (its whole process tree)", cmd_stop),
        ("start", "start a stopped job", cmd_start),
    ):
        command(name, help, fn).add_argument("job")

    command("reload", "re-read the daemon's config", cmd_reload)

    a = sub.add_parser("attach", help="register this Slurm task with the node's daemon, then"
                       " exec CMD (on the srun line)",
                       usage="trainwatch attach [--run-dir D] [--checkpoint-dir DIR]"
                             " [--timeout S] -- CMD ...")
    a.add_argument("--run-dir", help="the node's daemon's run_dir; {node}: SLURMD_NODENAME"
                   " (default $TRAINWATCH_RUN_DIR, else /run/trainwatch)")
    a.add_argument("--checkpoint-dir", help="where the job writes checkpoints")
    a.add_argument("--timeout", type=_seconds, metavar="DURATION",
                   help="give up (and run CMD unwatched) after this long (default"
                        " $TRAINWATCH_ATTACH_TIMEOUT, else 10s)")
    a.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    a.set_defaults(fn=cmd_attach)
