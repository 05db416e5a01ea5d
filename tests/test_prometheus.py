"""The exporter against the real thing: a real Prometheus server scrapes a real
`trainwatch run` (with the shipped scrape config and rules), promtool checks
the live exposition, and every PromQL expression shipped in grafana/ parses
and reads only metrics that the live exporter exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import WORKER, Workspace, free_port, need_binary, wait_for, workspace
from prometheus_client.parser import text_string_to_metric_families
from promql import (
    GRAFANA,
    dashboard_expressions,
    metric_names,
    recorded_names,
    rule_expressions,
    substitute,
)

REFERENCE = GRAFANA.parent / "docs" / "reference.md"  # the metric table (was the README's)


@dataclass
class Live:
    ws: Workspace
    config: Path
    metrics: str  # http://127.0.0.1:PORT/metrics
    prometheus: str  # http://127.0.0.1:PORT

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics, timeout=5) as r:
            return str(r.read().decode())

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """A `trainwatch run` of a 2-rank job on 2 simulated GPUs, scraped every
    second by a real Prometheus that loads the shipped rules."""
    prometheus = need_binary("prometheus")
    with workspace() as ws:
        port = free_port()
        job = {"command": [sys.executable, str(WORKER), "--ckpt-dir", str(ws.ckpt),
                           "--journal", str(ws.journal), "--steps", "100000",
                           "--interval", "0.05", "--ranks", "2", "--ckpt-every", "20"],
               "heartbeat": {"timeout": "60s"}}
        config = ws.config(job, metrics={"address": "127.0.0.1", "port": port},
                           gpu={"backend": "sim", "count": 2, "kmsg": None})
        ws.run(config)
        # The shipped scrape config, pointed at this trainwatch and sped up.
        prom = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(GRAFANA / f) for f in prom["rule_files"]]
        prom["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        prom_dir = ws.root / "prometheus"
        prom_dir.mkdir()
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(prom))
        web = free_port()
        server = subprocess.Popen(
            [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL, stderr=open(prom_dir / "log", "wb"),  # noqa: SIM115
        )
        lv = Live(ws, config, f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{web}")
        try:
            wait_for(lambda: _ok(lambda: lv.value('up{job="trainwatch"}') == 1), timeout=60,
                     what="Prometheus's first scrape of trainwatch")
            yield lv
        finally:
            server.terminate()
            server.wait(timeout=10)


def _ok(fn: Any) -> Any:
    try:
        return fn()
    except OSError:
        return None


def test_prometheus_sees_the_job_step_and_a_restart_after_faultinject_crash(live: Live) -> None:
    """Queried through Prometheus's HTTP API: the step advances, and a crash drilled
    with faultinject shows up as one restart of kind crash."""
    step = wait_for(lambda: live.value('trainwatch_job_step{job="job"}'), timeout=30,
                    what="the job's step in Prometheus")
    assert step >= 1
    before = live.value('trainwatch_job_restarts_total{job="job", kind="crash"}')
    assert before == 0
    r = live.ws.faultinject("crash", job="job")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: live.value('trainwatch_job_restarts_total{job="job", kind="crash"}') == 1,
             timeout=30, what="the restart in Prometheus")
    assert live.value('trainwatch_job_faults_total{job="job", kind="crash"}') == 1
    # Relaunched from the last good checkpoint, and working again.
    wait_for(lambda: live.value('trainwatch_job_state{job="job", state="running"}') == 1,
             timeout=30, what="the relaunched job running")
    assert live.value('trainwatch_job_attempts_total{job="job"}') == 2
    assert live.value('trainwatch_job_relaunch_seconds_count{job="job"}') == 1


def _full_scrape(live: Live) -> str:
    """An exposition with every family populated: an Xid counted, a checkpoint
    written, the job beating."""
    r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--config",
                        str(live.config), "--gpu", "0", "--xid", "63"],
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: "trainwatch_gpu_xid_errors_total{" in live.scrape()
             and "trainwatch_job_last_good_checkpoint_step{" in live.scrape()
             and "trainwatch_rank_heartbeat_age_seconds{" in live.scrape(),
             timeout=30, what="an Xid, a good checkpoint and heartbeat ages in the scrape")
    return live.scrape()


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count")}


def _exported(text: str) -> set[str]:
    """Every series name the exposition declares or carries. A family declared with no
    sample yet (a field this GPU does not support) is still one the exporter serves."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(f"{fam.name}{sfx}" for sfx in _SUFFIXES.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def test_promtool_check_metrics_is_clean_on_the_live_exposition(live: Live) -> None:
    """promtool's linter finds nothing to say about what trainwatch serves."""
    promtool = need_binary("promtool")
    text = _full_scrape(live)
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (
        r.stdout + r.stderr)


def _shipped() -> list[tuple[str, str]]:
    return [*rule_expressions(), *dashboard_expressions()]


def test_every_shipped_promql_expression_parses() -> None:
    """Each query in the dashboards and rules, Grafana variables filled in, is valid
    PromQL to promtool."""
    promtool = need_binary("promtool")
    exprs = _shipped()
    assert len(exprs) > 40
    rules = {"groups": [{"name": "shipped", "rules": [
        {"record": f"shipped:expr_{i}", "expr": substitute(e)} for i, (_, e) in enumerate(exprs)
    ]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump(rules, f)
        f.flush()
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True,
                           timeout=60, check=False)
    if r.returncode != 0:
        bad = [f"{where}: {e}" for i, (where, e) in enumerate(exprs)
               if f"expr_{i}" in r.stdout + r.stderr]
        pytest.fail(f"promtool: {r.stdout}{r.stderr}\n" + "\n".join(bad))


def test_every_shipped_expression_reads_only_metrics_the_live_exporter_exports(
        live: Live) -> None:
    """The names in grafana/ are compared against a real scrape, not a hand-kept list."""
    exported = _exported(_full_scrape(live)) | recorded_names() | {"up"}
    unknown = [f"{where}: {name}" for where, e in _shipped()
               for name in sorted(metric_names(substitute(e))) if name not in exported]
    assert not unknown, "\n".join(unknown)


def test_the_reference_documents_every_exported_metric_and_no_other(live: Live) -> None:
    """Every trainwatch_* family of a live scrape has a row in docs/reference.md's metric
    table, and every row names a family the exporter serves."""
    # Counters are documented by their series name, with _total.
    served = {f"{f.name}_total" if f.type == "counter" else f.name
              for f in text_string_to_metric_families(_full_scrape(live))
              if f.name.startswith("trainwatch_")}
    documented = set(re.findall(r"^\| `(trainwatch_[a-z_]+)` \|", REFERENCE.read_text(), re.M))
    assert served - documented == set(), "not documented"
    assert documented - served == set(), "documented but not exported"


def test_the_shipped_rules_evaluate_without_errors_in_prometheus(live: Live) -> None:
    """Prometheus loads grafana/rules and every rule evaluates cleanly against the
    live series (a bad vector match would show here as an error)."""

    def rules() -> list[dict[str, Any]] | None:
        with urllib.request.urlopen(f"{live.prometheus}/api/v1/rules", timeout=5) as r:
            groups = json.loads(r.read())["data"]["groups"]
        out = [rule for g in groups for rule in g["rules"]]
        return out if out and all(r["health"] != "unknown" for r in out) else None

    loaded = wait_for(lambda: _ok(rules), timeout=30, what="every rule evaluated once")
    shipped = {where.split(": ", 1)[1] for where, _ in rule_expressions()}
    assert {r["name"] for r in loaded} == shipped
    bad = [f"{r['name']}: {r.get('lastError')}" for r in loaded if r["health"] != "ok"]
    assert not bad, bad


@pytest.mark.parametrize(("expr", "names"), [
    ('rate(trainwatch_job_step{job=~"$job"}[5m])', {"trainwatch_job_step"}),
    ("sum by (instance, job) (increase(a_total[1h])) > on (instance, job) b", {"a_total", "b"}),
    ('histogram_quantile(0.95, sum by (le) (rate(x_bucket{le!="1e3"}[5m])))', {"x_bucket"}),
    ("(x unless x offset 10m) or increase(x[10m]) > 0", {"x"}),
    ('label_replace(up, "host", "$1", "instance", "(.*):.*") * on (host) group_left (n) y',
     {"up", "y"}),
    ("time() - trainwatch_job:last_good_checkpoint_age_seconds > 2 * 3600",
     {"trainwatch_job:last_good_checkpoint_age_seconds"}),
])
def test_metric_names_are_read_from_promql_grammar(expr: str, names: set[str]) -> None:
    """Functions, keywords, label lists, strings and durations are not metric names."""
    assert metric_names(substitute(expr)) == names
