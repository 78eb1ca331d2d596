"""The run-wide views as HTML fragments, shared by ``rtrace serve`` and ``rtrace report --html``.

Each function draws data that :mod:`rtrace.report.queries` computed; every text goes
through :func:`~rtrace.report.markup.h` (escaped), the plots are :mod:`rtrace.report.plots`'
SVG. Where a view links (a sort, a filter, a histogram bar, a rollout) it asks a
:class:`Links`: the server's links re-run the query, the static page's go to its own
step viewer (``#trace=...``) or are left out (a snapshot does not re-query).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Sequence

from . import plots
from .markup import Raw, h, join, query_string
from .queries import FAILURE_REASONS, OP_TEXT, Column, Filter, TableState

__all__ = ["Links", "StaticLinks", "ServeLinks", "rollouts_section", "histogram_strip", "steps_table", "run_curves",
           "prompt_list_section", "prompt_section", "failures_section", "mismatch_section", "reasons",
           "fmt", "RUN_PLOTS", "step_key", "parse_step_key", "downsample"]

#: (title, [(series label, metric)], unit) of the curves across steps (the step table's metrics)
RUN_PLOTS = (
    ("reward mean", [("mean", "reward_mean")], ""),
    ("zero-variance groups", [("groups", "zero_variance_groups_frac")], "%"),
    ("errors, truncations, partial", [("error", "error_rate"), ("truncated", "truncated_rate"),
                                      ("partial", "partial_rate")], "%"),
    ("latency (ms)", [("p50", "latency_ms_p50"), ("p90", "latency_ms_p90"), ("max", "latency_ms_max")], ""),
    ("per trajectory", [("turns", "turns_mean"), ("tool calls", "tool_calls_mean")], ""),
    ("tokens out per trajectory", [("tokens", "tokens_out_mean")], ""),
    ("advantage", [("mean", "advantage_mean"), ("std", "advantage_std")], ""),
    ("staleness (step − policy version)", [("mean", "staleness_mean"), ("max", "staleness_max")], ""),
    ("time per rollout (ms)", [("generation", "generation_ms_mean"), ("tools", "tool_ms_mean"),
                               ("waiting", "wait_ms_mean")], ""),
)
#: curves drawn from :func:`rtrace.report.queries.step_extras` when the run has them
EXTRA_PLOTS = (
    ("pass rate", [("pass", "pass_rate")], "%"),
    ("train-inference mismatch (k3)", [("k3", "mismatch_k3")], ""),
)
#: a curve has at most this many points; more steps are averaged in consecutive buckets
MAX_POINTS = 240


def step_key(validate: bool, step: int | None) -> str:
    """``t3`` / ``v3`` / ``t-``: a step's name in links (the static page's too)."""
    return f"{'v' if validate else 't'}{'-' if step is None else step}"


def parse_step_key(key: str) -> tuple[bool, int | None] | None:
    m = re.fullmatch(r"([tv])(-|-?\d{1,18})", key)
    if m is None:
        return None
    return m.group(1) == "v", None if m.group(2) == "-" else int(m.group(2))


def fmt(value: Any, kind: str = "float") -> str:
    """A cell's text: numbers in plain notation (:func:`rtrace.report.plots.fmt_number`),
    ``–`` for nothing, ``yes`` / ``no``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return plots.fmt_number(round(value, 1) if kind == "ms" and abs(value) >= 10 else value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# ----------------------------------------------------------------------------- links
class Links:
    """Where a view's links go. ``None`` means "no link" (a static snapshot cannot re-query)."""

    live = False

    def rollouts(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return None

    def rollout(self, trace_id: str) -> str:
        raise NotImplementedError

    def step(self, validate: bool, step: int | None) -> str | None:
        return None

    def prompt(self, key: str) -> str | None:
        return None

    def prompts(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return None

    def failures(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return None


class StaticLinks(Links):
    """The page ``rtrace report --html`` writes: its own step viewer, by the address's hash."""

    def rollout(self, trace_id: str) -> str:
        return f"#trace={trace_id}"

    def step(self, validate: bool, step: int | None) -> str | None:
        return f"#step={step_key(validate, step)}"

    def prompt(self, key: str) -> str | None:
        return "#" + query_string([("tab", "prompts"), ("prompt", key)])[1:]


class ServeLinks(Links):
    """``rtrace serve``: every link is a query on the server (``base`` = ``/run/<name>``)."""

    live = True

    def __init__(self, base: str) -> None:
        self.base = base

    def rollouts(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return f"{self.base}/rollouts{query_string(params)}"

    def rollout(self, trace_id: str) -> str:
        return f"{self.base}/rollout/{trace_id}"

    def step(self, validate: bool, step: int | None) -> str | None:
        return f"{self.base}/step/{step_key(validate, step)}"

    def prompt(self, key: str) -> str | None:
        return f"{self.base}/prompt{query_string([('key', key)])}"

    def prompts(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return f"{self.base}/prompts{query_string(params)}"

    def failures(self, params: Sequence[tuple[str, Any]]) -> str | None:
        return f"{self.base}/failures{query_string(params)}"


def _a(href: str | None, *children: Any, **attrs: Any) -> Raw:
    """A link, or its text alone when there is nowhere to go."""
    if href is None:
        return h("span", {k: v for k, v in attrs.items() if k in ("class_", "title")}, *children)
    return h("a", {"href": href, **attrs}, *children)


def _pager(shown_from: int, shown: int, total: int | None, prev_href: str | None, next_href: str | None,
           what: str = "rows") -> Raw:
    if not shown:
        text = f"no {what}"
    else:
        text = f"{what} {shown_from + 1:,}–{shown_from + shown:,}" + (f" of {total:,}" if total is not None else "")
    return h("p", {"class_": "pager"}, h("span", {"class_": "count"}, text),
             " ", _a(prev_href, "← previous", class_="prev") if prev_href else None,
             " ", _a(next_href, "next →", class_="next") if next_href else None)


# ----------------------------------------------------------------------------- the rollouts table
_CATEGORICAL = {"step", "group", "verdict", "finish", "status", "validate", "prompt", "truncated", "pass", "in_sample",
                "policy_version", "rollout", "sample", "turns", "tools"}


def _cell(col: Column, value: Any, state: TableState, links: Links, pin: int | None = None,
          validate: bool = False) -> Raw:
    cls = " ".join(filter(None, ["l" if col.kind in ("text", "id") else None, _pin_class(pin)])) or None
    if col.name == "verdict" and value is not None:
        inner: Any = h("span", {"class_": f"verdict v-{value}"}, value)
    elif col.name == "health":
        inner = h("span", {"class_": "fail"}, value) if value else ("–" if value is None else "")
    elif col.name == "truncated" and value:
        inner = h("span", {"class_": "warn"}, "yes")
    elif col.name == "latency":
        inner = fmt(value, "ms")
    elif col.kind in ("float", "int", "bool"):
        inner = fmt(value)
    elif col.name == "answer" and value:
        inner = h("span", {"class_": "txt"}, value)
    elif col.kind == "text":
        inner = h("span", {"class_": "txt"}, value) if value else "–"
    else:
        inner = "–" if value is None else value
    if col.name in _CATEGORICAL and value is not None and links.live:
        text = value if isinstance(value, str) else ("true" if value is True else "false" if value is False
                                                     else repr(value) if isinstance(value, float) else str(value))
        filters = [f for f in state.filters if f.column != col.name] + [Filter(col.name, "eq", text)]
        inner = h("a", {"href": links.rollouts(state.params(filters=filters, offset=0)), "class_": "f",
                        "title": f"only {col.label} = {text}"}, inner)
    if col.name == "step" and validate:
        inner = join([inner, " ", h("span", {"class_": "vbadge", "title": "a validation rollout"}, "val")])
    return h("td", {"class_": cls, "data_col": col.name}, inner)


def _sort_head(col: Column, state: TableState, links: Links, pin: int | None = None) -> Raw:
    mark = ""
    desc = False
    if state.sort == col.name:
        mark = " ▼" if state.desc else " ▲"
        desc = not state.desc
    elif col.kind in ("float", "int"):
        desc = True  # numbers: largest first on the first click
    href = links.rollouts(state.params(sort=col.name, desc=desc, offset=0))
    cls = " ".join(filter(None, ["l" if col.kind in ("text", "id") else None, _pin_class(pin)])) or None
    return h("th", {"class_": cls, "data_col": col.name, "title": col.doc or None},
             _a(href, col.label + mark, title=f"sort by {col.label}") if href else col.label + mark)


def histogram_strip(hist: dict[str, Any], state: TableState, links: Links) -> Raw:
    """The histograms above the table; with a server, each bar is a link that filters the
    table to it (a range on its column, replacing the column's range filters; an overflow
    bar: the values beyond its edge)."""
    svgs = []
    for name, hd in hist["hist"].items():
        bars = hd["bars"]
        hrefs = under = over = None
        if links.live:
            keep = [f for f in state.filters if f.column != name or f.op not in ("eq", "ge", "gt", "lt", "le")]

            def href(*add: Filter) -> str | None:
                return links.rollouts(state.params(filters=keep + list(add), offset=0))

            hrefs = []
            for i, (low, high, _) in enumerate(bars):
                if high is None:
                    hrefs.append(href(Filter(name, "eq", repr(float(low)))))
                else:
                    hrefs.append(href(Filter(name, "ge", repr(float(low))),
                                      Filter(name, "le" if i == len(bars) - 1 else "lt", repr(float(high)))))
            under = href(Filter(name, "lt", repr(float(hd["under"][1])))) if hd.get("under") else None
            over = href(Filter(name, "gt", repr(float(hd["over"][0])))) if hd.get("over") else None
        svg = plots.histogram_bars(hd["title"], bars, hrefs, hd.get("under"), hd.get("over"), under, over)
        note = f"{hd['missing']:,} without a value" if hd["missing"] else ""
        svgs.append(h("div", {"class_": "hist", "data_hist": name}, Raw(svg) if svg else
                      h("p", {"class_": "muted"}, f"{hd['title']}: no value"),
                      h("div", {"class_": "muted small"}, note) if note else None))
    return h("div", {"class_": "plots hists"}, svgs)


def _shown_value(col: Column | None, text: str) -> str:
    """A filter's value as a chip says it: a number rounded as the table writes numbers
    (``1.11``, not ``1.1100249999999998``; the exact value is the chip's tooltip)."""
    if col is None or col.kind not in ("float", "int"):
        return text
    try:
        value = float(text)
    except ValueError:
        return text
    return plots.fmt_number(value) if math.isfinite(value) else text


def _chips(state: TableState, columns: Sequence[Column], links: Links) -> Raw:
    by_name = {c.name: c for c in columns}
    chips = []
    for f in state.filters:
        rest = [g for g in state.filters if g is not f]
        col = by_name.get(f.column)
        value = "" if f.op in ("null", "notnull") else " " + _shown_value(col, f.value)
        text = f"{col.label if col else f.column} {OP_TEXT[f.op]}{value}"
        exact = f"{f.column} {OP_TEXT[f.op]} {f.value}" if value.strip() != f.value else None
        chips.append(h("span", {"class_": "chip on", "data_filter": f.param, "title": exact}, text, " ",
                       _a(links.rollouts(state.params(filters=rest, offset=0)), "×", class_="x",
                          title="remove this filter")))
    if state.q:
        chips.append(h("span", {"class_": "chip on", "data_filter": "q"}, f"text contains “{state.q}”", " ",
                       _a(links.rollouts(state.params(q="", offset=0)), "×", class_="x", title="remove the search")))
    if len(chips) > 1:
        chips.append(_a(links.rollouts([("_split", state.split)] + ([("_col", ",".join(state.shown))]
                                                                  if state.shown is not None else [])),
                        "clear all", class_="chip"))
    return h("div", {"class_": "chips", "id": "filters"}, chips) if chips else Raw("")


def _hidden(pairs: Iterable[tuple[str, Any]], skip: Sequence[str]) -> list[Raw]:
    return [h("input", {"type": "hidden", "name": k, "value": v}) for k, v in pairs
            if v is not None and v != "" and k not in skip]


def _forms(state: TableState, columns: Sequence[Column], links: Links) -> Raw:
    """Search, a filter on any column, and the column chooser: plain GET forms (they work
    without the page's script, which only submits the chooser on a click)."""
    pairs = state.params(offset=0)
    search = h("form", {"class_": "search", "method": "get", "action": "", "role": "search"},
               h("input", {"type": "search", "name": "q", "value": state.q, "placeholder": "search prompts and answers",
                           "aria_label": "search prompts and answers"}),
               _hidden(pairs, ("q",)), h("button", {"type": "submit"}, "search"))
    options = [h("option", {"value": c.name}, c.label) for c in columns]
    ops = [h("option", {"value": op}, text) for op, text in OP_TEXT.items()]
    filt = h("form", {"class_": "filter", "method": "get", "action": ""},
             h("select", {"name": "_f", "aria_label": "column"}, options),
             h("select", {"name": "_op", "aria_label": "comparison"}, ops),
             h("input", {"name": "_v", "placeholder": "value", "aria_label": "value", "size": "12"}),
             _hidden(pairs, ()), h("button", {"type": "submit"}, "filter"))
    shown = {c.name for c in columns if (c.shown if state.shown is None else c.name in state.shown)}
    boxes = [h("label", None, h("input", {"type": "checkbox", "name": "_c", "value": c.name,
                                          "checked": c.name in shown}), " ", c.label) for c in columns]
    chooser = h("details", {"class_": "cols"}, h("summary", None, f"columns ({len(shown)} of {len(columns)})"),
                h("form", {"method": "get", "action": "", "id": "colform"}, h("div", {"class_": "boxes"}, boxes),
                  _hidden(pairs, ("_col",)), h("input", {"type": "hidden", "name": "_c", "value": ""}),
                  h("button", {"type": "submit"}, "show these columns")))
    return h("div", {"class_": "tools"}, search, filt, chooser)


#: the widths (px) of the columns the table keeps in view when it scrolls sideways: its first
#: (the rollout's link) and the key columns (:data:`rtrace.report.queries.PINNED`) as they lead
#: the shown ones; the table's style gives each its width and offset (report.css: ``.pin``)
PIN_WIDTHS = {"": 86, "step": 88, "group": 110, "rollout": 44, "verdict": 94, "reward": 76}


def _pin_class(pin: int | None) -> str | None:
    return None if pin is None else f"pin c{pin}"


def _pins(shown: Sequence[Column]) -> tuple[dict[str, int], str]:
    """Which shown columns are pinned (name -> position after the link's 0) and the table's
    style: each position's width and left offset as CSS variables (``--w1``, ``--l1`` ...)."""
    from .queries import PINNED

    names = [""]
    for c in shown:
        if c.name not in PINNED:
            break
        names.append(c.name)
    style, left = [], 0
    for i, name in enumerate(names):
        style.append(f"--l{i}:{left}px;--w{i}:{PIN_WIDTHS[name]}px")
        left += PIN_WIDTHS[name]
    return {n: i for i, n in enumerate(names) if n}, ";".join(style)


def _split_switch(state: TableState, counts: dict[str, int] | None, links: Links) -> Raw:
    """Training, validation or both: the table's rows (``_split``), training by default."""
    from .queries import SPLITS

    current = state.rows_of
    items = []
    for name, (words, _) in SPLITS.items():
        n = (counts or {}).get(name)
        label = words + (f" {n:,}" if n is not None else "")
        items.append(_a(links.rollouts(state.params(split=name, offset=0)), label,
                        class_="chip" + (" on" if name == current else ""), data_split=name,
                        aria_current="true" if name == current else None))
    return h("nav", {"class_": "chips splits", "id": "split", "aria_label": "training or validation rollouts"},
             h("span", {"class_": "muted"}, "rollouts: "), items)


def rollouts_section(result: dict[str, Any], hist: dict[str, Any], state: TableState, columns: Sequence[Column],
                     links: Links, note: str = "", split_counts: dict[str, int] | None = None) -> Raw:
    """The run-wide table: the training / validation switch, search, filters, column chooser,
    histograms whose bars filter, sortable headers, a page of rows (each a link to its
    rollout; a validation rollout marked ``val``), a pager. The rollout's link and the key
    columns stay in view when the table scrolls sideways. ``split_counts``: the rollouts of
    each split (``train``, ``val``, ``all``), said on the switch."""
    total = hist["total"]
    shown: list[Column] = result["columns"]
    pins, pin_style = _pins(shown)
    head = [h("th", {"class_": "l pin c0"}, "rollout")] + [_sort_head(c, state, links, pins.get(c.name)) for c in shown]
    body = []
    for row in result["rows"]:
        passed = row["pass"]
        cls = f"r-{row['verdict']} " + ("row-pass" if passed is True else "row-fail" if passed is False else "row-unk")
        if row.get("validate"):
            cls += " row-val"
        body.append(h("tr", {"class_": cls, "data_trace": row["trace_id"]},
                      h("td", {"class_": "l pin c0"}, h("a", {"class_": "tid", "href": links.rollout(row["trace_id"]),
                                                              "title": row["trace_id"]}, row["trace_id"][:8])),
                      [_cell(c, row["cells"].get(c.name), state, links, pins.get(c.name), bool(row.get("validate")))
                       for c in shown]))
    prev_href = next_href = None
    if links.live:
        if state.offset:
            prev_href = links.rollouts(state.params(offset=max(0, state.offset - state.size)))
        if result["more"]:
            next_href = links.rollouts(state.params(offset=state.offset + state.size))
    problems = [h("p", {"class_": "note problem"}, p) for p in state.problems]
    return h("section", {"id": "rollouts", "aria_label": "every rollout", "data_split": state.rows_of},
             _split_switch(state, split_counts, links) if links.live else None,
             _forms(state, columns, links) if links.live else None, problems, _chips(state, columns, links),
             h("p", {"class_": "muted"}, note) if note else None,
             histogram_strip(hist, state, links),
             _pager(state.offset, len(result["rows"]), total, prev_href, next_href, "rollouts"),
             h("div", {"class_": "scroll", "id": "table-scroll"},
               h("table", {"class_": "rollouts", "style": pin_style}, h("thead", None, h("tr", None, head)),
                 h("tbody", None, body))),
             _pager(state.offset, len(result["rows"]), total, prev_href, next_href, "rollouts") if len(body) > 20
             else None)


# ----------------------------------------------------------------------------- steps
#: the step table's columns: (header, metric, format), as ``rtrace report`` prints them
def _step_columns() -> Sequence[tuple[str, str | None, str]]:
    from .table import COLUMNS

    return COLUMNS


def steps_table(rows: Sequence[Any], links: Links, first: int = 0, size: int | None = None,
                prev_href: str | None = None, next_href: str | None = None, newest_first: bool = False) -> Raw:
    """The per-step table (``rtrace report``'s), one table per split; each row links to its
    step; the slowest trace id links to its rollout. ``rows``: :data:`rtrace.report.table.Row`
    (steps ascending). ``newest_first``: the newest step on top (and ``first`` counts from it),
    as ``rtrace serve`` lists a run that is still being written."""
    from .table import cell

    cols = _step_columns()
    out = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        if newest_first:
            part = part[::-1]
        total = len(part)
        if size is not None and not validate:
            part = part[first: first + size]
        trs = []
        for _, step, values, slowest in part:
            key = step_key(validate, step)
            href = links.step(validate, step)
            tds = [h("td", None, _a(href, str(step)) if href and name is None else cell(values, name, fmt_, step))
                   for _, name, fmt_ in cols]
            link = h("a", {"class_": "tid", "href": links.rollout(slowest)}, slowest) if slowest else "-"
            trs.append(h("tr", {"data_step": key, "title": f"open {key}"}, tds, h("td", None, link)))
        table = h("div", {"class_": "scroll"}, h("table", {"class_": "run"}, h("thead", None, h("tr", None, [
            h("th", None, header) for header, _, _ in cols], h("th", None, "slowest trace"))), h("tbody", None, trs)))
        pager = None
        if size is not None and not validate and total > size:
            pager = _pager(first, len(part), total, prev_href, next_href, "steps")
        out.append(h("h2", None, "validation" if validate else "training"))
        out += [pager, table]
    return join(out)


def downsample(points: Sequence[tuple[int, float]], max_points: int = MAX_POINTS) -> tuple[list[tuple[int, float]], int]:
    """At most ``max_points`` points: consecutive steps averaged in buckets of ``k``
    (returned, 1 when nothing was averaged); each point at its bucket's first step."""
    pts = sorted((x, y) for x, y in points if y is not None and math.isfinite(y))
    if len(pts) <= max_points:
        return pts, 1
    k = math.ceil(len(pts) / max_points)
    return [(pts[i][0], sum(y for _, y in pts[i: i + k]) / len(pts[i: i + k])) for i in range(0, len(pts), k)], k


def run_curves(rows: Sequence[Any], extras: dict[tuple[bool, int], dict[str, float]] | None = None,
               rates: dict[tuple[bool, int], dict[str, float]] | None = None, validate: bool = False,
               compare: Sequence[tuple[str, Sequence[Any], dict | None]] = (), components: Iterable[str] | None = None
               ) -> Raw:
    """The curves across steps: the step table's metrics, the pass rate, each reward
    component (an outcome key's mean), the train-inference mismatch, the health rates.
    ``compare``: ``[(run name, rows, extras), ...]`` draws each metric once per run instead.
    ``components``: the outcome keys drawn (``outcome.<key>``; the keys most rollouts carry:
    :func:`rtrace.report.queries.curve_keys`); None: every one found."""
    runs = list(compare) or [("", rows, extras)]
    plots_out = []

    def metric_points(rs: Sequence[Any], ex: dict | None, metric: str) -> list[tuple[int, float]]:
        if metric in ("pass_rate", "mismatch_k3", "mismatch_frac", "length") or metric.startswith("outcome."):
            return [(s, v[metric]) for (val, s), v in (ex or {}).items() if val == validate and metric in v]
        return [(step, values.get(metric)) for val, step, values, _ in rs if val == validate]

    def draw(title: str, series: list[tuple[str, str]], unit: str) -> None:
        lines, k_max = [], 1
        for run_name, rs, ex in runs:
            for label, metric in series:
                pts, k = downsample(metric_points(rs, ex, metric))
                k_max = max(k_max, k)
                name = f"{run_name}: {label}" if run_name and len(series) > 1 else (run_name or label)
                lines.append((name, pts))
        note = f"mean of {k_max} steps per point" if k_max > 1 else ""
        svg = plots.line_plot(title, lines, unit, note)
        if svg:
            plots_out.append(Raw(svg))

    for title, series, unit in RUN_PLOTS:
        draw(title, list(series), unit)
    for title, series, unit in EXTRA_PLOTS:
        draw(title, list(series), unit)
    found = {k for _, _, ex in runs for v in (ex or {}).values() for k in v if k.startswith("outcome.")}
    for key in sorted(found if components is None else found & set(components)):
        draw(f"{key[len('outcome.'):]} (mean)", [(key[len("outcome."):], key)], "")
    if rates and not compare:
        checks = sorted({c for (v, _), r in rates.items() if v == validate for c in r})
        failing = [c for c in checks if any(r.get(c) for (v, _), r in rates.items() if v == validate)]
        if checks:
            shown = (failing or checks)[:plots.MAX_SERIES]
            lines = [(c[len("health/"):-len("_rate")], downsample([(s, r.get(c)) for (v, s), r in rates.items()
                                                                   if v == validate])[0]) for c in shown]
            svg = plots.line_plot("health: trajectories failing", lines, "%")
            if svg:
                plots_out.append(Raw(svg))
    return h("div", {"class_": "plots curves"}, plots_out)


# ----------------------------------------------------------------------------- prompts
def _rate(value: float | None) -> str:
    return "–" if value is None else plots.fmt_number(value, "%")


def prompt_list_section(result: dict[str, Any], links: Links, q: str = "", sort: str = "last", desc: bool = True,
                        offset: int = 0, size: int = 50) -> Raw:
    """Every prompt of the run with its question, the steps it appears at, its pass rate
    and mean reward; sortable, searchable, a page at a time; each a link to the prompt across steps."""
    def params(**changes: Any) -> list[tuple[str, Any]]:
        st = {"q": q, "sort": sort, "desc": desc, "offset": offset, **changes}
        return [("q", st["q"] or None), ("_sort", st["sort"] if st["sort"] != "last" else None),
                ("_desc", "0" if not st["desc"] else None), ("_offset", st["offset"] or None)]

    heads = [("prompt", "prompt id"), ("task", "question"), ("steps", "steps"), ("rollouts", "rollouts"),
             ("pass", "pass rate"), ("reward", "mean reward"), ("last", "steps (first–last)")]
    ths = []
    for key, label in heads:
        if key == "task" or not links.live:
            ths.append(h("th", {"class_": "l" if key in ("prompt", "task") else None}, label))
            continue
        mark = (" ▼" if desc else " ▲") if sort == key else ""
        ths.append(h("th", {"class_": "l" if key == "prompt" else None},
                     _a(links.prompts(params(sort=key, desc=not desc if sort == key else key != "prompt", offset=0)),
                        label + mark)))
    trs = []
    for p in result["prompts"]:
        first, last = p["first_step"], p["last_step"]
        trs.append(h("tr", {"data_prompt": p["prompt"]},
                      h("td", {"class_": "l"}, _a(links.prompt(p["prompt"]), p["prompt"])),
                      h("td", {"class_": "l"}, h("span", {"class_": "txt"}, p["task"] or "–")),
                      h("td", None, fmt(p["steps"])), h("td", None, fmt(p["n"])),
                      h("td", {"class_": "rate"}, _rate(p["pass_rate"])), h("td", None, fmt(p["reward"])),
                      h("td", None, "–" if first is None else f"{first:,}–{last:,}" if first != last else f"{first:,}")))
    search = None
    if links.live:
        search = h("form", {"class_": "search", "method": "get", "action": ""},
                   h("input", {"type": "search", "name": "q", "value": q, "placeholder": "prompt id or question",
                               "aria_label": "search prompts"}), h("button", {"type": "submit"}, "search"))
    prev_href = links.prompts(params(offset=max(0, offset - size))) if offset and links.live else None
    next_href = links.prompts(params(offset=offset + size)) if result["more"] and links.live else None
    recurring = any((p["steps"] or 0) > 1 for p in result["prompts"])
    hint = None if recurring or not result["prompts"] else h(
        "p", {"class_": "unknown"}, "No prompt of this page appears at more than one step: give rollout_context a "
                                   "prompt_id (rollout_context(..., prompt_id=\"gsm8k-17\")) to follow prompts across steps.")
    return h("section", {"id": "prompts"},
             h("p", {"class_": "muted"}, "Every prompt of the run, keyed by extra prompt_id, else group_id, else "
                                        "sample_index (as sample_prompts does). Pass: outcome correct, else reward > 0."),
             search, hint, _pager(offset, len(trs), result["total"], prev_href, next_href, "prompts"),
             h("div", {"class_": "scroll"}, h("table", {"class_": "prompts"}, h("thead", None, h("tr", None, ths)),
                                               h("tbody", None, trs))))


def prompt_section(result: dict[str, Any], links: Links, compare: dict[str, Any] | None = None,
                   names: tuple[str, str] = ("", "")) -> Raw:
    """One prompt across steps: its question, a pass-rate curve, and per step its pass rate,
    mean reward and every answer (coloured by pass, each a link to its rollout). With
    ``compare`` (the same prompt in a second run), the two runs side by side per step."""
    def answers(step: dict[str, Any] | None) -> Raw:
        if step is None:
            return h("span", {"class_": "muted"}, "not at this step")
        return join(h("div", {"class_": "ans"}, h("a", {"class_": "tid " + ("pass" if a["pass"] is True else "fail"
                                                                         if a["pass"] is False else "unk"),
                                                    "href": links.rollout(a["trace_id"]), "title": a["trace_id"]},
                                                  f"r{fmt(a['rollout'])} · {fmt(a['reward'])}"),
                                  " ", h("span", {"class_": "txt"}, a["answer"] if a["answer"] is not None
                                         else "(no answer)")) for a in step["answers"])

    def rate(step: dict[str, Any] | None) -> str:
        if step is None or not step["judged"]:
            return "–"
        return f"{plots.fmt_number(step['passed'] / step['judged'], '%')} ({step['passed']}/{step['judged']})"

    steps_a = {(s["validate"], s["step"]): s for s in result["steps"]}
    steps_b = {(s["validate"], s["step"]): s for s in (compare or {}).get("steps", [])}
    keys = sorted(set(steps_a) | set(steps_b), key=lambda k: (k[0], k[1] is None, k[1] or 0))
    rows = []
    for key in keys:
        a, b = steps_a.get(key), steps_b.get(key)
        label = ("validation step " if key[0] else "step ") + ("–" if key[1] is None else f"{key[1]:,}")
        href = links.step(*key)
        cells = [h("td", {"class_": "l"}, _a(href, label)), h("td", {"class_": "rate"}, rate(a)),
                 h("td", None, fmt(a["reward"]) if a else "–"), h("td", {"class_": "l"}, answers(a))]
        if compare is not None:
            cells += [h("td", {"class_": "rate"}, rate(b)), h("td", None, fmt(b["reward"]) if b else "–"),
                      h("td", {"class_": "l"}, answers(b))]
        rows.append(h("tr", {"data_step": step_key(*key)}, cells))
    heads = [("step", "l"), ("pass rate", None), ("reward", None), ("answers (the end of each)", "l")]
    if compare is not None:
        heads = [("step", "l"), (f"{names[0]}: pass", None), ("reward", None), (f"{names[0]}: answers", "l"),
                 (f"{names[1]}: pass", None), ("reward", None), (f"{names[1]}: answers", "l")]
    series = [(names[0] or "pass", [(s["step"], s["passed"] / s["judged"]) for s in result["steps"]
                                    if not s["validate"] and s["step"] is not None and s["judged"]])]
    if compare is not None:
        series.append((names[1], [(s["step"], s["passed"] / s["judged"]) for s in compare["steps"]
                                  if not s["validate"] and s["step"] is not None and s["judged"]]))
    curve = plots.line_plot("pass rate of this prompt", series, "%")
    return h("section", {"id": "prompt", "data_prompt": result["key"]},
             h("h2", None, f"prompt {result['key']} across steps"),
             h("pre", {"class_": "text task"}, result["task"]) if result.get("task") else None,
             h("div", {"class_": "plots"}, Raw(curve)) if curve else None,
             h("div", {"class_": "scroll"}, h("table", {"class_": "prompt"}, h("thead", None, h("tr", None, [
                 h("th", {"class_": c}, t) for t, c in heads])), h("tbody", None, rows))),
             h("p", {"class_": "muted"}, "More steps than shown: the first 100 are listed.") if result.get("more")
             else None)


# ----------------------------------------------------------------------------- failures
_RETOK = re.compile(r"^turn (\d+): .* first different at (\d+)")


def reasons(row: dict[str, Any], contexts: dict[tuple[str, int], Any] | None = None) -> list[tuple[str, str, Any]]:
    """Why a rollout is listed, in words: ``[(reason key, words, extra markup or None)]``.
    A retokenization finding shows the response's tokens around where they differ (from
    ``contexts``: :func:`retokenization_context` per (trace id, finding index))."""
    out: list[tuple[str, str, Any]] = []
    if row.get("status") == "error":
        out.append(("error", f"error: {row.get('error') or 'the rollout raised'}", None))
    if row.get("partial"):
        out.append(("partial", "partial: the rollout never ended (its root span timed out, or the process stopped "
                               "before it did)", None))
    if row.get("truncated"):
        tokens = row.get("output_tokens")
        out.append(("truncated", "truncated: a generation stopped at the length limit (finish reason length"
                    + (f"; {tokens:,} tokens out in all" if isinstance(tokens, int) else "") + ")", None))
    if row.get("correct") is False:
        expected = row.get("expected")
        out.append(("wrong", "wrong answer" + (f" (expected {expected})" if expected is not None else ""), None))
    reward = row.get("reward")
    if reward is None:
        out.append(("no_reward", "no reward recorded (record_reward, or an annotation reward=...)", None))
    elif reward <= 0 and row.get("correct") is not False:
        out.append(("reward_le_0", f"reward {fmt(reward)} ≤ 0", None))
    for i, finding in enumerate(row.get("health") or ()):
        check, detail = finding.get("check"), finding.get("detail") or ""
        extra = (contexts or {}).get((row.get("trace_id"), i))
        out.append(("health", f"{check}: {detail}" if detail else str(check), extra))
    return out


def retokenization_context(traj: Any, detail: str, around: int = 4) -> Raw | None:
    """For a retokenization finding (``turn T: ... first different at P``): the response
    tokens of turn T around position P as text pieces, the first different one marked, so
    the text that re-encodes differently is shown, not only ids. None when the trajectory
    has no token texts (token2text off) or the finding is not of that form."""
    m = _RETOK.match(detail or "")
    if m is None:
        return None
    turn, pos = int(m.group(1)), int(m.group(2))
    gens = [s for s in traj.spans if s.kind == "generation"]
    if not 0 < turn <= len(gens):
        return None
    tokens = gens[turn - 1].attributes.get("rtrace.response_tokens")
    ids = gens[turn - 1].response_ids or []
    if not isinstance(tokens, list) or not tokens:
        return h("span", {"class_": "muted"}, "(no token texts: tokens are shown with token2text on)")
    lo, hi = max(0, pos - around), min(len(tokens), pos + around + 1)
    pieces = []
    for i in range(lo, hi):
        tid = ids[i] if i < len(ids) else None
        pieces.append(h("span", {"class_": "tk" + (" at" if i == pos else ""),
                                 "title": f"token {i}" + (f" · id {tid}" if tid is not None else "")},
                        _visible(str(tokens[i]))))
    return h("span", {"class_": "retok"}, "tokens ", h("span", {"class_": "pieces"}, pieces),
             f" (token {pos} of turn {turn} is where decoding and encoding again part)")


def _visible(text: str) -> str:
    """A token's text with its whitespace made visible: where one token ends and the next
    begins is the point of the retokenization context."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "→") or "∅"


def failures_section(result: dict[str, Any], links: Links, reason: str | None = None, check: str | None = None,
                     contexts: dict[tuple[str, int], Any] | None = None, offset: int = 0, size: int = 50,
                     step: int | None = None) -> Raw:
    """Failed and unhealthy rollouts, each with why in words, filterable by reason and by
    health check, newest step first."""
    counts = result["counts"]

    def params(**changes: Any) -> list[tuple[str, Any]]:
        st = {"reason": reason, "check": check, "offset": offset, "step": step, **changes}
        return [("reason", st["reason"]), ("check", st["check"]), ("step", st["step"]), ("_offset", st["offset"] or None)]

    chips = [_a(links.failures(params(reason=None, check=None, offset=0)), f"all {counts.get('all_', 0):,}",
                class_="chip" + ("" if reason or check else " on"), data_reason="all")]
    for key, (words, _) in FAILURE_REASONS.items():
        if counts.get(key):
            chips.append(_a(links.failures(params(reason=key, check=None, offset=0)), f"{words} {counts[key]:,}",
                            class_="chip" + (" on" if reason == key else ""), data_reason=key))
    for name, n in result["checks"]:
        chips.append(_a(links.failures(params(check=name, reason=None, offset=0)), f"health: {name} {n:,}",
                        class_="chip" + (" on" if check == name else ""), data_check=name))
    trs = []
    for row in result["rows"]:
        why = reasons(row, contexts)
        href = links.step(bool(row["validate"]), row["step"])
        trs.append(h("tr", {"data_trace": row["trace_id"]},
                     h("td", {"class_": "l"}, h("a", {"class_": "tid", "href": links.rollout(row["trace_id"]),
                                                      "title": row["trace_id"]}, row["trace_id"][:8])),
                     h("td", None, _a(href, step_key(bool(row["validate"]), row["step"]))),
                     h("td", {"class_": "l"}, row["group_key"] or "–"), h("td", None, fmt(row["rollout_n"])),
                     h("td", None, fmt(row["reward"])),
                     h("td", {"class_": "l why"}, [h("div", {"class_": f"reason r-{key}"}, words,
                                                       h("div", None, extra) if extra is not None else None)
                                                   for key, words, extra in why]),
                     h("td", {"class_": "l"}, h("span", {"class_": "txt"}, row["answer"] or "–"))))
    prev_href = links.failures(params(offset=max(0, offset - size))) if offset else None
    next_href = links.failures(params(offset=offset + size)) if result["more"] else None
    return h("section", {"id": "failures"},
             h("p", {"class_": "muted"}, "Rollouts that ended in error, were cut at the length limit, never ended, "
                                        "answered wrong, got a reward ≤ 0 or none, or failed a rollout-health check "
                                        "(docs/health.md): each with why, in words."),
             h("div", {"class_": "chips"}, chips),
             _pager(offset, len(trs), None, prev_href, next_href, "failures"),
             h("div", {"class_": "scroll"}, h("table", {"class_": "failures"}, h("thead", None, h("tr", None, [
                 h("th", {"class_": "l"}, "rollout"), h("th", None, "step"), h("th", {"class_": "l"}, "group"),
                 h("th", None, "n"), h("th", None, "reward"), h("th", {"class_": "l"}, "why"),
                 h("th", {"class_": "l"}, "answer (its end)")])), h("tbody", None, trs))))


def mismatch_section(rows: Sequence[dict[str, Any]], links: Links) -> Raw:
    """The rollouts of a step with the largest train-inference mismatch (docs/token-values.md),
    each a link to its tokens coloured by the mismatch."""
    if not rows:
        return h("p", {"class_": "muted", "id": "mismatch"}, "No train-inference mismatch recorded at this step "
                 "(it needs the sampler's logprob and the trainer's old_logprob per token: docs/token-values.md).")
    trs = [h("tr", {"data_trace": r["trace_id"]},
             h("td", {"class_": "l"}, h("a", {"class_": "tid", "href": links.rollout(r["trace_id"]) +
                                              ("?color=mismatch" if links.live else ""), "title": r["trace_id"]},
                                        r["trace_id"][:8])),
             h("td", {"class_": "l"}, r["group_key"] or "–"), h("td", None, fmt(r["rollout_n"])),
             h("td", None, fmt(r["k3"])), h("td", None, fmt(r["k1"])), h("td", None, fmt(r["max"])),
             h("td", None, _rate(r["frac"])), h("td", None, fmt(r["output_tokens"])), h("td", None, fmt(r["reward"])))
           for r in rows]
    return h("div", {"id": "mismatch"}, h("div", {"class_": "scroll"}, h("table", None, h("thead", None, h("tr", None, [
        h("th", {"class_": "l"}, "rollout"), h("th", {"class_": "l"}, "group"), h("th", None, "n"),
        h("th", None, "k3"), h("th", None, "k1"), h("th", None, "max |Δ|"), h("th", None, "tokens outside ratio"),
        h("th", None, "tokens out"), h("th", None, "reward")])), h("tbody", None, trs))))
