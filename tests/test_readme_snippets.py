"""The README's Python snippets run as written. The names a snippet leaves to the
reader (torch, model, opt, train_step, steps) come from a prelude; everything else,
the remote URL included, is the README's text, run in a process of its own (the
remote on a real S3-compatible server, moto_server over HTTP)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conftest import missing
from trainwatch.snapshot.remote import steps as remote_steps

if TYPE_CHECKING:
    from s3server import S3Server

# The fixture s3server (a moto_server process).
pytest_plugins = ["s3server"]

ROOT = Path(__file__).resolve().parent.parent

# What the Snapshots snippet assumes exists: a model, its optimizer, a step function
# and a step count.
PRELUDE = """\
import json, os
import torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(os.environ["STEPS"])
def train_step():
    loss = model(torch.randn(4, 16)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""
EPILOGUE = """
print(json.dumps({"start": start, "last": step}))
"""


def python_snippet(section: str) -> str:
    """The first ```python block under the README's `## <section>` heading."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}", 1)[1]
    return body.split("```python\n", 1)[1].split("```", 1)[0]


def _create_bucket(server: S3Server, name: str) -> None:
    try:
        server.create_bucket(name)
    except urllib.error.HTTPError as e:  # made by an earlier test of this session
        if e.code != 409:
            raise


def _run(script: Path, cwd: Path, env: dict[str, str], steps: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, str(script)], cwd=cwd, env={**env, "STEPS": str(steps)},
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def test_the_snapshots_snippet_runs_as_written_first_then_resumes(
        s3server: S3Server, tmp_path: Path) -> None:
    """A first run (nothing to restore) trains from step 1 and uploads; a second run of the
    same text resumes after the newest snapshot the first left, which the remote holds."""
    for module in ("torch", "zstandard"):
        if importlib.util.find_spec(module) is None:
            missing(f"{module} is not installed (make test installs the dev extra)")
    code = python_snippet("Snapshots")
    assert "Snapshotter(" in code and "snap.close()" in code, code
    url = code.split('remote="', 1)[1].split('"', 1)[0]
    assert url.startswith("s3://"), url
    _create_bucket(s3server, url[len("s3://"):].split("/", 1)[0])
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + code + EPILOGUE)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINWATCH_", "AWS_"))} | s3server.env

    first = _run(script, tmp_path, env, steps=250)  # every_steps=200: one snapshot
    assert first == {"start": 0, "last": 250}, first
    assert [p.name for p in (tmp_path / "ckpt").glob("snapshot-*")] == ["snapshot-200"]
    assert remote_steps(url, env=s3server.env) == [200]

    second = _run(script, tmp_path, env, steps=250)
    assert second == {"start": 200, "last": 250}, second
