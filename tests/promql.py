"""Every PromQL expression shipped in grafana/, and the metric names each one
reads. The names come from PromQL's grammar, not from a hand-kept list: strings,
label matchers, ranges and label lists are removed, and what is left that is
neither a function call nor a keyword is a metric name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan", "atan2"}
# Grafana's variables, replaced by something PromQL accepts in their places.
_GRAFANA_VARS = [
    (re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}"),
     "5m"),
    (re.compile(r"\$\{?\w+(:\w+)?\}?"), ".*"),
]


def substitute(expr: str) -> str:
    for pattern, value in _GRAFANA_VARS:
        expr = pattern.sub(value, expr)
    return expr


def metric_names(expr: str) -> set[str]:
    s = _STRING.sub('""', expr)
    while True:
        stripped = _LABEL_LIST.sub(" ", _RANGE.sub(" ", _BRACES.sub(" ", s)))
        if stripped == s:
            break
        s = stripped
    names = set()
    for m in _IDENT.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]?|[eE]\d*", word):
            continue
        names.add(word)
    return names


def _grafana_query(q: str) -> str | None:
    """label_values(sel, label) and query_result(expr) -> the PromQL inside."""
    q = q.strip()
    m = re.fullmatch(r"label_values\((.*),\s*\w+\s*\)", q, re.S)
    if m:
        return m.group(1)
    m = re.fullmatch(r"query_result\((.*)\)", q, re.S)
    if m:
        return m.group(1)
    if re.fullmatch(r"label_values\(\s*\w+\s*\)|label_names\(\)|metrics\(.*\)", q):
        return None
    return q or None


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    """(where, expression) for every query in grafana/dashboards/*.json."""
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        doc = json.loads(path.read_text())
        for node in _walk(doc):
            expr = node.get("expr")
            if isinstance(expr, str) and expr.strip():
                yield f"{path.name}: {node.get('refId') or node.get('name') or ''}", expr
        for var in doc.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            q = var.get("query")
            if isinstance(q, dict):
                q = q.get("query")
            inner = _grafana_query(q or "") if isinstance(q, str) else None
            if inner:
                yield f"{path.name}: variable {var.get('name')}", inner


def rule_expressions() -> Iterator[tuple[str, str]]:
    for path in sorted((GRAFANA / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                yield f"{path.name}: {name}", str(rule["expr"])


def recorded_names() -> set[str]:
    out = set()
    for path in sorted((GRAFANA / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.update(r["record"] for r in group["rules"] if "record" in r)
    return out
