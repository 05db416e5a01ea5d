"""The evidence sections of an incident page (page.py), each from what was
kept with the incident: the loss and grad norm around a loss anomaly's onset
with the rollback marked (series.json, the evidence's "rollback"); what a GPU
said; how a process ended; the line a log rule matched; the job's checkpoints
as its catalog records them; the log tail (every rank's state and stacks:
ranks.py). Each returns HTML ("" when it has nothing to say), reads a bounded
amount (``MAX_FILE`` bytes of a file, ``MAX_POINTS`` of a series,
``MAX_CHECKPOINTS`` rows) and takes a file or value of an unexpected shape as
absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwatch.detectors.xid import classify
from trainwatch.evidence import series
from trainwatch.evidence.chart import Line, Mark, chart, step_fmt
from trainwatch.evidence.markup import Raw, esc, kv, section, table, tag
from trainwatch.evidence.show import CATALOG, evidence

ROLLBACK = "rollback"  # the evidence key actions/rollback.py records under
MAX_FILE = 2 << 20  # bytes read of one kept file (a stack dump, the series)
MAX_POINTS = 100_000  # of a series
MAX_SERIES = 16 << 20  # bytes of series.json read
MAX_CHECKPOINTS = 24  # rows of the checkpoints table: those nearest the incident
LOG_LINES = 50
_NOT_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_json(path: Path, limit: int = MAX_FILE) -> Any:
    """A kept JSON file, or None (absent, bigger than ``limit`` bytes, not JSON)."""
    try:
        if path.stat().st_size > limit:
            return None
        return json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None


def _value(v: object) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return _NOT_FINITE.get(v) if isinstance(v, str) else None


def as_list(v: object) -> list[Any]:
    """v if it is a list, else [] (what a file of another shape holds)."""
    return v if isinstance(v, list) else []


def as_dict(v: object) -> dict[str, Any]:
    """v if it is a dict, else {}."""
    return v if isinstance(v, dict) else {}


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# --- loss anomalies ------------------------------------------------------------


def _marks(onset: int | None, noticed: int | None, rb: Mapping[str, Any] | None) -> list[Mark]:
    out = []
    if onset is not None:
        out.append(Mark("onset", onset, f"onset: step {onset}", data={"step": str(onset)}))
    if noticed is not None:
        out.append(Mark("noticed", noticed, f"detected at step {noticed}",
                        data={"step": str(noticed)}))
    if rb is None:
        return out
    w = rb.get("window")
    if isinstance(w, list) and len(w) == 2 and all(_int(x) is not None for x in w):
        out.append(Mark("skip", w[0], f"skip window: steps {w[0]}-{w[1]}", end=w[1],
                        data={"start": str(w[0]), "end": str(w[1])}, show=False))
    resume = _int(rb.get("resume_step"))
    if resume is not None:
        out.append(Mark("resume", resume, f"resumed from step {resume}",
                        data={"step": str(resume)}))
    for s in as_list(rb.get("quarantined")):
        if _int(s) is not None:
            out.append(Mark("quarantined", s, f"quarantined checkpoint: step {s}",
                            data={"step": str(s)}, show=False, tick=True))
    return out


_LEGEND = (("onset", "var(--bad)"), ("detected", "var(--warn)"), ("resumed from", "var(--ok)"),
           ("skip window", "rgba(198,40,40,.3)"), ("quarantined checkpoint", "var(--bad)"),
           ("not finite", "var(--bad)"))


def _rollback(rb: Mapping[str, Any]) -> str:
    w, prev = rb.get("window"), rb.get("previous_window")
    w = w if isinstance(w, list) and len(w) == 2 else ["?", "?"]
    widened = (f"widening {rb.get('widening')} of {rb.get('max_widenings')} of the window "
               f"{prev[0]}-{prev[1]}" if isinstance(prev, list) and len(prev) == 2
               else "the anomaly's first rollback")
    resume = rb.get("resume_step")
    q = [str(s) for s in as_list(rb.get("quarantined"))]
    count = rb.get("quarantined_count")
    n = count if isinstance(count, int) else len(q)
    more = f" and {n - len(q)} more" if n > len(q) else ""
    skip = rb.get("skip")
    return kv([
        ("skip window", f"steps {w[0]}-{w[1]} ({widened}); TRAINWATCH_SKIP_STEPS={w[0]}:{w[1]}"),
        ("resumed from", "scratch" if resume is None else
         f"step {resume} (the newest good checkpoint before step {rb.get('resume_before')})"),
        ("quarantined", f"{n} checkpoint(s), kept on disk, never resumed from"
         + (f": steps {', '.join(q)}{more}" if q else "")),
        ("skip", Raw(tag(str(skip), "ok" if skip == "exact" else "warn")
                     + f" {esc(rb.get('skip_why') or '')}")),
        ("restart budget", rb.get("budget"))])


def loss(row: Mapping[str, Any], folder: Path) -> str:
    """The lead rank's loss and grad norm by step around the onset, the rollback marked."""
    ev = evidence(row)
    rb = ev.get(ROLLBACK) if isinstance(ev.get(ROLLBACK), dict) else None
    data = read_json(folder / series.NAME, MAX_SERIES)
    if not (isinstance(data, dict) and isinstance(data.get("steps"), list)):
        data = None
    if data is None and rb is None:
        return ""
    parts = []
    if data is not None:
        steps = data["steps"][:MAX_POINTS]
        onset = _int(data.get("onset_step"))
        noticed = _int(data.get("noticed_step"))
        marks = _marks(onset if onset is not None else _int(row.get("onset_step")),
                       noticed if noticed is not None else _int(ev.get("noticed_step")), rb)
        parts.append(f'<p class="sub">rank {esc(data.get("rank"))}: {len(steps)} steps kept '
                     f"around the onset ({esc(series.NAME)})</p>")
        for key, label in (("loss", "loss"), ("grad_norm", "grad norm")):
            vals = data.get(key) if isinstance(data.get(key), list) else []
            pts = [(float(s), _value(v)) for s, v in zip(steps, vals, strict=False)
                   if _int(s) is not None]
            if not any(y is not None for _, y in pts):
                parts.append(f'<p class="note">{esc(label)}: none sent</p>')
                continue
            parts.append(chart(key, [Line(key, pts, label)], marks, x_fmt=step_fmt,
                               title=f"{label} by step", x_label="step", y_label=label))
        parts.append('<p class="legend">' + "".join(
            f'<span><i style="background:{c}"></i>{esc(n)}</span>' for n, c in _LEGEND) + "</p>")
    elif row.get("kind") in {k.value for k in series.LOSS_KINDS}:
        parts.append('<p class="note">no loss series kept with this incident</p>')
    if rb is not None:
        parts.append("<h3>rollback</h3>" + _rollback(rb))
    return section("Loss and gradient norm", "".join(parts), "loss")


# --- GPU faults and crashes -------------------------------------------------------


def gpu(row: Mapping[str, Any], relaunch_gpus: str | None, before_gpus: str | None,
        gpus_state: Mapping[str, Any] | None) -> str:
    """What the GPU said: the Xid and its class, temperature, ECC, remapping; where
    the relaunch ran."""
    ev = evidence(row)
    kind = str(row.get("kind"))
    if not kind.startswith("gpu_") and "xid" not in ev:
        return ""
    xid = _int(ev.get("xid"))
    info = classify(xid, str(ev.get("message") or "")) if xid is not None else None
    g = row.get("gpu")
    state = []
    for what in ("excluded", "broken"):
        m = (gpus_state or {}).get(what)
        if isinstance(m, dict) and str(g) in m:
            state.append(f"{what}: {m[str(g)]}")
    pairs: list[tuple[str, object]] = [
        ("GPU", g), ("Xid", xid),
        ("mnemonic", info.name if info else None),
        ("description", info.description if info else None),
        ("class", ev.get("class") or (info.immediate.value if info else None)),
        ("driver message", ev.get("message")), ("PCI", ev.get("pci")),
        ("pid", ev.get("pid")), ("from", ev.get("source")), ("escalated", ev.get("escalated")),
        ("temperature", f"{ev['temperature_c']} °C" if ev.get("temperature_c") is not None
         else None),
        ("slowdown threshold", f"{ev['slowdown_temp_c']} °C"
         if ev.get("slowdown_temp_c") is not None else None),
        ("throttle reasons", ", ".join(map(str, ev["reasons"]))
         if isinstance(ev.get("reasons"), list) else None),
        ("uncorrected ECC (new)", ev.get("uncorrected_new")),
        ("uncorrected ECC (volatile)", ev.get("uncorrected_volatile")),
        ("row remap pending", ev.get("remap_pending")),
        ("retired pages pending", ev.get("retired_pages_pending")),
        ("NVML", ev.get("nvml")), ("UUID", ev.get("uuid")),
        ("GPUs before", before_gpus), ("relaunch got GPUs", relaunch_gpus),
        ("state now (gpus.json)", "; ".join(state) or None)]
    stall = as_dict(ev.get("stall"))
    util = ev.get("gpu_utilization") or stall.get("gpu_utilization")
    if isinstance(util, dict):
        pairs.append(("utilization", ", ".join(f"GPU {k}: {v}" for k, v in util.items())))
    return section("GPU", kv(pairs), "gpu")


def crash(row: Mapping[str, Any]) -> str:
    ev = evidence(row)
    if row.get("kind") not in ("crash", "oom") and "exit_code" not in ev:
        return ""
    ff = ev.get("first_failure") if isinstance(ev.get("first_failure"), dict) else {}
    return section("How it ended", kv([
        ("exit code", ev.get("exit_code")), ("signal", ev.get("signal")), ("pid", ev.get("pid")),
        ("last step", ev.get("last_step")),
        ("first to fail", ", ".join(f"{k} {v}" for k, v in ff.items()) if ff else None),
        ("torchrun says", ev.get("torchrun_root_cause"))]), "ended")


def log_rule(row: Mapping[str, Any]) -> str:
    """The job's line a log rule matched (detectors/logrules.py), with its context."""
    ev = evidence(row)
    if not isinstance(ev.get("line"), str):
        return ""
    before = [str(x) for x in as_list(ev.get("before"))][-10:]
    after = [str(x) for x in as_list(ev.get("after"))][:10]
    text = "\n".join([*before, ev["line"], *after])
    return section("The line that matched", kv([("rule", ev.get("rule"))])
                   + f"<pre>{esc(text)}</pre>", "line")


# --- checkpoints and the log tail -------------------------------------------------


def checkpoints(row: Mapping[str, Any], job_dir: Path, where: Path | None = None) -> str:
    """The job's checkpoints as its catalog recorded them at the incident (kept in
    the incident's folder ``where``; else the job's catalog.json now), those nearest
    the incident; this incident's quarantine and resume marked."""
    kept = where / CATALOG if where is not None else None
    at_incident = kept is not None and kept.exists()
    source = kept if at_incident and kept is not None else job_dir / "catalog.json"
    state = read_json(source)
    if not isinstance(state, dict):
        return section("Checkpoints", '<p class="note">no catalog recorded for this job</p>',
                       "checkpoints")
    def steps_of(k: str) -> dict[int, Any]:
        m = state.get(k)
        return {int(s): v for s, v in m.items() if s.lstrip("-").isdigit()} if isinstance(
            m, dict) else {}
    reported, bad, health, used, judged = (steps_of(k) for k in (
        "reported", "bad", "health", "used", "judged"))
    rb = evidence(row).get(ROLLBACK)
    listed = rb.get("quarantined") if isinstance(rb, dict) else None
    quarantined = {q for q in listed if _int(q) is not None} if isinstance(listed, list) else set()
    resumed = row.get("resumed_step")
    every = sorted(set(reported) | set(bad) | set(used) | set(judged) | quarantined)
    centre = _int(row.get("onset_step")) or (every[-1] if every else 0)
    mine = {s for s in every if s in quarantined or s == resumed}
    near = sorted(mine | set(sorted(every, key=lambda s: abs(s - centre))[:MAX_CHECKPOINTS]))
    rows, classes = [], []
    for s in near:
        why = bad.get(s)
        js = judged.get(s)
        j: Mapping[str, Any] = js if isinstance(js, dict) else {}
        verdict = ("quarantined" if str(why).startswith("quarantined") else "bad") if why else (
            "reported" if s in reported else "good" if j.get("good") is True
            else "incomplete" if j else "on disk")
        why = why or j.get("why")
        hs = health.get(s)
        h: Mapping[str, Any] = hs if isinstance(hs, dict) else {}
        notes = [*(["quarantined by this incident"] if s in quarantined else []),
                 *(["this incident's relaunch resumed here"] if s == resumed else [])]
        rows.append([s, verdict, h.get("loss"), ",".join(map(str, as_list(used.get(s)))) or "-",
                     reported.get(s) or j.get("path") or "-", why or "", "; ".join(notes)])
        classes.append("this" if notes else "")
    said = ("as the catalog judged them when the incident was recorded" if at_incident else
            f"as recorded now in {esc(source)} (no copy was kept with this incident)")
    body = (f'<p class="note">{said}; a rollback\'s own record of what it quarantined is '
            f"above; {len(near)} of {len(every)} checkpoints, nearest step {centre}</p>"
            + table(("step", "verdict", "loss", "resumed by attempts", "path", "why",
                     "this incident"), rows, classes, numeric=(0, 2)))
    return section("Checkpoints", body, "checkpoints")


def log_tail(folder: Path) -> str:
    try:
        with open(folder / "log-tail.txt", "rb") as f:
            raw = f.read(MAX_FILE)
    except OSError:
        return ""
    lines = raw.decode(errors="replace").splitlines()[-LOG_LINES:]
    return section(f"Log tail (last {len(lines)} lines)", f"<pre>{esc(chr(10).join(lines))}</pre>",
                   "log")


def raw_evidence(row: Mapping[str, Any], limit: int = 16384) -> str:
    text = json.dumps(evidence(row), indent=1, sort_keys=True, default=str)
    more = f"\n... {len(text) - limit} more characters" if len(text) > limit else ""
    return section("Evidence as recorded", f"<pre>{esc(text[:limit] + more)}</pre>", "evidence")

