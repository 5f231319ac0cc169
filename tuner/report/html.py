"""Self-contained HTML and hand-written inline SVG for reports (no matplotlib, no network, no JS
libraries): a line chart (log2 x), a heatmap, grouped horizontal bars (log x), a sortable table
and the page around them."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
# Tableau 10 (colour-blind friendly enough, distinct in print).
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
AXIS = "#444"
GRID = "#e3e3e3"


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def fmt_num(x: float | None, digits: int = 3) -> str:
    """Compact number: 3 significant digits, thousands without exponent."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.{digits}g}"


def fmt_tick(x: float) -> str:
    """Axis tick: no trailing zeros, thousands separated (0.5, 2, 2,000)."""
    if x == int(x):
        return f"{int(x):,}"
    return f"{x:g}"


def text_width(s: str, size: float, bold: bool = False) -> float:
    """Rough rendered width of ``s`` in a sans-serif font (for layout only)."""
    return len(s) * size * (0.62 if bold else 0.56)


def fmt_tokens(x: float) -> str:
    """1024 -> 1k, 131072 -> 128k, 40 -> 40."""
    x = int(round(x))
    if x >= 1024 and x % 1024 == 0:
        return f"{x // 1024}k"
    return str(x)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps 1, 2, 2.5 or 5 x 10^k)."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _text(x: float, y: float, s: str, *, size: int = 12, anchor: str = "start", weight: str = "normal",
          color: str = "#222", rotate: float | None = None, baseline: str | None = None,
          halo: bool = False) -> str:
    extra = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
    if halo:  # a white outline keeps labels legible over lines and markers
        extra += ' stroke="#fff" stroke-width="3" paint-order="stroke"'
    if baseline:
        extra += f' dominant-baseline="{baseline}"'
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{color}"{extra}>{esc(s)}</text>')


def _svg_open(width: int, height: int, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="{esc(FONT)}" role="img" '
            f'aria-label="{esc(title)}"><rect width="100%" height="100%" fill="#fff"/>')


# ---------------------------------------------------------------------------------------------
# Line chart


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]
    color: str
    tooltips: list[str] | None = None


@dataclass
class HLine:
    y: float
    label: str
    color: str = "#222"
    dash: str = "6 4"


def line_chart(
    series: Sequence[Series], *, title: str, x_label: str, y_label: str, hlines: Sequence[HLine] = (),
    width: int = 640, height: int = 380, y_max: float | None = None, legend_title: str = "",
) -> str:
    """Lines with markers; x on a log2 axis (ticks at powers of two), y linear from 0."""
    ml, mr, mt, mb = 70, 150, 40, 52
    pw, ph = width - ml - mr, height - mt - mb
    xs = [x for s in series for x, _ in s.points] or [1.0]
    ys = [y for s in series for _, y in s.points] + [h.y for h in hlines] + [0.0]
    x0, x1 = math.log2(min(xs)), math.log2(max(xs))
    pad = max(0.35, (x1 - x0) * 0.06)
    x0, x1 = x0 - pad, x1 + pad
    top = y_max if y_max is not None else max(ys) * 1.08 or 1.0
    yticks = [t for t in nice_ticks(0, top, 6) if t <= top * 1.0001]
    top = max(top, yticks[-1])

    def px(v: float) -> float:
        return ml + (math.log2(v) - x0) / (x1 - x0) * pw

    def py(v: float) -> float:
        return mt + ph - v / top * ph

    out = [_svg_open(width, height, title), _text(ml, 22, title, size=15, weight="bold")]
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID}"/>')
        out.append(_text(ml - 8, y + 4, fmt_tick(t), size=11, anchor="end", color=AXIS))
    xticks = [2.0**k for k in range(math.ceil(x0), math.floor(x1) + 1)]
    xticks = xticks[::max(1, math.ceil(len(xticks) / 10))]
    for t in xticks:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{mt}" y2="{mt + ph}" stroke="{GRID}"/>')
        out.append(_text(x, mt + ph + 17, fmt_tokens(t), size=11, anchor="middle", color=AXIS))
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="{AXIS}"/>')
    out.append(_text(ml + pw / 2, height - 10, x_label, size=13, anchor="middle"))
    out.append(_text(18, mt + ph / 2, y_label, size=13, anchor="middle", rotate=-90))
    for h in hlines:
        if h.y > top:
            continue
        y = py(h.y)
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{h.color}" '
                   f'stroke-width="1.5" stroke-dasharray="{h.dash}"/>')
        out.append(_text(ml + 6, y - 5, h.label, size=11, color=h.color, halo=True))
    for s in series:
        pts = sorted(s.points)
        if len(pts) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"/>')
        tips = dict(zip(s.points, s.tooltips or []))
        for x, y in pts:
            tip = tips.get((x, y), f"{s.label}: {fmt_tokens(x)}, {fmt_num(y)}")
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{s.color}" '
                       f'stroke="#fff" stroke-width="1"><title>{esc(tip)}</title></circle>')
    lx, ly = ml + pw + 16, mt + 6
    if legend_title:
        out.append(_text(lx, ly + 4, legend_title, size=12, weight="bold"))
        ly += 20
    for s in series:
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly:.1f}" y2="{ly:.1f}" stroke="{s.color}" '
                   f'stroke-width="2"/><circle cx="{lx + 11}" cy="{ly:.1f}" r="3.5" fill="{s.color}"/>')
        out.append(_text(lx + 28, ly + 4, s.label, size=12))
        ly += 19
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Heatmap


def diverging_color(ratio: float, span: float = 1.5) -> str:
    """White at 1.0, green above (up to span), red below (down to 1/span); log scale."""
    t = max(-1.0, min(1.0, math.log(ratio) / math.log(span))) if ratio > 0 else -1.0
    end = (26, 152, 80) if t >= 0 else (215, 48, 39)
    a = abs(t)
    rgb = [round(255 + (e - 255) * a) for e in end]
    return "#%02x%02x%02x" % tuple(rgb)


def sequential_color(frac: float) -> str:
    """White (0) to deep blue (1)."""
    a = max(0.0, min(1.0, frac))
    end = (8, 69, 148)
    rgb = [round(247 + (e - 247) * a) for e in end]
    return "#%02x%02x%02x" % tuple(rgb)


def _text_color(fill: str) -> str:
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#222"


@dataclass
class Cell:
    fill: str  # colour; "" for a grey "no data" cell
    text: str
    tooltip: str = ""


def heatmap(
    row_labels: Sequence[str], col_labels: Sequence[str], cells: Mapping[tuple[int, int], Cell], *,
    title: str, row_title: str, col_title: str, legend: str = "", cell_w: int = 78, cell_h: int = 34,
) -> str:
    """A grid of coloured cells with their value printed inside; missing cells stay blank."""
    ml, mt = 100, 66
    width = int(max(ml + cell_w * len(col_labels) + 30, 360, text_width(title, 15, True) + 24,
                    text_width(legend, 11) + 24))
    height = mt + cell_h * len(row_labels) + (44 if legend else 20)
    out = [_svg_open(width, height, title), _text(10, 22, title, size=15, weight="bold")]
    out.append(_text(ml + cell_w * len(col_labels) / 2, 44, col_title, size=12, anchor="middle", color=AXIS))
    out.append(_text(10, 44, row_title, size=12, color=AXIS))
    for j, c in enumerate(col_labels):
        out.append(_text(ml + cell_w * (j + 0.5), mt - 6, c, size=12, anchor="middle"))
    for i, r in enumerate(row_labels):
        out.append(_text(ml - 10, mt + cell_h * (i + 0.5) + 4, r, size=12, anchor="end"))
    for (i, j), cell in cells.items():
        x, y = ml + cell_w * j, mt + cell_h * i
        fill = cell.fill or "#f0f0f0"
        out.append(f'<g><rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" rx="3" '
                   f'fill="{fill}" stroke="#ccc" stroke-width="0.5"/>')
        color = _text_color(fill) if cell.fill else "#888"
        out.append(_text(x + (cell_w - 2) / 2, y + (cell_h - 2) / 2 + 4, cell.text, size=12,
                         anchor="middle", color=color))
        if cell.tooltip:
            out.append(f"<title>{esc(cell.tooltip)}</title>")
        out.append("</g>")
    if legend:
        out.append(_text(10, height - 14, legend, size=11, color=AXIS))
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Grouped horizontal bars (log x)


def _log_bounds(lo: float, hi: float) -> tuple[float, float]:
    """Widen [lo, hi] to 1-2-5 steps: (5, 20000) rather than (1, 100000)."""
    steps = [m * 10.0**d for d in range(-6, 10) for m in (1, 2, 5)]
    low = max([v for v in steps if v <= lo], default=steps[0])
    high = min([v for v in steps if v >= hi], default=steps[-1])
    return low, high if high > low else low * 10


def hbar_chart(
    groups: Sequence[str], series: Sequence[tuple[str, str]],
    values: Mapping[tuple[str, str], float], *, title: str, x_label: str,
    value_fmt: Callable[[float], str] = fmt_num, width: int = 900, label_w: int = 210,
) -> str:
    """One row group per entry of ``groups``, one bar per (label, colour) in ``series`` that has a
    value; log10 x axis. Values are printed at the bar ends."""
    bar_h, gap, group_gap = 11, 2, 12
    mt, mb, mr = 58, 44, 70
    present = [v for v in values.values() if v and v > 0] or [1.0, 10.0]
    lo, hi = _log_bounds(min(present) * 0.9, max(present) * 1.15)
    pw = width - label_w - mr
    heights = []
    for g in groups:
        n = sum(1 for s, _ in series if values.get((g, s)))
        heights.append(max(1, n) * (bar_h + gap) + group_gap)
    height = mt + sum(heights) + mb

    def px(v: float) -> float:
        return label_w + (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * pw

    out = [_svg_open(width, height, title), _text(10, 22, title, size=15, weight="bold")]
    lx = label_w
    for label, color in series:  # legend on one line under the title
        out.append(f'<rect x="{lx}" y="33" width="12" height="12" fill="{color}"/>')
        out.append(_text(lx + 16, 43, label, size=12))
        lx += 30 + 7 * len(label)
    plot_bottom = height - mb
    ticks = [m * 10.0**d for d in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0**d <= hi * 1.0001]
    few = math.log10(hi / lo) <= 2.5  # label 2 and 5 too when there are few decades
    for v in ticks:
        x = px(v)
        major = abs(math.log10(v) - round(math.log10(v))) < 1e-9
        stroke = "#cfcfcf" if major else "#eeeeee"
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{mt - 4}" y2="{plot_bottom}" stroke="{stroke}"/>')
        if major or few or v in (lo, hi):
            out.append(_text(x, plot_bottom + 16, fmt_tick(v), size=11, anchor="middle", color=AXIS))
    out.append(_text(label_w + pw / 2, height - 8, x_label, size=13, anchor="middle"))
    y = mt
    for g, h in zip(groups, heights):
        bars = [(s, c) for s, c in series if values.get((g, s))]
        out.append(_text(label_w - 8, y + (h - group_gap) / 2 + 4, g, size=12, anchor="end"))
        for s, c in bars:
            v = values[(g, s)]
            x = px(v)
            out.append(f'<rect x="{label_w}" y="{y}" width="{max(1.0, x - label_w):.1f}" height="{bar_h}" '
                       f'fill="{c}"><title>{esc(f"{g} - {s}: {value_fmt(v)}")}</title></rect>')
            out.append(_text(x + 4, y + bar_h - 2, value_fmt(v), size=10, color=AXIS))
            y += bar_h + gap
        if not bars:
            out.append(_text(label_w + 4, y + bar_h - 2, "no data", size=10, color="#999"))
            y += bar_h + gap
        y += group_gap
        out.append(f'<line x1="{label_w - 200}" x2="{label_w + pw}" y1="{y - group_gap / 2:.1f}" '
                   f'y2="{y - group_gap / 2:.1f}" stroke="#f3f3f3"/>')
    out.append(f'<line x1="{label_w}" x2="{label_w}" y1="{mt - 4}" y2="{plot_bottom}" stroke="{AXIS}"/>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Table and page


@dataclass
class Column:
    key: str
    label: str
    numeric: bool = False
    fmt: Callable[[object], str] | None = None
    title: str = ""


def table(columns: Sequence[Column], rows: Iterable[Mapping[str, object]], *,
          row_class: Callable[[Mapping], str] | None = None) -> str:
    """A sortable table (click a header); numeric cells sort by their raw value."""
    head = "".join(
        f'<th class="{"num" if c.numeric else ""}" title="{esc(c.title or "click to sort")}">{esc(c.label)}</th>'
        for c in columns
    )
    body = []
    for row in rows:
        cls = row_class(row) if row_class else ""
        tds = []
        for c in columns:
            v = row.get(c.key)
            text = c.fmt(v) if c.fmt else ("" if v is None else str(v))
            if c.numeric:
                sort = v if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else ""
                tds.append(f'<td class="num" data-v="{sort}">{esc(text)}</td>')
            else:
                tds.append(f"<td>{esc(text)}</td>")
        body.append(f'<tr class="{cls}">{"".join(tds)}</tr>')
    return (f'<div class="tablewrap"><table class="data sortable"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


CSS = """
body { font-family: %s; color: #222; margin: 24px 32px; max-width: 1500px; line-height: 1.4; }
h1 { font-size: 24px; margin: 0 0 6px 0; }
h2 { font-size: 19px; margin: 30px 0 10px 0; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px 0; color: #444; }
.meta { display: grid; grid-template-columns: repeat(auto-fill, minmax(260px, 1fr)); gap: 2px 24px;
        font-size: 14px; margin: 10px 0 16px 0; }
.meta b { color: #555; font-weight: 600; }
.banner { background: #b00020; color: #fff; font-size: 18px; font-weight: 700; padding: 14px 18px;
          border-radius: 6px; margin: 12px 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 10px 0; }
.card { border: 1px solid #ddd; border-radius: 8px; padding: 10px 16px; width: 230px; background: #fafafa; }
.card .v { font-size: 26px; font-weight: 700; }
.card .l { font-size: 13px; color: #555; }
.card.bad .v { color: #b00020; }
.charts { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
.charts svg { border: 1px solid #eee; border-radius: 6px; }
.note { font-size: 13px; color: #555; }
ul.skips { font-size: 13px; color: #444; }
.tablewrap { overflow-x: auto; }
table.data { border-collapse: collapse; font-size: 12.5px; font-variant-numeric: tabular-nums; }
table.data th { position: sticky; top: 0; background: #f2f2f2; cursor: pointer; text-align: left;
                padding: 5px 8px; border-bottom: 2px solid #bbb; white-space: nowrap; }
table.data th.num, table.data td.num { text-align: right; }
table.data td { padding: 3px 8px; border-bottom: 1px solid #eee; white-space: nowrap; }
table.data tr:nth-child(even) td { background: #fbfbfb; }
table.data tr.skipped td { color: #999; }
table.data tr.failed td, table.data tr.wrong td { color: #b00020; }
th.asc::after { content: " \\25B2"; } th.desc::after { content: " \\25BC"; }
""" % FONT

SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function (table) {
  table.querySelectorAll('th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var asc = !th.classList.contains('asc');
      table.querySelectorAll('th').forEach(function (h) { h.classList.remove('asc', 'desc'); });
      th.classList.add(asc ? 'asc' : 'desc');
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var num = th.classList.contains('num');
      rows.sort(function (a, b) {
        var x = a.cells[col], y = b.cells[col];
        if (num) {
          var u = x.dataset.v === '' ? NaN : parseFloat(x.dataset.v);
          var w = y.dataset.v === '' ? NaN : parseFloat(y.dataset.v);
          if (isNaN(u) && isNaN(w)) return 0; if (isNaN(u)) return 1; if (isNaN(w)) return -1;
          return asc ? u - w : w - u;
        }
        return asc ? x.textContent.localeCompare(y.textContent) : y.textContent.localeCompare(x.textContent);
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{CSS}</style></head><body>{body}<script>{SORT_JS}</script></body></html>\n")
