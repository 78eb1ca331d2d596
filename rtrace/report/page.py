"""The HTML page: the static template shipped in this package, the run's table and plots
(static HTML: readable before any script runs), and the page data as one JSON block.

The page is one self-contained file: its stylesheet and script are inlined from
``static/`` (no server, no network, no CDN; it works from ``file://``), the data is one
compressed block (:func:`encode_data`). The script renders the selected step lazily
(docs/report.md).
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
from importlib import resources
from typing import Any, Sequence

from . import plots
from .data import MAX_CHARS, MAX_MESSAGES, page_data
from .health import step_health
from .load import Record
from .table import COLUMNS, Row, cell, step_table

try:
    import orjson
except ImportError:  # pragma: no cover - depends on the installed extras
    orjson = None  # type: ignore[assignment]

__all__ = ["render", "encode_data", "decode_data", "STATIC_FILES"]

#: the files of ``rtrace/report/static`` the page is made of (the wheel must ship them)
STATIC_FILES = ("report.html", "report.css", "report.js")

#: ``<!--NAME-->`` or ``/*NAME*/`` in the template: where render() puts each part
_MARKER = re.compile(r"<!--([A-Z]+)-->|/\*([A-Z]+)\*/")

#: (title, [(series label, metric)], unit) of the plots across steps
RUN_PLOTS = (
    ("reward mean", [("mean", "reward_mean")], ""),
    ("zero-variance groups", [("groups", "zero_variance_groups_frac")], "%"),
    ("errors, truncations, partial", [("error", "error_rate"), ("truncated", "truncated_rate"),
                                      ("partial", "partial_rate")], "%"),
    ("latency (ms)", [("p50", "latency_ms_p50"), ("p90", "latency_ms_p90"), ("max", "latency_ms_max")], ""),
    ("per trajectory", [("turns", "turns_mean"), ("tool calls", "tool_calls_mean")], ""),
    ("tokens out per trajectory", [("tokens", "tokens_out_mean")], ""),
    ("advantage", [("mean", "advantage_mean"), ("std", "advantage_std")], ""),
)


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def encode_data(data: Any) -> str:
    """The page data as the page embeds it: JSON (UTF-8), gzip, base64. Text is most of it
    (answers, conversations), and gzip makes it about 3x smaller; the page decompresses it
    with the browser's own ``DecompressionStream``. Base64 holds no ``<``, so nothing in
    the data can end the ``<script>`` block."""
    if orjson is not None:
        raw = orjson.dumps(data)
    else:  # pragma: no cover
        raw = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def decode_data(text: str) -> Any:
    """The page data back from :func:`encode_data`'s text (for tests and tools)."""
    return json.loads(gzip.decompress(base64.b64decode(text)))


def _run_section(rows: Sequence[Row], health_rates: dict[tuple[bool, int], dict[str, float]]) -> str:
    esc = html.escape
    out = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        out.append(f"<h2>{'validation' if validate else 'training'}</h2><div class='scroll'><table class='run'>"
                   "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h, _, _ in COLUMNS)
                   + "<th>slowest trace</th></tr></thead><tbody>")
        for _, step, values, slowest in part:
            key = f"{'v' if validate else 't'}{step}"
            out.append(f"<tr data-step='{key}' title='open {esc(key)}'>" + "".join(
                f"<td>{esc(cell(values, name, fmt, step))}</td>" for _, name, fmt in COLUMNS))
            link = f"<a class='tid' href='#trace={esc(slowest)}'>{esc(slowest)}</a>" if slowest else "-"
            out.append(f"<td>{link}</td></tr>")
        out.append("</tbody></table></div><div class='plots'>")
        for title, series, unit in RUN_PLOTS:
            out.append(plots.line_plot(title, [(label, [(step, values.get(name)) for _, step, values, _ in part])
                                               for label, name in series], unit))
        checks = sorted({name for (v, _), rates in health_rates.items() if v == validate for name in rates})
        failing = [c for c in checks if any(health_rates.get((validate, s), {}).get(c) for _, s, _, _ in part)]
        if checks:
            shown = (failing or checks)[:plots.MAX_SERIES]
            out.append(plots.line_plot(
                "health: trajectories failing", [(c[len("health/"):-len("_rate")],
                                                  [(s, health_rates.get((validate, s), {}).get(c)) for _, s, _, _ in
                                                   part]) for c in shown], "%"))
        out.append("</div>")
    return "".join(out)


def render(records: Sequence[Record], paths: Sequence[str], notes: Sequence[str] = (), max_chars: int = MAX_CHARS,
           max_messages: int = MAX_MESSAGES) -> str:
    """The whole page for ``records`` read from ``paths``."""
    rows = step_table(r.traj for r in records)
    rates = {(h.validate, h.step): h.rates() for h in step_health(records) if h.step is not None}
    files = ", ".join(str(p) for p in paths)
    summary = f"{len(records):,} trajectories from {len(paths)} file(s): {files}"
    values = {"CSS": _static("report.css"), "TITLE": html.escape(f"rtrace report: {files}"),
              "SUMMARY": html.escape(summary),
              "NOTES": "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes),
              "RUN": _run_section(rows, rates), "JS": _static("report.js"),
              "DATA": encode_data(page_data(records, max_chars, max_messages))}
    # one pass over the template: a value is never searched for markers (the data may hold any text)
    return _MARKER.sub(lambda m: values[m.group(1) or m.group(2)], _static("report.html"))
