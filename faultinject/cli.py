"""The ``faultinject`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from trainwatch.config import ConfigError, default_dirs, load
from trainwatch.host.control import control_path

from faultinject import drills, joblog


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


def _index(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a GPU index (0, 1, ...), got {text!r}")
    return n


def _rank(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a rank (0, 1, ...), got {text!r}")
    return n


def _xid(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 99999:
        raise argparse.ArgumentTypeError(f"expected an Xid number such as 79, got {text!r}")
    return n


def _scale(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number such as 100, got {text!r}")
    return x


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 100_000:
        raise argparse.ArgumentTypeError(f"expected a number of steps from 1 to 100000, "
                                         f"got {text!r}")
    return n


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

    st = sub.add_parser("nccl-stall", help="SIGSTOP one rank of a multi-process job, so the "
                                           "others block in their collective (nccl_stall)")
    common(st)
    st.add_argument("--rank", type=_rank, required=True,
                    help="the rank (found through its heartbeats, else its RANK variable)")
    st.add_argument("--seconds", type=_seconds, help="resume it after this long")
    ll = sub.add_parser("log-line", help="append a line to the job's output log, as if the "
                                         "job printed it (for the log rules)")
    common(ll)
    which = ll.add_mutually_exclusive_group(required=True)
    which.add_argument("--line", help="the line, without its newline")
    which.add_argument("--preset", choices=sorted(joblog.PRESETS),
                       help="a real-format line of a built-in rule")

    n = sub.add_parser("nan", help="a non-finite loss at the job's current step (nan_loss)")
    common(n)
    g = sub.add_parser("grad-spike", help="the job's grad norm x SCALE for N steps "
                                          "(grad_norm_outlier)")
    common(g)
    g.add_argument("--scale", type=_scale, help="times the job's grad norm (default 100)")
    g.add_argument("--steps", type=_count, help="consecutive steps (default: the job's "
                                                "act_run, enough to act)")

    def gpu(sp: argparse.ArgumentParser, required: bool = True) -> None:
        sp.add_argument("--gpu", type=_index, required=required, help="the GPU's NVML index")
        sp.add_argument("--run-dir", help="trainwatch's run_dir (where control.sock is)")
        sp.add_argument("--config", help="or: the config that names it")

    x = sub.add_parser("gpu-xid", help="report an Xid on a GPU, as the driver would")
    gpu(x, required=False)
    x.add_argument("--xid", type=_xid, required=True, help="the Xid number, e.g. 79")
    x.add_argument("--message", help="the driver's text after the number "
                                     "(default: the Xid catalog's description)")
    x.add_argument("--kmsg", metavar="FILE",
                   help="append a real-format NVRM: Xid line to this text file instead "
                        "(with --pci, not --gpu)")
    x.add_argument("--pci", help="with --kmsg: the GPU's PCI address, e.g. 0000:06:00")
    gpu(sub.add_parser("gpu-lost", help="make a GPU read as fallen off the bus"))
    e = sub.add_parser("ecc", help="a pending row remap (or an uncorrected ECC error) on a GPU")
    gpu(e)
    e.add_argument("--uncorrected", action="store_true", help="a new uncorrected ECC error")
    gpu(sub.add_parser("thermal", help="a sustained HW thermal slowdown on a GPU"))
    return p


_SYSTEM_RUN_DIR = "/run/trainwatch"


def _run_dir(args: argparse.Namespace) -> str:
    """--run-dir, else the config's run_dir, else this user's default run_dir or,
    when nothing listens there, the system daemon's."""
    if args.run_dir:
        return str(args.run_dir)
    if args.config:
        return load(args.config).run_dir
    mine = default_dirs()[1]
    if mine != _SYSTEM_RUN_DIR and not os.path.exists(control_path(mine)) \
            and os.path.exists(control_path(_SYSTEM_RUN_DIR)):
        return _SYSTEM_RUN_DIR
    return mine


def _said(reply: dict[str, Any]) -> str:
    return f"trainwatch replied {json.dumps(reply, sort_keys=True)}" if reply else \
        "trainwatch accepted it"


def _gpu_drill(args: argparse.Namespace) -> str:
    """Carry out a GPU drill; the line that says what was done."""
    if args.cmd == "gpu-xid" and args.kmsg is not None:
        if args.pci is None:
            raise drills.DrillError("--kmsg: expected --pci too (the kernel log names the GPU "
                                    "by its PCI address, e.g. --pci 0000:06:00)")
        if args.gpu is not None or args.run_dir or args.config:
            raise drills.DrillError("--kmsg: expected --pci alone, not --gpu, --run-dir or "
                                    "--config (the line goes to the file, not to trainwatch)")
        line = drills.kmsg_xid(args.kmsg, args.pci, args.xid, args.message)
        return f"faultinject: appended to {args.kmsg}: {line}"
    if args.cmd == "gpu-xid":
        if args.pci is not None:
            raise drills.DrillError("--pci: only with --kmsg (give --gpu for trainwatch)")
        if args.gpu is None:
            raise drills.DrillError("gpu-xid: expected --gpu N (or --kmsg FILE with --pci)")
    run_dir = _run_dir(args)
    if args.cmd == "gpu-xid":
        reply = drills.gpu_xid(run_dir, args.gpu, args.xid, args.message)
        what = f"Xid {args.xid} on GPU {args.gpu}"
    elif args.cmd == "gpu-lost":
        reply = drills.gpu_lost(run_dir, args.gpu)
        what = f"a lost GPU {args.gpu}"
    elif args.cmd == "ecc":
        reply = drills.ecc(run_dir, args.gpu, args.uncorrected)
        kind = "an uncorrected ECC error" if args.uncorrected else "a pending row remap"
        what = f"{kind} on GPU {args.gpu}"
    else:
        reply = drills.thermal(run_dir, args.gpu)
        what = f"a thermal slowdown on GPU {args.gpu}"
    return f"faultinject: injected {what}; {_said(reply)}"


def _loss_drill(state_dir: str, args: argparse.Namespace) -> str:
    """Carry out ``nan`` or ``grad-spike``; the line that says what trainwatch found."""
    scale, steps = (args.scale, args.steps) if args.cmd == "grad-spike" else (None, None)
    reply = drills.loss(state_dir, args.job, args.cmd, scale, steps)
    first, last = reply.get("steps") or ["?", "?"]
    if args.cmd == "nan":
        what = f"a NaN loss at step {first}"
    else:
        what = f"grad norm x {scale or 100:g} at steps {first}-{last}"
    found = ", ".join(reply.get("found") or []) or "nothing (no detector fired)"
    return f"faultinject: injected {what} of job {args.job}; trainwatch found: {found}"


def _log_line(state_dir: str, args: argparse.Namespace) -> int:
    done = joblog.log_line(state_dir, args.job, args.line, args.preset)
    reads = f"built-in rule {done.rule} reads it" if done.rule else "no built-in rule reads it"
    how = f"preset {args.preset}, " if args.preset else ""
    print(f"faultinject: appended a line to the log of job {args.job} ({done.path}; {how}"
          f"{reads}): {done.line}")
    if done.not_told:
        print(f"faultinject: trainwatch was not told, so the incident will not say "
              f"injected: {done.not_told}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd in ("gpu-xid", "gpu-lost", "ecc", "thermal"):
            print(_gpu_drill(args))
            return 0
        state_dir = args.state_dir or (load(args.config).state_dir if args.config
                                       else default_dirs()[0])
        if args.cmd in ("nan", "grad-spike"):
            print(_loss_drill(state_dir, args))
            return 0
        if args.cmd == "log-line":
            return _log_line(state_dir, args)
        if args.cmd == "crash":
            done = drills.crash(state_dir, args.job, args.rank)
        elif args.cmd == "nccl-stall":
            done = drills.nccl_stall(state_dir, args.job, args.rank, args.seconds)
        else:
            done = drills.hang(state_dir, args.job, args.rank, args.seconds)
        pids = " ".join(map(str, done.pids))
        tail = f"; resumed (SIGCONT) after {args.seconds:g}s" \
            if args.cmd != "crash" and args.seconds is not None else ""
        print(f"faultinject: {done.signal} sent to {done.what} of job {args.job}: "
              f"pids {pids}{tail}")
        if done.not_told:
            print(f"faultinject: trainwatch was not told, so the incident will not say "
                  f"injected: {done.not_told}", file=sys.stderr)
    except (drills.DrillError, ConfigError) as e:
        print(f"faultinject: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
