"""A job's optional sections beyond the command and its checkpoints: the
log rules (``logs``) and the loss watch (``anomalies``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwatch.config import fields
from trainwatch.config.fields import Said
from trainwatch.config.reader import DUR, MISSING, STR, Reader, action
from trainwatch.config.schema import Anomalies, Logs
from trainwatch.detectors.logrules import LogRule, compile_rules
from trainwatch.detectors.loss import LossSettings
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
