"""A job's optional sections beyond the command and its checkpoints: the
log rules (``logs``), the loss watch (``anomalies``), the stall detector
(``stall``) and the evidence kept before a kill (``evidence``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwatch.config import fields
from trainwatch.config.fields import Said
from trainwatch.config.reader import DUR, MISSING, OPT_DUR, STR, Reader, action
from trainwatch.config.schema import Anomalies, Evidence, Logs
from trainwatch.detectors.logrules import LogRule, compile_rules
from trainwatch.detectors.loss import LossSettings
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


def anomalies(r: Reader, raw: object, path: str) -> Anomalies:
    """``anomalies:``: each detector setting by its name in LossSettings (a kind
    true/false, a count, a threshold), plus the rollback's margin and tries."""
    d = LossSettings()
    names = [f.name for f in dataclasses.fields(LossSettings)]
    m = r.mapping(raw, path, {*names, "margin", "max_rollbacks"})
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
    a = Anomalies()
    return Anomalies(detect=detect,
                     margin=r.get(m, "margin", path, fields.NATURAL, a.margin),
                     max_rollbacks=r.get(m, "max_rollbacks", path, fields.POSITIVE,
                                         a.max_rollbacks))


def stall(r: Reader, raw: object, path: str) -> StallSettings:
    """``stall: {factor, floor, ceiling, silence, idle_cpu}`` (detectors/stall.py)."""
    m = r.mapping(raw, path, {"factor", "floor", "ceiling", "silence", "idle_cpu"})
    d = StallSettings()
    s = StallSettings(
        factor=r.get(m, "factor", path, fields.FACTOR, d.factor),
        floor=r.get(m, "floor", path, DUR, d.floor),
        ceiling=r.get(m, "ceiling", path, DUR, d.ceiling),
        silence=r.get(m, "silence", path, OPT_DUR, d.silence),
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
