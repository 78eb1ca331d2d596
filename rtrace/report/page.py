"""The HTML page: the static template shipped in this package, the run's table and plots
(static HTML: readable before any script runs), and the page data as one JSON block.

The page ``rtrace report --html`` writes is one self-contained file: its stylesheet and
script are inlined from ``static/`` (no server, no network, no CDN; it works from
``file://``), the data is one compressed block (:func:`encode_data`). The script renders
the selected step lazily (docs/report.md). Above it, a snapshot of the run-wide views
``rtrace serve`` shows live (:mod:`rtrace.report.views`, the same code): the rollouts of
every step (newest first), their histograms, and a curve per reward component.

``rtrace serve`` shows a step with the same page and script (:func:`render` with
``live``): stylesheet and script are then files of the server (its content security
policy allows no inline script), and the page holds that step's trajectories only.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

from . import tokens, views
from .data import MAX_CHARS, MAX_MESSAGES, page_data
from .health import step_health
from .load import Record
from .markup import Raw, h, shown
from .table import Row, step_table

try:
    import orjson
except ImportError:  # pragma: no cover - depends on the installed extras
    orjson = None  # type: ignore[assignment]

__all__ = ["render", "encode_data", "decode_data", "STATIC_FILES", "RUN_PLOTS", "Live", "snapshot_db"]

#: the files of ``rtrace/report/static`` the page is made of (the wheel must ship them)
STATIC_FILES = ("report.html", "report.css", "report.js", "tokens.js")

#: ``<!--NAME-->`` or ``/*NAME*/`` in the template: where render() puts each part
_MARKER = re.compile(r"<!--([A-Z0-9]+)-->|/\*([A-Z]+)\*/")

#: (title, [(series label, metric)], unit) of the plots across steps
RUN_PLOTS = views.RUN_PLOTS
#: rows of the run-wide table in the page's snapshot
SNAPSHOT_ROWS = 100


@dataclass
class Live:
    """How ``rtrace serve`` embeds the page: its header, the step's own part, where its files are."""

    #: the run's base URL (``/run/<name>``): the script links a trajectory's full view there
    base: str
    #: the server's header (navigation), escaped HTML
    nav: str
    #: what replaces the run's table: the step's navigation, its mismatch list... (escaped HTML)
    run: str
    #: stylesheet and script URLs
    styles: Sequence[str] = ("/static/report.css", "/static/serve.css")
    scripts: Sequence[str] = ("/static/report.js", "/static/serve.js")
    #: the ``data-*`` attributes of ``<body>`` (the serve script's live updates)
    body: dict[str, str] | None = None


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


def _run_section(rows: Sequence[Row], health_rates: dict[tuple[bool, int], dict[str, float]],
                 extras: dict[tuple[bool, int], dict[str, float]] | None = None,
                 components: set[str] | None = None) -> str:
    links = views.StaticLinks()
    out = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if part:
            out.append(views.steps_table(part, links))
            out.append(views.run_curves(part, extras, health_rates, validate=validate, components=components))
    return "".join(out)


def snapshot_db(records: Sequence[Record]) -> Any:
    """The records' two tables in memory (:func:`rtrace.report.queries.memory_db`), for
    the run-wide snapshot; None without pyarrow and duckdb (the ``parquet`` extra)."""
    try:
        from .queries import memory_db

        return memory_db([r.traj for r in records], spans=False)
    except ImportError:
        return None


def _snapshot(db: Any) -> tuple[str, dict[tuple[bool, int], dict[str, float]], set[str] | None]:
    """The run-wide table of training rollouts (the newest steps first) and its histograms,
    as ``rtrace serve`` draws them; the per-step extras for the curves, and the outcome keys
    drawn as curves (those most rollouts carry)."""
    from . import queries as Q

    if db is None:
        return (str(h("p", {"class_": "note"}, "The run-wide rollouts table needs pyarrow and duckdb: "
                      "pip install 'rtrace[parquet]'")), {}, None)
    _, count = db.rows("SELECT count(*) FROM trajectories")
    columns = Q.columns_of(Q.discover_keys(db), count[0][0])
    state = Q.TableState(size=SNAPSHOT_ROWS)
    result = Q.rollouts(db, state, columns)
    hist = Q.histograms(db, state, columns)
    note = (f"A snapshot: the first {SNAPSHOT_ROWS} of {hist['total']:,} training rollouts, the newest step first "
            "(validation rollouts: in the step viewer below); rtrace serve sorts, filters and searches every step."
            if hist["total"] > SNAPSHOT_ROWS else
            "Every training rollout of the run, the newest step first (validation rollouts: in the step viewer "
            "below; rtrace serve sorts, filters and searches them).")
    section = views.rollouts_section(result, hist, state, columns, views.StaticLinks(), note)
    return (str(h("h2", None, "training rollouts of every step")) + section, Q.step_extras(db),
            Q.curve_keys(columns))


#: rollouts whose tokens the static page colours (the largest train-inference mismatch first)
TOKEN_ROLLOUTS = 5


def _token_section(records: Sequence[Record]) -> str:
    """The rollouts with the largest train-inference mismatch (else the first ones with
    per-token values), each generation's tokens coloured by the mismatch (else its first
    array), with a legend and each token's values in its tooltip: the page a person opens
    from disk shows what ``rtrace serve``'s rollout page shows (docs/token-values.md)."""
    with_values = [r.traj for r in records if any(s.kind == "generation" and s.token_values for s in r.traj.spans)]
    if not with_values:
        return ""

    def k3(t: Any) -> float:
        v = t.annotations.get("logprob_mismatch_k3")
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else -1.0

    chosen = sorted(with_values, key=k3, reverse=True)[:TOKEN_ROLLOUTS]
    parts: list[Any] = [h("h2", None, "tokens: the largest train-inference mismatch" if k3(chosen[0]) >= 0
                          else "tokens"),
                        h("p", {"class_": "note"}, f"{len(chosen)} of {len(with_values):,} rollouts with per-token "
                          "values; rtrace serve shows any rollout and colours by any array.")]
    for t in chosen:
        gens = [s for s in t.spans if s.kind == "generation"]
        names = tokens.available(gens)
        color = tokens.MISMATCH if tokens.MISMATCH in names else tokens.default_color(names)
        scale = tokens.scale_for(color, [v for g in gens for v in tokens.arrays_of(g).get(color or "", [])]) \
            if color else None
        facts = f"step {t.step} · sample {t.sample_index} · rollout {t.rollout_n} · reward {views.fmt(t.reward)}"
        if k3(t) >= 0:
            facts += f" · k3 {views.fmt(k3(t))}"
        parts.append(h("div", {"class_": "token-rollout", "data_trace": t.trace_id},
                       h("h3", None, h("code", {"class_": "tid"}, t.trace_id[:8]), " ", facts),
                       tokens.legend(color, scale) if scale is not None else None,
                       [h("div", {"class_": "turn"}, h("div", {"class_": "muted"}, f"turn {i}"),
                          tokens.overlay(g, color, scale)) for i, g in enumerate(gens, 1)]))
    return str(h("section", {"id": "tokens"}, parts))


def render(records: Sequence[Record], paths: Sequence[str], notes: Sequence[str] = (), max_chars: int = MAX_CHARS,
           max_messages: int = MAX_MESSAGES, db: Any = "auto", live: Live | None = None) -> str:
    """The whole page for ``records`` read from ``paths``. ``db``: the run's tables for
    the run-wide snapshot (a :class:`rtrace.report.queries.Db`; ``"auto"``: built from
    ``records`` in memory; None: left out). ``live``: the page ``rtrace serve`` shows for a step."""
    files = ", ".join(str(p) for p in paths)
    esc = html.escape
    data = encode_data(page_data(records, max_chars, max_messages))
    if live is None:
        rows = step_table(r.traj for r in records)
        rates = {(h_.validate, h_.step): h_.rates() for h_ in step_health(records) if h_.step is not None}
        snapshot, extras, components = (_snapshot(snapshot_db(records) if db == "auto" else db) if db is not None
                                        else ("", {}, None))
        summary = f"{len(records):,} trajectories from {len(paths)} file(s): {files}"
        values = {"STYLE": f"<style>{_static('report.css')}</style>", "BODY": "<body>", "NAV": "",
                  "H1": "<h1>rtrace report</h1>",
                  "RUN": _run_section(rows, rates, extras, components) + snapshot + _token_section(records),
                  "SCRIPT": f"<script>{_static('report.js')}</script><script>{_static('tokens.js')}</script>",
                  "TITLE": shown(f"rtrace report: {files}")}
    else:
        summary = f"{len(records):,} trajectories of {files}"
        body = {"data-base": live.base, **(live.body or {})}
        values = {"STYLE": "".join(str(h("link", {"rel": "stylesheet", "href": u})) for u in live.styles),
                  "BODY": "<body" + "".join(f' {k}="{esc(v)}"' for k, v in body.items()) + ">", "NAV": live.nav,
                  "H1": "", "RUN": live.run, "TITLE": shown(f"rtrace · {files}"),
                  "SCRIPT": "".join(str(h("script", {"src": u})) for u in live.scripts)}
    values.update(SUMMARY=shown(summary), NOTES="".join(f"<p class='note'>{shown(n)}</p>" for n in notes), DATA=data)
    # one pass over the template: a value is never searched for markers (the data may hold any text)
    return _MARKER.sub(lambda m: values[m.group(1) or m.group(2)], _static("report.html"))
