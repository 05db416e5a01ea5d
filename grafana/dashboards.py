"""Build trainwatch's Grafana dashboards as code with grafana-foundation-sdk.

    python grafana/dashboards.py          # (re)write grafana/dashboards/*.json
    python grafana/dashboards.py --check  # exit 1 if the committed JSON is stale

Every metric and recording rule used here is in the metric catalogue. Series without a
`job` label of their own (GPU, source, build) get job="trainwatch" from the scrape config,
so GPU series are never selected by job: a GPU panel that follows the selected jobs joins
on (instance, gpu) with trainwatch_job_gpu instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
TAGS = ["trainwatch"]
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label matchers. `job` exists only on job series (trainwatch_job_*, rank_*, heartbeat_*).
HOST = 'instance=~"$host"'
JOB = f'{HOST}, job=~"$job"'
GPU = f'{HOST}, gpu=~"$gpu"'
GPU_L = "{{instance}} GPU {{gpu}}"
JOB_L = "{{instance}} {{job}}"
RATE = "[$__rate_interval]"
XIDS = "trainwatch_gpu_xid_errors_total"

JOB_STATES = {"starting": "blue", "running": "green", "stopping": "purple", "backoff": "orange",
              "exited": "text", "fatal": "red", "paused": "yellow"}
GPU_STATES = {"healthy": "green", "unknown": "orange", "excluded": "red"}
RECOVERY = {"none": "green", "gpu_reset": "orange", "node_reboot": "red", "drain_p2p": "orange",
            "drain_and_reset": "red"}
Levels = Sequence[tuple[float | None, str]]
ALERT: Levels = ((None, "green"), (1, "red"))
WARN: Levels = ((None, "green"), (1, "orange"))
DASH = {"fill": "dash", "dash": [10, 10]}


# --------------------------------------------------------------------------- PromQL helpers
def m(name: str, matchers: str, *extra: str) -> str:
    """`name{matchers, extra...}`."""
    return name + "{" + ", ".join((matchers, *extra)) + "}"


def by(labels: str, agg: str, expr: str) -> str:
    """`agg by (labels) (expr)`."""
    return f"{agg} by ({labels}) ({expr})"


def over(fn: str, series: str, window: str = RATE) -> str:
    """`fn(series[window])`, e.g. rate or increase over Grafana's $__rate_interval."""
    return f"{fn}({series}{window})"


def new_or_increase(series: str, window: str) -> str:
    """Increase over `window` that also counts series born inside it (an Xid series appears
    with value 1 at its first Xid, which increase() alone never sees)."""
    return f"(({series} unless {series} offset {window}) or increase({series}[{window}]))"


def coded(metric: str, matchers: str, label: str, values: Sequence[str], by_: str) -> str:
    """One series per `by_` whose value is the 1-based index of the `label` value that is 1."""
    parts = [m(metric, matchers, f'{label}="{v}"') + f" * {i}" for i, v in enumerate(values, 1)]
    return by(by_, "max", " or ".join(parts))


def of_jobs(gpu_series: str) -> str:
    """Only the GPU series of GPUs that the selected jobs' current attempts were given."""
    return f"{gpu_series} and on (instance, gpu) ({m('trainwatch_job_gpu', JOB)} == 1)"


# --------------------------------------------------------------------------- panel helpers
@dataclass(frozen=True)
class Q:
    """One Prometheus target: expression, legend, instant or range, table format."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


P = TypeVar("P", timeseries.Panel, stat.Panel, statetimeline.Panel, bargauge.Panel, table.Panel)


def fixed(color: str) -> dict[str, str]:
    return {"mode": "fixed", "fixedColor": color}


def steps(levels: Levels) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in levels])


def names(colors: dict[str, str], keys: Sequence[str] | None = None) -> list[dm.ValueMapping]:
    """Value mapping keys[i] -> the i-th name in `colors`, coloured (keys default 1..n)."""
    pairs = zip(keys or [str(i) for i in range(1, len(colors) + 1)], colors.items(), strict=True)
    return [dm.ValueMap(options={k: dm.ValueMappingResult(text=n, color=c, index=i)
                                 for i, (k, (n, c)) in enumerate(pairs)})]


def setup(p: P, title: str, queries: Sequence[Q], unit: str, w: int, h: int,
          description: str, levels: Levels = ((None, "green"),)) -> P:
    """What every panel has: title, size, unit, thresholds, datasource, targets A, B, ..."""
    p = p.title(title).span(w).height(h).unit(unit).datasource(DS).thresholds(steps(levels))
    if description:
        p = p.description(description)
    for i, q in enumerate(queries):
        t = (prom.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i)).datasource(DS)
             .legend_format(q.legend or "__auto"))
        t = t.instant() if q.instant else t.range()
        p = p.with_target(t.format(PromQueryFormat.TABLE) if q.table else t)
    return p


def legend() -> cb.VizLegendOptions:
    return (cb.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM).show_legend(True))


def ts(title: str, *queries: Q, unit: str = "short", w: int = 12, h: int = 8,
       bars: bool = False, lo: float | None = None, hi: float | None = None,
       dashed: Sequence[str] = (), description: str = "") -> timeseries.Panel:
    """Time series; the targets whose refIds are in `dashed` are red dashed reference lines."""
    p = setup(timeseries.Panel(), title, queries, unit, w, h, description).legend(legend())
    p = p.tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                  .sort(common.SortOrder.DESCENDING))
    p = p.draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
    p = p.fill_opacity(60 if bars else 10)
    p = p.min(lo) if lo is not None else p
    p = p.max(hi) if hi is not None else p
    for ref in dashed:
        p = p.override_by_query(ref, [
            dm.DynamicConfigValue(id_val="color", value=fixed("red")),
            dm.DynamicConfigValue(id_val="custom.lineStyle", value=DASH),
            dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0)])
    return p


def st(title: str, *queries: Q, unit: str = "short", w: int = 4, h: int = 5,
       levels: Levels = ((None, "green"),), colors: dict[str, str] | None = None,
       mappings: list[dm.ValueMapping] | None = None, no_value: str = "",
       description: str = "") -> stat.Panel:
    """Stat of each series' last value; `colors` pins a colour to a series name."""
    p = setup(stat.Panel(), title, queries, unit, w, h, description, levels)
    p = p.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    p = p.graph_mode(common.BigValueGraphMode.NONE).color_mode(common.BigValueColorMode.VALUE)
    mode = common.BigValueTextMode
    p = p.text_mode(mode.VALUE_AND_NAME if any(q.legend for q in queries) else mode.VALUE)
    p = p.mappings(mappings) if mappings else p
    p = p.no_value(no_value) if no_value else p
    for name, color in (colors or {}).items():
        p = p.override_by_name(name, [dm.DynamicConfigValue(id_val="color", value=fixed(color))])
    return p


def timeline(title: str, query: Q, mappings: list[dm.ValueMapping], w: int = 12, h: int = 7,
             description: str = "") -> statetimeline.Panel:
    """State timeline whose values `mappings` turns into coloured names."""
    p = setup(statetimeline.Panel(), title, [query], "none", w, h, description)
    p = p.show_value(common.VisibilityMode.AUTO).merge_values(True).row_height(0.8)
    return p.legend(legend().show_legend(False)).mappings(mappings).fill_opacity(80)


def gauge(title: str, query: Q, unit: str, w: int = 8, h: int = 8,
          levels: Levels = ((None, "green"),), lo: float = 0, hi: float = 1) -> bargauge.Panel:
    """Horizontal bar gauge, one bar per series."""
    p = setup(bargauge.Panel(), title, [query], unit, w, h, "", levels).min(lo).max(hi)
    p = p.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    return (p.orientation(common.VizOrientation.HORIZONTAL)
            .display_mode(common.BarGaugeDisplayMode.GRADIENT).show_unfilled(True))


def tbl(title: str, query: Q, hide: Sequence[str], w: int = 12, h: int = 8) -> table.Panel:
    """Table of an instant query's series, without the columns in `hide`."""
    p = setup(table.Panel(), title, [query], "none", w, h, "").show_header(True)
    return p.with_transformation(dm.DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hide, True)}))


# --------------------------------------------------------------------------- dashboard helpers
class PromAnnotation(dm.AnnotationQuery):
    """The SDK's AnnotationQuery lacks Prometheus' titleFormat/textFormat/tagKeys/step."""

    def __init__(self, name: str, expr: str, title: str, text: str, tags: str, color: str) -> None:
        super().__init__(name=name, datasource=DS, enable=True, hide=False, icon_color=color,
                         expr=expr)
        self.title_format, self.text_format, self.tag_keys = title, text, tags

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "titleFormat": self.title_format,
                "textFormat": self.text_format, "tagKeys": self.tag_keys, "step": "60s",
                "useValueForTime": False}


@dataclass(frozen=True)
class Built(Builder[dm.AnnotationQuery]):
    """A builder handing back an annotation model built by hand."""

    obj: dm.AnnotationQuery

    def build(self) -> dm.AnnotationQuery:
        return self.obj


def query_var(name: str, label: str, query: str) -> db.QueryVariable:
    """Multi-value label_values() variable, All by default, All meaning the regex `.*`."""
    return (db.QueryVariable(name).label(label).query(query).datasource(DS)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])))


VARIABLES: dict[str, Callable[[], Builder[dm.VariableModel]]] = {
    "datasource": lambda: db.DatasourceVariable("datasource").label("Data source")
    .type("prometheus"),
    "host": lambda: query_var("host", "Host", "label_values(trainwatch_build_info, instance)"),
    "job": lambda: query_var("job", "Job",
                             f"label_values({m('trainwatch_job_state', HOST)}, job)"),
    "gpu": lambda: query_var("gpu", "GPU", f"label_values({m('trainwatch_gpu_info', HOST)}, gpu)"),
}

Section = tuple[str, Sequence[Builder[dm.Panel]]]


def build(uid: str, title: str, description: str, variables: Sequence[str],
          sections: Sequence[Section], annotations: Sequence[PromAnnotation] = ()) -> dm.Dashboard:
    """A dashboard of expanded rows, each followed by its panels laid out left to right."""
    d = (db.Dashboard(title).uid(uid).description(description).tags(TAGS).time("now-6h", "now")
         .refresh("30s").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(db.DashboardLink("trainwatch").type(dm.DashboardLinkType.DASHBOARDS).tags(TAGS)
               .as_dropdown(True).include_vars(True).keep_time(True)))
    for name in variables:
        d = d.with_variable(VARIABLES[name]())
    for a in annotations:
        d = d.annotation(Built(a))
    for row_title, panels in sections:
        # Row.with_panel would nest the panels and force the row collapsed; an expanded row
        # is a bare row followed by its panels at the top level.
        d = d.with_row(db.Row(row_title).collapsed(False))
        for panel in panels:
            d = d.with_panel(panel)
    out = d.build()
    for i, p in enumerate(out.panels or [], 1):
        p.id_val = i
    return out


# --------------------------------------------------------------------------- the dashboards
def fleet() -> dm.Dashboard:
    recovery = m("trainwatch_gpu_recovery_action", HOST, 'action!="none"')
    fatal = m("trainwatch_job_state", JOB, 'state="fatal"')
    return build(
        "trainwatch-fleet", "trainwatch / Fleet overview",
        "Every host's training jobs and GPUs, and the trainwatch daemon itself.",
        ["datasource", "host", "job"], [
            ("Jobs", [
                st("Jobs by state", Q(by("state", "sum", m("trainwatch_job_state", JOB)),
                                      "{{state}}", True), w=10, colors=JOB_STATES),
                st("Fatal jobs", Q(f"sum({fatal}) or vector(0)", instant=True), levels=ALERT),
                st("Restarts (last hour)", Q(
                    f"sum({m('trainwatch_job:restarts:increase1h', JOB)}) or vector(0)",
                    instant=True), w=5, levels=WARN),
                st("Faults (last hour)", Q(
                    f"sum({m('trainwatch_job:faults:increase1h', JOB)}) or vector(0)",
                    instant=True), w=5, levels=WARN),
                ts("Faults by kind", Q(by("kind", "sum", over(
                    "increase", m("trainwatch_job_faults_total", JOB))) + " > 0", "{{kind}}"),
                   bars=True, w=8),
                gauge("Goodput per job", Q(m("trainwatch_job_goodput_ratio", JOB), JOB_L, True),
                      "percentunit", levels=((None, "red"), (0.8, "orange"), (0.95, "green"))),
                ts("Heartbeat age of each job's slowest rank", Q(
                    m("trainwatch_job:heartbeat_age_seconds:max", JOB), JOB_L), unit="s", w=8),
            ]),
            ("GPUs", [
                st("GPUs by state", Q(by("state", "sum", m("trainwatch_gpu_state", HOST)),
                                      "{{state}}", True), w=8, colors=GPU_STATES),
                st("Lost GPUs", Q(f"sum({m('trainwatch_gpu_lost', HOST)})", instant=True),
                   levels=ALERT),
                st("Xids (last hour)", Q(f"sum({new_or_increase(m(XIDS, HOST), '1h')})"
                                         " or vector(0)", instant=True), levels=ALERT),
                st("GPUs needing a recovery action", Q(by("action", "count", f"{recovery} == 1"),
                                                       "{{action}}", True),
                   w=8, no_value="0", levels=((None, "red"),)),
            ]),
            ("trainwatch daemon", [
                st("Exporter up", Q(m("up", 'job="trainwatch"', HOST), "{{instance}}", True),
                   w=6, mappings=names({"down": "red", "up": "green"}, ["0", "1"])),
                st("Sources up", Q(m("trainwatch_source_up", HOST), "{{instance}} {{source}}",
                                   True),
                   w=6, mappings=names({"failing": "red", "ok": "green"}, ["0", "1"])),
                ts("Source read duration", Q(m("trainwatch_source_scrape_duration_seconds", HOST),
                                             "{{instance}} {{source}}"), unit="s", w=6),
                ts("Source and ledger write errors",
                   Q(by("instance, source", "sum",
                        over("rate", m("trainwatch_source_errors_total", HOST))),
                     "{{instance}} {{source}}"),
                   Q(over("rate", m("trainwatch_ledger_write_errors_total", HOST)),
                     "{{instance}} ledger"), unit="cps", w=6),
            ]),
        ])


def job_latency(what: str) -> timeseries.Panel:
    """p95 (recording rule) and p50 over the last hour of a trainwatch_job_*_seconds histogram."""
    bucket = m(f"trainwatch_job_{what}_seconds_bucket", JOB)
    p50 = f"histogram_quantile(0.5, {by('instance, job, le', 'sum', over('rate', bucket, '[1h]'))})"
    return ts(f"{what.capitalize()} latency (last hour)",
              Q(m(f"trainwatch_job:{what}_seconds:p95_1h", JOB), f"{JOB_L} p95"),
              Q(p50, f"{JOB_L} p50"), unit="s", w=8)


def job_counter(title: str, metric: str) -> timeseries.Panel:
    """Increase per interval of a per-(job, kind) counter, zero series hidden."""
    expr = by("instance, job, kind", "sum", over("increase", m(metric, JOB))) + " > 0"
    return ts(title, Q(expr, f"{JOB_L} {{{{kind}}}}"), bars=True)


def job_lost(title: str, metric: str, unit: str) -> stat.Panel:
    """What a per-job counter grew by over the dashboard's time range."""
    return st(title, Q(by("instance, job", "sum", over("increase", m(metric, JOB), "[$__range]")),
                       JOB_L, True), unit=unit, w=6, levels=WARN)


def job() -> dm.Dashboard:
    faults = m("trainwatch_job_faults_total", JOB)
    restarts = m("trainwatch_job_restarts_total", JOB)
    return build(
        "trainwatch-job", "trainwatch / Job",
        "One or more training jobs: progress, heartbeats, faults and restarts, checkpoints.",
        ["datasource", "host", "job", "gpu"], [
            ("State", [
                timeline("Job state", Q(coded("trainwatch_job_state", JOB, "state",
                                              list(JOB_STATES), "instance, job"), JOB_L),
                         names(JOB_STATES), h=5),
                st("Ranks heard from", Q(m("trainwatch_job_ranks", JOB), JOB_L, True)),
                st("Attempts launched", Q(m("trainwatch_job_attempts_total", JOB), JOB_L, True)),
                st("Current attempt running for", Q(
                    f"time() - {m('trainwatch_job_attempt_start_time_seconds', JOB)}", JOB_L, True),
                   unit="s"),
            ]),
            ("Progress", [
                ts("Step", Q(m("trainwatch_job_step", JOB), JOB_L), w=8),
                ts("Step rate (steps/s)", Q(m("trainwatch_job:step_rate:deriv5m", JOB), JOB_L),
                   w=8, lo=0),
                ts("Step per rank", Q(m("trainwatch_rank_step", JOB), f"{JOB_L} rank {{{{rank}}}}"),
                   w=8),
                ts("Loss", Q(m("trainwatch_job_loss", JOB), JOB_L)),
                ts("Gradient norm", Q(m("trainwatch_job_grad_norm", JOB), JOB_L)),
            ]),
            ("Heartbeats", [
                ts("Heartbeat age per rank",
                   Q(m("trainwatch_rank_heartbeat_age_seconds", JOB), f"{JOB_L} rank {{{{rank}}}}"),
                   Q(m("trainwatch_job_heartbeat_timeout_seconds", JOB), f"{JOB_L} timeout"),
                   unit="s", dashed=["B"],
                   description="A rank whose age crosses the dashed timeout is declared hung."),
                ts("Heartbeat datagrams",
                   Q(by("instance, job", "sum",
                        over("rate", m("trainwatch_heartbeat_datagrams_total", JOB))),
                     f"{JOB_L} received"),
                   Q(by("instance, job, reason", "sum",
                        over("rate", m("trainwatch_heartbeat_dropped_total", JOB))),
                     f"{JOB_L} dropped {{{{reason}}}}"), unit="cps"),
            ]),
            ("Faults and restarts", [
                job_counter("Faults by kind", "trainwatch_job_faults_total"),
                job_counter("Restarts by kind", "trainwatch_job_restarts_total"),
                job_latency("detection"),
                job_latency("relaunch"),
                ts("Goodput", Q(m("trainwatch_job_goodput_ratio", JOB), JOB_L),
                   unit="percentunit", w=8, lo=0, hi=1),
                job_lost("Steps lost (time range)", "trainwatch_job_steps_lost_total", "short"),
                job_lost("Time lost (time range)", "trainwatch_job_seconds_lost_total", "s"),
                st("Faults (last hour)", Q(m("trainwatch_job:faults:increase1h", JOB) + " > 0",
                                           f"{JOB_L} {{{{kind}}}}", True),
                   w=6, levels=WARN, no_value="0"),
                st("Restarts (last hour)", Q(m("trainwatch_job:restarts:increase1h", JOB), JOB_L,
                                             True), w=6, levels=WARN),
            ]),
            ("Checkpoints", [
                st("Last good checkpoint step", Q(m("trainwatch_job_last_good_checkpoint_step",
                                                    JOB), JOB_L, True), w=6, no_value="none"),
                st("Last good checkpoint age", Q(m(
                    "trainwatch_job:last_good_checkpoint_age_seconds", JOB), JOB_L, True),
                   unit="s", w=6,
                   levels=((None, "green"), (7200, "orange"), (21600, "red")), no_value="none"),
                st("Checkpoints on disk by verdict", Q(by("instance, job, state", "sum", m(
                    "trainwatch_job_checkpoints", JOB)), f"{JOB_L} {{{{state}}}}", True), w=12),
            ]),
            ("CPU and memory of the job", [
                ts("CPU used (cores)", Q(by("instance, job", "sum", over(
                    "rate", m("trainwatch_job_cpu_seconds_total", JOB))), JOB_L), w=9, lo=0,
                   description="CPU seconds per second of the job's processes, from its "
                               "attempt's cgroup; no data where the job runs without one."),
                ts("Host memory", Q(m("trainwatch_job_resident_memory_bytes", JOB),
                                    f"{JOB_L} resident (sum of RSS)"),
                   Q(m("trainwatch_job_memory_usage_bytes", JOB), f"{JOB_L} cgroup"),
                   Q(m("trainwatch_job_memory_peak_bytes", JOB), f"{JOB_L} cgroup peak"),
                   unit="bytes", w=9, lo=0,
                   description="The cgroup figures appear only where the memory controller "
                               "is enabled for the job's cgroup."),
                job_lost("OOM kills (time range)", "trainwatch_job_oom_kills_total", "short"),
            ]),
            ("GPUs of the job", [
                ts("GPU utilisation", Q(of_jobs(m("trainwatch_gpu_utilization_ratio", GPU)),
                                        GPU_L), unit="percentunit", lo=0, hi=1),
                ts("GPU memory used", Q(of_jobs(m("trainwatch_gpu_memory_used_bytes", GPU)),
                                        GPU_L), unit="bytes", lo=0),
            ]),
        ],
        annotations=[
            PromAnnotation("Faults", f"changes({faults}[1m]) > 0", "Fault: {{kind}}",
                           "{{job}} on {{instance}}: {{kind}} fault detected", "job,kind", "red"),
            PromAnnotation("Restarts", f"changes({restarts}[1m]) > 0", "Restart: {{kind}}",
                           "{{job}} on {{instance}} relaunched after a {{kind}} fault", "job,kind",
                           "orange"),
        ])


def gpu_rate(title: str, metric: str, labels: str = "instance, gpu") -> timeseries.Panel:
    """Per-second rate of a per-GPU counter, summed over `labels`."""
    extra = labels.removeprefix("instance, gpu").removeprefix(", ")
    legend = f"{GPU_L} {{{{{extra}}}}}" if extra else GPU_L
    return ts(title, Q(by(labels, "sum", over("rate", m(metric, GPU))), legend), unit="cps", w=8)


def gpu() -> dm.Dashboard:
    xids = m(XIDS, GPU)
    return build(
        "trainwatch-gpu", "trainwatch / GPU",
        "Per-GPU health as trainwatch sees it through NVML and the kernel log.",
        ["datasource", "host", "job", "gpu"], [
            ("Health", [
                timeline("GPU state", Q(coded("trainwatch_gpu_state", GPU, "state",
                                              list(GPU_STATES), "instance, gpu"), GPU_L),
                         names(GPU_STATES), w=8),
                timeline("NVML recovery action", Q(coded(
                    "trainwatch_gpu_recovery_action", GPU, "action", list(RECOVERY),
                    "instance, gpu"), GPU_L), names(RECOVERY), w=8),
                timeline("Lost (NVML: lost or needs reset)", Q(m("trainwatch_gpu_lost", GPU),
                                                               GPU_L),
                         names({"ok": "green", "lost": "red"}, ["0", "1"]), w=8),
                st("Row remapping and page retirement",
                   Q(f"sum({m('trainwatch_gpu_row_remap_pending', GPU)})", "remap pending", True),
                   Q(f"sum({m('trainwatch_gpu_row_remap_failed', GPU)})", "remap failed", True),
                   Q(f"sum({m('trainwatch_gpu_retired_pages_pending', GPU)})",
                     "retired pages pending", True), w=8, levels=ALERT),
                st("ECC errors since driver load", Q(by("type", "sum", m(
                    "trainwatch_gpu_ecc_errors_total", GPU)), "{{type}}", True), w=8, levels=WARN),
                st("Xids by class (last hour)", Q(by("class", "sum", new_or_increase(xids, "1h")),
                                                  "{{class}}", True),
                   w=8, levels=ALERT, no_value="0"),
            ]),
            ("Xids", [
                ts("Xids", Q(by("instance, gpu, xid, class", "sum",
                                new_or_increase(xids, "$__rate_interval")) + " > 0",
                             f"{GPU_L} Xid {{{{xid}}}} ({{{{class}}}})"), bars=True, w=24,
                   description="Xids per interval, by Xid and the NVIDIA catalog's action."),
            ]),
            ("Thermals, power, clocks", [
                ts("Temperature", Q(m("trainwatch_gpu_temperature_celsius", GPU), GPU_L),
                   Q(m("trainwatch_gpu_slowdown_temperature_celsius", GPU), f"{GPU_L} slowdown"),
                   unit="celsius", dashed=["B"]),
                ts("Power", Q(m("trainwatch_gpu_power_watts", GPU), GPU_L), unit="watt", lo=0),
                ts("Utilisation", Q(m("trainwatch_gpu_utilization_ratio", GPU), GPU_L),
                   unit="percentunit", lo=0, hi=1),
                timeline("Clock-event (throttle) reasons active", Q(
                    m("trainwatch_gpu_clock_event_active", GPU, 'reason!="gpu_idle"') + " == 1",
                    f"{GPU_L} {{{{reason}}}}"), names({"active": "orange"}), w=12, h=8),
            ]),
            ("Memory", [
                ts("Memory used and total", Q(m("trainwatch_gpu_memory_used_bytes", GPU), GPU_L),
                   Q(m("trainwatch_gpu_memory_total_bytes", GPU), f"{GPU_L} total"),
                   unit="bytes", lo=0, dashed=["B"]),
                ts("Remapped rows", Q(m("trainwatch_gpu_remapped_rows", GPU),
                                      f"{GPU_L} {{{{type}}}}")),
            ]),
            ("Errors", [
                gpu_rate("ECC errors", "trainwatch_gpu_ecc_errors_total", "instance, gpu, type"),
                gpu_rate("PCIe replays", "trainwatch_gpu_pcie_replays_total"),
                gpu_rate("NVLink errors", "trainwatch_gpu_nvlink_errors_total",
                         "instance, gpu, type"),
            ]),
            ("Inventory and jobs", [
                tbl("GPU inventory", Q(m("trainwatch_gpu_info", GPU), instant=True, table=True),
                    ["Time", "Value", "__name__", "job"]),
                ts("GPUs of the selected jobs", Q(of_jobs(m("trainwatch_gpu_utilization_ratio",
                                                            GPU)), GPU_L),
                   unit="percentunit", lo=0, hi=1,
                   description="Utilisation of the GPUs the selected jobs' current attempts "
                   "were given (joined on instance and gpu with trainwatch_job_gpu)."),
            ]),
        ],
        annotations=[
            PromAnnotation("Xids", f"(({xids} unless {xids} offset 1m) or changes({xids}[1m])) > 0",
                           "Xid {{xid}}", "{{instance}} GPU {{gpu}}: Xid {{xid}} ({{class}})",
                           "xid,class", "red"),
        ])


DASHBOARDS: dict[str, Callable[[], dm.Dashboard]] = {
    "trainwatch-fleet.json": fleet, "trainwatch-job.json": job, "trainwatch-gpu.json": gpu}


def render(dashboard: dm.Dashboard) -> str:
    return json.dumps(dashboard, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed JSON differs from what would be generated")
    args = parser.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        path, text = OUT_DIR / name, render(make())
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join('grafana/dashboards/' + n for n in stale)}; "
              "regenerate with: python grafana/dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
