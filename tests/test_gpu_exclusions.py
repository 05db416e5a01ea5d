"""The host's GPU exclusions (state_dir/gpus.json) outlive a restart of trainwatch:
an excluded GPU stays excluded, and a simulated GPU a drill broke (Xid 79) stays
broken until cleared, as a real one does; a file of another shape is ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import wait_for
from trainwatch.config import Gpu
from trainwatch.multihost import preflight
from trainwatch.watch.gpuwatch import GpuWatch


def _watch(state: Path) -> GpuWatch:
    w = GpuWatch(Gpu(backend="sim", count=2, kmsg=None, poll_interval=0.05), str(state),
                 lambda: None)
    w.start()
    wait_for(lambda: w.drain() is not None and w.health.source_up, what="a sample")
    return w


def test_an_excluded_and_broken_gpu_stay_so_across_a_restart(tmp_path: Path) -> None:
    w = _watch(tmp_path)
    try:
        w.inject_xid(1, 79)
        w.exclude(1, "gpu_xid 79")
    finally:
        w.close()
    w = _watch(tmp_path)  # trainwatch started again on the same state_dir
    try:
        assert w.health.excluded() == {1: "gpu_xid 79"}
        got = preflight.sim(w, [0, 1])
        assert got.passed is False and "GPU 1: injected Xid 79" in got.detail, got
        w.clear(1)  # trainwatch clear-gpu
    finally:
        w.close()
    w = _watch(tmp_path)
    try:
        assert w.health.excluded() == {} and preflight.sim(w, [0, 1]).passed
    finally:
        w.close()


@pytest.mark.parametrize("text", [
    "[1, 2]", '{"excluded": ["0"]}', '{"excluded": {"zero": "x"}}', '{"broken": 7}', "null",
])
def test_a_gpu_exclusion_file_of_another_shape_is_ignored(tmp_path: Path, text: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "gpus.json").write_text(text)
    w = _watch(tmp_path)
    try:
        assert w.health.excluded() == {} and preflight.sim(w, [0, 1]).passed
    finally:
        w.close()
    assert json.loads(text) is None or "not a GPU exclusion file" in caplog.text
