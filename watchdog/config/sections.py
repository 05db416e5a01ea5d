"""A job's optional sections beyond the command and its checkpoints: the
log rules (``logs``), the loss watch (``anomalies``), the stall detector
(``stall``), the evidence kept before a kill (``evidence``), and the
checkpoints with their retention (``checkpoints``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwatch.config import fields
from trainwatch.config.fields import Said
from trainwatch.config.reader import DUR, MISSING, OPT_DUR, STR, Reader, action
from trainwatch.config.schema import Anomalies, Checkpoints, Evidence, Keep, Logs
from trainwatch.detectors.logrules import LogRule, compile_rules
from trainwatch.detectors.losssettings import LossSettings
from trainwatch.detectors.stall import StallSettings
from trainwatch.types import DETECTED_KINDS, FaultKind


def logs(r: Reader, raw: object, path: str) -> Logs:
    """``logs: {builtin: true, rules: [{name, pattern, kind, count, window, action}]}``;
    every regex is compiled here, so a bad one is a config error naming its rule."""
    m = r.mapping(raw, path, {"builtin", "rules"})
    raw_rules = m.get("rules") or []
    if not isinstance(raw_rules, list):
        raise r.fail(f"{path}.rules", "a list of rules", raw_rules)
    rules: list[LogRule] = []
    kinds = ", ".join(sorted(k.value for k in DETECTED_KINDS))
    for i, raw_rule in enumerate(raw_rules):
        rp = f"{path}.rules[{i}]"
        rm = r.mapping(raw_rule, rp, {"name", "pattern", "kind", "count", "window", "action"})
        kind = r.get(rm, "kind", rp, STR, FaultKind.LOG_PATTERN.value)
        if kind not in {k.value for k in DETECTED_KINDS}:
            raise r.fail(f"{rp}.kind", f"a fault kind ({kinds})", kind)
        act = rm.get("action")
        rules.append(LogRule(
            name=r.get(rm, "name", rp, fields.NAME, MISSING),
            pattern=r.get(rm, "pattern", rp, STR, MISSING),
            kind=kind,
            count=r.get(rm, "count", rp, fields.POSITIVE, 1),
            window=r.get(rm, "window", rp, DUR, 60.0),
            action=None if act is None else action(r, f"{rp}.action", act).value,
        ))
    for i, rule in enumerate(rules):
        try:
            compile_rules([rule])
        except ValueError as e:
            raise r.fail(f"{path}.rules[{i}].pattern", "a valid regular expression",
                         Said(str(e))) from None
    return Logs(builtin=r.get(m, "builtin", path, "true or false", True), rules=tuple(rules))


# Keys of a job's anomalies that are now its policy's rollback settings.
_MOVED = {"margin": "before", "max_rollbacks": "max_widenings"}


def anomalies(r: Reader, raw: object, path: str) -> Anomalies:
    """``anomalies:``: each detector setting by its name in LossSettings (a kind
    true/false, a count, a threshold). The rollback's settings are the policy's."""
    d = LossSettings()
    names = [f.name for f in dataclasses.fields(LossSettings)]
    if isinstance(raw, dict):
        for old, new in _MOVED.items():
            if old in raw:
                raise r.fail(f"{path}.{old}", f"policies.<the job's policy>.rollback.{new}"
                             " (the setting moved there)", Said(f"anomalies.{old}"))
    m = r.mapping(raw, path, set(names))
    values: dict[str, Any] = {}
    for name in names:
        default = getattr(d, name)
        kind = ("true or false" if isinstance(default, bool) else
                fields.NATURAL if isinstance(default, int) else fields.POSITIVE_NUMBER)
        values[name] = r.get(m, name, path, kind, default)
    try:
        detect = LossSettings(**values)
    except ValueError as e:  # settings that contradict each other (act below alert)
        raise r.fail(path, f"settings that agree ({e})",
                     Said(", ".join(f"{k}: {v}" for k, v in m.items()))) from None
    return Anomalies(detect=detect)


def stall(r: Reader, raw: object, path: str) -> StallSettings:
    """``stall: {factor, floor, ceiling, silence, idle_cpu}`` (detectors/stall.py)."""
    m = r.mapping(raw, path, {"factor", "floor", "ceiling", "silence", "idle_cpu"})
    d = StallSettings()
    s = StallSettings(
        factor=r.get(m, "factor", path, fields.FACTOR, d.factor),
        floor=r.get(m, "floor", path, DUR, d.floor),
        ceiling=r.get(m, "ceiling", path, DUR, d.ceiling),
        silence=r.get(m, "silence", path, fields.OFF_DUR, d.silence),
        idle_cpu=r.get(m, "idle_cpu", path, fields.POSITIVE_NUMBER, d.idle_cpu),
    )
    if s.floor > s.ceiling:
        raise r.fail(f"{path}.floor", f"at most the ceiling ({s.ceiling:g}s)", m.get("floor"))
    return s


def evidence(r: Reader, raw: object, path: str) -> Evidence:
    """``evidence: {kinds: [...], timeout, native, log_lines, flight_recorder}``."""
    m = r.mapping(raw, path, {"kinds", "timeout", "native", "log_lines", "flight_recorder"})
    d = Evidence()
    on = d.kinds
    if "kinds" in m:
        raw_on = m["kinds"]
        known = {k.value for k in FaultKind}
        if not isinstance(raw_on, list) or not all(isinstance(k, str) and k in known
                                                     for k in raw_on):
            raise r.fail(f"{path}.kinds", "a list of fault kinds (" + ", ".join(sorted(known))
                         + ")", raw_on)
        on = frozenset(FaultKind(k) for k in raw_on)
    return Evidence(
        kinds=on,
        timeout=r.get(m, "timeout", path, DUR, d.timeout),
        native=r.get(m, "native", path, "true or false", d.native),
        log_lines=r.get(m, "log_lines", path, fields.NATURAL, d.log_lines),
        flight_recorder=r.get(m, "flight_recorder", path, "true or false", d.flight_recorder),
    )


# The layouts a remote store (trainwatch snapshots) can be pulled into.
REMOTE_LAYOUTS = ("trainwatch", "auto")
_PATTERN = "a file name pattern with one {step} and no '/'"
_FIXED = "the one file's name, without '/' (layout fixed)"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bytes(v: object) -> int:
    """An integer of bytes, or a string with a binary suffix: 500G, 1.5T, 200M."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if isinstance(v, str):
        text = v.strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        number = float(text[: len(text) - len(unit)])
        if number >= 0:
            return int(number * _UNITS[unit])
    raise ValueError(v)


def checkpoints(r: Reader, raw: object, path: str) -> Checkpoints:
    """``checkpoints: {dir, layout, pattern, marker, quiet_for, bad_after, keep, verify,
    verify_timeout, remote, on_pull_failure}``."""
    c = r.mapping(raw, path, {"dir", "layout", "pattern", "marker", "quiet_for", "bad_after",
                              "keep", "verify", "verify_timeout", "remote", "on_pull_failure"})
    d = Checkpoints()
    layout = r.get(c, "layout", path, fields.LAYOUT, d.layout)
    pattern = r.get(c, "pattern", path, STR, d.pattern)
    if layout == "fixed":
        if "/" in pattern or "{step}" in pattern or "pattern" not in c:
            raise r.fail(f"{path}.pattern", _FIXED, c.get("pattern", MISSING))
    elif pattern.count("{step}") != 1 or "/" in pattern:
        raise r.fail(f"{path}.pattern", _PATTERN, pattern)
    remote = r.get(c, "remote", path, fields.REMOTE, None)
    if remote is not None:
        if layout not in REMOTE_LAYOUTS:
            raise r.fail(f"{path}.layout", "trainwatch or auto (checkpoints.remote holds "
                         "trainwatch snapshots)", layout)
        if "dir" not in c:
            raise r.fail(f"{path}.dir", "the local folder a remote snapshot is pulled into "
                         "(checkpoints.remote is set)", MISSING)
    on_pull_failure = r.get(c, "on_pull_failure", path, STR, d.on_pull_failure)
    if on_pull_failure not in ("stop", "retire"):
        raise r.fail(f"{path}.on_pull_failure", "stop or retire (what a launch does when "
                     "the pull from checkpoints.remote fails)", on_pull_failure)
    return Checkpoints(
        dir=r.get(c, "dir", path, STR, None),
        layout=layout,
        pattern=pattern,
        marker=r.get(c, "marker", path, STR, None),
        quiet_for=r.get(c, "quiet_for", path, OPT_DUR, None),
        bad_after=r.get(c, "bad_after", path, fields.POSITIVE, d.bad_after),
        keep=_keep(r, c.get("keep"), f"{path}.keep"),
        verify=r.get(c, "verify", path, "true or false", d.verify),
        verify_timeout=r.get(c, "verify_timeout", path, DUR, d.verify_timeout),
        remote=remote,
        on_pull_failure=on_pull_failure,
    )


def _keep(r: Reader, raw: object, path: str) -> Keep:
    """``keep: {last, every, pinned, min_free_bytes}``; all unset: nothing is deleted."""
    k = r.mapping(raw, path, {"last", "every", "pinned", "min_free_bytes"})
    pinned = k.get("pinned") or []
    if not isinstance(pinned, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pinned):
        raise r.fail(f"{path}.pinned", "a list of steps (integers >= 0)", pinned)
    free = k.get("min_free_bytes")
    if free is not None:
        try:
            free = _bytes(free)
        except (ValueError, IndexError):
            raise r.fail(f"{path}.min_free_bytes",
                         "a number of bytes, e.g. 500000000000 or 500G", free) from None
    return Keep(last=r.get(k, "last", path, fields.POSITIVE, None) if "last" in k else None,
                every=r.get(k, "every", path, fields.POSITIVE, None) if "every" in k else None,
                pinned=tuple(pinned), min_free_bytes=free)
