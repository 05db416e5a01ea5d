"""The ``faultinject`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from trainwatch.config import ConfigError, default_dirs, load

from faultinject import drills


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _seconds(text: str) -> float:
    from trainwatch.config import parse_duration

    try:
        return parse_duration(text)
    except ValueError:
        msg = f"expected a duration such as 5 or 30s, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="faultinject", description="Inject faults into a supervised job.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--job", required=True, help="the job's name")
        sp.add_argument("--state-dir", help="trainwatch's state_dir")
        sp.add_argument("--config", help="or: the config that names it")

    c = sub.add_parser("crash", help="SIGKILL the job's leader (or one rank)")
    common(c)
    c.add_argument("--rank", type=int)
    h = sub.add_parser("hang", help="SIGSTOP the job (or one rank), optionally SIGCONT later")
    common(h)
    h.add_argument("--rank", type=int)
    h.add_argument("--seconds", type=_seconds, help="resume it after this long")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        state_dir = args.state_dir or (load(args.config).state_dir if args.config
                                       else default_dirs()[0])
        if args.cmd == "crash":
            pid = drills.crash(state_dir, args.job, args.rank)
            print(f"faultinject: SIGKILL sent to pid {pid} of job {args.job}")
        else:
            what = drills.hang(state_dir, args.job, args.rank, args.seconds)
            tail = f", resumed after {args.seconds:g}s" if args.seconds is not None else ""
            print(f"faultinject: SIGSTOP sent to {what} of job {args.job}{tail}")
    except (drills.DrillError, ConfigError) as e:
        print(f"faultinject: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
