"""The HTML of the incident pages: one self-contained document (inline CSS and
SVG; no script, no font, no image, nothing fetched), and the few helpers every
section builds with. Everything that comes from the ledger or a job goes
through ``esc`` (html.escape): a job's text never becomes markup. The page's
Content-Security-Policy forbids every fetch and every script, so that even a
mistake here could not make the page reach the network.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from html import escape

CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"

CSS = """
:root{color-scheme:light dark;--fg:#1d2330;--mute:#5b6475;--bg:#fff;--panel:#f5f6f8;
--line:#d8dce3;--bad:#c62828;--warn:#b26a00;--ok:#2e7d32;--acc:#1565c0}
@media (prefers-color-scheme:dark){:root{--fg:#e6e8ec;--mute:#9aa3b2;--bg:#15181e;
--panel:#1e232b;--line:#343b47;--bad:#ef6461;--warn:#f0a63a;--ok:#66bb6a;--acc:#64a7f0}}
*{box-sizing:border-box}
body{margin:0 auto;max-width:1100px;padding:16px 20px 48px;background:var(--bg);color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
h1{font-size:21px;margin:4px 0 2px}h2{font-size:16px;margin:26px 0 8px;
border-bottom:1px solid var(--line);padding-bottom:3px}h3{font-size:14px;margin:14px 0 4px}
.sub{color:var(--mute);margin:0 0 12px}
a{color:var(--acc)}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.kv dt{color:var(--mute)}dl.kv dd{margin:0;overflow-wrap:anywhere}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th{color:var(--mute);font-weight:600}td.num{white-space:nowrap}td.num,th.num{text-align:right;
font-variant-numeric:tabular-nums}
tr.odd-one td{background:rgba(198,40,40,.10)}tr.this td{background:rgba(21,101,192,.10)}
pre{background:var(--panel);padding:8px 10px;overflow:auto;white-space:pre-wrap;
overflow-wrap:anywhere;font:12px/1.4 ui-monospace,
"SFMono-Regular",Menlo,Consolas,monospace;max-height:420px;margin:6px 0}
.stack{border-left:4px solid var(--line);padding-left:8px;margin:8px 0}
.stack.odd-one{border-left-color:var(--bad)}.stack h3 .tag{margin-left:6px}
.tag{display:inline-block;font-size:11px;padding:0 6px;border-radius:8px;
background:var(--panel);border:1px solid var(--line);color:var(--mute)}
.tag.bad{color:var(--bad);border-color:var(--bad)}.tag.warn{color:var(--warn);
border-color:var(--warn)}.tag.ok{color:var(--ok);border-color:var(--ok)}
.note{color:var(--mute);font-size:12px;margin:2px 0 8px}
svg.chart{display:block;max-width:100%;height:auto;margin:4px 0}
svg.chart text{font-size:11px;fill:var(--mute)}
svg.chart .plot{fill:var(--panel);stroke:var(--line)}
svg.chart .grid{stroke:var(--line);stroke-width:.6}
svg.chart .line{fill:none;stroke-width:1.4}
.line-loss{stroke:var(--acc)}.line-grad_norm{stroke:#8e44ad}.line-progress{stroke:var(--ok)}
.line-ideal{stroke:var(--mute);stroke-dasharray:4 3}
.dot-loss{fill:var(--acc)}.dot-grad_norm{fill:#8e44ad}.dot-progress{fill:var(--ok)}
.mark{stroke-width:1.6}.mark-onset{stroke:var(--bad)}.mark-noticed{stroke:var(--warn)}
.mark-resume{stroke:var(--ok)}.mark-quarantined{stroke:var(--bad);stroke-width:3}
.mark-skip{fill:rgba(198,40,40,.13);stroke:none}.mark-nonfinite{fill:var(--bad);stroke:none}
.mark-incident{stroke:var(--warn);stroke-dasharray:3 2}.mark-rollback{stroke:var(--bad)}
.mark-outage{fill:rgba(178,106,0,.12);stroke:none}
svg.chart .mark-label{font-size:10px}svg.chart .label-onset{fill:var(--bad)}
svg.chart .label-noticed{fill:var(--warn)}svg.chart .label-resume{fill:var(--ok)}
.legend span{margin-right:12px;font-size:12px;color:var(--mute)}
.legend i{display:inline-block;width:14px;height:3px;margin-right:4px;vertical-align:middle}
footer{margin-top:32px;color:var(--mute);font-size:12px}
"""


def esc(v: object) -> str:
    """Text for HTML (element content or a quoted attribute)."""
    return escape(str(v), quote=True)


def when(t: object) -> str:
    """A Unix time as local date and time, to the ms (the footer gives the offset);
    "-" when unknown."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def seconds(v: object) -> str:
    """A duration, short: 0.052 s, 14.2 s, 3 min 5 s, 2 h 10 min."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    a = abs(v)
    if a < 60:
        return f"{v:.3g} s" if a < 10 else f"{v:.1f} s"
    if a < 3600:
        return f"{int(v // 60)} min {int(v % 60)} s"
    return f"{int(v // 3600)} h {int(v % 3600 // 60)} min"


def cell(v: object) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return esc(f"{v:.6g}")
    return esc(v)


def kv(pairs: Iterable[tuple[str, object]]) -> str:
    """A definition list of the pairs whose value is known (raw HTML values are
    given as ``Raw``)."""
    items = []
    for k, v in pairs:
        if v is None or v == "":
            continue
        items.append(f"<dt>{esc(k)}</dt><dd>{v.html if isinstance(v, Raw) else cell(v)}</dd>")
    return f'<dl class="kv">{"".join(items)}</dl>' if items else ""


class Raw:
    """HTML made here (already escaped), to go into kv() or table() as it is."""

    def __init__(self, html: str) -> None:
        self.html = html


def table(head: Sequence[str], rows: Iterable[Sequence[object]],
          classes: Iterable[str] = (), numeric: Sequence[int] = (),
          attrs: Iterable[str] = ()) -> str:
    """A table; ``classes``/``attrs``: per row, a class and extra attributes (made here)."""
    th = "".join(f'<th class="num">{esc(h)}</th>' if i in numeric else f"<th>{esc(h)}</th>"
                 for i, h in enumerate(head))
    body = []
    cls, extra = iter(classes), iter(attrs)
    for row in rows:
        c, a = next(cls, ""), next(extra, "")
        tds = "".join(
            ('<td class="num">' if i in numeric else "<td>")
            + (v.html if isinstance(v, Raw) else cell(v)) + "</td>"
            for i, v in enumerate(row))
        klass = f' class="{esc(c)}"' if c else ""
        body.append(f"<tr{klass}{a}>{tds}</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def tag(text: str, kind: str = "") -> str:
    return f'<span class="tag {esc(kind)}">{esc(text)}</span>'


def section(title: str, body: str, ident: str) -> str:
    return f'<section id="{esc(ident)}"><h2>{esc(title)}</h2>{body}</section>' if body else ""


def link(href: str, text: str) -> str:
    return f'<a href="{esc(href)}" rel="noreferrer">{esc(text)}</a>'


def document(title: str, body: str) -> str:
    """The whole page: self-contained, no script, nothing fetched."""
    made = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">'
            '<meta name="referrer" content="no-referrer">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>"
            f"<body>{body}<footer>made by trainwatch at {esc(made)}; "
            "self-contained: nothing on this page is fetched</footer></body></html>\n")
