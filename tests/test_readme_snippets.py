"""The documentation's Python snippets run as written (the Snapshots one, moved from
the README to docs/checkpoints.md). The names a snippet leaves to the reader (torch,
model, opt, train_step, steps) come from a prelude; everything else, the remote URL
included, is the page's text, run in a process of its own (the remote on a real
S3-compatible server, moto_server over HTTP)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def python_snippet(page: str, section: str) -> str:
    """The first ```python block under the `## <section>` heading of ``page``."""
    text = (ROOT / page).read_text()
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
    code = python_snippet("docs/checkpoints.md", "Snapshots")
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


def _anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings (lower case, punctuation dropped,
    spaces as hyphens, a repeat numbered), outside code blocks."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_of_the_readme_and_docs_leads_somewhere() -> None:
    """Each relative link in README.md and docs/*.md names a file of the checkout, and
    each #anchor a heading of its page: the text moved out of the README is reachable."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.name}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_first_screen() -> None:
    """The README stays short (well under 150 lines), keeps the two commands as they
    are, the five-line client and `trainwatch run`, and sends the rest to docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    assert "make demo   # sets up .venv" in text and "make test   # sets up .venv" in text
    assert "hb = client.connect()" in text and "trainwatch run --checkpoint-dir" in text
    for page in ("jobs", "checkpoints", "faults", "operating", "reference", "figures"):
        assert f"(docs/{page}.md)" in text, page
