"""Incident pages in a real browser (Debian's chromium, headless; `.ci/run` installs
it): each kind of incident (a nan_loss rollback, an nccl_stall with stacks, a crash,
an Xid, a job's hostile output) and the index render; every mark stands where the
data says, measured on the laid-out page (a probe reads each mark's box back into
the DOM, which --dump-dom returns); nothing is fetched (chromium's own net log: no
request on the page's behalf, where a control page's requests are caught); a
screenshot of each is kept (the test's tmp dir, and $TRAINWATCH_ARTIFACTS when set).

The probe is a script placed before the page's Content-Security-Policy (which
forbids every script after it); the page itself has none."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import missing
from test_incident_page import HOSTILE, cli, ledger, scenario

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--no-default-browser-check", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio",
         # Nothing this browser asks for leaves the machine (its own update checks
         # included); 127.0.0.1 stays reachable for the control page.
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
# Read at import: conftest clears every TRAINWATCH_* variable around each test.
ARTIFACTS = os.environ.get("TRAINWATCH_ARTIFACTS")
WIDTH = 1280
MAX_HEIGHT = 8000
TOLERANCE_PX = 1.0

# On load: the laid-out box of every chart's plot and of every mark, and what would
# show a page that ran or fetched anything, written into <html data-probe>.
PROBE = """<script>addEventListener("load", () => {
  const box = e => { const b = e.getBoundingClientRect();
    return [b.left + scrollX, b.top + scrollY, b.width, b.height]; };
  const out = {height: document.documentElement.scrollHeight, title: document.title,
    scripts: document.scripts.length, images: document.images.length,
    links: [...document.querySelectorAll("a[href]")].map(a => a.href), charts: []};
  document.querySelectorAll("svg[data-chart]").forEach(svg => {
    const plot = svg.querySelector("[data-role=plot]");
    out.charts.push({name: svg.dataset.chart, plot: box(plot),
      xmin: +plot.dataset.xMin, xmax: +plot.dataset.xMax,
      marks: [...svg.querySelectorAll("[data-mark]")].map(m => ({
        kind: m.dataset.mark, tag: m.tagName, box: box(m), x: +m.dataset.x,
        end: m.dataset.endX === undefined ? null : +m.dataset.endX,
        step: m.dataset.step === undefined ? null : +m.dataset.step,
        incident: m.dataset.incident === undefined ? null : +m.dataset.incident}))});
  });
  document.documentElement.setAttribute("data-probe", JSON.stringify(out));
});</script>"""


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        missing("chromium is not installed (apt-get install --no-install-recommends chromium)")
        raise AssertionError("unreachable")
    return path


def browse(page: Path, work: Path, *extra: str) -> tuple[str, list[str]]:
    """Load ``page`` in headless chromium: stdout (with --dump-dom: the DOM after
    load) and the URLs it requested on the page's behalf (its net log)."""
    work.mkdir(parents=True, exist_ok=True)
    netlog = work / f"{page.stem}.{len(list(work.glob('*.netlog.json')))}.netlog.json"
    r = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={work / 'profile'}",
                        f"--log-net-log={netlog}", *extra, page.as_uri()],
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, page_requests(netlog, page.as_uri())


def page_requests(netlog: Path, own: str) -> list[str]:
    """Requests the page made (not chromium's own: those have no origin and no
    file:// isolation key), other than the page itself."""
    data = json.loads(netlog.read_text())
    names = {v: k for k, v in data["constants"]["logEventTypes"].items()}
    out = []
    for e in data["events"]:
        p = e.get("params") or {}
        if names.get(e["type"]) != "URL_REQUEST_START_JOB" or "url" not in p:
            continue
        by_page = (p.get("initiator") != "not an origin"
                   or "file://" in str(p.get("network_isolation_key"))
                   or "file://" in str(p.get("site_for_cookies")))
        if by_page and p["url"] != own:
            out.append(p["url"])
    return out


def probed(page: Path, work: Path) -> dict[str, Any]:
    """The page with the probe, loaded: what the probe read; and no request."""
    text = page.read_text()
    assert text.count("<head>") == 1
    copy = work / f"probed-{page.name}"
    work.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace("<head>", "<head>" + PROBE, 1))
    dom, fetched = browse(copy, work, "--dump-dom", f"--window-size={WIDTH},900")
    assert fetched == [], fetched
    start = dom.index('data-probe="') + len('data-probe="')
    import html

    got: dict[str, Any] = json.loads(html.unescape(dom[start:dom.index('"', start)]))
    return got


def screenshot(page: Path, work: Path, height: int) -> Path:
    """A full-page screenshot of the page as written (no probe); kept as an artifact."""
    shot = work / "screens" / f"{page.stem}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    _, fetched = browse(page, work, f"--screenshot={shot}",
                        f"--window-size={WIDTH},{max(600, min(height, MAX_HEIGHT))}")
    assert fetched == [], fetched
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if ARTIFACTS:
        dest = Path(ARTIFACTS) / "incident-pages"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / shot.name)
    return shot


def placed(chart: dict[str, Any], x: float) -> float:
    """Where the laid-out plot box puts the value x."""
    left, _, width, _ = chart["plot"]
    return float(left + (x - chart["xmin"]) / (chart["xmax"] - chart["xmin"]) * width)


def assert_placed(probe: dict[str, Any]) -> None:
    """Each mark's laid-out box is where its chart's plot box puts its value."""
    for c in probe["charts"]:
        for m in c["marks"]:
            x, _, w, _ = m["box"]
            centre = x + w / 2 if m["tag"] in ("line", "circle") else x
            assert abs(centre - placed(c, m["x"])) <= TOLERANCE_PX, (c["name"], m)
            if m["end"] is not None:
                assert abs(x + w - placed(c, m["end"])) <= TOLERANCE_PX, (c["name"], m)


def check(page: Path, work: Path) -> dict[str, Any]:
    """Render: placed marks, no script ran, nothing fetched, a screenshot kept."""
    probe = probed(page, work)
    assert probe["scripts"] == 1 and probe["images"] == 0, probe  # the probe's only
    assert probe["title"].startswith("trainwatch"), probe["title"]
    assert_placed(probe)
    screenshot(page, work, probe["height"])
    return probe


def marks_of(probe: dict[str, Any], chart: str) -> set[tuple[str, float | None]]:
    [c] = [c for c in probe["charts"] if c["name"] == chart]
    return {(m["kind"], m["step"]) for m in c["marks"]}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chromium()
    return tmp_path_factory.mktemp("browser")


def _page(state: Path, incident: int, out: Path) -> Path:
    r = cli("--state-dir", str(state), "--show", str(incident), "--html", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_the_net_log_catches_what_a_page_fetches(work: Path) -> None:
    """The control: a page that loads an image from a local server and a stylesheet
    from a name that does not resolve: both are in the net log, and the server was hit
    (so an empty list for the incident pages means nothing was fetched)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        control = work / "control.html"
        control.write_text(f'<!DOCTYPE html><html><head><link rel="stylesheet" '
                           f'href="http://leak.invalid/x.css"></head><body>'
                           f'<img src="http://127.0.0.1:{port}/x.png"></body></html>')
        _, fetched = browse(control, work / "control", "--dump-dom")
    finally:
        server.shutdown()
        server.server_close()
    assert f"http://127.0.0.1:{port}/x.png" in fetched and "http://leak.invalid/x.css" in \
        fetched, fetched
    assert hits == ["/x.png"]


def test_a_rollback_page_renders_with_its_marks_in_place(work: Path) -> None:
    """nan_loss rollbacks: both charts' marks (onset, noticed, resume, skip window,
    quarantined, NaN flags) laid out where their steps are, the same steps the ledger
    and series.json hold."""
    state = scenario("rollback")
    for inc in ledger(state)[0]:
        probe = check(_page(state, inc["id"], work / f"rollback-{inc['id']}.html"), work)
        rb = inc["evidence"]["rollback"]
        data = json.loads((state / "jobs" / "job" / "incidents" / str(inc["id"])
                           / "series.json").read_text())
        nans = {("nonfinite", s) for s, v in zip(data["steps"], data["loss"], strict=True)
                if v == "nan"}
        want = {("onset", inc["onset_step"]), ("noticed", inc["evidence"]["noticed_step"]),
                ("resume", rb["resume_step"]), ("skip", None),
                *(("quarantined", s) for s in rb["quarantined"])}
        assert marks_of(probe, "loss") == want | nans
        assert marks_of(probe, "grad_norm") == want
        for c in probe["charts"]:
            [skip] = [m for m in c["marks"] if m["kind"] == "skip"]
            assert (skip["x"], skip["end"]) == tuple(rb["window"])


def test_a_stall_page_renders(work: Path) -> None:
    """nccl_stall with both ranks' stacks: no chart, nothing fetched, a screenshot."""
    state = scenario("stall")
    inc = ledger(state)[0][0]
    probe = check(_page(state, inc["id"], work / "stall.html"), work)
    assert probe["charts"] == []


def test_crash_and_xid_pages_render(work: Path) -> None:
    """A crash and an Xid 79: no chart, no script, nothing fetched, a screenshot each."""
    state = scenario("crash_xid")
    for inc in ledger(state)[0]:
        check(_page(state, inc["id"], work / f"{inc['kind']}.html"), work)


def test_a_page_of_hostile_job_output_runs_and_fetches_nothing(work: Path) -> None:
    """The job printed a script, an image and a javascript: link: in the browser the
    page has no script but the probe, no image, no link, its title is its own."""
    state = scenario("hostile")
    [inc] = ledger(state)[0]
    page = _page(state, inc["id"], work / "hostile.html")
    probe = check(page, work)
    assert probe["links"] == [] and "pwned" not in probe["title"]
    dom, _ = browse(page, work / "hostile-dom", "--dump-dom")
    assert dom.count("&lt;script&gt;document.title") >= 2, HOSTILE


def test_index_pages_render_with_incidents_where_they_happened(work: Path) -> None:
    """The index of each run: every incident marked on the goodput chart at its onset
    (laid out where the time axis puts it), its page linked."""
    for name in ("rollback", "crash_xid"):
        state = scenario(name)
        out = work / name / f"index-{name}.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        r = cli("--state-dir", str(state), "--html", str(out))
        assert r.returncode == 0, r.stderr
        probe = check(out, work / name)
        incs = ledger(state)[0]
        [c] = probe["charts"]
        marked = {m["incident"]: m["x"] for m in c["marks"] if m["kind"] != "outage"}
        assert marked == {i["id"]: pytest.approx(i["time"] - (i["detection_latency_s"] or 0))
                          for i in incs}
        assert sorted(probe["links"]) == sorted(
            (out.parent / f"incident-{i['id']}.html").as_uri() for i in incs)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A proxy in the environment must not carry the browser's requests elsewhere."""
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
              "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    yield
