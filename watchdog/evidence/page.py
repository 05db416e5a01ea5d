"""Incident pages: one self-contained HTML page per incident (``incident_page``)
and an index of a ledger's incidents, per job, with each job's goodput over
time (``index_page``). What ``trainwatch incidents --show N --html FILE`` and
``trainwatch incidents --html FILE`` write, and what a server can serve: both
are functions of the state dir and ledger rows (``Ledger.incidents``), read
only from root's own folders (the ledger, the incident folders, the job's
catalog.json), bounded, and escaped (markup.esc).

Grafana links appear only when a base URL is given: the dashboards of
grafana/dashboards (uids below) for the job and the incident's window.
"""

from __future__ import annotations

import logging
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainwatch.evidence import ranks, sections, timeline
from trainwatch.evidence.capture import SUMMARY
from trainwatch.evidence.chart import Line, Mark, chart, time_ticks
from trainwatch.evidence.markup import (
    Raw,
    document,
    esc,
    kv,
    link,
    seconds,
    section,
    table,
    tag,
    when,
)
from trainwatch.evidence.show import folder
from trainwatch.state.ledger import Ledger

log = logging.getLogger("trainwatch")

DASHBOARDS = {"job": "trainwatch-job", "gpu": "trainwatch-gpu", "fleet": "trainwatch-fleet"}
WINDOW_PAD = 900.0  # s of Grafana time range either side of an incident
MAX_TRANSITIONS = 20_000  # of one job read for its timeline and goodput
MAX_INDEX_ROWS = 500  # incidents of one job listed in the index (the newest)
MAX_LABELS = 12  # incidents of a goodput chart labelled (more: tooltips only)
INCIDENT_LINK = "incident-{id}.html"  # where the index links each incident (CLI's files)


def _transitions(state_dir: str, job: str) -> list[dict[str, Any]]:
    """The job's transitions, oldest first ([] without a readable ledger)."""
    try:
        ledger = Ledger(state_dir, readonly=True)
    except (FileNotFoundError, sqlite3.Error):
        return []
    try:
        rows = ledger.db.execute(
            "SELECT * FROM (SELECT * FROM transitions WHERE job=? ORDER BY id DESC LIMIT ?)"
            " ORDER BY id", (job, MAX_TRANSITIONS)).fetchall()
        return [dict(r) for r in rows]
    except sqlite3.Error:
        return []
    finally:
        ledger.close()


def grafana_url(base: str, uid: str, job: str, start: float | None, end: float | None,
                gpu: object = None) -> str:
    """A dashboard's URL for the job (and GPU) over [start, end] (Unix seconds)."""
    q: list[tuple[str, str]] = [("var-job", job)]
    if isinstance(gpu, int):
        q.append(("var-gpu", str(gpu)))
    if start is not None and end is not None:
        q += [("from", str(int(start * 1000))), ("to", str(int(end * 1000)))]
    return f"{base.rstrip('/')}/d/{urllib.parse.quote(uid)}?{urllib.parse.urlencode(q)}"


def _grafana(base: str | None, row: Mapping[str, Any], start: float | None,
             end: float | None) -> str:
    if not base:
        return ""
    job = str(row.get("job"))
    a = None if start is None else start - WINDOW_PAD
    b = None if end is None else end + WINDOW_PAD
    links = [link(grafana_url(base, DASHBOARDS["job"], job, a, b), "job dashboard")]
    if row.get("gpu") is not None or str(row.get("kind")).startswith("gpu_"):
        links.append(link(grafana_url(base, DASHBOARDS["gpu"], job, a, b, row.get("gpu")),
                          "GPU dashboard"))
    links.append(link(grafana_url(base, DASHBOARDS["fleet"], job, a, b), "fleet overview"))
    return section("Grafana", f"<p>{' · '.join(links)} (the incident's window, "
                              f"{int(WINDOW_PAD // 60)} min either side)</p>", "grafana")


def _header(row: Mapping[str, Any]) -> str:
    flags = "".join([tag("observe only", "warn")] * bool(row.get("observe_only"))
                    + [tag("injected by a drill", "warn")] * bool(row.get("injected")))
    title = (f"<h1>Incident {esc(row.get('id'))}: {esc(row.get('kind'))} "
             f"on {esc(row.get('job'))} {flags}</h1>")
    sub = f'<p class="sub">{esc(when(row.get("time")))}: {esc(row.get("decision"))}</p>'
    return title + sub + kv([
        ("job", row.get("job")), ("kind", row.get("kind")), ("detected", when(row.get("time"))),
        ("action", row.get("action")), ("decision", row.get("decision")),
        ("rank", row.get("rank")), ("GPU", row.get("gpu")), ("attempt", row.get("attempt")),
        ("onset step", row.get("onset_step")),
        ("detection latency", seconds(row.get("detection_latency_s"))
         if row.get("detection_latency_s") is not None else None),
        ("time to relaunch", seconds(row.get("time_to_relaunch_s"))
         if row.get("time_to_relaunch_s") is not None else None),
        ("resumed from", row.get("resumed_from")), ("resumed at step", row.get("resumed_step")),
        ("steps lost", row.get("steps_lost"))])


def _timeline(phases: Sequence[timeline.Phase], detected: object) -> str:
    rows: list[list[object]] = []
    prev: float | None = None
    for p in phases:
        since = (p.at - detected if p.at is not None and isinstance(detected, (int, float))
                 else None)
        step: float | None = p.at - prev if p.at is not None and prev is not None else None
        rows.append([p.name, when(p.at), "-" if since is None else f"{since:+.3f} s",
                     seconds(step) if step is not None else "-", p.note])
        prev = p.at if p.at is not None else prev
    attrs = [f' data-phase="{esc(p.name)}" data-time="{p.at!r}"' for p in phases]
    return section("Timeline", table(("phase", "time", "from detection", "took", "what"), rows,
                                     attrs=attrs, numeric=(2, 3)), "timeline")


def _safe(name: str, fn: Callable[..., str], *args: Any) -> str:
    """A section; one that cannot be made of what was recorded (a shape no version
    wrote) is a line saying so, and the rest of the page is made."""
    try:
        return fn(*args)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError,
            OSError) as e:
        log.warning("incident page: section %s: %s: %s", name, type(e).__name__, e)
        return (f'<p class="note">{esc(name)}: not shown ({esc(type(e).__name__)}: '
                f"{esc(str(e)[:300])})</p>")


def incident_page(state_dir: str, row: Mapping[str, Any], grafana: str | None = None) -> str:
    """The page of one incident (a ledger row: Ledger.incidents) as HTML."""
    job = str(row.get("job"))
    where = folder(state_dir, job, int(row.get("id") or 0))
    ts = _transitions(state_dir, job)
    summary = sections.read_json(where / SUMMARY)
    summary = summary if isinstance(summary, dict) else None
    phases = timeline.phases(row, ts, summary)
    s = timeline.steps(row, ts)
    known = [p.at for p in phases if p.at is not None]
    gpus_state = sections.read_json(Path(state_dir) / "gpus.json")
    body = [
        _safe("header", _header, row), _safe("timeline", _timeline, phases, row.get("time")),
        _safe("loss", sections.loss, row, where),
        _safe("ranks and stacks", ranks.stacks, row, where, summary),
        _safe("GPU", sections.gpu, row,
              timeline.gpus_of(s.relaunch.get("reason")) if s.relaunch else None,
              timeline.gpus_of(s.start.get("reason")) if s.start else None,
              gpus_state if isinstance(gpus_state, dict) else None),
        _safe("how it ended", sections.crash, row),
        _safe("the line that matched", sections.log_rule, row),
        _safe("checkpoints", sections.checkpoints, row, Path(state_dir) / "jobs" / job, where),
        _safe("log tail", sections.log_tail, where),
        _grafana(grafana, row, min(known) if known else None, max(known) if known else None),
        _safe("evidence", sections.raw_evidence, row),
        f'<p class="note">evidence folder: {esc(where)}</p>']
    return document(f"trainwatch incident {row.get('id')}: {row.get('kind')} on {job}",
                    "".join(body))


# --- the index ---------------------------------------------------------------------


def _clock(t0: float, t1: float) -> Callable[[float], str]:
    fmt = "%H:%M:%S" if t1 - t0 < 86400 else "%m-%d %H:%M"
    return lambda v: time.strftime(fmt, time.localtime(v))


def goodput_chart(rows: Sequence[Mapping[str, Any]], ts: Sequence[Mapping[str, Any]],
                  now: float | None = None) -> str:
    """The job's cumulative time making progress, over time; incidents and rollbacks marked."""
    g = timeline.goodput(rows, ts, now)
    if g is None:
        return '<p class="note">the ledger has no start of this job</p>'
    span = g.end - g.start
    unit, div = ("h", 3600.0) if span >= 7200 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    progress = [(t, v / div) for t, v in g.points]
    ideal = [(g.start, 0.0), (g.end, span / div)]
    marks = []
    for row in rows:
        at = timeline.onset(row) or row.get("time")
        if not isinstance(at, (int, float)):
            continue
        kind = "rollback" if row.get("action") == "rollback" else "incident"
        marks.append(Mark(kind, float(at), f"#{row.get('id')} {row.get('kind')}",
                          data={"incident": str(row.get("id")), "time": repr(float(at))},
                          show=len(rows) <= MAX_LABELS))
    for o in g.outages:
        until = min(g.end, o.back + o.redo)
        marks.append(Mark("outage", o.start, f"#{o.incident}: no progress until {when(until)}",
                          end=until, data={"incident": str(o.incident)}, show=False))
    svg = chart("goodput", [Line("ideal", ideal, "every second making progress"),
                            Line("progress", progress, "time making progress")], marks,
                title="time making progress", x_label="time", y_label=f"progress ({unit})",
                x_fmt=_clock(g.start, g.end), x_ticks=time_ticks, height=200, log=False,
                x_domain=(g.start, g.end if g.end > g.start else g.start + 1))
    ratio = g.ratio
    figure = f"goodput {ratio:.1%}" if ratio is not None else "goodput unknown"
    return (f'<p class="sub" data-goodput="{"" if ratio is None else f"{ratio:.6f}"}">'
            f"{esc(figure)}: {esc(seconds(g.points[-1][1]))} of {esc(seconds(span))} making "
            f"progress, from {esc(when(g.start))} to {esc(when(g.end))}</p>{svg}"
            '<p class="legend"><span><i style="background:var(--ok)"></i>progress</span>'
            '<span><i style="background:var(--mute)"></i>no fault</span>'
            '<span><i style="background:var(--warn)"></i>incident</span>'
            '<span><i style="background:var(--bad)"></i>rollback</span>'
            '<span><i style="background:rgba(178,106,0,.3)"></i>no progress</span></p>')


def index_page(state_dir: str, rows: Sequence[Mapping[str, Any]], grafana: str | None = None,
               link_to: str = INCIDENT_LINK, now: float | None = None) -> str:
    """The incidents of ``rows`` (oldest first), a section per job, each with its
    goodput over time; each incident links to ``link_to`` (``{id}`` replaced)."""
    jobs: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        jobs.setdefault(str(r.get("job")), []).append(r)
    body = [f"<h1>trainwatch incidents</h1><p class=\"sub\">{len(rows)} incident(s) of "
            f"{len(jobs)} job(s) in {esc(state_dir)}</p>"]
    for job, rs in sorted(jobs.items()):
        ts = _transitions(state_dir, job)
        table_rows, classes = [], []
        for r in list(reversed(rs))[:MAX_INDEX_ROWS]:
            href = link_to.replace("{id}", str(r.get("id")))
            table_rows.append([Raw(link(href, f"#{r.get('id')}")), when(r.get("time")),
                               r.get("kind"), r.get("rank"), r.get("gpu"), r.get("action"),
                               r.get("onset_step"), r.get("resumed_step"), r.get("steps_lost"),
                               seconds(r.get("time_to_relaunch_s"))
                               if r.get("time_to_relaunch_s") is not None else None,
                               r.get("decision")])
            classes.append("odd-one" if r.get("action") == "rollback" else "")
        links = ""
        if grafana:
            first = timeline.onset(rs[0]) or rs[0].get("time")
            last = rs[-1].get("relaunched_at") or rs[-1].get("time")
            a = first - WINDOW_PAD if isinstance(first, (int, float)) else None
            b = last + WINDOW_PAD if isinstance(last, (int, float)) else None
            url = grafana_url(grafana, DASHBOARDS["job"], job, a, b)
            links = f"<p>{link(url, 'job dashboard')} (these incidents' window)</p>"
        body.append(section(f"Job {job}", _safe("goodput", goodput_chart, rs, ts, now) + table(
            ("incident", "detected", "kind", "rank", "GPU", "action", "onset step",
             "resumed at", "steps lost", "to relaunch", "decision"),
            table_rows, classes, numeric=(3, 4, 6, 7, 8)) + links + (
            f'<p class="note">the newest {MAX_INDEX_ROWS} of {len(rs)} are listed</p>'
            if len(rs) > MAX_INDEX_ROWS else ""), f"job-{job}"))
    if not rows:
        body.append('<p class="note">no incidents recorded</p>')
    return document("trainwatch incidents", "".join(body))
