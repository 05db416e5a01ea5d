"""The operator commands that talk to the running daemon over its control
socket (``trainwatch.host.control``): ``status``, ``incidents``, ``checkpoints``,
``rollback``, ``pause``, ``resume``, ``stop``, ``start`` and ``reload``; and
``attach``, a Slurm task's (trainwatch.slurmattach).

Each sends one request and prints the reply as a table or one line, or with
``--json`` the reply's payload (without ``"ok"``). What goes wrong is one line
on stderr and exit 1: no daemon, permission denied, or the daemon's own refusal
(``trainwatch OP: why``, e.g. a job that runs as another user: access.py); a
bad ``--config`` stays a usage error (exit 2, via ``ConfigError`` in
``cli.main``). ``incidents`` also works without a daemon: it
reads the ledger read-only, as it always has; so does ``checkpoints JOB
--state-dir S``, from the job's state there (checkpointlist.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainwatch.cli.tables import (
    age,
    render_checkpoints,
    render_incidents,
    render_plan,
    render_status,
    state_word,
)
from trainwatch.config import ConfigError, default_dirs, load
from trainwatch.evidence import show
from trainwatch.host.control import ControlError, control_path, request
from trainwatch.state import checkpointlist
from trainwatch.state.ledger import Ledger

__all__ = [
    "age",
    "render_checkpoints",
    "render_incidents",
    "render_status",
    "run_dir_of",
]

INCIDENT_LIMIT = 50  # rows `incidents` asks for by default: one reply is at most 64 KiB

Command = Callable[[argparse.Namespace], int]


class Failed(Exception):
    """A command failed for a reason outside the user's flags: one line, exit 1."""

    def __init__(self, line: str, op: str | None = None) -> None:
        super().__init__(line)
        self.op = op


class NotRunning(Failed):
    """No daemon behind the run_dir (no socket, or nothing bound to it)."""


def _command(body: Command) -> Command:
    """Failed becomes its one line on stderr and exit 1."""

    @functools.wraps(body)
    def cmd(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except Failed as e:
            who = f"trainwatch {e.op}" if e.op else "trainwatch"
            print(f"{who}: {e}", file=sys.stderr)
            return 1

    return cmd


# --- talking to the daemon ---------------------------------------------------


def run_dir_of(args: argparse.Namespace) -> str:
    """--run-dir, else the config's run_dir, else the default one."""
    if args.run_dir:
        return str(args.run_dir)
    if args.config:
        return load(args.config).run_dir
    return default_dirs()[1]


# A rollback to a step only the remote store holds waits for the remote's
# listing, in a hand as the job's user (pull.LIST_MAX, 10 s, after the hand's start,
# pull.START_MAX, 10 s).
ROLLBACK_WAIT = 30.0


def _permission(path: str) -> Failed:
    # The socket is open to every local user (the daemon decides per request);
    # what keeps one out is the folder it lies in.
    return Failed(f"permission denied: {path}: its folder (run_dir) is not open to this user")


def ask(run_dir: str, op: str, args: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request; the reply's payload (without "ok"). Raises Failed, one line."""
    path = control_path(run_dir)
    try:
        reply = request(run_dir, op, args, timeout)
    except ControlError as e:
        # request() raises "from None"; the OS error it maps is still the context.
        cause = e.__context__
        if isinstance(cause, FileNotFoundError | ConnectionRefusedError):
            raise NotRunning(f"no trainwatch daemon at {path} (is it running?"
                             " --run-dir/--config)") from None
        if isinstance(cause, PermissionError):
            raise _permission(path) from None
        raise Failed(str(e)) from None
    if not reply["ok"]:
        error = " ".join(str(reply.get("error") or "failed").split())
        if error.startswith("not permitted"):  # ControlSocket's refusal of the sender
            raise _permission(path)
        # ControlSocket puts the op before a handler's error; we name it already.
        raise Failed(error.removeprefix(f"{op}: "), op)
    return {k: v for k, v in reply.items() if k != "ok"}


def _print_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=1)
    print()


def _render(op: str, fn: Callable[[], str]) -> str:
    """A reply that does not have the expected shape is one line, not a traceback
    (a daemon of another version)."""
    try:
        return fn()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise Failed(f"unexpected reply from the daemon ({type(e).__name__}: {e})", op) from None


def _reload_line(reply: dict[str, Any]) -> str:
    parts = [f"{what} {', '.join(reply[what])}" for what in ("added", "changed", "removed")
             if reply.get(what)]
    unchanged = len(reply.get("unchanged") or [])
    if not parts:
        return f"reloaded: no changes ({unchanged} job(s) unchanged)"
    return f"reloaded: {'; '.join(parts)}; {unchanged} unchanged"


# --- the commands ------------------------------------------------------------


@_command
def cmd_status(args: argparse.Namespace) -> int:
    reply = ask(run_dir_of(args), "status", {})
    if args.json:
        _print_json(reply)
    else:
        print(_render("status", lambda: render_status(reply)))
    return 0


def _ledger_rows(state_dir: str, job: str | None, limit: int, *,
                 missing: Callable[[], Exception]) -> list[dict[str, Any]]:
    """The newest ``limit`` incidents of the ledger, oldest first, read-only."""
    try:
        ledger = Ledger(state_dir, readonly=True)
    except FileNotFoundError:
        raise missing() from None
    try:
        return ledger.incidents(job)[-limit:]
    except sqlite3.Error as e:
        raise Failed(f"{ledger.path}: cannot read the ledger: {e}", "incidents") from None
    finally:
        ledger.close()


def _state_dir(args: argparse.Namespace) -> str:
    """--state-dir, else the config's state_dir, else the default one."""
    config = load(args.config) if args.config else None
    return str(args.state_dir or (config.state_dir if config else default_dirs()[0]))


def _no_ledger(state_dir: str) -> Callable[[], Exception]:
    return lambda: ConfigError(f"{state_dir}: no ledger here (expected {state_dir}/ledger.db)")


def _show(args: argparse.Namespace) -> int:
    """One incident in full, from the ledger and the evidence kept beside it."""
    state_dir = _state_dir(args)
    rows = _ledger_rows(state_dir, None, 1 << 30, missing=_no_ledger(state_dir))
    row = next((r for r in rows if r["id"] == args.show), None)
    if row is None:
        raise Failed(f"no incident {args.show} in {state_dir}/ledger.db", "incidents")
    if args.html is not None:
        from trainwatch.evidence import page  # the renderer: only for --html

        _write_html(args.html, page.incident_page(state_dir, row, args.grafana),
                    f"incident {row['id']} ({row['kind']} on {row['job']})")
    elif args.json:
        _print_json(row)
    else:
        print(show.render(row, show.folder(state_dir, row["job"], row["id"])))
    return 0


def _write_html(path: str, text: str, what: str | None) -> None:
    """The page to ``path`` (``-``: stdout), whole or not at all (a temp file beside
    it, renamed over it), readable as the umask allows; a line says where (unless
    ``what`` is None)."""
    if path == "-":
        sys.stdout.write(text)
        return
    dest = Path(path)
    if dest.is_dir():
        raise Failed(f"--html {path}: is a folder (expected a file name, e.g. "
                     f"{dest / 'index.html'})", "incidents")
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with open(fd, "w", encoding="utf-8", closefd=False) as f:
                f.write(text)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise Failed(f"--html {path}: cannot write it: {e.strerror or e}", "incidents") from None
    if what is not None:
        print(f"wrote {what} to {dest} ({len(text.encode()) // 1024 + 1} KiB)",
              file=sys.stderr)


def _index(args: argparse.Namespace) -> int:
    """The index page of the ledger's incidents (--job's only), each job's goodput
    over time; and each listed incident's page beside it (``page.INCIDENT_LINK``),
    where the index links to them."""
    from trainwatch.evidence import page  # the renderer: only for --html

    state_dir = _state_dir(args)
    rows = _ledger_rows(state_dir, args.job, args.limit, missing=_no_ledger(state_dir))
    if args.job and not rows:
        raise Failed(f"no incidents of job {args.job!r} in {state_dir}/ledger.db", "incidents")
    if args.html == "-":
        _write_html("-", page.index_page(state_dir, rows, args.grafana), None)
        return 0
    here = Path(args.html).parent
    if not here.is_dir():
        raise Failed(f"--html {args.html}: cannot write it: no folder {here}", "incidents")
    for row in rows:  # first: the index links only to pages that are there
        _write_html(str(here / page.INCIDENT_LINK.replace("{id}", str(row["id"]))),
                    page.incident_page(state_dir, row, args.grafana), None)
    _write_html(args.html, page.index_page(state_dir, rows, args.grafana),
                f"the index of {len(rows)} incident(s) (their pages beside it, "
                f"{page.INCIDENT_LINK.replace('{id}', 'N')})")
    return 0


@_command
def cmd_incidents(args: argparse.Namespace) -> int:
    if args.grafana is not None and args.html is None:
        raise ConfigError("--grafana: expected only with --html (the links go on the page)")
    if args.show is not None:
        return _show(args)
    if args.html is not None:
        return _index(args)
    limit = args.limit
    if args.state_dir and not args.run_dir:
        # The user named the ledger: read it, daemon or not (as before issue 10).
        state_dir = str(args.state_dir)
        rows = _ledger_rows(state_dir, args.job, limit, missing=lambda: ConfigError(
            f"{state_dir}: no ledger here (expected {state_dir}/ledger.db)"))
    else:
        config = load(args.config) if args.config else None
        run_dir = args.run_dir or (config.run_dir if config else default_dirs()[1])
        # Without a daemon, the ledger of the same config (or the defaults); not for
        # a bare --run-dir, whose ledger we do not know.
        fallback = args.state_dir or (config.state_dir if config else
                                      None if args.run_dir else default_dirs()[0])
        try:
            rows = ask(run_dir, "incidents", {"job": args.job, "limit": limit})["incidents"]
        except NotRunning as e:
            if fallback is None:
                raise
            nothing = Failed(f"{e} and no ledger at {fallback}/ledger.db")
            rows = _ledger_rows(str(fallback), args.job, limit, missing=lambda: nothing)
        if not isinstance(rows, list):
            raise Failed("unexpected reply from the daemon (incidents is not a list)",
                         "incidents")
    if args.json:
        _print_json(rows)  # the rows, as before: the same whether daemon or ledger
    else:
        print(_render("incidents", lambda: render_incidents(rows)))
    return 0


@_command
def cmd_checkpoints(args: argparse.Namespace) -> int:
    if args.state_dir and not args.run_dir:
        return _checkpoints_from_disk(args)
    reply = ask(run_dir_of(args), "checkpoints", {"job": args.job, "plan": args.plan})
    if args.json:
        _print_json(reply)
    elif args.plan:
        print(_render("checkpoints", lambda: render_plan(reply)))
    else:
        print(_render("checkpoints", lambda: render_checkpoints(reply)))
    return 0


def _checkpoints_from_disk(args: argparse.Namespace) -> int:
    """Post-mortem: the listing from the job's state in --state-dir, no daemon asked
    (the settings from --config's job when given, else from that state)."""
    if args.plan:
        raise ConfigError("--plan: expected a live daemon (--config or --run-dir), not"
                          " --state-dir: retention's plan is the daemon's")
    configured = load(args.config).job(args.job) if args.config else None
    reply, source = checkpointlist.from_state_dir(str(args.state_dir), args.job, configured)
    where = f"{source.state_dir}/jobs/{args.job}"
    if args.json:
        _print_json({**reply, "source": {"from": "disk", "state_dir": source.state_dir,
                                         "settings": source.settings}})
    else:
        print(f"read from disk ({where}), not from a live daemon; settings from"
              f" {source.settings}")
        print(render_checkpoints(reply))
    return 0


@_command
def cmd_rollback(args: argparse.Namespace) -> int:
    reply = ask(run_dir_of(args), "rollback", {"job": args.job, "step": args.to_step},
                timeout=ROLLBACK_WAIT)
    if args.json:
        _print_json(reply)
    else:
        print(_render("rollback", lambda: f"{reply['job']}: relaunching from step"
                                          f" {reply['step']} ({reply['checkpoint']})"))
    return 0


def _job_command(op: str) -> Command:
    @_command
    def cmd(args: argparse.Namespace) -> int:
        reply = ask(run_dir_of(args), op, {"job": args.job})
        if args.json:
            _print_json(reply)
        else:
            print(_render(op, lambda: f"{reply['job']}: "
                                      f"{state_word(reply['state'], bool(reply['paused']))}"))
        return 0

    cmd.__name__ = cmd.__qualname__ = f"cmd_{op}"
    return cmd


cmd_pause = _job_command("pause")
cmd_resume = _job_command("resume")
cmd_stop = _job_command("stop")
cmd_start = _job_command("start")


@_command
def cmd_reload(args: argparse.Namespace) -> int:
    reply = ask(run_dir_of(args), "reload", {})
    if args.json:
        _print_json(reply)
    if not reply.get("reloaded"):
        raise Failed(str(reply.get("error") or "not reloaded"), "reload")
    if not args.json:
        print(_render("reload", lambda: _reload_line(reply)))
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    """Attach, then exec CMD (returns only when there is nothing to exec)."""
    from trainwatch import slurmattach

    return slurmattach.run(args.command, args.run_dir, args.checkpoint_dir, args.timeout)


# --- the parsers -------------------------------------------------------------


