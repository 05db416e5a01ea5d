"""The lead rank's loss and gradient norm around a loss anomaly's onset, kept
with its incident as ``<incident folder>/series.json``: the steps from
``BEFORE`` before the onset to ``AFTER`` after it, as far as the job had beaten
them when the incident was recorded (the steps up to the one it was noticed
at). Bounded: at most BEFORE + AFTER + 1 points, about 56 KB.

The file: ``{"rank", "onset_step", "noticed_step", "steps": [...], "loss": [...],
"grad_norm": [...]}``, one entry per step; a value the job did not send is
null, a non-finite one the string "nan", "inf" or "-inf" (JSON has neither).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainwatch.state.atomic import read_json, write_json
from trainwatch.types import FaultKind

NAME = "series.json"
BEFORE = 512  # steps before the onset kept
AFTER = 512  # steps after it
KEPT = BEFORE + AFTER + 1  # what a job's loss feed remembers of its lead rank
LOSS_KINDS = frozenset({FaultKind.NAN_LOSS, FaultKind.LOSS_SPIKE,
                        FaultKind.GRAD_NORM_OUTLIER, FaultKind.DIVERGENCE})
_ROWS_BEFORE = 8  # of the onset, in incidents --show; and at most _ROWS_AFTER from it
_ROWS_AFTER = 12

Point = tuple[int, float | None, float | None]  # step, loss, grad norm


def _num(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


def _float(x: object) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def keep(folder: Path, rank: int, onset: int, noticed: object,
         points: Iterable[Point]) -> Path:
    """Write the points within the window around ``onset``; the file's path.
    Raises OSError (a full or read-only state_dir)."""
    kept = [p for p in points if onset - BEFORE <= p[0] <= onset + AFTER][-KEPT:]
    path = folder / NAME
    write_json(path, {
        "rank": rank, "onset_step": onset,
        "noticed_step": noticed if isinstance(noticed, int) else None,
        "steps": [p[0] for p in kept], "loss": [_num(p[1]) for p in kept],
        "grad_norm": [_num(p[2]) for p in kept]})
    return path


def load(folder: Path) -> dict[str, Any] | None:
    data = read_json(folder / NAME)
    return data if isinstance(data, dict) and isinstance(data.get("steps"), list) else None


def _cell(x: object) -> str:
    v = _float(x)
    return "-" if v is None else f"{v:.6g}"


def render(folder: Path) -> list[str]:
    """The series as ``incidents --show`` prints it: what was kept, and the
    rows around the onset; nothing when none was kept."""
    data = load(folder)
    if data is None:
        return []
    steps = [s for s in data["steps"] if isinstance(s, int)]
    loss, grad = data.get("loss") or [], data.get("grad_norm") or []
    if not steps:
        return [f"loss and grad norm: none beaten around the onset ({NAME})"]
    onset = data.get("onset_step")
    out = [f"loss and grad norm of rank {data.get('rank')}: steps {steps[0]}-{steps[-1]} "
           f"({len(steps)} values) kept in {NAME}"]
    at = next((i for i, s in enumerate(steps) if isinstance(onset, int) and s >= onset),
              len(steps))
    lo, hi = max(0, at - _ROWS_BEFORE), min(len(steps), at + _ROWS_AFTER)
    out.append(f"  {'step':>10}  {'loss':>12}  {'grad_norm':>12}")
    for i in range(lo, hi):
        mark = "  <- onset" if steps[i] == onset else ""
        if steps[i] == data.get("noticed_step") and steps[i] != onset:
            mark = "  <- noticed"
        out.append(f"  {steps[i]:>10}  {_cell(loss[i] if i < len(loss) else None):>12}  "
                   f"{_cell(grad[i] if i < len(grad) else None):>12}{mark}")
    if hi < len(steps):
        out.append(f"  ... {len(steps) - hi} more steps")
    return out
