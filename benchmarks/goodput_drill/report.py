"""The drill's table and its chart (an SVG written by hand: no plotting dependency)."""

from __future__ import annotations

from html import escape

COLORS = {"trainwatch": "#1f77b4", "torchrun": "#d62728", "nvrx": "#2ca02c", "limit": "#999999"}


def svg(title: str, lines: dict[str, list[tuple[float, int]]], seconds: float,
        faults: list[tuple[str, float]], width: int = 720, height: int = 360) -> str:
    """Effective steps over wall time, one line per system; the faults as ticks."""
    left, right, top, bottom = 60, 130, 30, 40
    top_steps = max([s for pts in lines.values() for _, s in pts] + [1])

    def x(t: float) -> float:
        return left + (width - left - right) * t / seconds

    def y(s: float) -> float:
        return height - bottom - (height - top - bottom) * s / top_steps

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<text x="{left}" y="18" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{y(0)}" x2="{x(seconds)}" y2="{y(0)}" stroke="#000"/>',
           f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{top}" stroke="#000"/>',
           f'<text x="{x(seconds / 2)}" y="{height - 8}" text-anchor="middle">wall time (s)</text>',
           f'<text x="14" y="{top + 10}">steps</text>']
    for i in range(5):
        t = seconds * i / 4
        out.append(f'<text x="{x(t)}" y="{y(0) + 15}" text-anchor="middle">{t:.0f}</text>')
        s = top_steps * i / 4
        out.append(f'<text x="{left - 5}" y="{y(s) + 4}" text-anchor="end">{s:.0f}</text>')
    for kind, t in faults:
        out.append(f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{y(0)}" '
                   f'stroke="#ccc" stroke-dasharray="3,3"/>'
                   f'<text x="{x(t):.1f}" y="{top - 2}" text-anchor="middle" '
                   f'font-size="10">{escape(kind)}</text>')
    for i, (name, pts) in enumerate(lines.items()):
        color = COLORS.get(name, "#000")
        path = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in pts)
        dash = ' stroke-dasharray="6,4"' if name == "limit" else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} '
                   f'points="{path}"/>')
        out.append(f'<text x="{width - right + 10}" y="{top + 20 + 18 * i}" '
                   f'fill="{color}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def cell(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)
