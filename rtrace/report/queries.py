"""The run-wide views' data: SQL over a run's two tables (docs/dataset.md), run by DuckDB.

One set of queries for ``rtrace serve`` (over the run's dataset, or over JSONL files the
server copies into one) and for the snapshot ``rtrace report --html`` writes (over the
same tables built in memory from the files it read). Every figure comes from SQL; the
views (:mod:`rtrace.report.views`) only draw it. Values are bound as parameters, never
pasted into the SQL; the only names pasted are those of :class:`Column` objects this
module made (an outcome or annotation key found in the data is written as a quoted SQL
string literal).

Queries run through a :class:`Db`: anything with ``rows(sql, params)`` and
``arrow(sql, params)``, and ``table`` / ``flat``: the relation the views read
(``trajectories``, the run's view), or, on the server, a flat copy of it in a local DuckDB
file (:func:`index_select`: every column the views sort, filter and search on, map lookups
already done, no conversation), which sorts a million rollouts in tens of milliseconds where
the Parquet files take a second or more. :data:`FIELDS` are the expressions that differ
between the two. The server's queries run with a time limit (:mod:`rtrace.serve.sources`);
:func:`memory_db` wraps trajectories held in memory.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

__all__ = ["Db", "RelationDb", "memory_db", "Column", "Filter", "TableState", "BASE_COLUMNS", "PROMPT_SQL", "PASS_SQL",
           "discover_keys", "columns_of", "curve_keys", "PINNED", "SPLITS", "parse_state", "where_sql", "rollouts",
           "histograms", "HISTOGRAMS",
           "prompt_list", "prompt_steps", "failures", "FAILURE_REASONS", "mismatch_top", "step_extras",
           "load_trajectories", "step_rows", "step_health_rates", "trace_id_ok", "FIELDS", "INDEX_COLUMNS",
           "flat_columns", "index_select", "ident"]

#: the prompt a rollout answers (:func:`rtrace.pipeline.sampling.prompt_key`'s rule, in SQL)
PROMPT_SQL = ("coalesce(extra_str['prompt_id'], CAST(extra_int['prompt_id'] AS VARCHAR), group_id, "
              "CAST(sample_index AS VARCHAR))")
#: pass (:func:`rtrace.report.data.passed`): ``outcome.correct`` when a boolean, else reward > 0
PASS_SQL = "coalesce(outcome_bool['correct'], reward > 0)"
_TEXT_CHARS = 240  # a table cell's text: the head of a prompt, the end of an answer
#: what the views read beyond plain columns: name -> SQL over the trajectories view; the
#: flat index holds each as a column of that name
FIELDS = {
    "_prompt": PROMPT_SQL,
    "_pass": PASS_SQL,
    "_correct": "outcome_bool['correct']",
    "_expected": ("coalesce(outcome_str['expected'], CAST(outcome_int['expected'] AS VARCHAR), "
                  "CAST(outcome_double['expected'] AS VARCHAR))"),
    "_checks": "list_transform(health, lambda x: x.check)",
    "_mk1": "annotations_double['logprob_mismatch_k1']",
    "_mk3": "annotations_double['logprob_mismatch_k3']",
    "_mmax": "annotations_double['logprob_mismatch_max']",
    "_mfrac": "annotations_double['logprob_mismatch_frac']",
}
#: the trajectories columns the flat index copies as they are
INDEX_COLUMNS = ("trace_id", "step", "validate", "group_key", "rollout_n", "sample_index", "reward", "advantage",
                 "verdict", "status", "error", "partial", "truncated", "finish_reason", "in_sample", "num_turns",
                 "num_tool_calls", "input_tokens", "output_tokens", "duration_ms", "policy_version", "task", "answer",
                 "kept")


def _t(db: Any) -> str:
    """The relation the views read on ``db``."""
    return getattr(db, "table", "trajectories")


def _x(db: Any, name: str) -> str:
    """A :data:`FIELDS` expression on ``db`` (its column on the flat index)."""
    return name if getattr(db, "flat", False) else FIELDS[name]


def ident(name: str) -> str:
    """A quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


class Db(Protocol):
    """What the views' queries run on."""

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple]]:
        """The result's column names and rows."""

    def arrow(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        """The result as a pyarrow Table."""


class RelationDb:
    """A :class:`Db` over anything with DuckDB's ``sql(query, params=...)`` (a
    :class:`rtrace.dataset.Run`, a DuckDB connection), without a time limit."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def _rel(self, sql: str, params: Sequence[Any] | None) -> Any:
        return self.target.sql(sql, params=list(params)) if params else self.target.sql(sql)

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple]]:
        rel = self._rel(sql, params)
        return list(rel.columns), rel.fetchall()

    def arrow(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        from ..dataset.reader import _arrow

        return _arrow(self._rel(sql, params))


def memory_db(trajectories: Sequence[Any], run: str = "report", spans: bool = True) -> RelationDb:
    """The two tables of ``trajectories`` (:class:`~rtrace.trajectory.Trajectory`), in
    memory, as a :class:`Db` (``rtrace report --html`` on JSONL files; ``spans=False``: an
    empty spans table, the run-wide views read none). Needs pyarrow and duckdb."""
    import duckdb

    from ..dataset.encode import encode_safely, rows_of, tables

    if spans:
        ttable, stable, _, _ = encode_safely(list(trajectories), run)
    else:
        try:
            ttable, stable = tables([(trow, [], messages) for trow, _, messages in
                                     (rows_of(t, run) for t in trajectories)])
        except Exception:  # a value Arrow refuses: the careful path (degrades it)
            ttable, stable, _, _ = encode_safely(list(trajectories), run)
    con = duckdb.connect()
    con.register("_rtrace_t", ttable)
    con.register("_rtrace_s", stable)
    con.execute("CREATE VIEW trajectories AS SELECT * FROM _rtrace_t")
    con.execute("CREATE VIEW spans AS SELECT * FROM _rtrace_s")
    db = RelationDb(con)
    db.tables = (ttable, stable)  # type: ignore[attr-defined]  # kept alive with the connection
    return db


def _literal(text: str) -> str:
    """A SQL string literal (DuckDB: a quote is written twice; backslashes are plain)."""
    return "'" + text.replace("'", "''") + "'"


# ----------------------------------------------------------------------------- columns
@dataclass(frozen=True)
class Column:
    """A column of the rollouts table: its name in URLs, its header, its SQL and kind."""

    name: str
    label: str
    sql: str
    #: ``int``, ``float``, ``text``, ``bool`` or ``id`` (how a filter parses its value, how a cell is drawn)
    kind: str
    #: shown unless the column chooser says otherwise
    shown: bool = True
    doc: str = ""


#: the columns every run has, in the table's order: the pinned key columns (rollout, step,
#: group, n, verdict, reward: the stylesheet keeps them in view while the rest scrolls), the
#: length and truncation beside the reward, then the texts; outcome keys found in the data
#: come after the answer, annotation keys at the end (:func:`columns_of`)
BASE_COLUMNS: tuple[Column, ...] = (
    Column("step", "step", "step", "int"),
    Column("group", "group", "group_key", "text", True, "GRPO group: group_id, else sample_index"),
    Column("rollout", "n", "rollout_n", "int", True, "rollout_n: the rollout's number in its group"),
    Column("verdict", "verdict", "verdict", "text", True, "error, partial, truncated, correct, wrong or ok"),
    Column("reward", "reward", "reward", "float"),
    Column("length", "tokens out", "output_tokens", "int", True, "response length: tokens generated"),
    Column("truncated", "truncated", "truncated", "bool", True, "a generation stopped at the length limit"),
    Column("advantage", "advantage", "advantage", "float"),
    Column("task", "prompt", "task", "text", True, "the first user message"),
    Column("answer", "answer (its end)", "answer", "text", True, "the last assistant message"),
    Column("turns", "turns", "num_turns", "int"),
    Column("latency", "latency ms", "duration_ms", "float"),
    Column("health", "health", "array_to_string(list_transform(health, lambda x: x.check), ', ')", "text", True,
           "the rollout-health checks that failed (empty: healthy; blank: not checked)"),
    Column("validate", "validation", "validate", "bool", False, "a validation rollout"),
    Column("sample", "sample", "sample_index", "int", False),
    Column("prompt", "prompt id", PROMPT_SQL, "text", False, "extra prompt_id, else group_id, else sample_index"),
    Column("pass", "pass", PASS_SQL, "bool", False, "outcome.correct when a boolean, else reward > 0"),
    Column("finish", "finish", "finish_reason", "text", False),
    Column("tools", "tool calls", "num_tool_calls", "int", False),
    Column("tokens_in", "tokens in", "input_tokens", "int", False),
    Column("status", "status", "status", "text", False),
    Column("error", "error", "error", "text", False),
    Column("policy_version", "policy", "policy_version", "int", False),
    Column("in_sample", "in sample", "in_sample", "bool", False, "counted by the step metrics"),
    Column("kept", "kept", "array_to_string(kept, ', ')", "text", False),
    Column("trace", "trace id", "trace_id", "id", False),
)
#: the columns the table keeps in view when it scrolls sideways (after its first, the rollout's link)
PINNED = ("step", "group", "rollout", "verdict", "reward")
_AFTER_ANSWER = [c.name for c in BASE_COLUMNS].index("answer") + 1
#: an outcome key gets a column shown by default, and a curve across steps, only when at
#: least this share of the rollouts carries it (a key one rollout in 38,000 set is in the chooser)
COMMON_KEY_SHARE = 0.5

#: the maps whose keys become columns: (map prefix, column name prefix, SQL kind)
_MAPS = (("outcome", "outcome."), ("annotations", "annotation."))
_MAP_KINDS = {"double": "float", "int": "int", "bool": "bool", "str": "text"}
#: annotation keys that already have a column
_KNOWN_ANNOTATIONS = {"advantage"}


def discover_keys(db: Db, source: str = "trajectories", by_file: bool = False) -> dict[Any, int]:
    """Every key of the outcome and annotation maps in ``source`` (a table or a
    ``read_parquet(...)`` expression) with the number of rows that carry it:
    ``{("outcome", "double", "reward/format"): 36}``. ``by_file``: keyed by ``(file, (map,
    kind, key))``, ``source`` having a ``_file`` column (a run's counts kept per data file,
    so a compacted file replaces its inputs' counts)."""
    file = "_file, " if by_file else ""
    parts = [f"SELECT {file}'{m}' AS m, '{k}' AS k, unnest(map_keys({m}_{k})) AS key FROM {source}"
             for m, _ in _MAPS for k in _MAP_KINDS]
    _, rows = db.rows(f"SELECT {file}m, k, key, count(*) FROM ({' UNION ALL '.join(parts)}) GROUP BY ALL")
    if by_file:
        return {(f, (m, k, key)): int(n) for f, m, k, key, n in rows if key is not None}
    return {(m, k, key): int(n) for m, k, key, n in rows if key is not None}


def columns_of(keys: Iterable[tuple[str, str, str]] | dict[tuple[str, str, str], int],
               total: int | None = None) -> list[Column]:
    """The rollouts table's columns: :data:`BASE_COLUMNS` with a column per outcome key
    (``record_reward``'s keywords: TRL's ``reward/<function>``, ``expected`` ...) after the
    answer, and per annotation key at the end (hidden unless it is the train-inference
    mismatch). With ``keys`` counted (:func:`discover_keys`) and ``total`` rows, an outcome
    key is shown by default only when :data:`COMMON_KEY_SHARE` of the rows carry it."""
    counts = keys if isinstance(keys, dict) else None
    by_key: dict[tuple[str, str], set[str]] = {}
    carried: dict[tuple[str, str], int] = {}
    for m, kind, key in keys:
        by_key.setdefault((m, key), set()).add(kind)
        carried[(m, key)] = carried.get((m, key), 0) + (counts[(m, kind, key)] if counts is not None else 0)
    outcome, annotation = [], []
    for (m, key), kinds in sorted(by_key.items()):
        if m == "annotations" and key in _KNOWN_ANNOTATIONS:
            continue
        if m == "outcome" and key == "correct" and kinds == {"bool"}:
            continue  # the verdict and pass columns
        lit = _literal(key)
        numeric = [k for k in ("double", "int") if k in kinds]
        if numeric:
            sql = f"coalesce({', '.join(f'{m}_{k}[{lit}]' for k in numeric)})"
            kind = "float" if "double" in numeric else "int"
        elif "bool" in kinds:
            sql, kind = f"{m}_bool[{lit}]", "bool"
        else:
            sql, kind = f"coalesce({m}_str[{lit}], {m}_json[{lit}])", "text"
        common = counts is None or not total or carried[(m, key)] >= COMMON_KEY_SHARE * total
        prefix = "outcome." if m == "outcome" else "annotation."
        shown = (m == "outcome" and kind != "text" and common) or key == "logprob_mismatch_k3"
        col = Column(prefix + key, key, sql, kind, shown,
                     f"{'record_reward' if m == 'outcome' else 'annotation'} {key!r}")
        (outcome if m == "outcome" else annotation).append(col)
    cols = list(BASE_COLUMNS)
    return cols[:_AFTER_ANSWER] + outcome + cols[_AFTER_ANSWER:] + annotation


def curve_keys(columns: Sequence[Column]) -> set[str]:
    """The outcome keys drawn as curves across steps (``outcome.<key>``): those shown by
    default (numeric, carried by most rollouts: :func:`columns_of`)."""
    return {c.name for c in columns if c.shown and c.name.startswith("outcome.")}


#: the base columns whose SQL reads a :data:`FIELDS` expression: their SQL on the flat index
_FLAT_SQL = {"prompt": "_prompt", "pass": "_pass", "health": "array_to_string(_checks, ', ')"}


def flat_columns(columns: Sequence[Column]) -> list[Column]:
    """``columns`` as they read the flat index: an outcome or annotation column is the
    index's column of its name; the rest read the same columns (or :data:`FIELDS`)."""
    out = []
    for c in columns:
        if c.name.startswith(("outcome.", "annotation.")):
            sql = ident(c.name)
        else:
            sql = _FLAT_SQL.get(c.name, c.sql)
        out.append(Column(c.name, c.label, sql, c.kind, c.shown, c.doc))
    return out


def index_select(columns: Sequence[Column]) -> str:
    """The SELECT list of the flat index over the trajectories view: :data:`INDEX_COLUMNS`,
    :data:`FIELDS`, and each outcome and annotation column of ``columns`` (raw form) under its name."""
    parts = list(INDEX_COLUMNS) + [f"{sql} AS {name}" for name, sql in FIELDS.items()]
    parts += [f"{c.sql} AS {ident(c.name)}" for c in columns if c.name.startswith(("outcome.", "annotation."))]
    return ", ".join(parts)


# ----------------------------------------------------------------------------- the table's state
_OPS = {"eq": "=", "ne": "<>", "gt": ">", "ge": ">=", "lt": "<", "le": "<=", "contains": "ILIKE",
        "null": "IS NULL", "notnull": "IS NOT NULL"}
#: how each op is written on a chip
OP_TEXT = {"eq": "=", "ne": "≠", "gt": ">", "ge": "≥", "lt": "<", "le": "≤", "contains": "contains",
           "null": "is empty", "notnull": "is set"}
MAX_PAGE = 500
#: the table's switch between training and validation rollouts (``_split=``): name -> (words, SQL).
#: Training by default: a step's validation rollouts are another policy's answers to other prompts
SPLITS = {"train": ("training", "NOT validate"), "val": ("validation", "validate"), "all": ("both", "true")}


@dataclass(frozen=True)
class Filter:
    column: str
    op: str
    value: str

    @property
    def param(self) -> str:
        """Its query-string name: ``reward__gt``, ``verdict`` (eq)."""
        return self.column if self.op == "eq" else f"{self.column}__{self.op}"


@dataclass
class TableState:
    """What the rollouts table shows: filters, text search, sort, page, columns."""

    filters: list[Filter] = field(default_factory=list)
    q: str = ""
    sort: str | None = None
    desc: bool = False
    offset: int = 0
    size: int = 50
    shown: list[str] | None = None
    #: ``train``, ``val`` or ``all`` (:data:`SPLITS`); None: training, or both when a filter is on ``validate``
    split: str | None = None
    #: what was not understood, in words (shown on the page; the rest still applies)
    problems: list[str] = field(default_factory=list)

    @property
    def rows_of(self) -> str:
        """The split the table holds: the switch's, else training unless a filter is on ``validate``."""
        if self.split is not None:
            return self.split
        return "all" if any(f.column == "validate" for f in self.filters) else "train"

    def params(self, **changes: Any) -> list[tuple[str, Any]]:
        """The query-string pairs of this state with ``changes`` (``filters=[...]``, ``sort=``,
        ``offset=`` ...); defaults are left out."""
        st = {"filters": self.filters, "q": self.q, "sort": self.sort, "desc": self.desc, "offset": self.offset,
              "size": self.size, "shown": self.shown, "split": self.split, **changes}
        out: list[tuple[str, Any]] = [("_split", st["split"])] + [(f.param, f.value) for f in st["filters"]]
        out += [("q", st["q"] or None), ("_sort", st["sort"]), ("_desc", "1" if st["desc"] and st["sort"] else None),
                ("_size", st["size"] if st["size"] != 50 else None), ("_offset", st["offset"] or None)]
        if st["shown"] is not None:
            out.append(("_col", ",".join(st["shown"])))
        return out


def parse_state(pairs: Iterable[tuple[str, str]], columns: Sequence[Column]) -> TableState:
    """The state from query-string pairs: ``_sort``, ``_desc``, ``_offset``, ``_size``,
    ``_col`` (comma list of shown columns), ``_split`` (``train``, ``val``, ``all``), ``q`` (text search in prompts and answers),
    and filters ``<column>[__<op>]=<value>`` (ops: eq, ne, gt, ge, lt, le, contains, null,
    notnull). Unknown names and values that do not parse are said in ``problems``."""
    names = {c.name: c for c in columns}
    st = TableState()
    for key, value in pairs:
        if key == "q":
            st.q = value.strip()[:500]
        elif key == "_sort":
            if value in names:
                st.sort = value
            else:
                st.problems.append(f"no column {value!r} to sort by")
        elif key == "_desc":
            st.desc = value not in ("", "0", "false")
        elif key in ("_offset", "_size"):
            try:
                number = int(value)
            except ValueError:
                st.problems.append(f"{key}={value!r} is not a number")
                continue
            if key == "_offset":
                st.offset = max(0, number)
            else:
                st.size = min(MAX_PAGE, max(1, number))
        elif key == "_col":
            st.shown = [n for n in value.split(",") if n in names]
        elif key == "_split":
            if value in SPLITS:
                st.split = value
            else:
                st.problems.append(f"_split={value!r}: one of {', '.join(SPLITS)}")
        elif key.startswith("_"):
            continue  # the server's own (_fragment ...)
        else:
            column, _, op = key.partition("__")
            op = op or "eq"
            if column not in names:
                st.problems.append(f"no column {column!r} to filter on")
            elif op not in _OPS:
                st.problems.append(f"unknown filter {op!r} (one of {', '.join(_OPS)})")
            else:
                try:
                    _value(names[column], op, value)
                except ValueError as exc:
                    st.problems.append(f"{column}: {exc}")
                    continue
                st.filters.append(Filter(column, op, value))
    return st


def _value(col: Column, op: str, text: str) -> Any:
    if op in ("null", "notnull"):
        return None
    if op == "contains":
        return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    if col.kind == "int":
        try:
            return int(text)
        except ValueError:
            return float(text)  # a histogram bar's edge: reward__ge=0.5 on an int column is still a range
    if col.kind == "float":
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text!r} is not a finite number")
        return value
    if col.kind == "bool":
        low = text.strip().lower()
        if low in ("1", "true", "yes", "t"):
            return True
        if low in ("0", "false", "no", "f"):
            return False
        raise ValueError(f"{text!r} is not true or false")
    return text


def where_sql(state: TableState, columns: Sequence[Column], extra: Sequence[tuple[str, Sequence[Any]]] = (),
              db: Any = None) -> tuple[str, list[Any]]:
    """``WHERE`` clause (without the word) and its parameters. The text search (``q``, and
    ``contains`` on the answer) asks ``db.text_search(text, columns, trace_ids)`` first (the
    server's word index: same rows, without reading every answer); without it, it scans."""
    names = {c.name: c for c in columns}
    search = getattr(db, "text_search", None)
    parts, params = [], []
    for f in state.filters:
        col = names[f.column]
        if f.op in ("null", "notnull"):
            parts.append(f"({col.sql}) {_OPS[f.op]}")
            continue
        found = search(f.value, ("answer",)) if f.op == "contains" and col.sql == "answer" and search else None
        if found is not None:
            parts.append(found[0])
            params += found[1]
            continue
        if f.op == "contains":
            parts.append(f"CAST(({col.sql}) AS VARCHAR) ILIKE ? ESCAPE '\\'")
        else:
            parts.append(f"({col.sql}) {_OPS[f.op]} ?")
        params.append(_value(col, f.op, f.value))
    if state.q:
        hex_id = bool(re.fullmatch(r"[0-9a-f]{6,32}", state.q))  # a trace id, or its start
        found = search(state.q, ("task", "answer"), hex_id) if search else None
        if found is not None:
            parts.append(found[0])
            params += found[1]
        else:
            pattern = "%" + state.q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            search_sql = "task ILIKE ? ESCAPE '\\' OR answer ILIKE ? ESCAPE '\\'"
            params += [pattern, pattern]
            if hex_id:
                search_sql += " OR starts_with(trace_id, ?)"
                params.append(state.q)
            parts.append(search_sql)
    if state.rows_of != "all":
        parts.append(SPLITS[state.rows_of][1])
    for sql, p in extra:
        parts.append(sql)
        params += list(p)
    return (" AND ".join(f"({p})" for p in parts) or "true"), params


def shown_columns(state: TableState, columns: Sequence[Column]) -> list[Column]:
    if state.shown is None:
        return [c for c in columns if c.shown]
    chosen = set(state.shown)
    return [c for c in columns if c.name in chosen]


def _cell_sql(col: Column) -> str:
    if col.name == "task":
        return f"left(task, {_TEXT_CHARS})"
    if col.name == "answer":
        return f"right(answer, {_TEXT_CHARS})"
    if col.kind == "text":
        return f"left(CAST(({col.sql}) AS VARCHAR), {_TEXT_CHARS})"
    return col.sql


def rollouts(db: Db, state: TableState, columns: Sequence[Column]) -> dict[str, Any]:
    """One page of the rollouts table: ``columns`` (the shown ones), ``rows`` (dicts with
    ``trace_id``, ``verdict``, ``pass``, ``step``, ``validate`` always), ``more``. Two
    queries: the page's trace ids in order (reading only what the filters and the sort
    need), then those rows' cells (their steps' data only)."""
    shown = shown_columns(state, columns)
    names = {c.name: c for c in columns}
    where, params = where_sql(state, columns, db=db)
    table = _t(db)
    # the flat index's rows are found again by rowid (a table's own, read in one snapshot:
    # `pinned`); the run's view has none, its rows are found by trace id in their steps' files
    key = "rowid" if getattr(db, "flat", False) else "trace_id"
    if state.sort is not None:
        order = f"({names[state.sort].sql}) {'DESC' if state.desc else 'ASC'} NULLS LAST, {key}"
    else:  # the newest steps first: a live run's latest rollouts on top
        order = f"step DESC NULLS LAST, validate, group_key, rollout_n, {key}"
    sql = (f"SELECT {key}, step FROM {table} WHERE {where} ORDER BY {order} "
           f"LIMIT {int(state.size) + 1} OFFSET {int(state.offset)}")
    out = []
    with getattr(db, "pinned", contextlib.nullcontext)():
        _, ids = db.rows(sql, params)
        more = len(ids) > state.size
        ids = ids[: state.size]
        if ids:
            select = [f"{key} AS _key", "trace_id AS _trace", "verdict AS _verdict", f"{_x(db, '_pass')} AS _pass",
                      "step AS _step", "validate AS _validate"] + [f"{_cell_sql(c)} AS c{i}" for i, c in enumerate(shown)]
            if key == "rowid":
                found = f"rowid IN ({', '.join(str(int(k)) for k, _ in ids)})"
                args: list[Any] = []
            else:
                steps = sorted({s for _, s in ids if s is not None})
                found = " OR ".join(([f"step IN ({', '.join(str(int(s)) for s in steps)})"] if steps else [])
                                    + (["step IS NULL"] if any(s is None for _, s in ids) else []))
                found = f"({found}) AND trace_id IN ({', '.join('?' for _ in ids)})"
                args = [k for k, _ in ids]
            _, rows = db.rows(f"SELECT {', '.join(select)} FROM {table} WHERE {found}", args)
            by_key = {r[0]: r for r in rows}
            for k, _ in ids:
                row = by_key.get(k)
                if row is None:  # pragma: no cover - both queries read one snapshot
                    continue
                _, trace, verdict, passed, step, validate = row[:6]
                out.append({"trace_id": trace, "verdict": verdict, "pass": passed, "step": step, "validate": validate,
                            "cells": {c.name: row[6 + i] for i, c in enumerate(shown)}})
    return {"columns": shown, "rows": out, "more": more, "sql": sql, "params": params}


# ----------------------------------------------------------------------------- histograms
#: (title, column): the histograms above the table, each bar a filter
HISTOGRAMS = (("reward", "reward"), ("response length (tokens out)", "length"), ("latency (ms)", "latency"),
              ("advantage", "advantage"))
#: the histograms' ranges and bins are chosen from a sample of this many values of each (all of
#: them below it): :func:`rtrace.report.plots.histogram_plan`
SAMPLE = 4096


def _bin_sql(v: str, g: Any) -> str:
    """SQL of :meth:`rtrace.report.plots.Grid.bin_of` for value ``v`` on grid ``g`` (its numbers
    written in: they are this module's, not the data's); NULL for a value that is not finite."""
    scale, op = repr(10.0 ** abs(g.exp)), "/" if g.exp < 0 else "*"
    n = f"floor({v} / {g.width!r})"

    def at(index: str) -> str:
        return f"({index}) * {g.mult} {op} {scale}"

    return (f"CASE WHEN isfinite({v}) THEN greatest(-1, least({g.k}, {n} - {g.first} + CAST({v} >= {at(n + ' + 1')} "
            f"AS INT) - CAST({v} < {at(n)} AS INT) - CAST({v} = {g.edge(g.k)!r} AS INT))) END")


def histograms(db: Db, state: TableState, columns: Sequence[Column],
               which: Sequence[tuple[str, str]] = HISTOGRAMS) -> dict[str, Any]:
    """The rollouts that match ``state`` (filters, search, split; not the page): their count
    and a histogram of each column of ``which``: ``{"total": n, "hist": {column: {...}}}``,
    each ``{"bars": [(low, high or None, count)], "under": (smallest, edge, count) or None,
    "over": (edge, largest, count) or None, "categorical": bool, "n": values, "missing":
    rows without a finite value}``, as :func:`rtrace.report.plots.histogram` draws one: a bar
    per value up to 12 distinct values, else round bins over the robust range and an overflow
    bar at an end for the values beyond it. Two statements: the count, each column's
    smallest and largest value and a sample of its values (from which the bins are chosen
    here, :func:`rtrace.report.plots.histogram_plan`); then every histogram's counts per bin
    (or value) in one pass."""
    from .plots import count_bars, histogram_plan

    names = {c.name: c for c in columns}
    where, params = where_sql(state, columns, db=db)
    cols = [names[c] for _, c in which]
    values = ", ".join(f"CAST(({c.sql}) AS DOUBLE) AS v{i}" for i, c in enumerate(cols))
    source = f"(SELECT {values} FROM {_t(db)} WHERE {where})"
    ok = [f"FILTER (WHERE isfinite(v{i}))" for i in range(len(cols))]
    stats = ", ".join(f"min(v{i}) {ok[i]}, max(v{i}) {ok[i]}, count(v{i}) {ok[i]}" for i in range(len(cols)))
    sample = ", ".join(f"list(v{i}) {ok[i]}" for i in range(len(cols)))
    _, head = db.rows(f"WITH f AS MATERIALIZED {source} SELECT count(*), {stats}, (SELECT [{sample}] FROM f USING "
                      f"SAMPLE reservoir({SAMPLE} ROWS) REPEATABLE (7)) FROM f", params)
    total, rest, sampled = int(head[0][0]), head[0][1:-1], head[0][-1] or [[] for _ in cols]
    out: dict[str, Any] = {"total": total, "hist": {}}
    plans, keys = [], []
    for i, ((title, name), col) in enumerate(zip(which, cols)):
        lo, hi, count = rest[3 * i: 3 * i + 3]
        plan = histogram_plan(sampled[i] or [], lo, hi, int(count or 0), col.kind == "int")
        plans.append(plan)
        out["hist"][name] = {"title": title, "column": name, "n": int(count or 0), "missing": total - int(count or 0),
                             "categorical": False, "bars": [], "under": None, "over": None}
        keys.append(None if plan is None else f"CASE WHEN isfinite(v{i}) THEN v{i} END" if plan.categorical
                    else _bin_sql(f"v{i}", plan.grid))
    found: dict[int, dict[float, int]] = {}
    used = [i for i, k in enumerate(keys) if k is not None]
    if used:  # one pass, a grouping set per histogram (GROUPING_ID: the bit of each column not grouped by)
        xs = ", ".join(f"x{i}" for i in used)
        _, rows = db.rows(f"SELECT {xs}, count(*), GROUPING_ID({xs}) FROM (SELECT "
                          f"{', '.join(f'{keys[i]} AS x{i}' for i in used)} FROM {source}) "
                          f"GROUP BY GROUPING SETS ({', '.join(f'(x{i})' for i in used)})", params)
        full = (1 << len(used)) - 1
        which_set = {full ^ (1 << (len(used) - 1 - j)): i for j, i in enumerate(used)}
        for row in rows:
            i = which_set[row[-1]]
            x = row[used.index(i)]
            if x is not None:
                found.setdefault(i, {})[x] = int(row[-2])
    for i, (_, name) in enumerate(which):
        if plans[i] is not None:
            out["hist"][name].update(count_bars(plans[i], found.get(i, {})))
    return out


# ----------------------------------------------------------------------------- prompts
#: sort keys of the prompt list -> SQL
PROMPT_SORTS = {"prompt": "prompt", "steps": "steps", "rollouts": "n", "pass": "pass_rate", "reward": "reward",
                "last": "last_step"}


def prompt_list(db: Db, q: str = "", sort: str = "last", desc: bool = True, offset: int = 0, size: int = 50
                ) -> dict[str, Any]:
    """Every prompt of the run (by :data:`PROMPT_SQL`): its question, steps it appears at,
    rollouts, pass rate and mean reward, first and last step; ``q`` searches keys and questions."""
    prompt, ok = _x(db, "_prompt"), _x(db, "_pass")
    where, params = f"{prompt} IS NOT NULL", []
    if q:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        where += f" AND ({prompt} ILIKE ? ESCAPE '\\' OR task ILIKE ? ESCAPE '\\')"
        params += [pattern, pattern]
    order = PROMPT_SORTS.get(sort, "last_step")
    sql = (f"WITH p AS (SELECT {prompt} AS prompt, left(any_value(task), {_TEXT_CHARS}) AS task, "
           f"count(DISTINCT (validate, step)) AS steps, count(*) AS n, "
           f"avg(CASE WHEN {ok} THEN 1.0 WHEN NOT {ok} THEN 0.0 END) AS pass_rate, "
           f"avg(reward) AS reward, min(step) AS first_step, max(step) AS last_step "
           f"FROM {_t(db)} WHERE {where} GROUP BY 1) "
           f"SELECT *, count(*) OVER () AS total FROM p ORDER BY {order} {'DESC' if desc else 'ASC'} NULLS LAST, "
           f"prompt LIMIT {int(size) + 1} OFFSET {int(offset)}")
    names, rows = db.rows(sql, params)
    items = [dict(zip(names, r)) for r in rows]
    total = items[0]["total"] if items else 0
    return {"prompts": items[:size], "more": len(items) > size, "total": total}


def prompt_steps(db: Db, key: str, answers: int = 16, offset: int = 0, size: int = 100) -> dict[str, Any]:
    """One prompt across steps: per (validate, step) its rollouts, pass count, mean reward
    and up to ``answers`` answers (the end of each), in step order; and its question."""
    prompt, ok, table = _x(db, "_prompt"), _x(db, "_pass"), _t(db)
    sql = (f"SELECT validate, step, count(*) AS n, count(*) FILTER (WHERE {ok}) AS passed, "
           f"count({ok}) AS judged, avg(reward) AS reward, "
           f"list({{'trace_id': trace_id, 'rollout': rollout_n, 'reward': reward, 'pass': {ok}, "
           f"'verdict': verdict, 'answer': right(answer, {_TEXT_CHARS})}} ORDER BY rollout_n NULLS LAST, trace_id)"
           f"[1:{int(answers)}] AS answers "
           f"FROM {table} WHERE {prompt} = ? GROUP BY ALL ORDER BY validate, step NULLS LAST "
           f"LIMIT {int(size) + 1} OFFSET {int(offset)}")
    names, rows = db.rows(sql, [key])
    steps = [dict(zip(names, r)) for r in rows]
    _, task = db.rows(f"SELECT task FROM {table} WHERE {prompt} = ? AND task IS NOT NULL LIMIT 1", [key])
    return {"key": key, "task": task[0][0] if task else None, "steps": steps[:size], "more": len(steps) > size}


# ----------------------------------------------------------------------------- failures
#: reason -> (words on a chip, SQL; ``{correct}`` and ``{checks}`` are :data:`FIELDS`): why a
#: rollout is listed as a failure
FAILURE_REASONS = {
    "error": ("error", "status = 'error'"),
    "truncated": ("truncated", "truncated"),
    "partial": ("partial", "partial"),
    "wrong": ("wrong answer", "{correct} = false"),
    "reward_le_0": ("reward ≤ 0", "reward <= 0"),
    "no_reward": ("no reward", "reward IS NULL"),
    "unhealthy": ("unhealthy", "len({checks}) > 0"),
}


def failures(db: Db, reason: str | None = None, check: str | None = None, step: int | None = None,
             offset: int = 0, size: int = 50) -> dict[str, Any]:
    """The rollouts that failed (any of :data:`FAILURE_REASONS`) or carry a health finding,
    newest step first, with what is needed to say why in words (the page's rows' health
    findings read from the run itself); counts per reason and per health check.
    ``reason`` / ``check`` / ``step`` narrow the list."""
    table, checks = _t(db), _x(db, "_checks")
    sql_of = {k: v.format(correct=_x(db, "_correct"), checks=checks) for k, (_, v) in FAILURE_REASONS.items()}
    any_reason = " OR ".join(f"({v})" for v in sql_of.values())
    where, params = [f"({any_reason})"], []
    if reason in FAILURE_REASONS:
        where.append(sql_of[reason])
    if check:
        where.append(f"list_contains({checks}, ?)")
        params.append(check)
    if step is not None:
        where.append("step = ?")
        params.append(step)
    clause = " AND ".join(where)
    sql = (f"SELECT trace_id, step, validate, group_key, rollout_n, reward, status, left(error, 600) AS error, "
           f"partial, truncated, finish_reason, output_tokens, {_x(db, '_correct')} AS correct, "
           f"{_x(db, '_expected')} AS expected, verdict, right(answer, {_TEXT_CHARS}) AS answer FROM {table} "
           f"WHERE {clause} ORDER BY step DESC NULLS LAST, validate, group_key, rollout_n, trace_id "
           f"LIMIT {int(size) + 1} OFFSET {int(offset)}")
    names, rows = db.rows(sql, params)
    items = [dict(zip(names, r)) for r in rows][: size + 1]
    if items:  # the findings' details of this page's rollouts, from the run (their steps' files only)
        page = items[:size]
        steps = sorted({r["step"] for r in page if r["step"] is not None})
        step_sql = " OR ".join(([f"step IN ({', '.join(str(int(x)) for x in steps)})"] if steps else [])
                               + (["step IS NULL"] if any(r["step"] is None for r in page) else []))
        marks = ", ".join("?" for _ in page)
        _, found = db.rows(f"SELECT trace_id, health FROM trajectories WHERE ({step_sql}) AND trace_id IN ({marks})",
                           [r["trace_id"] for r in page])
        health = dict(found)
        for r in items:
            r["health"] = health.get(r["trace_id"])
    step_where, step_params = ("step = ?", [step]) if step is not None else ("true", [])
    counts_sql = ("SELECT " + ", ".join(f"count(*) FILTER (WHERE {v}) AS {name}" for name, v in sql_of.items())
                  + f", count(*) FILTER (WHERE {any_reason}) AS all_, count(*) AS total FROM {table} "
                  f"WHERE {step_where}")
    cnames, crow = db.rows(counts_sql, step_params)
    counts = dict(zip(cnames, crow[0])) if crow else {}
    _, found_checks = db.rows(f"SELECT c, count(*) FROM (SELECT unnest({checks}) AS c FROM {table} WHERE "
                              f"{step_where} AND len({checks}) > 0) GROUP BY 1 ORDER BY 2 DESC, 1", step_params)
    return {"rows": items[:size], "more": len(items) > size, "counts": counts,
            "checks": [(c, n) for c, n in found_checks if c is not None]}


# ----------------------------------------------------------------------------- a step
_MISMATCH = ("k1", "k3", "max", "frac")


def mismatch_top(db: Db, validate: bool, step: int | None, limit: int = 20) -> list[dict[str, Any]]:
    """The rollouts of a step with the largest train-inference mismatch (``logprob_mismatch_k3``,
    docs/token-values.md), largest first."""
    names = {"k1": "_mk1", "k3": "_mk3", "max": "_mmax", "frac": "_mfrac"}
    cols = ", ".join(f"{_x(db, names[k])} AS {k}" for k in _MISMATCH)
    k3 = _x(db, "_mk3")
    step_sql = "step IS NULL" if step is None else "step = ?"
    sql = (f"SELECT trace_id, group_key, rollout_n, reward, {cols}, output_tokens FROM {_t(db)} "
           f"WHERE validate = ? AND {step_sql} AND {k3} IS NOT NULL "
           f"ORDER BY {k3} DESC, trace_id LIMIT {int(limit)}")
    names, rows = db.rows(sql, [validate] + ([] if step is None else [step]))
    return [dict(zip(names, r)) for r in rows]


def step_extras(db: Db, where: str = "true", params: Sequence[Any] = ()) -> dict[tuple[bool, int], dict[str, float]]:
    """Per (validate, step) of the step's sample, what the step table does not have: the mean
    of each numeric outcome key (``outcome.reward/format`` ...), the pass rate, the mean
    train-inference mismatch, the mean response length."""
    out: dict[tuple[bool, int], dict[str, float]] = {}
    sql = (f"SELECT validate, step, avg(CASE WHEN {PASS_SQL} THEN 1.0 WHEN NOT {PASS_SQL} THEN 0.0 END) AS pass_rate, "
           "avg(annotations_double['logprob_mismatch_k3']) AS mismatch_k3, "
           "avg(annotations_double['logprob_mismatch_frac']) AS mismatch_frac, avg(output_tokens) AS length "
           f"FROM trajectories WHERE in_sample AND step IS NOT NULL AND ({where}) GROUP BY ALL")
    names, rows = db.rows(sql, list(params))
    for r in rows:
        d = dict(zip(names, r))
        key = (bool(d.pop("validate")), int(d.pop("step")))
        out[key] = {k: float(v) for k, v in d.items() if v is not None}
    sql = ("SELECT validate, step, k, avg(v) FROM (SELECT validate, step, unnest(map_keys(m)) AS k, "
           "unnest(map_values(m)) AS v FROM (SELECT validate, step, map_concat(outcome_double, "
           "map_from_entries(list_transform(map_entries(outcome_int), lambda e: {'key': e.key, 'value': "
           f"CAST(e.value AS DOUBLE)}}))) AS m FROM trajectories WHERE in_sample AND step IS NOT NULL AND ({where}))) "
           "WHERE isfinite(v) GROUP BY ALL")
    _, rows = db.rows(sql, list(params))
    for validate, step, key, value in rows:
        out.setdefault((bool(validate), int(step)), {})[f"outcome.{key}"] = float(value)
    return out


def step_rows(db: Db, where: str = "true", params: Sequence[Any] = ()) -> list[Any]:
    """The report's step table rows (:func:`rtrace.report.dataset.step_table_sql`) for the steps ``where`` selects."""
    from .dataset import step_rows_of, step_sql

    columns = db.rows("SELECT * FROM trajectories LIMIT 0")[0]
    return step_rows_of(*db.rows(step_sql(where, columns), list(params)))


# ----------------------------------------------------------------------------- whole trajectories
_HEX = re.compile(r"^[0-9a-f]{32}$")


def load_trajectories(db: Db, where: str, params: Sequence[Any] = (), span_where: str = "true",
                      span_params: Sequence[Any] = (), limit: int | None = None) -> list[Any]:
    """:class:`~rtrace.trajectory.Trajectory` objects (spans included) of the trajectories
    matching ``where``; ``span_where`` narrows the spans scan to their partitions
    (``step = 3``: DuckDB then opens that step's files only)."""
    from ..dataset.encode import to_trajectories
    from ..dataset.reader import _ints_for_times

    lim = f" LIMIT {int(limit)}" if limit is not None else ""
    traj = _ints_for_times(db.arrow(f"SELECT * FROM trajectories WHERE {where}{lim}", list(params)))
    if traj.num_rows == 0:
        return []
    spans = _ints_for_times(db.arrow(
        f"SELECT * FROM spans WHERE ({span_where}) AND trace_id IN (SELECT trace_id FROM trajectories WHERE {where}{lim})",
        list(span_params) + list(params)))
    return to_trajectories(traj.to_pylist(), spans.to_pylist())


def trace_id_ok(text: str) -> bool:
    """A trace id as the dataset writes it (32 lowercase hex digits)."""
    return bool(_HEX.match(text))


def step_health_rates(db: Db, where: str = "true", params: Sequence[Any] = ()
                      ) -> dict[tuple[bool, int], dict[str, float]]:
    """``health/<check>_rate`` per (validate, step), as :class:`rtrace.report.health.StepHealth`
    computes them: trajectories of the step's sample failing the check / those of the sample
    that carry health; every check that ran on the step (or was found) has a rate."""
    base = f"FROM trajectories WHERE step IS NOT NULL AND ({where})"
    names, rows = db.rows(
        "SELECT validate, step, count(*) FILTER (WHERE in_sample AND health IS NOT NULL) AS checked, "
        "list_distinct(flatten(list(health_checks))) AS ran, count(health_checks) = 0 AS unknown_ran "
        f"{base} GROUP BY ALL", list(params))
    out: dict[tuple[bool, int], dict[str, float]] = {}
    checked: dict[tuple[bool, int], int] = {}
    from ..config import HEALTH_CHECKS

    for validate, step, n, ran, unknown_ran in rows:
        key = (bool(validate), int(step))
        checked[key] = n
        if n:
            names_ran = list(HEALTH_CHECKS) if unknown_ran else [c for c in HEALTH_CHECKS if c in (ran or ())]
            out[key] = {f"health/{c}_rate": 0.0 for c in names_ran}
    _, rows = db.rows(
        "SELECT validate, step, h.check, count(DISTINCT trace_id) FILTER (WHERE in_sample) FROM (SELECT validate, "
        f"step, in_sample, trace_id, unnest(health) AS h {base} AND len(health) > 0) GROUP BY ALL", list(params))
    for validate, step, check, failing in rows:
        key = (bool(validate), int(step))
        if checked.get(key) and check is not None:
            out.setdefault(key, {})[f"health/{check}_rate"] = failing / checked[key]
    return out
