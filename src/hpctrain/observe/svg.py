"""Inline SVG charts for the HTML report: lines, a heatmap, a waterfall, a timeline.

No plotting library and no network: each function returns an ``<svg>`` element as text that a
browser draws as it is. Every text that comes from a run (names, hosts, labels) is escaped
by hpctrain.observe.markup.esc.
Line charts carry their points in ``data-series`` for the report's hover read-out.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence

from hpctrain.observe.markup import esc

# Colour-blind-safe (Okabe-Ito) for overlaid runs.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#F0E442")
_W, _H = 640, 260
_M = {"left": 64, "right": 16, "top": 14, "bottom": 40}
MAX_POINTS = 2000


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def fmt(value: float) -> str:
    """A short human number: 12.3k, 0.0042, 3.21."""
    if value is None or not math.isfinite(value):
        return "n/a"
    a = abs(value)
    if a >= 1e9:
        return f"{value / 1e9:.3g}G"
    if a >= 1e6:
        return f"{value / 1e6:.3g}M"
    if a >= 1e4:
        return f"{value / 1e3:.3g}k"
    if a == 0 or a >= 0.01:
        return f"{value:.4g}"
    return f"{value:.2e}"


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def line_chart(series: Sequence[tuple[str, Sequence[tuple[float, float]], str]], *,
               x_label: str, y_label: str, log_y: bool = False, dashed: Sequence[str] = ()
               ) -> str:
    """An SVG line chart of ``(label, [(x, y)], colour)`` series (non-finite y left out)."""
    clean = []
    for label, points, colour in series:
        pts = [(float(x), float(y)) for x, y in points
               if y is not None and math.isfinite(y) and (not log_y or y > 0)]
        if pts:
            clean.append((label, _thin(pts), colour))
    if not clean:
        return empty_chart("no data recorded")
    xs = [x for _, pts, _ in clean for x, _ in pts]
    ys = [math.log10(y) if log_y else y for _, pts, _ in clean for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    else:
        pad = (y1 - y0) * 0.05
        y0, y1 = y0 - pad, y1 + pad
    pw = _W - _M["left"] - _M["right"]
    ph = _H - _M["top"] - _M["bottom"]

    def sx(x: float) -> float:
        return _M["left"] + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        v = math.log10(y) if log_y else y
        return _M["top"] + (1 - (v - y0) / (y1 - y0)) * ph

    parts = [_frame(x_label, y_label)]
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{sx(t):.1f}" y="{_H - _M["bottom"] + 16}" '
                     f'text-anchor="middle" class="tick">{esc(fmt(t))}</text>')
    for t in _ticks(y0, y1):
        y = _M["top"] + (1 - (t - y0) / (y1 - y0)) * ph
        label = fmt(10 ** t) if log_y else fmt(t)
        parts.append(f'<line x1="{_M["left"]}" x2="{_W - _M["right"]}" y1="{y:.1f}" '
                     f'y2="{y:.1f}" class="grid"/>'
                     f'<text x="{_M["left"] - 6}" y="{y + 4:.1f}" text-anchor="end" '
                     f'class="tick">{esc(label)}</text>')
    data = []
    for label, pts, colour in clean:
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}"
                     for i, (x, y) in enumerate(pts))
        dash = ' stroke-dasharray="5,3"' if label in dashed else ""
        parts.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}>'
                     f'<title>{esc(label)}</title></path>')
        if len(pts) == 1:
            x, y = pts[0]
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>')
        data.append({"label": label, "colour": colour,
                     "points": [[round(sx(x), 1), round(sy(y), 1), x, y] for x, y in pts]})
    legend = "".join(
        f'<span class="key"><i style="background:{colour}"></i>{esc(label)}</span>'
        for label, _, colour in clean)
    svg = (f'<svg viewBox="0 0 {_W} {_H}" class="chart line" role="img" '
           f'data-series="{esc(json.dumps(data))}">{"".join(parts)}</svg>')
    return svg + f'<div class="legend">{legend}</div>'


def empty_chart(message: str) -> str:
    """A chart-sized box that says why there is nothing to draw."""
    return (f'<svg viewBox="0 0 {_W} 60" class="chart empty" role="img">'
            f'<text x="{_W / 2}" y="34" text-anchor="middle" class="note">'
            f'{esc(message)}</text></svg>')


def _frame(x_label: str, y_label: str) -> str:
    return (f'<rect x="{_M["left"]}" y="{_M["top"]}" width="{_W - _M["left"] - _M["right"]}" '
            f'height="{_H - _M["top"] - _M["bottom"]}" class="frame"/>'
            f'<text x="{(_W + _M["left"]) / 2}" y="{_H - 6}" text-anchor="middle" '
            f'class="axis">{esc(x_label)}</text>'
            f'<text transform="translate(14,{(_H - _M["bottom"]) / 2}) rotate(-90)" '
            f'text-anchor="middle" class="axis">{esc(y_label)}</text>')


def heatmap(rows: Sequence[str], columns: Sequence[float], values: list[list[float | None]],
            *, marked: Sequence[int] = (), x_label: str, title: str) -> str:
    """Rows x columns of seconds, coloured by each cell's excess over its column's median.

    ``marked`` rows (stragglers) get a red label. A cell's tooltip gives row, column, value.
    """
    if not rows or not columns:
        return empty_chart("no per-rank timings recorded")
    n_rows, n_cols = len(rows), len(columns)
    row_h = max(2.0, min(18.0, 360.0 / n_rows))
    left, top = 150, 8
    width = _W + 120 - left - 16
    cell_w = width / n_cols
    height = top + n_rows * row_h + 44
    medians = []
    for c in range(n_cols):
        col = [v[c] for v in values if v[c] is not None]
        medians.append(statistics.median(col) if col else None)
    parts = []
    for r in range(n_rows):
        y = top + r * row_h
        if row_h >= 8:
            cls = "tick straggler" if r in marked else "tick"
            parts.append(f'<text x="{left - 6}" y="{y + row_h * 0.75:.1f}" text-anchor="end" '
                         f'class="{cls}">{esc(rows[r])}</text>')
        for c in range(n_cols):
            v, m = values[r][c], medians[c]
            if v is None or m is None:
                continue
            excess = (v - m) / m if m > 0 else 0.0
            parts.append(f'<rect x="{left + c * cell_w:.2f}" y="{y:.2f}" '
                         f'width="{cell_w + 0.3:.2f}" height="{row_h:.2f}" '
                         f'fill="{_heat(excess)}"><title>{esc(rows[r])}, '
                         f'{esc(fmt(columns[c]))}: {v:.4f} s ({100 * excess:+.0f}% vs median)'
                         f'</title></rect>')
    for r in marked:
        y = top + r * row_h
        parts.append(f'<rect x="{left}" y="{y:.2f}" width="{width:.2f}" height="{row_h:.2f}" '
                     f'class="marked"/>')
    for t in _ticks(columns[0], columns[-1]) if n_cols > 1 else [columns[0]]:
        c = min(range(n_cols), key=lambda i: abs(columns[i] - t))
        parts.append(f'<text x="{left + (c + 0.5) * cell_w:.1f}" '
                     f'y="{top + n_rows * row_h + 16:.1f}" text-anchor="middle" '
                     f'class="tick">{esc(fmt(t))}</text>')
    parts.append(f'<text x="{left + width / 2:.1f}" y="{height - 6:.1f}" text-anchor="middle" '
                 f'class="axis">{esc(x_label)}</text>')
    return (f'<svg viewBox="0 0 {_W + 120} {height:.0f}" class="chart heatmap" role="img" '
            f'aria-label="{esc(title)}">{"".join(parts)}</svg>'
            '<div class="legend"><span class="key"><i style="background:#f7f7f7"></i>median'
            '</span><span class="key"><i style="background:#fdae61"></i>+25%</span>'
            '<span class="key"><i style="background:#d7191c"></i>+50% or more</span>'
            '<span class="key"><i style="background:#abd9e9"></i>faster</span></div>')


def _heat(excess: float) -> str:
    """White at the median, orange to red above it, blue below."""
    if excess >= 0:
        t = min(1.0, excess / 0.5)
        r, g, b = 247 + (215 - 247) * t, 247 + (25 - 247) * t, 247 + (28 - 247) * t
    else:
        t = min(1.0, -excess / 0.5)
        r, g, b = 247 + (171 - 247) * t, 247 + (217 - 247) * t, 247 + (233 - 247) * t
    return f"rgb({r:.0f},{g:.0f},{b:.0f})"


def waterfall(total: float, parts: Sequence[tuple[str, float]], final_label: str) -> str:
    """Wall time, minus each lost part as a falling bar, down to what is left (productive)."""
    if total <= 0:
        return empty_chart("no wall time recorded")
    bars = [("wall time", 0.0, total, "#555")]
    level = total
    for label, seconds in parts:
        seconds = max(0.0, float(seconds))
        bars.append((label, level - seconds, level, "#d7191c"))
        level -= seconds
    bars.append((final_label, 0.0, max(level, 0.0), "#009E73"))
    pw = _W - _M["left"] - _M["right"]
    ph = _H - _M["top"] - _M["bottom"] - 20
    bw = pw / len(bars)

    def sy(v: float) -> float:
        return _M["top"] + (1 - v / total) * ph

    out = [f'<rect x="{_M["left"]}" y="{_M["top"]}" width="{pw}" height="{ph}" class="frame"/>']
    for t in _ticks(0, total):
        out.append(f'<text x="{_M["left"] - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" '
                   f'class="tick">{esc(fmt(t))} s</text>')
    for i, (label, lo, hi, colour) in enumerate(bars):
        x = _M["left"] + i * bw + bw * 0.15
        h = max(sy(lo) - sy(hi), 0.8)
        out.append(f'<rect x="{x:.1f}" y="{sy(hi):.1f}" width="{bw * 0.7:.1f}" height="{h:.1f}" '
                   f'fill="{colour}"><title>{esc(label)}: {hi - lo:.1f} s '
                   f'({100 * (hi - lo) / total:.1f}%)</title></rect>'
                   f'<text x="{x + bw * 0.35:.1f}" y="{_H - _M["bottom"] - 4:.1f}" '
                   f'text-anchor="middle" class="tick">{esc(label)}</text>'
                   f'<text x="{x + bw * 0.35:.1f}" y="{sy(hi) - 3:.1f}" text-anchor="middle" '
                   f'class="tick">{100 * (hi - lo) / total:.1f}%</text>')
    return (f'<svg viewBox="0 0 {_W} {_H}" class="chart waterfall" role="img">'
            f'{"".join(out)}</svg>')


def timeline(lanes: Sequence[tuple[str, Sequence[tuple[float, float, str, str]]]],
             span: tuple[float, float], *, x_label: str) -> str:
    """Lanes of spans ``(start, end, label, colour)``; a zero-length span is a marker."""
    t0, t1 = span
    if t1 <= t0:
        t1 = t0 + 1
    left, lane_h, top = 120, 26, 8
    width = _W + 120 - left - 16
    height = top + lane_h * len(lanes) + 40

    def sx(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * width

    out = [f'<rect x="{left}" y="{top}" width="{width}" height="{lane_h * len(lanes)}" '
           f'class="frame"/>']
    for i, (lane, items) in enumerate(lanes):
        y = top + i * lane_h
        out.append(f'<text x="{left - 6}" y="{y + lane_h * 0.65:.1f}" text-anchor="end" '
                   f'class="tick">{esc(lane)}</text>')
        for start, end, label, colour in items:
            tip = f"<title>{esc(label)}</title>"
            if end > start:
                out.append(f'<rect x="{sx(start):.1f}" y="{y + 4}" '
                           f'width="{max(sx(end) - sx(start), 1.5):.1f}" height="{lane_h - 8}" '
                           f'fill="{colour}" opacity="0.75">{tip}</rect>')
            else:
                x = sx(start)
                out.append(f'<path d="M{x:.1f},{y + 4} L{x + 5:.1f},{y + lane_h / 2:.1f} '
                           f'L{x:.1f},{y + lane_h - 4} L{x - 5:.1f},{y + lane_h / 2:.1f} Z" '
                           f'fill="{colour}">{tip}</path>')
    for t in _ticks(0, t1 - t0):
        out.append(f'<text x="{sx(t0 + t):.1f}" y="{top + lane_h * len(lanes) + 16}" '
                   f'text-anchor="middle" class="tick">{esc(fmt(t))}</text>')
    out.append(f'<text x="{left + width / 2:.1f}" y="{height - 6:.1f}" text-anchor="middle" '
               f'class="axis">{esc(x_label)}</text>')
    return (f'<svg viewBox="0 0 {_W + 120} {height}" class="chart timeline" role="img">'
            f'{"".join(out)}</svg>')
