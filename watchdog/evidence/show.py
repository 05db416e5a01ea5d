"""``trainwatch incidents --show N``: one incident and the evidence kept
beside it (``folder``), as text: the ledger row; what a rollback did (its skip
window, widening, quarantined checkpoints, whether the skip is exact); the
loss and grad norm around a loss anomaly's onset; the verdict from the stacks
and which evidence decided, the rank named, the process states, each rank's
main-thread stack, the log tail and the files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwatch.detectors.stacks import frames, main_thread
from trainwatch.evidence import series
from trainwatch.evidence.capture import SUMMARY
from trainwatch.evidence.pyspy import frame
from trainwatch.state.atomic import read_json

ROW_FIELDS = ("job", "kind", "rank", "gpu", "action", "decision", "attempt", "observe_only",
              "injected", "detection_latency_s", "resumed_from", "resumed_step", "steps_lost")
ROLLBACK = "rollback"  # the evidence key actions/rollback.py records what it did under
MAX_FRAMES = 15  # per rank; deeper frames are counted, not printed
LOG_LINES = 20


def evidence(row: Mapping[str, Any]) -> dict[str, Any]:
    """An incident row's evidence as a dict (its JSON text parsed; {"raw": text}
    when it is not JSON)."""
    ev = row.get("evidence")
    if isinstance(ev, str):
        try:
            ev = json.loads(ev)
        except ValueError:
            return {"raw": ev}
    return ev if isinstance(ev, dict) else {}


CATALOG = "catalog.json"  # in an incident's folder: the job's catalog as of the incident


def folder(state_dir: str, job: str, incident: int) -> Path:
    """Where an incident's evidence lives: ``<state_dir>/jobs/<job>/incidents/<id>``."""
    if not job or "/" in job or job in (".", ".."):
        raise ValueError(f"not a job name: {job!r}")
    return Path(state_dir) / "jobs" / job / "incidents" / str(int(incident))


def _head(row: dict[str, Any]) -> list[str]:
    when = row.get("time")
    stamp = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
             if isinstance(when, (int, float)) else "-")
    out = [f"incident {row.get('id', '?')} at {stamp}"]
    out += [f"  {k}: {row[k]}" for k in ROW_FIELDS if row.get(k) is not None]
    ev = {k: v for k, v in evidence(row).items() if k != ROLLBACK}  # shown by _rollback
    if ev:
        out.append("  evidence:")
        out += [f"    {k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}"
                for k, v in sorted(ev.items())]
    return out


def _steps(steps: object, count: object) -> str:
    shown = [str(s) for s in steps] if isinstance(steps, list) else []
    n = count if isinstance(count, int) else len(shown)
    more = f" and {n - len(shown)} more" if n > len(shown) else ""
    return f"{n} checkpoint(s): steps {', '.join(shown)}{more}" if n else "none"


def _rollback(row: dict[str, Any]) -> list[str]:
    """What a rollback past a loss anomaly did (actions/rollback.py apply)."""
    rb = evidence(row).get(ROLLBACK)
    if not isinstance(rb, dict):
        return []
    w, prev = rb.get("window") or ["?", "?"], rb.get("previous_window")
    how = (f"widening {rb.get('widening')} of {rb.get('max_widenings')} of the window "
           f"{prev[0]}-{prev[1]}" if isinstance(prev, list) and len(prev) == 2
           else "the anomaly's first rollback")
    resume = rb.get("resume_step")
    return ["rollback:",
            f"  skip window: steps {w[0]}-{w[1]} ({how}), TRAINWATCH_SKIP_STEPS={w[0]}:{w[1]}",
            f"  resume: {'from scratch' if resume is None else f'from step {resume}'} "
            f"(the newest good checkpoint before step {rb.get('resume_before')})",
            f"  quarantined (kept on disk, never resumed from): "
            f"{_steps(rb.get('quarantined'), rb.get('quarantined_count'))}",
            f"  skip: {rb.get('skip')}: {rb.get('skip_why')}",
            f"  restart budget: {rb.get('budget')}"]


def _absent(row: dict[str, Any], where: Path) -> str:
    """Why there are no stacks and log tail: never captured (the kind is not in
    the job's evidence.kinds, or nothing was left to capture), or lost."""
    if (where / SUMMARY).exists():
        return f"process evidence unreadable: {where / SUMMARY}"
    kept = [x for x, there in (("the rollback", evidence(row).get(ROLLBACK) is not None),
                               ("the loss series", (where / series.NAME).exists())) if there]
    what = f"kept: {' and '.join(kept)}; " if kept else ""
    return (f"{what}stacks and log tail: none kept for this {row.get('kind')} (captured only "
            "for the kinds in the job's evidence.kinds, before a kill)")


def _verdict(s: dict[str, Any]) -> list[str]:
    v = s.get("verdict")
    if not isinstance(v, dict):
        return ["verdict: none (no rank stacks)"]
    rs = [str(r) for r in v.get("suspects") or []]
    suspects = f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)}" if rs else "no rank"
    out = [f"verdict: {suspects} (decided by {v.get('decided_by')})",
           f"  why: {v.get('why')}"]
    named = s.get("named")
    if named is not None:
        agree = {True: "agree", False: "disagree", None: "say nothing"}[v.get("agrees")]
        out.append(f"  rank named by the step/CPU evidence: {named} (the stacks {agree})")
    if v.get("in_collective"):
        out.append(f"  inside a collective: {', '.join(str(r) for r in v['in_collective'])}")
    groups = v.get("groups") or []
    if groups:
        out.append("  stack groups: " + " | ".join(",".join(str(r) for r in g) for g in groups))
    return out


def _targets(s: dict[str, Any], where: Path) -> list[str]:
    out = ["processes:"]
    for t in s.get("targets") or []:
        who = f"rank {t['rank']}" if t.get("rank") is not None else "launcher"
        spy = t.get("py_spy") or {}
        how = (f"py-spy {spy.get('mode')}" if spy.get("ok")
               else f"no stack: {spy.get('error') or 'py-spy not run'}")
        if spy.get("native_skipped"):
            how += " (native frames skipped: process stopped)"
        out.append(f"  {who:8} pid {t.get('pid')}  state {t.get('state') or '-'}  "
                   f"cpu {t.get('cpu_seconds', '-')}s  {how}")
    out.append("stacks (main thread, innermost first; identical stacks once):")
    shown: dict[tuple[str, ...], list[str]] = {}
    for t in s.get("targets") or []:
        data = read_json(where / "stacks" / f"{t.get('file')}.json")
        if isinstance(data, list):
            fs = tuple(frame(dict(f)) for f in frames(main_thread(data)))
            shown.setdefault(fs, []).append(str(t.get("file")))
    for fs, files in shown.items():
        out.append(f"  {', '.join(files)}:")
        out += [f"    {f}" for f in fs[:MAX_FRAMES]]
        if len(fs) > MAX_FRAMES:
            out.append(f"    ... {len(fs) - MAX_FRAMES} more")
    return out


def _tail(where: Path) -> list[str]:
    try:
        lines = (where / "log-tail.txt").read_text(errors="replace").splitlines()
    except OSError:
        return ["log tail: none"]
    return [f"log tail (last {min(LOG_LINES, len(lines))} lines):",
            *(f"  {x}" for x in lines[-LOG_LINES:])]


def _files(where: Path) -> list[str]:
    out = [f"files in {where}:"]
    for p in sorted(where.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            out.append(f"  {p.relative_to(where)} ({p.stat().st_size} bytes)")
    return out


def _group(row: dict[str, Any]) -> list[str]:
    """A multi-host job's group restart (multihost/group.py): where it began and
    what every host claimed, the same on every host's incident of it."""
    ev = evidence(row)
    gen = ev.get("group_restart")
    if not isinstance(gen, int):
        return []
    out = [f"group restart {gen}: began on {ev.get('began', '?')}, decided by "
           f"{ev.get('decided_on', '?')}{'' if ev.get('charged', True) else ', not charged'}"]
    claims = ev.get("claims")
    for c in claims if isinstance(claims, list) else []:
        if isinstance(c, dict):
            rank = f" rank {c['rank']}" if isinstance(c.get("rank"), int) else ""
            at = c.get("at")
            stamp = (time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"
                     if isinstance(at, (int, float)) else "-")
            out.append(f"  {c.get('host', '?')}{rank}: {c.get('kind', '?')} at {stamp}")
    across = ev.get("stacks_across_hosts")
    if isinstance(across, dict):
        suspects = across.get("suspects") or []
        out.append(f"  stacks of {across.get('ranks')} ranks on {across.get('hosts')} hosts, "
                   f"by {across.get('decided_by')}: "
                   f"{', '.join(map(str, suspects)) if suspects else 'no odd one out'}")
        for grp in across.get("groups") or []:
            if isinstance(grp, dict):
                out.append(f"    {', '.join(map(str, grp.get('ranks') or []))}: {grp.get('top')}")
    return out


def render(row: dict[str, Any], folder: Path) -> str:
    """The incident and its evidence, as text."""
    out = _head(row) + _group(row) + _rollback(row) + series.render(folder)
    s = read_json(folder / SUMMARY)
    if not isinstance(s, dict):
        out.append(_absent(row, folder))
        if folder.is_dir():
            out += _files(folder)
        return "\n".join(out)
    spent = f"captured in {s.get('seconds')} s"
    if s.get("deadline_hit"):
        spent += " (deadline hit: some evidence is missing)"
    out.append(spent)
    out += _verdict(s)
    out += _targets(s, folder)
    fr = s.get("flight_recorder")
    if isinstance(fr, dict):
        out.append("flight recorder: " + (", ".join(fr.get("files") or []) or "no dump"))
    out += [f"error: {e}" for e in s.get("errors") or []]
    out += _tail(folder)
    out += _files(folder)
    return "\n".join(out)
