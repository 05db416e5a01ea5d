"""The Prometheus rules in grafana/rules: promtool accepts them and their unit tests
pass, every alert is labelled, annotated and documented in grafana/RUNBOOK.md, every
alert has a firing and a quiet promtool case, and the recording rules are exactly the
metric catalogue's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import need_binary  # skips without promtool; fails instead under CI=true

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "grafana" / "rules"
ALERTS = RULES / "alerts.yml"
RECORDING = RULES / "recording.yml"
RULE_TESTS = sorted((RULES / "tests").glob("*.yml"))
RUNBOOK = ROOT / "grafana" / "RUNBOOK.md"

# The recording rules of the metric catalogue (issue 4), name -> expression.
CATALOGUE_RECORDING = {
    "trainwatch_job:step_rate:deriv5m": "clamp_min(deriv(trainwatch_job_step[5m]), 0)",
    "trainwatch_job:last_good_checkpoint_age_seconds":
        "time() - trainwatch_job_last_good_checkpoint_timestamp_seconds",
    "trainwatch_job:heartbeat_age_seconds:max":
        "max by (instance, job) (trainwatch_rank_heartbeat_age_seconds)",
    "trainwatch_job:restarts:increase1h":
        "sum by (instance, job) (increase(trainwatch_job_restarts_total[1h]))",
    "trainwatch_job:faults:increase1h":
        "sum by (instance, job, kind) (increase(trainwatch_job_faults_total[1h]))",
    "trainwatch_job:detection_seconds:p95_1h":
        "histogram_quantile(0.95, sum by (instance, job, le) "
        "(rate(trainwatch_job_detection_seconds_bucket[1h])))",
    "trainwatch_job:relaunch_seconds:p95_1h":
        "histogram_quantile(0.95, sum by (instance, job, le) "
        "(rate(trainwatch_job_relaunch_seconds_bucket[1h])))",
    "trainwatch_gpu:xid_errors:increase1h":
        "sum by (instance, gpu, uuid, xid, class) (increase(trainwatch_gpu_xid_errors_total[1h]))",
}


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def _rules(path: Path) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [r for r in _rules(ALERTS) if "alert" in r]


def _github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _squash(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def test_promtool_check_rules_accepts_both_rule_files() -> None:
    """`promtool check rules` passes on alerts.yml and recording.yml."""
    promtool = need_binary("promtool")
    p = _run(promtool, "check", "rules", str(ALERTS), str(RECORDING))
    assert p.returncode == 0, p.stdout + p.stderr


def test_promtool_unit_tests_pass() -> None:
    """Every promtool unit test under grafana/rules/tests passes."""
    promtool = need_binary("promtool")
    assert RULE_TESTS, "no promtool test files in grafana/rules/tests"
    p = _run(promtool, "test", "rules", *(str(t.relative_to(RULES)) for t in RULE_TESTS),
             cwd=RULES)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_has_severity_annotations_and_a_runbook_section() -> None:
    """Each alert has severity critical|warning, summary, description, and a runbook_url
    whose anchor is a heading of grafana/RUNBOOK.md."""
    headings = {
        _github_anchor(m.group(1))
        for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", RUNBOOK.read_text(), re.MULTILINE)
    }
    alerts = _alerts()
    assert alerts, "alerts.yml has no alerts"
    for rule in alerts:
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in {"critical", "warning"}, name
        ann = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert str(ann.get(key, "")).strip(), f"{name}: no {key}"
        doc, _, anchor = ann["runbook_url"].partition("#")
        assert (ROOT / doc).resolve() == RUNBOOK, f"{name}: runbook_url points at {doc}"
        assert anchor == name.lower(), f"{name}: anchor {anchor!r}"
        assert anchor in headings, f"{name}: no heading {anchor!r} in RUNBOOK.md"


def test_every_alert_has_a_firing_and_a_quiet_promtool_case() -> None:
    """Each alert appears in the promtool tests with non-empty exp_alerts and with
    `exp_alerts: []`."""
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for test in doc.get("tests") or []:
            for case in test.get("alert_rule_test") or []:
                if case.get("exp_alerts"):
                    fires.add(case["alertname"])
                elif "exp_alerts" in case and case["exp_alerts"] == []:
                    quiet.add(case["alertname"])
    names = {r["alert"] for r in _alerts()}
    assert not names - fires, f"alerts never tested firing: {sorted(names - fires)}"
    assert not names - quiet, f"alerts never tested quiet: {sorted(names - quiet)}"


def test_recording_rules_are_exactly_the_catalogues() -> None:
    """recording.yml's group trainwatch.recording defines every catalogue recording rule,
    with the catalogue's expression, and nothing else."""
    doc = yaml.safe_load(RECORDING.read_text())
    assert [g["name"] for g in doc["groups"]] == ["trainwatch.recording"]
    defined = {r["record"]: r["expr"] for r in _rules(RECORDING)}
    assert set(defined) == set(CATALOGUE_RECORDING)
    for name, expr in CATALOGUE_RECORDING.items():
        assert _squash(defined[name]) == _squash(expr), name


@pytest.mark.parametrize("path", [ALERTS, RECORDING], ids=lambda p: p.name)
def test_rule_files_reference_no_job_label_on_gpu_series(path: Path) -> None:
    """GPU series are never selected by `job` (it is "trainwatch" there, not a training job)."""
    for rule in _rules(path):
        for sel in re.findall(r"trainwatch_gpu_\w+\{[^}]*\}", rule["expr"]):
            assert not re.search(r"\bjob\s*[=!]", sel), f"{rule.get('alert')}: {sel}"
