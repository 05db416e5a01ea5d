"""The config of a job that spans hosts: top-level ``host`` (and ``--host``), a job's
``nodes``, what check-config refuses in one line and what it prints."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from trainwatch.config import ConfigError, load

TORCHRUN = ("[torchrun, --nnodes=2:4, --nproc-per-node=8, --rdzv-backend=c10d,"
            " --rdzv-endpoint=head:29400, --rdzv-id=llama, train.py]")


def _write(tmp_path: Path, job: str = "", top: str = "",
           command: str = TORCHRUN, ckpt: str = "checkpoints: {dir: ckpt}, ") -> Path:
    """The job's PATH holds a torchrun (check-config looks its program up there)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "torchrun").write_text("#!/bin/sh\n")
    (bin_ / "torchrun").chmod(0o755)
    job = f"env: {{PATH: {bin_}}}, {job}"
    path = tmp_path / "trainwatch.yaml"
    path.write_text(f"{top}jobs:\n  - {{name: llama, command: {command}, {ckpt}{job}}}\n")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("written", "nodes"), [
    ("nodes: 2:4", (2, 4)),  # YAML 1.1 would read this as 124 (base 60)
    ("nodes: '2:4'", (2, 4)),
])
def test_nodes_is_read_as_torchruns_min_max(tmp_path: Path, written: str,
                                            nodes: tuple[int, int]) -> None:
    """nodes: 2:4, quoted or not, is (2, 4); host: names this host."""
    config = load(_write(tmp_path, written, "host: gpu-node-17\n"))
    assert config.jobs[0].nodes == nodes
    assert config.host == "gpu-node-17"


def test_a_single_node_count_and_the_default_host(tmp_path: Path) -> None:
    """nodes: 2 is 2:2; without host: the host is the machine's hostname; no nodes: None."""
    config = load(_write(tmp_path, "nodes: 2", command="[torchrun, --nnodes=2, t.py]"))
    assert config.jobs[0].nodes == (2, 2)
    assert config.host == socket.gethostname()
    assert load(_write(tmp_path, command="[python, t.py]")).jobs[0].nodes is None


BAD = [
    pytest.param("", "host: 'gpu node'\n", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: host: expected a host name of 1-64 letters, digits, '.', '_', '-',"
                 " got 'gpu node'", id="host-space"),
    pytest.param("", f"host: {'h' * 65}\n", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: host: expected a host name", id="host-too-long"),
    pytest.param("", "host: ''\n", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: host: expected a host name", id="host-empty"),
    pytest.param("nodes: 4:2", "", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.nodes: expected a host count N or \"MIN:MAX\"",
                 id="max-below-min"),
    pytest.param("nodes: 0", "", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.nodes: expected a host count", id="zero"),
    pytest.param("nodes: [2, 4]", "", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.nodes: expected a host count", id="list"),
    pytest.param("nodes: 2:4", "", TORCHRUN, "",
                 "<file>: jobs.llama.checkpoints.dir: expected the folder every host sees",
                 id="no-checkpoint-dir"),
    pytest.param("nodes: 2:4", "", "[python, train.py]", "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.command: nodes needs a torchrun command; got 'python'",
                 id="not-torchrun"),
    pytest.param("nodes: 2", "", TORCHRUN, "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.command: nodes is 2 but the torchrun command has"
                 " --nnodes=2:4", id="nnodes-mismatch"),
    pytest.param("nodes: 2", "", "[python, -m, torch.distributed.launch, --nnodes=2, t.py]",
                 "checkpoints: {dir: ckpt}, ",
                 "<file>: jobs.llama.command: python -m torch.distributed.launch is not"
                 " supported", id="launch"),
]


@pytest.mark.parametrize(("job", "top", "command", "ckpt", "message"), BAD)
def test_a_bad_span_or_host_is_refused_with_one_line(
        tmp_path: Path, job: str, top: str, command: str, ckpt: str, message: str) -> None:
    """A bad host, nodes, a job with nodes and no shared checkpoint folder, or a command
    that is not torchrun with the same --nnodes: one line naming the field."""
    path = _write(tmp_path, job, top, command, ckpt)
    with pytest.raises(ConfigError) as caught:
        load(path)
    text = str(caught.value)
    assert text.startswith(message.replace("<file>", str(path))), text
    assert "\n" not in text
    r = _cli("check-config", str(path))
    assert r.returncode == 2 and r.stdout == "" and r.stderr == f"trainwatch: {text}\n"


def test_check_config_prints_the_span_and_the_torchrun_command_trainwatch_runs(
        tmp_path: Path) -> None:
    """check-config says the job's span, this host, and the command and variables it runs."""
    (tmp_path / "ckpt").mkdir()
    path = _write(tmp_path, "nodes: 2:4", "host: gpu-node-17\n")
    r = _cli("check-config", str(path))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[1] == (
        "job llama: spans 2:4 hosts (this one: gpu-node-17); runs torchrun"
        " --max-restarts=1000000 --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d"
        " --rdzv-endpoint=head:29400 --rdzv-id=llama train.py; with"
        " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TRAINWATCH_HOST=gpu-node-17")


def test_check_config_warns_of_a_users_low_max_restarts(tmp_path: Path) -> None:
    """The user's --max-restarts=3 is kept, shown, and warned about in one stderr line."""
    (tmp_path / "ckpt").mkdir()
    path = _write(tmp_path, "nodes: 2", command="[torchrun, --nnodes=2, --max-restarts=3, t.py]")
    r = _cli("check-config", str(path))
    assert r.returncode == 0, r.stderr
    assert "runs torchrun --nnodes=2 --max-restarts=3 t.py;" in r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith(f"trainwatch: warning: {path}: jobs.llama.command: torchrun's"
                           " --max-restarts=3 is kept")


@pytest.mark.parametrize("command", ["run", "daemon"])
def test_a_bad_host_flag_is_one_line(tmp_path: Path, command: str) -> None:
    """--host takes what host: takes; anything else is one line and exit 2."""
    (tmp_path / "ckpt").mkdir()
    path = _write(tmp_path, "nodes: 2:4")
    r = _cli(command, "--config", str(path), "--host", "a/b")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("trainwatch: --host: expected a host name of 1-64 letters, digits,"
                        " '.', '_', '-', got 'a/b'\n")


def test_a_run_command_replacing_a_spanning_jobs_is_checked_too(tmp_path: Path) -> None:
    """trainwatch run --config F -- CMD: a CMD that is not torchrun for a job with nodes is
    one line, before anything starts."""
    path = _write(tmp_path, "nodes: 2:4")
    r = _cli("run", "--config", str(path), "--state-dir", str(tmp_path / "state"),
             "--", "python", "train.py")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("trainwatch: -- CMD: nodes needs a torchrun command; got 'python'"
                        " (torchrun ... or python -m torch.distributed.run ..., the program"
                        " itself, not a shell or a wrapper around it)\n")
    assert not (tmp_path / "state").exists()
