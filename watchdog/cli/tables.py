"""The operator commands' tables (``trainwatch status``, ``incidents``,
``checkpoints``): a daemon's reply (or the ledger's rows) as aligned text."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [tuple(head), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}{unit}"
    return f"{x}{unit}"


def age(seconds: float | None) -> str:
    """3.2s, 4m, 2h, 3d; - when unknown."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m"
    if s < 86400:
        return f"{int(s // 3600)}h"
    return f"{int(s // 86400)}d"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def state_word(state: str | None, paused: bool) -> str:
    shown = state or "-"  # None: a job not started yet
    return f"{shown} (paused)" if paused and state != "paused" else shown


def _gpus(gpus: list[int] | None) -> str:
    if gpus is None:
        return "-"
    return ",".join(str(g) for g in gpus) if gpus else "none"


def render_status(reply: dict[str, Any], now: float | None = None) -> str:
    """The daemon's line, then one line per job (or "no jobs")."""
    now = time.time() if now is None else now
    lines = []
    d = reply.get("daemon")
    if d:
        lines.append(f"trainwatch {d['version']}: pid {d['pid']}, up {age(d['uptime'])},"
                     f" config {d.get('config') or '-'}")
    jobs = reply["jobs"]
    if not jobs:
        lines.append("no jobs")
        return "\n".join(lines)
    rows = []
    for j in jobs:
        last = j.get("last_incident")
        incident = "-" if not last else (f"#{last['id']} {last['kind']} {last['action']}"
                                         f" {age(now - float(last['time']))} ago")
        rows.append((j["job"], state_word(j["state"], bool(j["paused"])), _fmt(j["step"]),
                     _rate(j["steps_per_second"]), age(j["last_beat_age"]),
                     str(j["restarts"]), _gpus(j["gpus"]), incident))
    head = ("JOB", "STATE", "STEP", "STEPS/S", "BEAT", "RESTARTS", "GPUS", "LAST INCIDENT")
    lines.append(_table(head, rows))
    return "\n".join(lines)


def render_incidents(rows: list[dict[str, Any]]) -> str:
    """The ledger's incident rows as a table (or "no incidents")."""
    if not rows:
        return "no incidents"
    head = ("id", "time", "job", "kind", "rank", "action", "attempt", "detect", "relaunch",
            "resumed", "lost")
    table = []
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
        action = r["action"] + (" (observed)" if r["observe_only"] else "")
        table.append((
            str(r["id"]), when, r["job"], r["kind"], _fmt(r["rank"]), action, str(r["attempt"]),
            _fmt(r["detection_latency_s"], "s"), _fmt(r["time_to_relaunch_s"], "s"),
            _fmt(r["resumed_step"]), _fmt(r["steps_lost"]),
        ))
    return _table(head, table)


def render_checkpoints(reply: dict[str, Any]) -> str:
    """STEP VERDICT PATH (WHY); the last good one's verdict reads "last good"."""
    cps = reply["checkpoints"]
    if not cps:
        return f"no checkpoints for {reply['job']}"
    rows = [(str(c["step"]), "last good" if c.get("last_good") else str(c["verdict"]),
             _loss(c.get("health")), _size(c.get("size")), _when(c.get("time")),
             ",".join(map(str, c.get("attempts") or [])) or "-",
             c["path"] + (f" ({c['why']})" if c.get("why") else ""))
            for c in cps]
    return _table(("STEP", "VERDICT", "LOSS", "SIZE", "WRITTEN", "RESUMED BY", "PATH"), rows)


def _size(n: object) -> str:
    if not isinstance(n, int):
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _when(t: object) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _loss(health: object) -> str:
    """The loss when the checkpoint was reported, and how far it stood from the
    recent mean (in standard deviations, sd); "-" when trainwatch saw none."""
    if not isinstance(health, dict) or not isinstance(health.get("loss"), (int, float)):
        return "-"
    z = health.get("loss_z")
    return f"{health['loss']:.4g}" + (f" ({z:+.1f} sd)" if isinstance(z, (int, float)) else "")


def render_plan(reply: dict[str, Any]) -> str:
    """Retention's plan: what would be deleted, then why each other one stays."""
    if not reply["rules"]:
        return f"{reply['job']}: no checkpoints.keep rule: nothing is ever deleted"
    rows = [(str(c["step"]), "delete", c["path"]) for c in reply["delete"]]
    rows += [(str(k["step"]), "keep", str(k["why"])) for k in reply["kept"]]
    free = reply.get("free_bytes")
    tail = f"\nfree: {free / 1e9:.1f} GB" if isinstance(free, int) else ""
    return _table(("STEP", "PLAN", "PATH / WHY"), sorted(rows, key=lambda r: int(r[0]))) + tail
