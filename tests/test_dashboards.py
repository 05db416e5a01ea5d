"""The generated Grafana dashboards (grafana/dashboards/*.json) and the provisioning
files: the committed JSON is what grafana/dashboards.py generates, every dashboard has
the variables its queries use, and every query goes through the datasource variable."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import missing

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
SCRIPT = GRAFANA / "dashboards.py"
DASHBOARDS = GRAFANA / "dashboards"

# Which variables each dashboard must have (the job view may add gpu).
NEEDS = {
    "trainwatch-fleet": {"datasource", "host", "job"},
    "trainwatch-job": {"datasource", "host", "job"},
    "trainwatch-gpu": {"datasource", "host", "job", "gpu"},
}
# The label each query variable lists, and the label the job view may add.
VAR_LABEL = {"host": "instance", "job": "job", "gpu": "gpu"}
OPTIONAL = {"trainwatch-job": {"gpu"}}


def _load(uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARDS / f"{uid}.json").read_text())
    return data


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def _run_check(script: Path) -> subprocess.CompletedProcess[str]:
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        missing("grafana-foundation-sdk is not installed (the dev extra, Python >= 3.11)")
    return subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_regenerating_the_dashboards_changes_nothing() -> None:
    """The committed JSON is exactly what `grafana/dashboards.py` generates."""
    proc = _run_check(SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_fails_with_one_line_when_the_json_is_stale(tmp_path: Path) -> None:
    """`--check` exits 1 with a one-line message when a committed dashboard was hand-edited."""
    copy = tmp_path / "grafana"
    shutil.copytree(DASHBOARDS, copy / "dashboards")
    shutil.copy(SCRIPT, copy / "dashboards.py")
    stale = copy / "dashboards" / "trainwatch-gpu.json"
    stale.write_text(stale.read_text().replace('"Temperature"', '"Temp"'))
    proc = _run_check(copy / "dashboards.py")
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "trainwatch-gpu.json" in proc.stderr


@pytest.mark.parametrize("uid", sorted(NEEDS))
def test_dashboard_has_the_variables_it_needs(uid: str) -> None:
    """Each dashboard has a Prometheus datasource variable and its host/job/gpu variables."""
    dash = _load(uid)
    assert dash["uid"] == uid
    assert "trainwatch" in dash["tags"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert NEEDS[uid] <= set(variables) <= NEEDS[uid] | OPTIONAL.get(uid, set())
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for name in set(variables) - {"datasource"}:
        var = variables[name]
        assert var["type"] == "query"
        assert re.fullmatch(rf"label_values\(trainwatch_\w+(\{{.*\}})?, {VAR_LABEL[name]}\)",
                            var["query"]), var["query"]
        assert var["multi"] and var["includeAll"]


@pytest.mark.parametrize("uid", sorted(NEEDS))
def test_every_query_uses_the_datasource_variable(uid: str) -> None:
    """Every panel target, annotation and query variable reads from `${datasource}`."""
    dash = _load(uid)
    sources = [t["datasource"] for p in _panels(dash) for t in p["targets"]]
    sources += [a["datasource"] for a in dash["annotations"].get("list", [])]
    sources += [v["datasource"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert sources
    for ds in sources:
        assert ds == {"type": "prometheus", "uid": "${datasource}"}


@pytest.mark.parametrize("uid", sorted(NEEDS))
def test_every_panel_has_a_title_and_non_empty_expressions(uid: str) -> None:
    """Every panel has a title and at least one target, and no expression is empty."""
    dash = _load(uid)
    for panel in _panels(dash):
        assert panel.get("title", "").strip()
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
    for annotation in dash["annotations"].get("list", []):
        assert annotation["expr"].strip()


@pytest.mark.parametrize("uid", sorted(NEEDS))
def test_gpu_series_are_never_selected_by_job(uid: str) -> None:
    """No selector of a trainwatch_gpu_* series matches on `job` (GPU series have none)."""
    dash = _load(uid)
    exprs = [t["expr"] for p in _panels(dash) for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"].get("list", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    for expr in exprs:
        for matchers in re.findall(r"trainwatch_gpu_\w+\{([^}]*)\}", expr):
            assert not re.search(r"\bjob\s*[=!]", matchers), expr


@pytest.mark.parametrize("uid", sorted(NEEDS))
def test_panels_have_unique_ids_and_fit_the_grid(uid: str) -> None:
    """Panel ids are unique and every panel lies inside Grafana's 24-column grid."""
    panels = _load(uid)["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, p["title"]


def test_dashboard_provider_points_at_the_dashboards_folder() -> None:
    """The dashboard provider YAML parses and loads a `dashboards/trainwatch` folder."""
    text = (GRAFANA / "provisioning" / "dashboards" / "trainwatch.yml").read_text()
    provider = yaml.safe_load(text)["providers"][0]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert Path(path).parts[-2:] == ("dashboards", "trainwatch")
    assert f"grafana/dashboards/*.json {path}" in text  # the install comment copies them there


def test_datasource_example_is_prometheus_with_uid_prometheus() -> None:
    """The example data source YAML parses: Prometheus, uid `prometheus`, localhost:9090."""
    text = (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    (ds,) = yaml.safe_load(text)["datasources"]
    assert (ds["type"], ds["uid"], ds["url"]) == ("prometheus", "prometheus",
                                                  "http://localhost:9090")
