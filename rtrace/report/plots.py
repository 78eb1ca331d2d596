"""Honest small plots as inline SVG: line plots across steps, histograms of one step.

What "honest" means here (issue #22, item 7):

- the y axis starts at zero (or goes below it when a value does): 0.625 -> 0.875 does not
  fill the height; rates and fractions are drawn as percentages from 0%;
- the ticks are round numbers (1, 2, 5 x 10^k) written in plain notation with thousands
  separators (``1,650``, never ``1.65e+03``);
- the x axis shows the steps there are: one step is one point over its label, never an
  axis from 1 to 2 with a "step 4";
- every point and bar carries its exact value in a tooltip (``<title>``).

No JavaScript, no dependency: the page's stylesheet colours the classes used here.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from typing import Sequence

__all__ = ["ticks", "tick_labels", "fmt_number", "line_plot", "histogram", "histogram_bars"]

W, H = 360, 170
LEFT, RIGHT, TOP, BOTTOM = 50, 12, 24, 30
LEGEND = 14  # the legend's line, under the title
#: series colours are classes s0..s3 of the page's stylesheet
MAX_SERIES = 4
#: a histogram draws one bar per value up to this many distinct values, else equal-width bins
MAX_CATEGORIES = 12
MAX_BINS = 20


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= ``raw``."""
    exp = math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * 10**exp >= raw * (1 - 1e-12):
            return m * 10**exp
    return 10 ** (exp + 1)  # pragma: no cover - the loop ends at 10


def ticks(low: float, high: float, count: int = 4) -> list[float]:
    """Round tick values covering ``[min(low, 0), max(high, 0)]``: zero is always one."""
    low, high = min(low, 0.0), max(high, 0.0)
    if high - low <= 0:
        high = 1.0
    step = _nice_step((high - low) / count)
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def tick_labels(values: Sequence[float], unit: str = "") -> list[str]:
    """Labels of round ticks, all with the same decimals (the fewest that write each exactly)."""
    scaled = [v * 100 for v in values] if unit == "%" else list(values)
    decimals = next((d for d in range(13) if all(abs(round(v, d) - v) < 1e-9 for v in scaled)), 12)
    return [f"{v:,.{decimals}f}".replace("-0", "0") if v == 0 else f"{v:,.{decimals}f}" for v in scaled]


def fmt_number(value: float, unit: str = "") -> str:
    """A value in plain notation: ``1,650``, ``1,650.3``, ``0.625``, ``0.0001235`` (below
    1e-6 in scientific notation, ``-1.23e-17``: the rounding noise it usually is); with
    ``unit="%"`` a fraction as a percentage (``25%``, ``12.5%``, ``0.01%``)."""
    if value is None or not math.isfinite(value):
        return str(value)
    if unit == "%":
        pct = value * 100
        if pct != 0 and abs(pct) < 0.1:
            return f"{pct:.2g}%" if abs(pct) >= 1e-4 else "<0.0001%"
        return _strip(f"{pct:,.1f}") + "%"
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return _strip(f"{value:,.1f}")
    if abs(value) >= 1:
        return _strip(f"{value:.3f}")
    if abs(value) < 1e-6:  # rounding noise (an advantage mean of -1.2e-17) is shown as what it is
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{_strip(mantissa)}e{int(exponent)}"
    decimals = min(15, 3 - math.floor(math.log10(abs(value))))
    return _strip(f"{value:.{decimals}f}")


def _strip(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


#: legend labels longer than this are cut (the whole label is the item's tooltip)
LEGEND_CHARS = 28


def _legend(labels: Sequence[str]) -> tuple[list[str], int]:
    """The legend's items, on as many lines under the title as they need (never over the
    plot's right edge, never over the title); returns the SVG and the number of lines."""
    out, x, line = [], LEFT, 0
    for i, label in enumerate(labels):
        text = label if len(label) <= LEGEND_CHARS else label[: LEGEND_CHARS - 1] + "…"
        width = 6.2 * len(text) + 24
        if x > LEFT and x + width > W - RIGHT:
            line, x = line + 1, LEFT
        tip = f"<title>{_esc(label)}</title>" if text != label else ""
        out.append(f'<text class="s{i % MAX_SERIES} l" x="{x:.0f}" y="{TOP + 4 + LEGEND * line}">{tip}&#9632; '
                   f'{_esc(text)}</text>')
        x += width
    return out, (line + 1 if labels else 0)


def _frame(title: str, yt: list[float], unit: str, sy, legend: Sequence[str] = ()) -> list[str]:
    out = [f'<text class="t" x="{LEFT}" y="14">{_esc(title)}</text>']
    out += _legend(legend)[0]
    for v, label in zip(yt, tick_labels(yt, unit)):
        y = sy(v)
        label += "%" if unit == "%" else ""
        cls = "z" if v == 0 else "g"
        out.append(f'<line class="{cls}" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="a" x="{LEFT - 4}" y="{y + 3.5:.1f}" text-anchor="end">{label}</text>')
    return out


#: above this many steps a curve is a line without a dot (and tooltip) per step
MAX_DOTS = 60


def line_plot(title: str, series: Sequence[tuple[str, Sequence[tuple[int, float]]]], unit: str = "",
              note: str = "") -> str:
    """One plot across steps: ``series`` is ``[(label, [(step, value), ...]), ...]`` (up to
    four: more are left out); ``unit="%"`` for fractions. Non-finite values are left out.
    The legend wraps onto more lines rather than run past the plot; above
    :data:`MAX_DOTS` steps the points have no dot of their own. ``note`` goes under the
    x axis (``mean of 5 steps per point``). Returns ``""`` when there is nothing to draw."""
    series = [(label, [(x, float(y)) for x, y in pts if y is not None and math.isfinite(y)])
              for label, pts in series[:MAX_SERIES]]
    series = [(label, pts) for label, pts in series if pts]
    if not series:
        return ""
    steps = sorted({x for _, pts in series for x, _ in pts})
    values = [y for _, pts in series for _, y in pts]
    yt = ticks(min(values), max(values) if unit != "%" else max(max(values), 0.0))
    y0, y1 = yt[0], yt[-1]
    legend = [label for label, _ in series] if len(series) > 1 else []
    if len(steps) == 1 and legend:  # one step: the values go in the legend (labels at one x would collide)
        legend = [f"{label} {fmt_number(pts[0][1], unit)}" for label, pts in series]
    top = TOP + LEGEND * _legend(legend)[1]

    def sy(v: float) -> float:
        return top + (y1 - v) / (y1 - y0) * (H - top - BOTTOM)

    x0, x1 = steps[0], steps[-1]

    def sx(s: float) -> float:
        if x1 == x0:  # one step: one point in the middle, over its own label
            return (LEFT + W - RIGHT) / 2
        return LEFT + 8 + (s - x0) / (x1 - x0) * (W - RIGHT - LEFT - 16)

    out = [f'<svg class="plot" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{_esc(title)}">']
    out += _frame(title, yt, unit, sy, legend)
    labelled = steps if len(steps) <= 12 else sorted({round(t) for t in ticks(0, x1 - x0, 5)
                                                      if 0 <= t <= x1 - x0} | {0, x1 - x0})
    if len(steps) > 12:
        labelled = [x0 + t for t in labelled]
    for s in labelled:
        out.append(f'<text class="a" x="{sx(s):.1f}" y="{H - 12}" text-anchor="middle">{s:,}</text>')
    out.append(f'<text class="a" x="{W - RIGHT}" y="{H - 1}" text-anchor="end">step</text>')
    if note:
        out.append(f'<text class="a" x="{LEFT}" y="{H - 1}">{_esc(note)}</text>')
    dots = len(steps) <= MAX_DOTS
    for i, (label, pts) in enumerate(series):
        pts = sorted(pts)
        if len(pts) > 1:
            line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            tip = "" if dots else (f"<title>{_esc(label)}: {len(pts)} steps, last (step {pts[-1][0]}) "
                                   f"{_esc(fmt_number(pts[-1][1], unit))}</title>")
            out.append(f'<polyline class="s{i}" fill="none" points="{line}">{tip}</polyline>')
        for x, y in pts if dots or len(pts) == 1 else ():
            tip = f"{label}: step {x}: {fmt_number(y, unit)}" if len(series) > 1 else f"step {x}: {fmt_number(y, unit)}"
            out.append(f'<circle class="s{i}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3"><title>{_esc(tip)}</title>'
                       f'</circle>')
        if len(steps) == 1 and len(series) == 1:  # a single point: say its value next to it, under the title
            x, y = pts[0]
            out.append(f'<text class="v" x="{sx(x) + 6:.1f}" y="{max(top + 10, sy(y) - 6):.1f}">'
                       f'{fmt_number(y, unit)}</text>')
    out.append("</svg>")
    return "".join(out)


def histogram(title: str, values: Sequence[float]) -> str:
    """The distribution of one step's values: a bar per distinct value when there are at
    most 12 (rewards of 0 and 1: two bars labelled 0 and 1), else up to 20 equal-width bins
    labelled by their edges. Counts on the y axis from 0. Non-finite values are left out
    (the caller says how many). ``""`` when there is no value."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    distinct = Counter(vals)
    if len(distinct) <= MAX_CATEGORIES:
        return histogram_bars(title, [(v, None, c) for v, c in sorted(distinct.items())])
    lo, hi = min(vals), max(vals)
    nbins = min(MAX_BINS, max(2, math.ceil(math.sqrt(len(vals)))))
    width = (hi - lo) / nbins
    counts = [0] * nbins
    for v in vals:
        counts[min(nbins - 1, int((v - lo) / width))] += 1
    return histogram_bars(title, [(lo + i * width, lo + (i + 1) * width if i < nbins - 1 else hi, c)
                                  for i, c in enumerate(counts)])


def histogram_bars(title: str, bars: Sequence[tuple[float, float | None, int]],
                   links: Sequence[str | None] | None = None) -> str:
    """A histogram of counted bars: ``(value, None, count)`` per distinct value, or
    ``(low, high, count)`` per bin (the last bin includes ``high``), as :func:`histogram`
    and ``rtrace.report.queries.histograms`` count them. ``links``: a URL per bar (a click
    filters the table to that bar). ``""`` when there is no bar."""
    if not bars:
        return ""
    binned = bars[0][1] is not None
    drawn = []
    for i, (low, high, count) in enumerate(bars):
        if not binned:
            drawn.append((fmt_number(low), count, f"{fmt_number(low)}: {count}"))
        else:
            close = "]" if i == len(bars) - 1 else ")"
            drawn.append(("", count, f"[{fmt_number(low)}, {fmt_number(high)}{close}: {count}"))
    lo_edge, hi_edge = bars[0][0], bars[-1][1] if binned else bars[-1][0]
    mid = (lo_edge + hi_edge) / 2
    if abs(mid) < 1e-9 * abs(hi_edge - lo_edge):  # -1.2e-7 between -2.6 and 2.6 is 0, rounding apart
        mid = 0.0
    edges = [] if not binned else [fmt_number(lo_edge), fmt_number(mid), fmt_number(hi_edge)]
    # headroom over the tallest bar: its count is written above it, never over the title
    top_count = max(c for _, c, _ in drawn)
    yt = [t for t in ticks(0, top_count * 1.1 if top_count >= 4 else top_count + 1, 4) if t == int(t)] or [0, 1]
    y1 = yt[-1] or 1

    def sy(v: float) -> float:
        return TOP + (y1 - v) / y1 * (H - TOP - BOTTOM)

    out = [f'<svg class="plot" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{_esc(title)}">']
    out += _frame(title, yt, "", sy)
    span = W - RIGHT - LEFT
    slot = span / len(drawn)
    gap = 0.15 * slot if not edges else 1.0
    for i, (label, count, tip) in enumerate(drawn):
        x, y = LEFT + i * slot + gap / 2, sy(count)
        rect = (f'<rect class="b" x="{x:.1f}" y="{y:.1f}" width="{slot - gap:.1f}" height="{sy(0) - y:.1f}">'
                f'<title>{_esc(tip)}</title></rect>')
        link = links[i] if links is not None else None
        if link and count:  # the whole slot is the target, not only the bar (a short bar is hard to hit)
            rect = (f'<a href="{_esc(link)}" class="bar" data-bar="{i}"><rect class="hit" x="{LEFT + i * slot:.1f}" '
                    f'y="{TOP}" width="{slot:.1f}" height="{sy(0) - TOP:.1f}"/>{rect}</a>')
        out.append(rect)
        if label:
            out.append(f'<text class="a" x="{x + (slot - gap) / 2:.1f}" y="{H - 12}" text-anchor="middle">'
                       f'{_esc(label)}</text>')
        label_count = f"{count:,}"
        if count and 5.6 * len(label_count) <= slot + 2:  # a count wider than its bar is left to the tooltip
            out.append(f'<text class="v" x="{x + (slot - gap) / 2:.1f}" y="{max(TOP - 2, y - 2):.1f}" '
                       f'text-anchor="middle">{label_count}</text>')
    for label, anchor, x in zip(edges, ("start", "middle", "end"), (LEFT, LEFT + span / 2, W - RIGHT)):
        out.append(f'<text class="a" x="{x:.1f}" y="{H - 12}" text-anchor="{anchor}">{_esc(label)}</text>')
    out.append("</svg>")
    return "".join(out)
