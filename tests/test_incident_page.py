"""Incident pages (issue 24): `trainwatch incidents --show N --html FILE` and
`trainwatch incidents --html FILE` over incidents that real `trainwatch run`s
recorded (a rollback past bad data, a stopped torchrun rank, a crash and an Xid
on a simulated GPU): each page says what the ledger and the evidence say, marks
what the data says where it says it, escapes what a job wrote, fetches nothing,
and bad input is one line, never a traceback.

The state dirs are made once per test process (``scenario``) and shared with
test_incident_page_browser.py."""

from __future__ import annotations

import atexit
import functools
import html
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from conftest import finish, wait_for, workspace

# Steps BAD..BAD+3 have bad data: a NaN loss on each. The data of step k is drawn
# from k (said with data_order), every step is checkpointed; the loss falls and the
# grad norm wobbles, so the page has a curve to draw around the onset.
_BAD_DATA = textwrap.dedent(
    """
    import math, os, sys, time
    from trainwatch import client
    ckpt, steps, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = int(open(client.resume_from()).read()) if client.resume_from() else 0
    skip = client.skip_steps()
    hb = client.connect()
    hb.data_order("step", "batch k is drawn from k", step=start)
    for step in range(start + 1, steps + 1):
        time.sleep(0.01)
        if skip and skip[0] <= step <= skip[1]:
            hb.beat(step)
            continue
        loss = math.nan if bad <= step <= bad + 3 else 2.0 / (1 + 0.01 * step)
        hb.beat(step, loss=loss, grad_norm=0.5 + 0.1 * math.sin(step))
        path = os.path.join(ckpt, f"step_{step}")
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)
        hb.checkpoint(step, path)
    """
)
BAD = 50
XID79_GPU1 = "NVRM: Xid (PCI:0000:11:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"


def _copy_state(src: Path) -> Path:
    """The state dir, kept past its workspace (removed when the test process ends)."""
    dest = Path(tempfile.mkdtemp(prefix="twpage", dir="/tmp"))
    atexit.register(shutil.rmtree, dest, True)
    shutil.copytree(src, dest / "state")
    return dest / "state"


def _rollback() -> Path:
    """Bad data at steps 50-53 under a real `trainwatch run`: nan_loss rollbacks whose
    skip window widens; each incident keeps its loss series and rollback record."""
    with workspace() as ws:
        script = ws.root / "trainer.py"
        script.write_text(_BAD_DATA)
        cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), "90", str(BAD)],
                         "resume_args": [],
                         "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}},
                        policy={"max_restarts": 2})
        code, out = finish(ws.run(cfg), timeout=180)
        assert code == 0, out[-3000:]
        incs = ws.incidents()
        assert len(incs) >= 2 and all(i["kind"] == "nan_loss" for i in incs), incs
        return _copy_state(ws.state)


def _crash_then_xid() -> Path:
    """One job on four simulated GPUs: it crashes at step 15 (exit 3), is relaunched,
    then Xid 79 on GPU 1 in the kernel log gets it relaunched without that GPU."""
    with workspace() as ws:
        kern = ws.root / "kern.log"
        kern.write_text("")
        cfg = ws.config(
            {"command": ws.worker("--steps", "300", "--crash-at", "15"),
             "gpus": {"devices": [0, 1, 2, 3], "min": 2}},
            {"max_restarts": 3},
            gpu={"backend": "sim", "count": 4, "kmsg": str(kern), "poll_interval": "0.2s"})
        p = ws.run(cfg)
        wait_for(lambda: any(e["event"] == "start" and e["attempt"] == 1 for e in ws.events())
                 and (ws.status().get("step") or 0) >= 40, timeout=60, what="the relaunch")
        with open(kern, "a") as f:
            f.write(XID79_GPU1)
        code, out = finish(p, timeout=120)
        assert code == 0, out[-3000:]
        kinds = [i["kind"] for i in ws.incidents()]
        assert kinds == ["crash", "gpu_xid"], kinds
        return _copy_state(ws.state)


def _stall() -> Path:
    """A torchrun job (2 ranks, gloo) whose rank 1 stops itself after step 35:
    nccl_stall, rank 1 named, both ranks' stacks kept. It stops itself, not by
    `faultinject nccl-stall` (test_stall.py), so that its stack is never the one the
    other rank blocks in: a stop from outside can land inside the all-reduce."""
    from test_torchrun import _ddp

    with workspace() as ws:
        args = ["--beat", "--steps", "150", "--interval", "0.05", "--ckpt-every", "20",
                "--print-every", "5", "--stop-rank1-at", "35"]
        p = ws.run(ws.config({"command": _ddp(ws, *args), "gpus": {"devices": [0, 1]}},
                             gpu={"backend": "sim", "count": 2, "kmsg": None}))
        wait_for(lambda: ws.incidents(), timeout=180, what="the stall incident")
        code, out = finish(p, timeout=240)
        assert code == 0, out[-3000:]
        assert ws.incidents()[0]["kind"] == "nccl_stall", ws.incidents()
        return _copy_state(ws.state)


# What a job printed, as it lands in an incident's evidence and its log tail: if it
# became markup, the page would run a script and fetch from the network.
HOSTILE = ('torch.OutOfMemoryError: CUDA out of memory. <script>document.title="pwned"'
           '</script><img src="http://leak.invalid/x.png"><a href="javascript:alert(1)">x</a>'
           ' & "quotes" \'too\'')
_PRINTS = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["TRAINWATCH_ATTEMPT"] == "0":
        print(sys.argv[1], flush=True)
        time.sleep(60)
    """
)


def _hostile() -> Path:
    """A job whose output holds markup: an oom incident (the cuda_oom log rule) with
    the line in its evidence and its log tail (evidence.kinds: [oom])."""
    with workspace() as ws:
        script = ws.root / "prints.py"
        script.write_text(_PRINTS)
        p = ws.run(ws.config({"command": [sys.executable, str(script), HOSTILE],
                              "evidence": {"kinds": ["oom"]}},
                             policy={"actions": {"oom": "restart"}}))
        code, out = finish(p, timeout=120)
        assert code == 0, out[-3000:]
        assert [i["kind"] for i in ws.incidents()] == ["oom"], ws.incidents()
        return _copy_state(ws.state)


_BUILDERS = {"rollback": _rollback, "crash_xid": _crash_then_xid, "stall": _stall,
             "hostile": _hostile}


@functools.cache
def scenario(name: str) -> Path:
    """The state dir of a real run (made once per test process)."""
    return _BUILDERS[name]()


# --- reading pages back ----------------------------------------------------------


class Page(HTMLParser):
    """Every element's tag and attributes, in document order; the text, tags dropped."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.chunks: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.chunks).split())

    def marks(self, kind: str | None = None) -> list[dict[str, str]]:
        return [a for _, a in self.elements if "data-mark" in a
                and (kind is None or a["data-mark"] == kind)]

    def charts(self) -> dict[str, list[tuple[str, dict[str, str]]]]:
        """Each chart's elements (data-chart: its name)."""
        out: dict[str, list[tuple[str, dict[str, str]]]] = {}
        current = None
        for tag, a in self.elements:
            if tag == "svg":
                current = a.get("data-chart")
                out[current or ""] = []
            elif current is not None:
                out[current].append((tag, a))
        return out


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", "incidents", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def render(state: Path, incident: int, out: Path, *extra: str) -> Page:
    """`trainwatch incidents --show N --html FILE`, and the page it wrote."""
    r = cli("--state-dir", str(state), "--show", str(incident), "--html", str(out), *extra)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and f"to {out}" in r.stderr, (r.stdout, r.stderr)
    return Page(out.read_text())


def ledger(state: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The incidents (evidence parsed) and transitions, as recorded."""
    con = sqlite3.connect(f"file:{state / 'ledger.db'}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        incs = [dict(r) for r in con.execute("SELECT * FROM incidents ORDER BY id")]
        ts = [dict(r) for r in con.execute("SELECT * FROM transitions ORDER BY id")]
    finally:
        con.close()
    for i in incs:
        i["evidence"] = json.loads(i["evidence"])
    return incs, ts


def expected_x(plot: dict[str, str], x: float) -> float:
    """Where the chart's scale puts x (chart.py: the plot's data-x-min/max over its width)."""
    x0, x1 = float(plot["data-x-min"]), float(plot["data-x-max"])
    return float(plot["x"]) + (x - x0) / (x1 - x0) * float(plot["width"])


def mark_x(tag: str, a: dict[str, str]) -> float:
    return float(a["cx"] if tag == "circle" else a["x"] if tag == "rect" else a["x1"])


def assert_marks_placed(chart: list[tuple[str, dict[str, str]]]) -> None:
    """Every mark of a chart stands where its data-x says (bands: x to data-end-x)."""
    [plot] = [a for t, a in chart if a.get("data-role") == "plot"]
    for tag, a in chart:
        if "data-mark" not in a:
            continue
        assert abs(mark_x(tag, a) - expected_x(plot, float(a["data-x"]))) <= 0.06, (tag, a)
        if "data-end-x" in a:
            right = float(a["x"]) + float(a["width"])
            assert abs(right - expected_x(plot, float(a["data-end-x"]))) <= 0.11, a


def assert_self_contained(text: str) -> None:
    """No script, no fetched resource, no external link but the given Grafana's."""
    p = Page(text)
    tags = {t for t, _ in p.elements}
    assert not tags & {"script", "img", "link", "iframe", "object", "embed", "image", "use"}
    for t, a in p.elements:
        assert "src" not in a and not any(k.startswith("on") for k in a), (t, a)
        href = a.get("href")
        assert href is None or href.startswith(("http://grafana.example:3000/d/", "incident-",
                                                "#")), href
    css = re.findall(r"<style>(.*?)</style>", text, re.S)
    assert css and not any("url(" in c or "@import" in c for c in css)
    assert 'http-equiv="Content-Security-Policy"' in text and "default-src &#x27;none&#x27;" \
        in text


# --- the pages ---------------------------------------------------------------------


def test_a_rollback_page_marks_onset_detection_resume_skip_window_and_quarantine(
        tmp_path: Path) -> None:
    """Each nan_loss rollback's page: its loss and grad norm charts carry the onset, the
    step it was noticed at, the step resumed from, the skip window and every quarantined
    checkpoint, as the incident recorded them, each where the chart's scale puts that
    step; the NaN steps of series.json are flagged; the timeline's times are the
    ledger's; the rollback's record is spelled out; nothing is fetched."""
    state = scenario("rollback")
    incs, ts = ledger(state)
    for inc in incs:
        page = render(state, inc["id"], tmp_path / f"{inc['id']}.html")
        rb = inc["evidence"]["rollback"]
        data = json.loads((state / "jobs" / "job" / "incidents" / str(inc["id"])
                           / "series.json").read_text())
        charts = page.charts()
        assert set(charts) == {"loss", "grad_norm"}, set(charts)
        for name, els in charts.items():
            marks: dict[str, list[dict[str, str]]] = {}
            for _, a in els:
                if "data-mark" in a:
                    marks.setdefault(a["data-mark"], []).append(a)
            assert [m["data-step"] for m in marks["onset"]] == [str(inc["onset_step"])]
            assert [m["data-step"] for m in marks["noticed"]] == [
                str(inc["evidence"]["noticed_step"])]
            assert [m["data-step"] for m in marks["resume"]] == [str(rb["resume_step"])]
            assert rb["resume_step"] == inc["resumed_step"]
            assert [(m["data-start"], m["data-end"]) for m in marks["skip"]] == [
                tuple(map(str, rb["window"]))]
            assert sorted(int(m["data-step"]) for m in marks["quarantined"]) == sorted(
                rb["quarantined"])
            assert_marks_placed(els)
            if name == "loss":
                nans = [s for s, v in zip(data["steps"], data["loss"], strict=True)
                        if v == "nan"]
                assert nans and sorted(int(m["data-step"]) for m in marks["nonfinite"]) == nans
        phases = {a["data-phase"]: float(a["data-time"]) for t, a in page.elements
                  if t == "tr" and "data-phase" in a}
        mine = [t for t in ts if t["attempt"] in (inc["attempt"], inc["attempt"] + 1)]
        assert phases["detection"] == inc["time"]
        assert phases["onset"] == pytest.approx(inc["time"] - inc["detection_latency_s"])
        assert phases["kill"] == next(t["time"] for t in mine if t["to_state"] == "stopping")
        assert phases["relaunch"] == next(t["time"] for t in mine if t["to_state"] == "starting"
                                          and t["attempt"] == inc["attempt"] + 1)
        assert phases["first beat"] == next(t["time"] for t in mine if t["to_state"] == "running"
                                            and t["attempt"] == inc["attempt"] + 1)
        assert list(phases) == ["onset", "detection", "kill", "stopped", "relaunch",
                                "first beat"], list(phases)
        w = rb["window"]
        assert f"TRAINWATCH_SKIP_STEPS={w[0]}:{w[1]}" in page.text
        assert f"resumed from step {rb['resume_step']}" in page.text
        assert_self_contained((tmp_path / f"{inc['id']}.html").read_text())
        # The checkpoints table is the catalog as it stood at the incident, kept with it:
        # no checkpoint the relaunches wrote after it.
        kept = json.loads((state / "jobs" / "job" / "incidents" / str(inc["id"])
                           / "catalog.json").read_text())
        now = json.loads((state / "jobs" / "job" / "catalog.json").read_text())
        assert max(map(int, kept["reported"])) < max(map(int, now["reported"])) == 90, kept
        assert "as the catalog judged them when the incident was recorded" in page.text
    # The widened window of the second rollback names the one it widened.
    assert "widening 1 of 3 of the window 50-50" in render(
        state, incs[1]["id"], tmp_path / "again.html").text


def test_a_stall_page_lists_every_rank_and_highlights_the_odd_stack(tmp_path: Path) -> None:
    """nccl_stall of a torchrun job whose rank 1 was stopped: both ranks with their last
    step and process state (rank 1: T), the verdict naming rank 1, the stacks grouped
    (distinct ones apart), rank 1's highlighted as the odd one out."""
    state = scenario("stall")
    [inc, *_] = ledger(state)[0]
    page = render(state, inc["id"], tmp_path / "stall.html")
    steps = inc["evidence"]["steps"]
    text = page.text
    for rank, step in steps.items():  # rank, last step, process state
        assert re.search(rf"\b{rank} {step} [SRDT]\b", text), (rank, step, text[:3000])
    assert re.search(rf"\b1 {steps['1']} T\b", text)
    assert "verdict rank 1" in text
    groups = [a for t, a in page.elements if t == "div" and "data-group" in a]
    assert {g["data-ranks"] for g in groups} == {"0", "1"}, groups
    odd = [g for g in groups if "odd-one" in g["class"]]
    assert [g["data-ranks"] for g in odd] == ["1"], groups
    assert "ddp.py" in text and "odd one out" in text
    assert_self_contained((tmp_path / "stall.html").read_text())


def test_a_crash_page_and_an_xid_page_say_how_it_ended_and_where_it_relaunched(
        tmp_path: Path) -> None:
    """The crash: its exit code and last step. Xid 79 on GPU 1: the Xid, its catalog
    mnemonic and class, the GPUs before and those the relaunch got (without GPU 1), and
    that GPU 1 is excluded now. Both with their whole timeline."""
    state = scenario("crash_xid")
    crash, xid = ledger(state)[0]
    text = render(state, crash["id"], tmp_path / "crash.html").text
    assert "exit code 3" in text and "last step 15" in text, text[:2000]
    assert "relaunch" in text and "first beat" in text
    page = render(state, xid["id"], tmp_path / "xid.html")
    text = page.text
    assert "Xid 79" in text and "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in text
    assert "class RESTART_BM" in text
    assert "GPUs before 0,1,2,3" in text and "relaunch got GPUs 0,2,3" in text, text[:3000]
    assert "excluded: gpu_xid 79" in text
    for f in ("crash.html", "xid.html"):
        assert_self_contained((tmp_path / f).read_text())


def test_the_index_charts_goodput_marks_every_incident_and_links_their_pages(
        tmp_path: Path) -> None:
    """`incidents --html FILE`: one section per job with its goodput (between 0 and 1,
    from the ledger), a chart of time making progress with each incident marked at its
    onset (rollbacks as rollbacks), each incident linked to its page, written beside."""
    for name, rollbacks in (("rollback", True), ("crash_xid", False)):
        state = scenario(name)
        incs, _ = ledger(state)
        out = tmp_path / name / "index.html"
        out.parent.mkdir()
        r = cli("--state-dir", str(state), "--html", str(out))
        assert r.returncode == 0, r.stderr
        page = Page(out.read_text())
        [ratio] = [float(a["data-goodput"]) for _, a in page.elements if "data-goodput" in a]
        assert 0 < ratio < 1
        [chart] = page.charts().values()
        assert_marks_placed(chart)
        kinds = {a["data-incident"]: a["data-mark"] for _, a in chart
                 if a.get("data-mark") in ("incident", "rollback")}
        assert kinds == {str(i["id"]): "rollback" if i["action"] == "rollback" else "incident"
                         for i in incs}
        assert ("rollback" in kinds.values()) is rollbacks
        for i in incs:
            onset = i["time"] - (i["detection_latency_s"] or 0)
            [m] = [a for _, a in chart if a.get("data-incident") == str(i["id"])
                   and a["data-mark"] != "outage"]
            assert float(m["data-time"]) == pytest.approx(onset)
        links = [a["href"] for t, a in page.elements if t == "a"]
        assert links == [f"incident-{i['id']}.html" for i in reversed(incs)]
        assert all((out.parent / h).is_file() for h in links)
        assert_self_contained(out.read_text())


def test_a_jobs_text_never_becomes_markup(tmp_path: Path) -> None:
    """A line of the job's with a script, an image and a javascript: link lands in the
    incident's evidence and log tail: the page shows it as text, every character of it,
    and has no element the job wrote."""
    state = scenario("hostile")
    [inc] = ledger(state)[0]
    out = tmp_path / "hostile.html"
    page = render(state, inc["id"], out)
    assert_self_contained(out.read_text())
    assert page.text.count(" ".join(HOSTILE.split())) >= 2  # the matched line and the log tail
    assert "javascript:" not in {a.get("href", "") for _, a in page.elements}
    assert html.escape(HOSTILE) in out.read_text()


def test_grafana_links_only_with_a_base_url_to_the_shipped_dashboards(tmp_path: Path) -> None:
    """Without --grafana: no link out. With it: the job and GPU dashboards (their uids as
    grafana/dashboards has them) for this job and the incident's window."""
    state = scenario("crash_xid")
    _, xid = ledger(state)[0]
    plain = render(state, xid["id"], tmp_path / "plain.html")
    assert not [a for t, a in plain.elements if t == "a"]
    page = render(state, xid["id"], tmp_path / "g.html", "--grafana", "http://grafana.example:3000/")
    hrefs = [a["href"] for t, a in page.elements if t == "a"]
    uids = {json.loads(p.read_text())["uid"]
            for p in (Path(__file__).parents[1] / "grafana" / "dashboards").glob("*.json")}
    assert len(hrefs) == 3
    import urllib.parse

    for h in hrefs:
        u = urllib.parse.urlsplit(h)
        assert (u.scheme, u.netloc) == ("http", "grafana.example:3000")
        assert u.path.startswith("/d/") and u.path[3:] in uids, h
        q = dict(urllib.parse.parse_qsl(u.query))
        assert q["var-job"] == "job"
        assert int(q["from"]) < xid["time"] * 1000 < int(q["to"])
    assert any("var-gpu=1" in h for h in hrefs)


def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    """No such incident, a file that cannot be written, a folder for a file, a bad
    --grafana, --grafana without --html, no ledger: one line on stderr, no traceback."""
    state = str(scenario("crash_xid"))
    cases = [
        (("--state-dir", state, "--show", "99", "--html", str(tmp_path / "x.html")), 1,
         "no incident 99"),
        (("--state-dir", state, "--show", "1", "--html", str(tmp_path / "no" / "x.html")), 1,
         "cannot write it"),
        (("--state-dir", state, "--show", "1", "--html", str(tmp_path)), 1, "is a folder"),
        (("--state-dir", state, "--html", str(tmp_path / "none" / "i.html")), 1,
         "cannot write it"),
        (("--state-dir", state, "--html", str(tmp_path / "i.html"), "--job", "nope"), 1,
         "no incidents of job 'nope'"),
        (("--state-dir", state, "--show", "1", "--html", str(tmp_path / "x.html"),
          "--grafana", "grafana:3000"), 2, "expected Grafana's base URL"),
        (("--state-dir", state, "--show", "1", "--grafana", "http://g:3000"), 2,
         "--grafana: expected only with --html"),
        (("--state-dir", str(tmp_path), "--show", "1", "--html", str(tmp_path / "x.html")), 2,
         "no ledger here"),
    ]
    for args, code, says in cases:
        r = cli(*args)
        assert r.returncode == code, (args, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "x.html").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_html_to_stdout_with_a_dash() -> None:
    """--html -: the page on stdout, nothing else."""
    r = cli("--state-dir", str(scenario("crash_xid")), "--show", "1", "--html", "-")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("<!DOCTYPE html>") and r.stdout.rstrip().endswith("</html>")


def test_a_long_series_is_thinned_to_the_plot_and_keeps_its_spike() -> None:
    """100,000 steps draw a path of at most ~2 points per pixel column; the one spike's
    value is still the path's highest point (chart.thin keeps each column's extremes)."""
    from trainwatch.evidence import chart

    pts = [(float(s), 1.0 + (s % 7) * 0.01) for s in range(100_000)]
    pts[61_234] = (61_234.0, 50.0)
    svg = chart.chart("loss", [chart.Line("loss", pts)], log=False)
    [d] = re.findall(r'data-line="loss" d="([^"]+)"', svg)
    xy = [tuple(map(float, v.split())) for v in re.split("[ML]", d) if v]
    assert len(xy) <= 2 * 800 + 4 and len(svg) < 40_000, (len(xy), len(svg))
    top = min(xy, key=lambda p: p[1])
    [plot] = [a for _, a in Page(svg).charts()["loss"] if a.get("data-role") == "plot"]
    assert top[0] == pytest.approx(expected_x(plot, 61_234), abs=0.6)  # the spike, drawn
    assert sorted(p[1] for p in xy)[1] - top[1] > 0.5 * float(plot["height"])


def test_evidence_of_any_shape_makes_a_page_never_an_exception(tmp_path: Path) -> None:
    """Rows and kept files of shapes no version wrote (wrong types, truncated JSON, a
    series longer than its values) still make a whole page: what cannot be shown is a
    line saying so; the index of such rows too."""
    from trainwatch.evidence import page

    state = tmp_path / "state"
    where = state / "jobs" / "job" / "incidents" / "7"
    (where / "stacks").mkdir(parents=True)
    (where / "series.json").write_text('{"steps": [1, 2, "x", 4], "loss": ["nan", {}], '
                                       '"grad_norm": 5, "onset_step": "2"}')
    (where / "evidence.json").write_text('{"targets": [{"rank": "x"}, 5, {"rank": 3, '
                                         '"file": "../../x", "py_spy": 7}], "verdict": []}')
    (where / "stacks" / "rank3.json").write_text("{not json")
    (where / "log-tail.txt").write_bytes(b"\xff\xfe <b>bold</b>\n")
    (state / "jobs" / "job" / "catalog.json").write_text('{"reported": [], "bad": {"x": 1}}')
    weird: list[dict[str, Any]] = [
        {"id": 7, "job": "job", "kind": "nan_loss", "time": "noon", "attempt": None,
         "evidence": {"rollback": {"window": [1], "quarantined": "xy", "resume_step": "a",
                                   "previous_window": 3}, "noticed_step": [], "steps": [1],
                      "processes": {"x": 5, "2": {"pid": "p"}}, "ranks_stale": 5,
                      "xid": "79", "line": 7, "first_failure": [1], "reasons": 3}},
        {"id": 7, "job": "job", "kind": "gpu_xid", "gpu": "one", "time": 1e9,
         "attempt": 2, "action": "restart", "evidence": '{"xid": 79, "class": null, '
                                                         '"temperature_c": "hot"}'},
        {"id": 7, "job": "job", "kind": "crash", "time": 1e9, "detection_latency_s": "x",
         "evidence": "not json <i>"},
    ]
    for row in weird:
        text = page.incident_page(str(state), row, "http://grafana.example:3000")
        assert text.rstrip().endswith("</html>") and "<b>bold</b>" not in text
        assert "<i>" not in text and "not shown" not in text
        assert_self_contained(text)
    assert page.index_page(str(state), weird).rstrip().endswith("</html>")
