"""``rtrace report PATH.jsonl [...]``: the per-step metrics of JSONL files, as a table or
one static HTML page.

The same statistics as the step metrics the sinks receive (``rtrace.pipeline.metrics``,
docs/metrics.md), computed over every trajectory of the files (several files, e.g. one
per worker, merge exactly). For people who only have the JSONL file: a step at a glance.
"""

from __future__ import annotations

import html
import math
from typing import Iterable, Sequence, TextIO

from .exporters.jsonl import read_jsonl
from .pipeline.metrics import StepStats
from .trajectory import Trajectory

__all__ = ["step_table", "write_report", "COLUMNS"]

#: The table's columns: (header, metric name after the prefix, format).
COLUMNS = (
    ("step", None, "{}"),
    ("n", "trajectories", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("± std", "reward_std", "{:.3f}"),
    ("min", "reward_min", "{:.3f}"),
    ("max", "reward_max", "{:.3f}"),
    ("0-var groups", "zero_variance_groups_frac", "{:.0%}"),
    ("turns", "turns_mean", "{:.2f}"),
    ("tools", "tool_calls_mean", "{:.2f}"),
    ("tok in", "tokens_in_mean", "{:.0f}"),
    ("tok out", "tokens_out_mean", "{:.0f}"),
    ("err", "error_rate", "{:.0%}"),
    ("trunc", "truncated_rate", "{:.0%}"),
    ("p50 ms", "latency_ms_p50", "{:.1f}"),
    ("p90 ms", "latency_ms_p90", "{:.1f}"),
    ("max ms", "latency_ms_max", "{:.1f}"),
    ("gen", "time_generation_frac", "{:.0%}"),
    ("tool", "time_tool_frac", "{:.0%}"),
)


def step_table(trajectories: Iterable[Trajectory]) -> list[tuple[bool, int, dict[str, float], str | None]]:
    """``(validate, step, metrics without prefix, slowest trace id)`` per step, in order."""
    stats: dict[tuple[bool, int], StepStats] = {}
    for traj in trajectories:
        if isinstance(traj.step, int) and not isinstance(traj.step, bool):
            stats.setdefault((traj.validate, traj.step), StepStats()).add(traj)
    rows = []
    for (validate, step), st in sorted(stats.items()):
        values = {k.split("/", 1)[1]: v for k, v in st.values("x").items()}
        rows.append((validate, step, values, st.slowest[1] or None))
    return rows


def _cell(values: dict[str, float], name: str | None, fmt: str, step: int) -> str:
    if name is None:
        return str(step)
    value = values.get(name)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def format_table(rows: Sequence[tuple[bool, int, dict[str, float], str | None]]) -> str:
    """The rows as a fixed-width text table (training first, then validation)."""
    out: list[str] = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        out.append("validation" if validate else "training")
        cells = [[h for h, _, _ in COLUMNS] + ["slowest trace"]]
        for _, step, values, slowest in part:
            cells.append([_cell(values, name, fmt, step) for _, name, fmt in COLUMNS] + [slowest or "-"])
        widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
        for row in cells:
            out.append("  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip())
        out.append("")
    return "\n".join(out)


def _svg(points: list[tuple[int, float]], title: str, width: int = 320, height: int = 140) -> str:
    """A small line plot as inline SVG (no JavaScript, no dependency)."""
    pts = [(x, y) for x, y in points if isinstance(y, float) and math.isfinite(y)]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    pad = 28

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)

    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5"/>' for x, y in pts)
    return (f'<figure><svg width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">'
            f'<polyline fill="none" stroke="#3b6ea5" stroke-width="2" points="{line}"/>'
            f'<g fill="#3b6ea5">{dots}</g>'
            f'<text x="{pad}" y="14" font-size="11">{html.escape(title)}</text>'
            f'<text x="2" y="{sy(y1) + 4:.0f}" font-size="9">{y1:.3g}</text>'
            f'<text x="2" y="{sy(y0) + 4:.0f}" font-size="9">{y0:.3g}</text>'
            f'<text x="{sx(x0):.0f}" y="{height - 8}" font-size="9">step {x0}</text>'
            f'<text x="{sx(x1) - 30:.0f}" y="{height - 8}" font-size="9">step {x1}</text>'
            f"</svg></figure>")


def write_report(paths: Sequence[str], out: TextIO, html_path: str | None = None) -> int:
    """Print the per-step table of the JSONL ``paths``; with ``html_path``, also write one
    static HTML page with the tables and plots. Returns the number of trajectories read."""
    trajectories: list[Trajectory] = []
    for path in paths:
        trajectories.extend(read_jsonl(path))
    rows = step_table(trajectories)
    out.write(f"{len(trajectories)} trajectories from {len(paths)} file(s)\n\n")
    out.write(format_table(rows) + "\n")
    if html_path:
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(_html(rows, len(trajectories), paths))
        out.write(f"wrote {html_path}\n")
    return len(trajectories)


def _html(rows: Sequence[tuple[bool, int, dict[str, float], str | None]], n: int, paths: Sequence[str]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>rtrace report</title><style>"
             "body{font:14px system-ui,sans-serif;margin:24px}table{border-collapse:collapse;margin:8px 0 24px}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
             "figure{display:inline-block;margin:4px}code{font-size:12px}</style></head><body>",
             f"<h1>rtrace report</h1><p>{n} trajectories from {', '.join(html.escape(p) for p in paths)}</p>"]
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        parts.append(f"<h2>{'validation' if validate else 'training'}</h2><table><tr>")
        parts.extend(f"<th>{html.escape(h)}</th>" for h, _, _ in COLUMNS)
        parts.append("<th>slowest trace</th></tr>")
        for _, step, values, slowest in part:
            parts.append("<tr>" + "".join(f"<td>{html.escape(_cell(values, name, fmt, step))}</td>"
                                          for _, name, fmt in COLUMNS))
            parts.append(f"<td><code>{html.escape(slowest or '-')}</code></td></tr>")
        parts.append("</table>")
        for title, name in (("reward mean", "reward_mean"), ("latency p90 (ms)", "latency_ms_p90"),
                            ("turns per trajectory", "turns_mean"), ("error rate", "error_rate")):
            parts.append(_svg([(step, values.get(name, math.nan)) for _, step, values, _ in part], title))
    parts.append("</body></html>\n")
    return "".join(parts)
