"""State files rewritten in place (status.json every second, the catalog, manifests):
a reader sees the old file or the new one, never half, and nothing is left beside them."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from trainwatch.state import atomic


@pytest.mark.parametrize("durable", [False, True])
def test_a_reader_sees_the_old_file_or_the_new_one_never_half(tmp_path: Path,
                                                                durable: bool) -> None:
    path = tmp_path / "status.json"
    atomic.write_json(path, {"n": 0, "pad": "x" * 20000}, durable=durable)
    done = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def read() -> None:
        while not done.is_set():
            try:
                seen.append(json.loads(path.read_bytes())["n"])
            except FileNotFoundError:
                errors.append("the file was missing")
            except ValueError as e:
                errors.append(f"half a file: {e}")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 301 if not durable else 31):
            atomic.write_json(path, {"n": n, "pad": "x" * 20000}, durable=durable)
    finally:
        done.set()
        reader.join()
    assert errors == []
    assert seen == sorted(seen)
    assert json.loads(path.read_bytes())["n"] == (300 if not durable else 30)
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_rewrite_sets_the_mode_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "catalog.json"
    for n in range(3):
        atomic.write_json(path, {"n": n}, durable=False, mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.json"]


def test_a_link_at_the_path_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    path = tmp_path / "status.json"
    path.symlink_to(target)
    atomic.write_json(path, {"n": 1}, durable=False)
    assert not path.is_symlink()
    assert json.loads(path.read_text()) == {"n": 1}
    assert target.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "status.json"]


def test_a_folder_at_the_path_fails_the_write_and_stays_where_it_is(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.mkdir()
    (path / "inside").write_text("kept")
    with pytest.raises(OSError):
        atomic.write_json(path, {"n": 1}, durable=False)
    assert (path / "inside").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_stale_temp_file_from_a_crash_is_reused(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    atomic.write_json(path, {"n": 1}, durable=False)
    stale = tmp_path / ".status.json.tmp"
    stale.write_text("left by a daemon killed between its two steps" * 100)
    atomic.write_json(path, {"n": 2}, durable=False)
    assert json.loads(path.read_text()) == {"n": 2}
    assert sorted(os.listdir(tmp_path)) == ["status.json"]
