"""trainwatch.snapshot's on-disk side: the format and its judge, the tree of a
training state round-tripped bit-identically, the content-addressed store
(dedup by hard link, full vs incremental bytes, zstd) and its GC."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trainwatch.snapshot import blobs, format, reader, writer
from trainwatch.snapshot.format import judge, published


def same(a: Any, b: Any) -> bool:
    """Bit-identical, recursively: tensors and arrays by their bytes, dtype and shape."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
                == bytes(b.reshape(-1).view(torch.uint8).numpy()))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return (type(b) is dict and list(a) == list(b)
                and all(type(k) is type(kb) for k, kb in zip(a, b, strict=True))
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and bool(a == b)


def rich_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 5, generator=g).to(torch.bfloat16),
                  "b": torch.randn(5, generator=g),
                  "idx": torch.arange(7, dtype=torch.int64),
                  "mask": torch.tensor([True, False, True]),
                  "scalar": torch.tensor(3.25),  # 0-dim
                  "empty": torch.zeros(0, 3),
                  "strided": torch.arange(12.0).reshape(3, 4).t()},  # not contiguous
        "optim": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(3)}},
                  "param_groups": [{"lr": 1e-3, "params": [0], "betas": (0.9, 0.999)}]},
        "np": {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "z": np.float64(2.5) * np.ones(()),
               "big_endian": np.arange(3, dtype=">i4")},
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 0.1],
        "tuple": (1, "a", None, True),
        "$odd": {"$leaf": 1},  # user keys that look like skeleton nodes
        "bytes": b"\x00\x01raw",
        "pickled": {1, 2, 3},
        "int_keys": {1: "a", 2: "b"},
        "big_int": 2**80,
    }


def test_rich_state_round_trips_bit_identically(tmp_path: Path) -> None:
    """bf16, int, bool, 0-dim, empty and strided tensors, numpy, int keys, tuples,
    nan/inf floats, $-keys, bytes and pickled leaves come back bit-identical."""
    state = rich_state()
    w = writer.write(str(tmp_path), 10, state)
    assert w.published and w.folder == str(tmp_path / "snapshot-10")
    step, back = reader.load(w.folder)
    assert step == 10
    assert same(state, back)
    assert back["model"]["w"].dtype == torch.bfloat16 and back["model"]["scalar"].dim() == 0
    kinds = {leaf.kind for leaf in format.read(w.folder).leaves}
    assert kinds == {"torch", "numpy", "bytes", "pickle"}


def test_numpy_strings_and_array_subclasses_round_trip(tmp_path: Path) -> None:
    """A unicode array (its dtype name "str64" is not one numpy takes back) and a masked
    array (more than its bytes: pickled whole) save and restore, mask included."""
    state = {"words": np.array(["ab", "c"]), "when": np.array(["2026-11-24"], "M8[ns]"),
             "masked": np.ma.array([1.0, 2.0], mask=[False, True])}
    w = writer.write(str(tmp_path), 1, state)
    got = reader.load(w.folder)[1]
    assert same(got["words"], state["words"]) and same(got["when"], state["when"])
    assert type(got["masked"]) is np.ma.MaskedArray
    assert got["masked"].mask.tolist() == [False, True] and got["masked"][0] == 1.0


def test_manifest_holds_the_documented_fields(tmp_path: Path) -> None:
    """snapshot.json: format, version, step, tree, leaves with chunks, keep, stats, meta."""
    w = writer.write(str(tmp_path), 3, {"x": np.zeros(4)}, keep=2, meta={"run": "a"})
    doc = json.loads((Path(w.folder) / "snapshot.json").read_text())
    assert doc["format"] == "trainwatch.snapshot" and doc["version"] == 1 and doc["step"] == 3
    assert doc["keep"] == 2 and doc["meta"] == {"run": "a"}
    assert doc["tree"] == {"x": {"$leaf": 0}}
    (leaf,) = doc["leaves"]
    assert leaf["kind"] == "numpy" and leaf["dtype"] == "float64" and leaf["shape"] == [4]
    assert leaf["nbytes"] == 32 and leaf["chunks"][0]["codec"] is None
    assert set(doc["stats"]) == {"bytes", "new_bytes", "stored_new", "chunks", "new_chunks",
                                 "stage_s", "write_s"}
    assert sorted(os.listdir(w.folder)) == sorted(["snapshot.json", leaf["chunks"][0]["hash"]])


def test_a_leaf_is_cut_into_chunks(tmp_path: Path) -> None:
    """A leaf larger than a chunk is stored as several chunk files, restored whole."""
    data = np.arange(1000, dtype=np.int32)
    w = writer.write(str(tmp_path), 1, {"d": data}, chunk=1024)
    leaf = format.read(w.folder).leaves[0]
    assert [c.size for c in leaf.chunks] == [1024, 1024, 1024, 928]
    assert same(reader.load(w.folder)[1]["d"], data)


def test_unchanged_chunks_are_hard_links_to_one_file(tmp_path: Path) -> None:
    """Two snapshots of the same bytes share one inode with the store: no byte written twice."""
    state = {"frozen": np.arange(1000.0), "step": 1}
    a = writer.write(str(tmp_path), 1, state)
    b = writer.write(str(tmp_path), 2, {**state, "step": 2})
    (h,) = [c.hash for c in format.read(a.folder).leaves[0].chunks]
    sa, sb = os.stat(Path(a.folder) / h), os.stat(Path(b.folder) / h)
    store = os.stat(blobs.store_path(str(tmp_path), h))
    assert sa.st_ino == sb.st_ino == store.st_ino and store.st_nlink == 3
    assert b.manifest.stats["new_bytes"] == 0 and b.manifest.stats["new_chunks"] == 0


def test_incremental_writes_only_what_changed_full_writes_everything(tmp_path: Path) -> None:
    """A changed head over a frozen base: incremental writes the head only; full writes all."""
    base, head = np.arange(4096, dtype=np.float32), np.zeros(16, dtype=np.float32)
    writer.write(str(tmp_path), 1, {"base": base, "head": head})
    inc = writer.write(str(tmp_path), 2, {"base": base, "head": head + 1}).manifest.stats
    full = writer.write(str(tmp_path), 3, {"base": base, "head": head + 2},
                        incremental=False).manifest.stats
    assert inc["bytes"] == full["bytes"] == base.nbytes + head.nbytes
    assert inc["new_bytes"] == inc["stored_new"] == head.nbytes and inc["new_chunks"] == 1
    assert full["new_bytes"] == full["bytes"] and full["new_chunks"] == 2


def test_zstd_shrinks_compressible_chunks_and_stores_noise_raw(tmp_path: Path) -> None:
    """zstd frames for compressible bytes, raw files for random ones; both restore exactly."""
    state = {"ints": np.zeros(100_000, dtype=np.int64),
             "noise": np.random.default_rng(0).integers(0, 256, 80_000, dtype=np.uint8)}
    w = writer.write(str(tmp_path), 1, state, compress="zstd")
    ints, noise = format.read(w.folder).leaves
    assert ints.chunks[0].codec == "zstd" and ints.chunks[0].stored < ints.nbytes // 100
    assert (Path(w.folder) / (ints.chunks[0].hash + ".zst")).exists()
    assert noise.chunks[0].codec is None and noise.chunks[0].stored == noise.nbytes
    assert w.manifest.stats["stored_new"] < w.manifest.stats["new_bytes"]
    assert same(reader.load(w.folder)[1], state)
    # A later uncompressed save links the stored frame: a chunk is stored once, whichever codec.
    again = writer.write(str(tmp_path), 2, state)
    assert again.manifest.stats["new_bytes"] == 0


def test_publish_never_overwrites_an_existing_snapshot(tmp_path: Path) -> None:
    """A second save of the same step loses: the first stays, its staging is removed."""
    first = writer.write(str(tmp_path), 5, {"v": b"first"})
    second = writer.write(str(tmp_path), 5, {"v": b"second"})
    assert first.published and not second.published
    assert reader.load(first.folder)[1] == {"v": b"first"}
    assert [n for n in os.listdir(tmp_path) if n.startswith(".staging")] == []


def test_publish_with_replace_puts_the_old_snapshot_aside(tmp_path: Path) -> None:
    """replace=True: the new save of a step wins, the old folder is gone, nothing left over."""
    writer.write(str(tmp_path), 5, {"v": b"first"})
    second = writer.write(str(tmp_path), 5, {"v": b"second"}, replace=True)
    assert second.published and reader.load(second.folder)[1] == {"v": b"second"}
    assert sorted(os.listdir(tmp_path)) == ["blobs", "snapshot-5"]


def test_published_lists_name_matched_folders_oldest_first(tmp_path: Path) -> None:
    """published(): snapshot-<step> folders only, by step; staging and others ignored."""
    for step in (10, 9, 100):
        writer.write(str(tmp_path), step, {"s": step})
    (tmp_path / "snapshot-x").mkdir()
    (tmp_path / ".staging-7-h-1-1").mkdir()
    (tmp_path / "snapshot-3").write_text("a file")
    assert [s for s, _ in published(tmp_path)] == [9, 10, 100]
    assert published(tmp_path / "missing") == []


def test_judge_finds_truncated_missing_and_wrong_manifests(tmp_path: Path) -> None:
    """judge(): complete only with every chunk at its stored size and a valid manifest."""
    w = writer.write(str(tmp_path), 4, {"a": np.arange(100), "b": b"x" * 50})
    assert judge(w.folder)[0]
    chunks = format.read(w.folder).chunks()
    first = Path(w.folder) / next(iter(chunks))
    data = first.read_bytes()
    os.unlink(first)  # a new inode: the store's copy stays whole
    first.write_bytes(data[:-1])
    assert judge(w.folder) == (False, f"chunk {first.name} has {len(data) - 1} bytes, "
                                      f"expected {len(data)}")
    first.unlink()
    assert judge(w.folder) == (False, f"chunk {first.name} missing")
    manifest = Path(w.folder) / "snapshot.json"
    doc = json.loads(manifest.read_text())
    for bad, why in (({**doc, "step": 5}, "does not match"), ({**doc, "version": 2}, "version"),
                     ({**doc, "format": "x"}, "format")):
        manifest.write_text(json.dumps(bad))
        ok, said = judge(w.folder)
        assert not ok and why in said and "\n" not in said
    manifest.write_text('{"format": "trainwatch.snapshot", "ver')
    assert "not JSON" in judge(w.folder)[1]
    manifest.unlink()
    assert not judge(w.folder)[0]
    assert "not a snapshot folder" in judge(tmp_path)[1]


def test_a_corrupt_chunk_fails_restore_with_one_line(tmp_path: Path) -> None:
    """A chunk whose bytes no longer match its hash (same size) is refused by restore."""
    w = writer.write(str(tmp_path), 1, {"a": np.arange(100)})
    (c,) = format.read(w.folder).chunks().values()
    path = Path(w.folder) / c.name
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    os.unlink(path)
    path.write_bytes(bytes(data))
    assert judge(w.folder)[0]  # sizes only
    with pytest.raises(ValueError, match="does not match its hash") as e:
        reader.load(w.folder)
    assert "\n" not in str(e.value)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_gc_removes_only_what_nothing_references(tmp_path: Path) -> None:
    """collect(): a deleted snapshot's own chunks, dead staging and .deleting folders go;
    chunks another snapshot links, a live save's staging and its chunks stay."""
    root = str(tmp_path)
    shared = np.arange(500.0)
    a = writer.write(root, 1, {"shared": shared, "own": np.ones(7)})
    b = writer.write(root, 2, {"shared": shared, "own": np.ones(9)})
    own_a = format.read(a.folder).leaves[1].chunks[0].name
    assert blobs.delete(root, a.folder)  # collects too
    assert not os.path.exists(blobs.store_path(root, own_a))
    assert judge(b.folder)[0] and same(reader.load(b.folder)[1]["shared"], shared)
    host = blobs._host()
    live = blobs.Staging(root, 3)  # this process: alive
    live_chunk = live.add(blobs.digest(b"live"), 4, lambda: (b"live", None))
    dead = tmp_path / f".staging-4-{host}-{dead_pid()}-1"
    dead.mkdir()
    (dead / "junk").write_bytes(b"x")
    other_host = tmp_path / f".staging-4-otherhost-{dead_pid()}-1"
    other_host.mkdir()
    deleting = tmp_path / ".deleting-1-99"
    deleting.mkdir()
    tomb = tmp_path / ".snapshot-5.trainwatch-deleting"  # the daemon's retention, cut short
    tomb.mkdir()
    got = blobs.collect(root)
    assert got["folders"] == 3 and got["blobs"] == 0
    assert not dead.exists() and not deleting.exists() and not tomb.exists()
    assert other_host.exists() and os.path.isdir(live.path)  # not ours to judge; alive
    assert os.path.exists(blobs.store_path(root, live_chunk.name))
    live.abandon()
    assert blobs.collect(root)["blobs"] == 1
    b_chunks = {c.name for c in format.read(b.folder).chunks().values()}
    stored = {n for d in os.listdir(tmp_path / "blobs") for n in os.listdir(tmp_path / "blobs" / d)}
    assert stored == b_chunks
    blobs.delete(root, b.folder)
    assert os.listdir(tmp_path / "blobs") == []  # empty subfolders removed too


def test_delete_refuses_what_is_not_a_snapshot_of_the_folder(tmp_path: Path) -> None:
    """delete() takes only snapshot-<step> folders directly under the root."""
    other = tmp_path / "elsewhere" / "snapshot-1"
    other.mkdir(parents=True)
    with pytest.raises(ValueError):
        blobs.delete(str(tmp_path), str(other))
    with pytest.raises(ValueError):
        blobs.delete(str(tmp_path), str(tmp_path / "blobs"))
    assert blobs.delete(str(tmp_path), str(tmp_path / "snapshot-9")) is False


def test_importing_the_format_loads_nothing_heavy() -> None:
    """The daemon imports trainwatch.snapshot.format and .blobs: no torch, numpy, zstd, fsspec."""
    code = ("import sys, trainwatch.snapshot, trainwatch.snapshot.format,"
            " trainwatch.snapshot.blobs;"
            "print(sorted(m for m in ('torch', 'numpy', 'zstandard', 'fsspec', 'xxhash')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
