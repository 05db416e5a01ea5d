"""The ranks section of an incident page (page.py) for hangs and stalls: every
rank the incident knows with its last step, process state, CPU and how py-spy
fared (the evidence's steps and processes, evidence.json's targets), and the
main-thread stacks grouped as the verdict groups them (detectors/stacks.py:
by function and file), each group once, the odd ones out highlighted (a group
smaller than the largest, or holding a suspect). Bounded: ``MAX_RANKS`` ranks
(and stack files read), ``MAX_GROUPS`` groups in full, ``MAX_FRAMES`` frames.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwatch.detectors.stacks import Signature, frames, main_thread, signature
from trainwatch.evidence.markup import esc, kv, section, table, tag
from trainwatch.evidence.pyspy import frame
from trainwatch.evidence.sections import as_dict, as_list, read_json
from trainwatch.evidence.show import evidence

MAX_RANKS = 256  # ranks listed (and stack files read); the rest are counted
MAX_GROUPS = 12  # stack groups shown in full; the rest are listed by their ranks
MAX_FRAMES = 15  # per stack; deeper frames are counted


def _stack(folder: Path, stem: object) -> tuple[Signature, tuple[str, ...]] | None:
    """A rank's main-thread stack: its signature (what the verdict groups ranks by,
    detectors/stacks.py) and its frames as people read them."""
    if not isinstance(stem, str) or "/" in stem or stem.startswith("."):
        return None
    data = read_json(folder / "stacks" / f"{stem}.json")
    if not isinstance(data, list):
        return None
    return signature(data), tuple(frame(dict(f)) for f in frames(main_thread(data)))


def _ranks(ev: Mapping[str, Any], summary: Mapping[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Every rank the incident knows: its last step, process state, CPU, pid."""
    out: dict[int, dict[str, Any]] = {}

    def of(r: object) -> dict[str, Any] | None:
        try:
            n = int(str(r))
        except ValueError:
            return None
        if n < 0:  # an earlier release's key for a process with no rank (-pid)
            return None
        return out.setdefault(n, {}) if len(out) < MAX_RANKS or n in out else None

    stall = as_dict(ev.get("stall"))
    steps = ev.get("steps") or stall.get("steps")
    for r, s in (steps.items() if isinstance(steps, dict) else ()):
        if (d := of(r)) is not None:
            d["step"] = s
    procs = ev.get("processes") or stall.get("processes")
    for r, p in (procs.items() if isinstance(procs, dict) else ()):
        if isinstance(p, dict) and (d := of(r)) is not None:
            d.update(pid=p.get("pid"), state=p.get("state"), cpu_rate=p.get("cpu"))
    targets = (summary or {}).get("targets")
    for t in targets if isinstance(targets, list) else []:
        if isinstance(t, dict) and t.get("rank") is not None and (d := of(t["rank"])) is not None:
            spy = as_dict(t.get("py_spy"))
            d.update(pid=t.get("pid"), state=t.get("state") or d.get("state"),
                     cpu=t.get("cpu_seconds"), file=t.get("file"),
                     spy="ok" if spy.get("ok") else spy.get("error") or "not run")
    for key in ("ranks_stale", "ranks_stopped", "ranks_tied"):
        listed = ev.get(key)
        for r in listed if isinstance(listed, list) else []:
            if (d := of(r)) is not None:
                d.setdefault("flags", []).append(key.removeprefix("ranks_"))
    return out


def stacks(row: Mapping[str, Any], folder: Path, summary: Mapping[str, Any] | None) -> str:
    """Every rank's last step and state; the stacks grouped, the odd ones highlighted."""
    ev = evidence(row)
    ranks = _ranks(ev, summary)
    if not ranks:
        return ""
    verdict = as_dict((summary or {}).get("verdict")) or as_dict(ev.get("stacks"))
    suspects = {s for s in as_list(verdict.get("suspects")) if isinstance(s, int)}
    named = row.get("rank")
    groups: dict[Signature, list[int]] = {}
    shown: dict[Signature, tuple[str, ...]] = {}  # the frames of the group's first rank
    for r, d in sorted(ranks.items()):
        got = _stack(folder, d.get("file"))
        if got is not None:
            groups.setdefault(got[0], []).append(r)
            shown.setdefault(got[0], got[1])
    ordered = [(shown[sig], rs) for sig, rs in
               sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))]
    biggest = len(ordered[0][1]) if ordered else 0
    group_of = {r: i for i, (_, rs) in enumerate(ordered) for r in rs}
    odd = {r for r, i in group_of.items() if len(ordered) > 1 and len(ordered[i][1]) < biggest}
    odd |= suspects
    rows, classes = [], []
    for r, d in sorted(ranks.items()):
        flags = [*(["named"] if r == named else []), *(["suspect"] if r in suspects else []),
                 *d.get("flags", [])]
        rows.append([r, d.get("step"), d.get("state"), d.get("cpu"), d.get("cpu_rate"),
                     d.get("pid"), d.get("spy"),
                     f"#{group_of[r] + 1}" if r in group_of else "-", " ".join(flags)])
        classes.append("odd-one" if r in odd or r == named else "")
    total = len(ranks)
    who = sorted(suspects)
    parts = [kv([("verdict", f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
                  if who else "no rank"),
                 ("decided by", verdict.get("decided_by")), ("why", verdict.get("why")),
                 ("rank named", named),
                 ("inside a collective",
                  ", ".join(map(str, as_list(verdict.get("in_collective")))))]),
             table(("rank", "last step", "state", "CPU s", "CPU rate", "pid", "py-spy",
                    "stack", "flags"), rows, classes, numeric=(0, 1, 3, 4, 5))]
    if total >= MAX_RANKS:
        parts.append(f'<p class="note">at most {MAX_RANKS} ranks are listed</p>')
    if ordered:
        parts.append(f"<h3>stacks (main thread, innermost first; {len(ordered)} distinct; "
                     "the lines of the first rank of each)</h3>")
    for i, (fs, rs) in enumerate(ordered[:MAX_GROUPS]):
        is_odd = any(r in odd for r in rs)
        head = (f"#{i + 1}: rank{'s' if len(rs) > 1 else ''} {esc(', '.join(map(str, rs)))}"
                + (tag("odd one out", "bad") if is_odd else ""))
        text = "\n".join(fs[:MAX_FRAMES]) + (f"\n... {len(fs) - MAX_FRAMES} more frames"
                                              if len(fs) > MAX_FRAMES else "")
        parts.append(f'<div class="stack{" odd-one" if is_odd else ""}" data-group="{i + 1}" '
                     f'data-ranks="{esc(",".join(map(str, rs)))}"><h3>{head}</h3>'
                     f"<pre>{esc(text or '(no frames)')}</pre></div>")
    if len(ordered) > MAX_GROUPS:
        rest = [r for _, rs in ordered[MAX_GROUPS:] for r in rs]
        parts.append(f'<p class="note">{len(ordered) - MAX_GROUPS} more distinct stacks, of '
                     f"ranks {esc(', '.join(map(str, rest[:64])))}"
                     f"{' ...' if len(rest) > 64 else ''} (in {esc(folder / 'stacks')})</p>")
    errors = [str(e) for e in as_list((summary or {}).get("errors"))][:20]
    if errors:
        parts.append("<h3>capture errors</h3><pre>" + esc("\n".join(errors)) + "</pre>")
    return section("Ranks and stacks", "".join(parts), "ranks")
