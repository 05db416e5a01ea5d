"""Small hand-written SVG line charts for the incident pages (page.py): no
library, no script, no network; a few kilobytes whatever the length of the
series (a line of more points than the plot is wide is thinned to the lowest
and highest value of each pixel column, in step order, so a spike survives).

Every mark is one SVG element carrying what it marks, so that a reader (a test,
a browser's DOM) can check it stands where the data says: ``data-mark`` (its
kind), ``data-x`` (the value on the x axis) and the mark's own ``data-*``
(``data-step="21"``). The plot area is ``<rect data-role="plot">`` with the
domain it maps (``data-x-min``, ``data-x-max``, ``data-y-min``, ``data-y-max``,
``data-y-scale``): a vertical mark at x stands at ``plot.x + (x - x_min) /
(x_max - x_min) * plot.width``; a band (``end`` set) spans x to end.

Values that are not finite (a NaN loss) break the line and are drawn as flags
on the plot's top edge (``data-mark="nonfinite"``), at most ``MAX_FLAGS``; the
rest are counted in the chart's caption. The y axis is logarithmic when asked,
or (``log=None``) when every value is positive and they span more than
``LOG_SPAN`` times: one spike then leaves the rest of the curve readable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

Point = tuple[float, float | None]  # x, y (None: no value; nan or inf: not finite)

MAX_FLAGS = 200  # non-finite points flagged one by one; the rest are counted
MAX_MARKS = 400  # marks drawn; the rest are counted
LOG_SPAN = 100.0
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 28, 30, 34  # margins around the plot, px
_LABEL_ROWS = 3  # heights at which mark labels take turns, so that close ones stay apart


@dataclass(frozen=True)
class Line:
    name: str  # its CSS class (line-<name>) and data-line
    points: Sequence[Point]
    label: str = ""


@dataclass(frozen=True)
class Mark:
    kind: str  # data-mark; its CSS class (mark-<kind>)
    x: float
    label: str  # the tooltip; also drawn beside the mark when ``show`` is set
    end: float | None = None  # a band from x to end
    data: Mapping[str, str] = field(default_factory=dict)  # more data-* attributes
    show: bool = True  # draw the label (else the tooltip only)
    tick: bool = False  # a short tick at the bottom edge, not a line across the plot


def _num(v: float) -> str:
    """A coordinate: 1 decimal is finer than a pixel."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def fmt(v: float) -> str:
    """A tick label: short, exact enough to read."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.2g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return f"{v:.0f}" if a >= 1000 else f"{v:.4g}"


def step_fmt(v: float) -> str:
    """A step: the whole number."""
    return str(int(v)) if float(v).is_integer() else fmt(v)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values (1, 2 or 5 times a power of ten apart) in [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    count = math.floor((hi - first) / step + 1e-9) + 1
    return [round(first + i * step, 12) for i in range(max(0, min(count, 50)))]


_CLOCK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
                43200, 86400, 172800, 604800)


def time_ticks(lo: float, hi: float, n: int = 7) -> list[float]:
    """About ``n`` Unix times on round clock values (every 5 s, 15 min, 6 h, ...)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return []
    step = next((s for s in _CLOCK_STEPS if s >= (hi - lo) / n), _CLOCK_STEPS[-1])
    offset = time.localtime(lo).tm_gmtoff if step >= 3600 else 0  # local hours
    first = math.ceil((lo + offset) / step) * step - offset
    return [float(first + i * step) for i in range(int((hi - first) // step) + 1)][:50]


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    every = max(1, math.ceil((b - a) / 6))
    return [10.0 ** e for e in range(a, b + 1, every) if lo <= 10.0 ** e <= hi * (1 + 1e-9)]


def _finite(y: float | None) -> bool:
    return y is not None and math.isfinite(y)


@dataclass(frozen=True)
class _Scale:
    x0: float
    x1: float
    y0: float
    y1: float
    log: bool
    width: float
    height: float

    def px(self, x: float) -> float:
        return _LEFT + (x - self.x0) / (self.x1 - self.x0) * self.width

    def py(self, y: float) -> float:
        if self.log:
            f = (math.log10(y) - math.log10(self.y0)) / (math.log10(self.y1) - math.log10(self.y0))
        else:
            f = (y - self.y0) / (self.y1 - self.y0)
        return _TOP + (1.0 - f) * self.height


def _y_domain(values: list[float], log: bool) -> tuple[float, float]:
    if not values:
        return (1.0, 10.0) if log else (0.0, 1.0)
    lo, hi = min(values), max(values)
    if log:
        return 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def thin(points: Sequence[Point], x0: float, x1: float, columns: int) -> list[Point]:
    """At most about 2 points per pixel column: each column's lowest and highest
    finite value in x order; a gap (None or not finite) is kept as None."""
    if len(points) <= 2 * columns or x1 <= x0:
        return [(x, y if _finite(y) else None) for x, y in points]
    out: list[Point] = []
    col: list[Point] = []
    at = None

    def flush() -> None:
        if not col:
            return
        lo = min(col, key=lambda p: p[1] if p[1] is not None else math.inf)
        hi = max(col, key=lambda p: p[1] if p[1] is not None else -math.inf)
        out.extend(sorted({lo, hi}, key=lambda p: p[0]))
        col.clear()

    for x, y in points:
        c = int((x - x0) / (x1 - x0) * columns)
        if c != at:
            flush()
            at = c
        if _finite(y):
            col.append((x, y))
        else:
            flush()
            if out and out[-1][1] is not None:
                out.append((x, None))
    flush()
    return out


def _path(points: list[Point], s: _Scale) -> str:
    parts: list[str] = []
    pen = False
    for x, y in points:
        if y is None or (s.log and y <= 0):
            pen = False
            continue
        parts.append(f"{'L' if pen else 'M'}{_num(s.px(x))} {_num(s.py(y))}")
        pen = True
    return "".join(parts)


def _dots(points: list[Point], s: _Scale, name: str) -> str:
    """A dot for each value with no value beside it (a line of one point draws nothing)."""
    out = []
    for i, (x, y) in enumerate(points):
        if y is None or (s.log and y <= 0):
            continue
        before = points[i - 1][1] if i > 0 else None
        after = points[i + 1][1] if i + 1 < len(points) else None
        if before is None and after is None:
            out.append(f'<circle class="dot dot-{escape(name)}" cx="{_num(s.px(x))}" '
                       f'cy="{_num(s.py(y))}" r="2.5"/>')
    return "".join(out)


def _attrs(m: Mark) -> str:
    extra = "".join(f' data-{escape(k)}="{escape(v)}"' for k, v in m.data.items())
    end = f' data-end-x="{escape(repr(m.end))}"' if m.end is not None else ""
    return (f'class="mark mark-{escape(m.kind)}" data-mark="{escape(m.kind)}" '
            f'data-x="{escape(repr(m.x))}"{end}{extra}')


def _mark(m: Mark, s: _Scale, row: int) -> str:
    tip = f"<title>{escape(m.label)}</title>"
    top, bottom = _TOP, _TOP + s.height
    if m.end is not None:
        a, b = s.px(m.x), s.px(m.end)
        svg = (f'<rect {_attrs(m)} x="{_num(a)}" y="{top}" width="{_num(max(0.0, b - a))}" '
               f'height="{_num(s.height)}">{tip}</rect>')
        at = a
    elif m.tick:
        at = s.px(m.x)
        svg = (f'<line {_attrs(m)} x1="{_num(at)}" x2="{_num(at)}" y1="{_num(bottom - 9)}" '
               f'y2="{_num(bottom)}">{tip}</line>')
    else:
        at = s.px(m.x)
        svg = (f'<line {_attrs(m)} x1="{_num(at)}" x2="{_num(at)}" y1="{top}" '
               f'y2="{_num(bottom)}">{tip}</line>')
    if m.show and m.label:
        y = bottom + 22 if m.tick else top - 4 - 9 * (row % _LABEL_ROWS)
        anchor = "end" if at > _LEFT + s.width * 0.8 else "start"
        tx = at + (2 if anchor == "start" else -2)
        svg += (f'<text class="mark-label label-{escape(m.kind)}" x="{_num(tx)}" '
                f'y="{_num(y)}" text-anchor="{anchor}">{escape(m.label)}</text>')
    return svg


def _domain(lines: Sequence[Line], marks: Sequence[Mark]) -> tuple[float, float]:
    xs = [x for ln in lines for x, _ in ln.points] + [m.x for m in marks]
    xs += [m.end for m in marks if m.end is not None]
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return 0.0, 1.0
    lo, hi = min(xs), max(xs)
    return (lo - 1, hi + 1) if lo == hi else (lo, hi)


def chart(name: str, lines: Sequence[Line], marks: Sequence[Mark] = (), *, title: str = "",
          x_label: str = "", y_label: str = "", x_fmt: Callable[[float], str] = fmt,
          width: int = 880, height: int = 220, log: bool | None = None,
          x_domain: tuple[float, float] | None = None,
          x_ticks: Callable[[float, float], list[float]] | None = None) -> str:
    """An ``<svg>`` line chart with its marks (``data-chart`` = name)."""
    x0, x1 = x_domain or _domain(lines, marks)
    if x1 <= x0:
        x0, x1 = x0 - 1, x0 + 1
    ys = [y for ln in lines for x, y in ln.points
          if y is not None and math.isfinite(y) and x0 <= x <= x1]
    if log is None:
        use_log = bool(ys) and min(ys) > 0 and max(ys) / min(ys) > LOG_SPAN
    else:
        use_log = log and any(y > 0 for y in ys)
    if use_log:
        ys = [y for y in ys if y > 0]
    y0, y1 = _y_domain(ys, use_log)
    pw, ph = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    s = _Scale(x0, x1, y0, y1, use_log, pw, ph)
    out = [f'<svg class="chart" data-chart="{escape(name)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{escape(title or name)}">',
           f"<title>{escape(title or name)}</title>",
           f'<rect data-role="plot" class="plot" x="{_LEFT}" y="{_TOP}" width="{pw}" '
           f'height="{ph}" data-x-min="{x0!r}" data-x-max="{x1!r}" data-y-min="{y0!r}" '
           f'data-y-max="{y1!r}" data-y-scale="{"log" if use_log else "linear"}"/>']
    yt = _log_ticks(y0, y1) if use_log else nice_ticks(y0, y1)
    for v in yt:
        py = s.py(v)
        out.append(f'<line class="grid" x1="{_LEFT}" x2="{_LEFT + pw}" y1="{_num(py)}" '
                   f'y2="{_num(py)}"/><text class="tick" x="{_LEFT - 4}" y="{_num(py + 3)}" '
                   f'text-anchor="end">{escape(fmt(v))}</text>')
    for v in (x_ticks or (lambda a, b: nice_ticks(a, b, 8)))(x0, x1):
        px = s.px(v)
        out.append(f'<line class="grid" x1="{_num(px)}" x2="{_num(px)}" y1="{_TOP}" '
                   f'y2="{_TOP + ph}"/><text class="tick" x="{_num(px)}" '
                   f'y="{_TOP + ph + 13}" text-anchor="middle">{escape(x_fmt(v))}</text>')
    ordered = sorted(marks[:MAX_MARKS], key=lambda m: (m.end is None, m.tick, m.x))
    row = 0
    for m in ordered:  # bands first: behind the lines
        if m.end is not None:
            out.append(_mark(m, s, row))
            row += 1 if m.show else 0
    flags: list[tuple[float, str]] = []
    for ln in lines:
        thinned = thin([p for p in ln.points if x0 <= p[0] <= x1], x0, x1, int(pw))
        out.append(f'<path class="line line-{escape(ln.name)}" data-line="{escape(ln.name)}" '
                   f'd="{_path(thinned, s)}"><title>{escape(ln.label or ln.name)}</title></path>')
        out.append(_dots(thinned, s, ln.name))
        flags += [(x, "nan" if y != y else ("inf" if y > 0 else "-inf"))
                  for x, y in ln.points if y is not None and not math.isfinite(y)]
    for x, what in flags[:MAX_FLAGS]:
        px = s.px(x)
        step = f' data-step="{int(x)}"' if float(x).is_integer() else ""
        out.append(f'<circle class="mark mark-nonfinite" data-mark="nonfinite" '
                   f'data-x="{x!r}"{step} data-value="{what}" '
                   f'cx="{_num(px)}" cy="{_TOP}" r="3"><title>{escape(x_fmt(x))}: {what}'
                   f"</title></circle>")
    for m in ordered:
        if m.end is None:
            out.append(_mark(m, s, row))
            row += 1 if m.show and not m.tick else 0
    out.append(f'<text class="axis" x="{_LEFT + pw / 2:.0f}" y="{height - 3}" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="axis" x="12" y="{_TOP + ph / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {_TOP + ph / 2:.0f})">{escape(y_label)}'
               f'{" (log)" if use_log else ""}</text>')
    out.append("</svg>")
    more = [f"{len(flags) - MAX_FLAGS} more non-finite values not flagged"] * (
        len(flags) > MAX_FLAGS)
    more += [f"{len(marks) - MAX_MARKS} more marks not drawn"] * (len(marks) > MAX_MARKS)
    if more:
        out.append(f'<p class="note">{escape("; ".join(more))}</p>')
    return "".join(out)
