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
from dataclasses import dataclass
from typing import Sequence

from .._serialize import bidi_visible

__all__ = ["ticks", "tick_labels", "fmt_number", "line_plot", "histogram", "histogram_bars", "Grid", "grid", "bins_for",
           "binned", "tail_quantiles", "Plan", "histogram_plan", "count_bars", "TAIL", "REACH"]

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
    """Text of a plot (a title, a legend, a tooltip): escaped, bidirectional controls made visible."""
    return html.escape(bidi_visible(text), quote=True)


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


#: a histogram's bins cover the values from the 1st to the 99th percentile (:data:`TAIL`),
#: stretched to the smallest / largest value when it lies within :data:`REACH` of that range
#: from them; values farther out are counted in an overflow bar at that end, so one
#: 185,200-token answer among 500-token ones is one bar "> 600", not 38,000 rollouts in the
#: first of 20 bins
TAIL, REACH = 0.01, 0.5


@dataclass(frozen=True)
class Grid:
    """Round histogram bins: ``k`` bins of width ``mult`` x 10^``exp`` (``mult`` 1, 2 or 5),
    from edge number ``first`` (the edges are multiples of the width). The SQL of
    :func:`rtrace.report.queries.histograms` chooses the same grid (tests compare them)."""

    first: int
    k: int
    mult: int
    exp: int

    @property
    def width(self) -> float:
        return self.mult * 10.0 ** self.exp

    def edge(self, j: int) -> float:
        """Edge ``j`` (0 .. k): the double nearest its decimal value (``0.3``, never
        ``0.30000000000000004``), so a filter on it reads as it is written."""
        return self.at(self.first + j)

    def at(self, n: int) -> float:
        """The ``n``-th multiple of the width, as :meth:`edge` writes it."""
        n = n * self.mult
        return n / 10.0 ** -self.exp if self.exp < 0 else n * 10.0 ** self.exp

    def bin_of(self, v: float) -> int:
        """The bin of ``v``: 0 .. k-1 (the last includes its high edge), -1 below, k above;
        ``v`` compared with the edges themselves, as a filter ``v >= edge`` compares it
        (``floor(v / width)`` alone puts 0.3 below the edge 0.3: 0.3 / 0.1 is
        2.9999999999999996). The SQL of :func:`rtrace.report.queries.histograms` is this."""
        n = math.floor(v / self.width)
        j = n - self.first + (v >= self.at(n + 1)) - (v < self.at(n)) - (v == self.edge(self.k))
        return min(max(j, -1), self.k)


def bins_for(count: int) -> int:
    """How many bins ``count`` values get (before rounding the width): sqrt, 2 to :data:`MAX_BINS`."""
    return min(MAX_BINS, max(2, math.ceil(math.sqrt(count))))


def grid(low: float, high: float, q_low: float, q_high: float, bins: int, integer: bool = False) -> Grid:
    """The bins for values from ``low`` to ``high`` whose :data:`TAIL` quantiles are
    ``q_low`` / ``q_high``: about ``bins`` bins of a round width (1, 2 or 5 x 10^k; at least
    1 for integers) over the robust range (:data:`REACH`). Each step is written as the SQL
    of :func:`rtrace.report.queries.histograms` computes it, operation for operation."""
    spread = q_high - q_low
    a = low if low >= q_low - REACH * spread else q_low
    b = high if high <= q_high + REACH * spread else q_high
    if b <= a:
        a, b = low, high
    raw = (b - a) / bins
    exp = math.floor(math.log10(raw))
    m = raw / 10.0 ** exp
    mult = 1 if m <= 1 else 2 if m <= 2 else 5 if m <= 5 else 10
    if mult == 10:
        mult, exp = 1, exp + 1
    if integer and exp < 0:
        mult, exp = 1, 0
    g = Grid(0, 1, mult, exp)
    f0, l0 = math.floor(a / g.width), math.ceil(b / g.width)
    first = f0 - (Grid(f0, 1, mult, exp).edge(0) > a) + (Grid(f0, 1, mult, exp).edge(1) <= a)
    last = l0 + (Grid(l0, 1, mult, exp).edge(0) < b) - (Grid(l0 - 1, 1, mult, exp).edge(0) >= b)
    return Grid(first, max(1, last - first), mult, exp)


def tail_quantiles(values: Sequence[float]) -> tuple[float, float]:
    """The :data:`TAIL` quantiles: the sorted values at ``int(q * (n - 1))``."""
    s = sorted(values)
    return s[int(TAIL * (len(s) - 1))], s[int((1 - TAIL) * (len(s) - 1))]


@dataclass(frozen=True)
class Plan:
    """How one histogram counts: a bar per value (``categorical``), else ``grid``'s bins."""

    categorical: bool
    grid: Grid
    low: float
    high: float


def histogram_plan(sample: Sequence[float], low: float, high: float, count: int, integer: bool = False
                   ) -> Plan | None:
    """The histogram of ``count`` values from ``low`` to ``high``, chosen from ``sample`` (all
    of them, or a uniform sample of them: the SQL of :func:`rtrace.report.queries.histograms`
    takes 4,096): a bar per value when the sample has at most :data:`MAX_CATEGORIES`
    distinct values (:func:`count_bars` falls back to the bins when the whole has more),
    else :func:`grid`'s bins from the sample's tail quantiles. None without a value."""
    vals = [float(v) for v in sample if v is not None and math.isfinite(v)]
    if not count or not vals:
        return None
    if low == high:
        return Plan(True, Grid(0, 1, 1, 0), low, high)
    categorical = len(set(vals)) <= MAX_CATEGORIES
    return Plan(categorical, grid(low, high, *tail_quantiles(vals), bins_for(count), integer), low, high)


def count_bars(plan: Plan, counts: dict[float, int]) -> dict:
    """The histogram's ``bars`` / ``under`` / ``over`` / ``categorical`` from ``counts``: per
    value (categorical plans) or per bin (-1: below the bins, k: above). A categorical plan
    whose values turn out more than :data:`MAX_CATEGORIES` is binned on its grid."""
    if plan.categorical and len(counts) <= MAX_CATEGORIES:
        return {"categorical": True, "bars": [(float(x), None, n) for x, n in sorted(counts.items())],
                "under": None, "over": None}
    if plan.categorical:
        per_bin: Counter = Counter()
        for x, n in counts.items():
            per_bin[plan.grid.bin_of(x)] += n
        counts = dict(per_bin)
    bars, under, over = binned(plan.grid, {int(x): n for x, n in counts.items()}, plan.low, plan.high)
    return {"categorical": False, "bars": bars, "under": under, "over": over}


def histogram(title: str, values: Sequence[float]) -> str:
    """The distribution of one step's values: a bar per distinct value when there are at
    most 12 (rewards of 0 and 1: two bars labelled 0 and 1), else up to 20 bins of a round
    width over the robust range (:func:`grid`), with an overflow bar at an end for the values
    beyond it (:func:`histogram_plan`). Counts on the y axis from 0. Non-finite values are
    left out (the caller says how many). ``""`` when there is no value."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    plan = histogram_plan(vals, min(vals, default=0.0), max(vals, default=0.0), len(vals))
    if plan is None:
        return ""
    counts = Counter(vals) if plan.categorical else Counter(plan.grid.bin_of(v) for v in vals)
    drawn = count_bars(plan, dict(counts))
    return histogram_bars(title, drawn["bars"], under=drawn["under"], over=drawn["over"])


def binned(g: Grid, counts: dict[int, int], low: float, high: float
           ) -> tuple[list[tuple[float, float, int]], tuple[float, float, int] | None, tuple[float, float, int] | None]:
    """``(bars, under, over)`` of counts per bin (-1: below, k: above): each bar ``(low edge,
    high edge, count)``; an overflow ``(smallest value, edge, count)`` / ``(edge, largest
    value, count)``, or None when no value is beyond that end."""
    bars = [(g.edge(j), g.edge(j + 1), counts.get(j, 0)) for j in range(g.k)]
    under = (low, g.edge(0), counts[-1]) if counts.get(-1) else None
    over = (g.edge(g.k), high, counts[g.k]) if counts.get(g.k) else None
    return bars, under, over


#: about how wide a character of the plots' 10 px labels is (DejaVu Sans digits: 6.36 px)
CHAR_PX = 6.4


def _place(labels: Sequence[tuple[float, str, str, int]]) -> list[tuple[float, str, str]]:
    """Axis labels ``(x, text, anchor, priority)`` that do not overlap: the most important
    first (lower ``priority``), then each other one only where it leaves 4 px to its neighbours."""
    taken: list[tuple[float, float]] = []
    out = []
    for x, text, anchor, _ in sorted(labels, key=lambda item: item[3]):
        width = CHAR_PX * len(text)
        left = x - width / 2 if anchor == "middle" else x if anchor == "start" else x - width
        right = left + width
        if any(left < r + 4 and right > l - 4 for l, r in taken):
            continue
        taken.append((left, right))
        out.append((x, text, anchor))
    return sorted(out)


def histogram_bars(title: str, bars: Sequence[tuple[float, float | None, int]],
                   links: Sequence[str | None] | None = None, under: Sequence[float] | None = None,
                   over: Sequence[float] | None = None, under_link: str | None = None,
                   over_link: str | None = None) -> str:
    """A histogram of counted bars: ``(value, None, count)`` per distinct value, or
    ``(low, high, count)`` per bin (the last bin includes ``high``), as :func:`histogram`
    and ``rtrace.report.queries.histograms`` count them; ``under`` / ``over``: the overflow
    bars beyond the bins (``(smallest, edge, count)``, ``(edge, largest, count)``), drawn
    apart at each end in another shade. ``links``: a URL per bar (a click filters the table
    to that bar), ``under_link`` / ``over_link`` the overflows'. The x axis has round labels
    that never overlap; a count is written over its bar only where it fits. ``""`` when
    there is no bar."""
    if not bars:
        return ""
    binned_ = bars[0][1] is not None
    slots = []  # (label under the bar or "", count, tooltip, link, overflow)
    if binned_ and under:
        slots.append((f"< {fmt_number(under[1])}", int(under[2]),
                      f"< {fmt_number(under[1])} (from {fmt_number(under[0])}): {int(under[2]):,}", under_link, True))
    for i, (low, high, count) in enumerate(bars):
        link = links[i] if links is not None else None
        if not binned_:
            slots.append((fmt_number(low), count, f"{fmt_number(low)}: {count:,}", link, False))
        else:
            close = "]" if i == len(bars) - 1 else ")"
            slots.append(("", count, f"[{fmt_number(low)}, {fmt_number(high)}{close}: {count:,}", link, False))
    if binned_ and over:
        slots.append((f"> {fmt_number(over[0])}", int(over[2]),
                      f"> {fmt_number(over[0])} (up to {fmt_number(over[1])}): {int(over[2]):,}", over_link, True))
    # headroom over the tallest bar: its count is written above it, never over the title
    top_count = max(c for _, c, _, _, _ in slots)
    yt = [t for t in ticks(0, top_count * 1.1 if top_count >= 4 else top_count + 1, 4) if t == int(t)] or [0, 1]
    y1 = yt[-1] or 1

    def sy(v: float) -> float:
        return TOP + (y1 - v) / y1 * (H - TOP - BOTTOM)

    out = [f'<svg class="plot" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{_esc(title)}">']
    out += _frame(title, yt, "", sy)
    apart = 6.0  # the gap between an overflow bar and the bins
    n_over = sum(1 for s in slots if s[4])
    span = W - RIGHT - LEFT
    slot = (span - apart * n_over) / len(slots)
    gap = 0.15 * slot if not binned_ else 1.0
    labels: list[tuple[float, str, str, int]] = []
    x = float(LEFT)
    lefts = []
    for i, (label, count, tip, link, overflow) in enumerate(slots):
        if overflow and i > 0:
            x += apart
        lefts.append(x)
        bx, y = x + gap / 2, sy(count)
        cls = "b o" if overflow else "b"
        rect = (f'<rect class="{cls}" x="{bx:.1f}" y="{y:.1f}" width="{slot - gap:.1f}" height="{sy(0) - y:.1f}">'
                f'<title>{_esc(tip)}</title></rect>')
        if link and count:  # the whole slot is the target, not only the bar (a short bar is hard to hit)
            rect = (f'<a href="{_esc(link)}" class="bar" data-bar="{i}"><rect class="hit" x="{x:.1f}" '
                    f'y="{TOP}" width="{slot:.1f}" height="{sy(0) - TOP:.1f}"/>{rect}</a>')
        out.append(rect)
        centre = bx + (slot - gap) / 2
        if label:
            anchor = "middle"
            if overflow:  # at the plot's ends: anchored inside it
                anchor, centre_x = ("start", x) if i == 0 else ("end", x + slot)
            else:
                centre_x = centre
            labels.append((centre_x, label, anchor, 0 if overflow else 1))
        text = f"{count:,}"
        if count and CHAR_PX * len(text) + 2 <= slot:  # a count wider than its bar is left to the tooltip
            out.append(f'<text class="v" x="{centre:.1f}" y="{max(TOP - 2, y - 2):.1f}" '
                       f'text-anchor="middle">{text}</text>')
        x += slot
        if overflow and i == 0:
            x += apart
    if binned_:  # round edges at the bins' boundaries: both ends first, then every s-th edge that fits
        first = 1 if under else 0
        k = len(bars)
        widest = max(len(fmt_number(b[0])) for b in bars) * CHAR_PX + 8
        every = next(s for s in (1, 2, 5, 10, 20, 50) if (k // s + 1) * widest <= span or s == 50)
        for j in range(k + 1):
            edge = bars[j][0] if j < k else bars[-1][1]
            at = lefts[first + j] if j < k else lefts[first + k - 1] + slot
            anchor = "end" if j == k and not over else "middle"  # the plot's right margin is narrow
            labels.append((at, fmt_number(edge), anchor, 2 if j in (0, k) else 3 if j % every == 0 else 9))
        labels = [lab for lab in labels if lab[3] != 9]
    for lx, text, anchor in _place(labels):
        out.append(f'<text class="a" x="{lx:.1f}" y="{H - 12}" text-anchor="{anchor}">{_esc(text)}</text>')
    out.append("</svg>")
    return "".join(out)
