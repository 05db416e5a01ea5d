"""Each job's CPU and memory, read from its attempt's cgroup at scrape time: real
jobs that burn CPU and hold memory, a relaunch, a job that has ended, and a job
without a cgroup; the kernel's files read as recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from conftest import Workspace, free_port, missing, need_root, wait_for
from test_metrics import Scrape
from trainwatch.actions import cgroup
from trainwatch.actions.cgroup import Usage, read_usage

MB = 1 << 20
USAGE = ("trainwatch_job_cpu_seconds_total", "trainwatch_job_resident_memory_bytes",
         "trainwatch_job_memory_usage_bytes", "trainwatch_job_memory_peak_bytes",
         "trainwatch_job_oom_kills_total")

# CPU is burnt by the job's own clock (process_time), never by the wall clock: the
# amounts below hold however slow the machine. b"x" * n writes every page, so the
# 50 MB are resident (bytes(n) would be the kernel's lazy zero pages).
_BURN = ("import os, sys, time\n"
         "def burn(s):\n"
         "    t = time.process_time() + s\n"
         "    while time.process_time() < t:\n"
         "        pass\n"
         "keep = b'x' * (50 << 20)\n")


def _need_cgroups() -> None:
    need_root("creating the attempts' cgroups")
    if cgroup.base() is None:
        missing("needs a writable cgroup v2 hierarchy (the attempts' cgroups)")


def _job(ws: Workspace, code: str, **top: Any) -> Scrape:
    port = free_port()
    ws.run(ws.config({"command": [sys.executable, "-c", _BURN + code]},
                     metrics={"address": "127.0.0.1", "port": port}, **top))
    return Scrape(port)


def _exposition(s: Scrape) -> str:
    with urllib.request.urlopen(s.url, timeout=5) as r:
        return str(r.read().decode())


def test_cpu_seconds_rise_and_resident_memory_holds_what_the_job_allocated(
        ws: Workspace) -> None:
    """A job that burns 0.5 s of CPU and holds 50 MB: its CPU counter reaches 0.5 s and
    its resident memory 50 MB; memory.current and memory.peak are exported exactly where
    the kernel keeps them for its cgroup."""
    _need_cgroups()
    ready = ws.root / "ready"
    s = _job(ws, f"burn(0.5); open({str(ready)!r}, 'w').close(); time.sleep(300)")
    wait_for(ready.exists, timeout=30, what="the job to burn its CPU")
    cpu = wait_for(lambda: s.get("trainwatch_job_cpu_seconds_total", job="job"),
                   what="the job's CPU seconds")
    assert cpu >= 0.5
    assert (s.get("trainwatch_job_resident_memory_bytes", job="job") or 0) >= 50 * MB
    cg = Path(ws.status()["cgroup"])
    memory = s.get("trainwatch_job_memory_usage_bytes", job="job")
    peak = s.get("trainwatch_job_memory_peak_bytes", job="job")
    if (cg / "memory.current").exists():  # the memory controller is enabled for it
        assert memory is not None and memory >= 50 * MB
        assert s.get("trainwatch_job_oom_kills_total", job="job") == 0
    else:
        assert memory is None and s.get("trainwatch_job_oom_kills_total", job="job") is None
    if (cg / "memory.peak").exists():
        assert peak is not None and peak >= 50 * MB
    else:
        assert peak is None
    later = wait_for(lambda: (v := s.get("trainwatch_job_cpu_seconds_total", job="job")) and v,
                     what="another scrape")
    assert later >= cpu


def test_cpu_seconds_do_not_go_back_after_a_relaunch(ws: Workspace) -> None:
    """Attempt 0 burns 0.3 s, is scraped, burns 0.6 s more unscraped and crashes;
    attempt 1 burns little. The job's CPU counter after the relaunch holds all of
    attempt 0 (its last 0.6 s read as its cgroup was removed) and never goes back."""
    _need_cgroups()
    ready0, go, ready1 = (ws.root / n for n in ("ready0", "go", "ready1"))
    s = _job(ws, "if os.environ['TRAINWATCH_ATTEMPT'] == '0':\n"
                 f"    burn(0.3); open({str(ready0)!r}, 'w').close()\n"
                 f"    while not os.path.exists({str(go)!r}):\n"
                 "        time.sleep(0.02)\n"
                 "    burn(0.6); sys.exit(3)\n"
                 f"open({str(ready1)!r}, 'w').close(); time.sleep(300)\n")
    wait_for(ready0.exists, timeout=30, what="attempt 0 to burn its first CPU")
    before = wait_for(lambda: s.get("trainwatch_job_cpu_seconds_total", job="job"),
                      what="attempt 0's CPU seconds")
    assert before >= 0.3
    go.touch()
    # No scrape until attempt 1 runs: only close() saw attempt 0's last 0.6 s.
    wait_for(ready1.exists, timeout=30, what="attempt 1 to start")
    wait_for(lambda: ws.status().get("attempt") == 1, what="attempt 1 in the status")
    seen = [wait_for(lambda: s.get("trainwatch_job_cpu_seconds_total", job="job"),
                     what="the job's CPU seconds after the relaunch") for _ in range(5)]
    assert s.get("trainwatch_job_attempts_total", job="job") == 2
    assert seen[0] >= before + 0.5
    assert seen == sorted(seen)  # a counter: never back


def test_a_finished_job_keeps_its_cpu_seconds_and_shows_no_memory(ws: Workspace) -> None:
    """A job that burnt 0.4 s and exited before any scrape: its CPU seconds are still
    exported (read as its cgroup was removed), its memory no longer is."""
    _need_cgroups()
    port = free_port()
    # The daemon with a second, long job keeps the exporter up after the first ends.
    cfg = ws.config({"command": [sys.executable, "-c", _BURN + "burn(0.4)"]},
                    metrics={"address": "127.0.0.1", "port": port})
    doc = yaml.safe_load(cfg.read_text())
    doc["jobs"].append({"name": "long", "command": [sys.executable, "-c",
                                                    "import time; time.sleep(60)"]})
    cfg.write_text(yaml.safe_dump(doc))
    ws.procs.append(subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    wait_for(lambda: ws.status().get("state") == "exited", timeout=30, what="the job to exit")
    s = Scrape(port)
    cpu = wait_for(lambda: s.get("trainwatch_job_cpu_seconds_total", job="job"),
                   what="the exporter")
    assert cpu >= 0.4
    assert s.get("trainwatch_job_resident_memory_bytes", job="job") is None
    assert s.get("trainwatch_job_resident_memory_bytes", job="long") is not None


# `trainwatch run` where cgroups are not ours to write: cgroup.base() says so (as in
# test_hardening_process).
_RUN_WITHOUT_CGROUP = (
    "import sys, trainwatch.actions.cgroup as c; c.base = lambda *a, **k: None; "
    "from trainwatch.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_a_job_without_a_cgroup_has_no_usage_series(ws: Workspace) -> None:
    """Membership by process tree (no cgroup): the job's CPU and memory series are
    absent, not 0, and the families' help says so."""
    port = free_port()
    cfg = ws.config({"command": [sys.executable, "-c", _BURN + "burn(0.2); time.sleep(300)"]},
                    metrics={"address": "127.0.0.1", "port": port})
    ws.procs.append(subprocess.Popen(
        [sys.executable, "-c", _RUN_WITHOUT_CGROUP, "run", "--config", str(cfg),
         "--no-passthrough"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    s = Scrape(port)
    wait_for(lambda: s.get("trainwatch_job_state", job="job", state="running") == 1,
             timeout=30, what="the job running")
    assert ws.status()["cgroup"] is None
    helps = {line.split()[2]: line for line in _exposition(s).splitlines()
             if line.startswith("# HELP ")}
    for name in USAGE:
        assert s.get(name, job="job") is None, name
        assert "no cgroup of its own" in helps[name], name


def _kernel_files(d: Path, **files: str) -> Path:
    d.mkdir()
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)
    return d


def test_usage_is_read_from_the_kernels_flat_keyed_and_single_value_files(
        tmp_path: Path) -> None:
    """cpu.stat, memory.current, memory.peak and memory.events as cgroup v2 writes them;
    cgroup.procs names the members whose RSS is summed."""
    d = _kernel_files(
        tmp_path / "cg",
        cpu_stat="usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
        memory_current="73400320\n", memory_peak="104857600\n",
        memory_events="low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n",
        cgroup_procs=f"{os.getpid()}\n")
    u = read_usage(str(d))
    assert u is not None
    assert (u.cpu_usec, u.memory_bytes, u.memory_peak_bytes, u.oom_kills) == (
        2_500_000, 73_400_320, 104_857_600, 2)
    assert u.resident_bytes >= 10 * MB  # this Python process's own RSS


def test_usage_without_a_memory_controller_has_no_memory_figures(tmp_path: Path) -> None:
    """A cgroup the memory controller is not enabled for has cpu.stat only: memory is
    None (absent), not 0; a member gone meanwhile is skipped."""
    d = _kernel_files(tmp_path / "cg", cpu_stat="usage_usec 7\n", cgroup_procs="999999999\n")
    assert read_usage(str(d)) == Usage(cpu_usec=7, resident_bytes=0, memory_bytes=None,
                                       memory_peak_bytes=None, oom_kills=None)


def test_a_vanished_or_garbled_cgroup_reads_as_none_never_an_error(tmp_path: Path) -> None:
    """A cgroup removed under the scrape is None; garbage in a file is no figure."""
    assert read_usage(str(tmp_path / "gone")) is None
    d = _kernel_files(tmp_path / "cg", cpu_stat="usage_usec lots\n", memory_current="max\n")
    assert read_usage(str(d)) is None
    d2 = _kernel_files(tmp_path / "cg2", cpu_stat="usage_usec 1\n", memory_current="max\n",
                       memory_events="oom_kill x\n", cgroup_procs="abc\n")
    assert read_usage(str(d2)) == Usage(cpu_usec=1, resident_bytes=0, memory_bytes=None,
                                        memory_peak_bytes=None, oom_kills=None)
