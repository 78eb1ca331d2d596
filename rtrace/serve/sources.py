"""The runs ``rtrace serve`` shows, kept up to date while they are written, and their queries.

A :class:`RunSource` is one run: a dataset (a folder or URL written by the parquet sink,
read with :func:`rtrace.open_run`) or JSONL files. JSONL files are copied, as they grow,
into a dataset in a temporary folder (:class:`JsonlIngest`): the views then run the same
SQL on both, DuckDB reads Parquet columns instead of parsing every line at every query
(a sort over all steps reads one column, not the run's text), and the copy is made once,
line by line as the run appends, by the dataset's own encoder and writer. What that
costs: a JSONL run is parsed once at start (about 10,000 trajectories a second on this
project's machine) and takes disk space in the temporary folder while served.

:class:`Sources` refreshes every run on one thread (``refresh_s``): new files are listed
(and new JSONL lines copied), and the caches the pages read (the step table, the
outcome keys, per-step curves, health rates) are computed again for the steps that
changed only. A page reads one immutable :class:`Snapshot` of them.

A local run also gets a flat index (:class:`FlatIndex`): a table in a DuckDB file in the
server's temporary folder with every column the table sorts, filters and searches on (map
lookups done, the conversation left out), one row per trajectory, kept in step with the
files (rows of new files added, rows of files a compaction replaced removed, in one
transaction). Sorting a million rollouts by reward reads one column of it in tens of
milliseconds; the Parquet files took a second or more (they are read for a page's rows,
a step, a rollout). Beside it, the answers' words (:class:`~rtrace.serve.search.WordIndex`),
built a slice per refresh after the start, for the text search. Their cost: their build
(docs/serve.md, Performance) and their disk (for the generated million-rollout run, prompts
and answers included, about 170 MB for the table and 90 MB for the words).

Queries run on a DuckDB cursor of the run's connection, each with a time limit
(:class:`TimedDb`): past it the query is interrupted and the page says so
(:class:`QueryTimeout`), as Datasette does with ``sql_time_limit_ms``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..events import RunEvent, is_event_line
from ..report import queries as Q

__all__ = ["RunSource", "Sources", "Snapshot", "TimedDb", "QueryTimeout", "NoData", "JsonlIngest", "FlatIndex",
           "sources_from_paths"]

logger = logging.getLogger("rtrace")


class NoData(LookupError):
    """The run has nothing to query yet (no dataset, or it could not be opened)."""


class QueryTimeout(Exception):
    """A query ran past its time limit and was interrupted."""

    def __init__(self, limit_ms: float) -> None:
        super().__init__(f"the query took longer than {limit_ms:,.0f} ms and was stopped")
        self.limit_ms = limit_ms


class TimedDb:
    """A :class:`rtrace.report.queries.Db` on a fresh cursor of the run's connection per
    query, interrupted after ``limit_ms`` (DuckDB's ``interrupt()``, from a timer thread);
    the views read the run's flat index when it has one (``table``, ``flat``)."""

    def __init__(self, source: "RunSource", limit_ms: float, table: str = "trajectories") -> None:
        self.source, self.limit_ms = source, limit_ms
        self.table = table
        self.flat = table != "trajectories"
        self._pinned: Any = None
        #: milliseconds spent in SQL by this page's queries (shown in its footer and JSON)
        self.spent_ms = 0.0
        self.queries = 0

    def text_search(self, q: str, columns: Sequence[str] = ("task", "answer"), trace_ids: bool = False
                    ) -> tuple[str, list[Any]] | None:
        """The flat index's search for ``q`` in ``columns`` (:class:`~rtrace.serve.search.WordIndex`):
        SQL and parameters; None without a flat index (the caller scans)."""
        index = self.source.index
        if not self.flat or index is None or index.columns is None or index.table != self.table:
            return None
        # once per run version: the page's two queries (its rows, its histograms) and its re-sorts share it
        return self.source.cached(("search", q, tuple(columns), trace_ids),
                                  lambda: index.words.predicate(self, self.table, q, columns, trace_ids))

    @contextlib.contextmanager
    def pinned(self) -> Any:
        """Queries in the block run on one cursor, in one transaction: they read one snapshot
        of the flat index (a refresh in between changes none of their answers, nor its
        rowids). Over the run's views there is nothing to pin (rows are found again by trace
        id), and each query stays free to list the run again (:meth:`_run`)."""
        if not self.flat:
            yield self
            return
        cursor = self.source.cursor()
        cursor.execute("BEGIN TRANSACTION")
        self._pinned = cursor
        try:
            yield self
        finally:
            self._pinned = None
            try:
                cursor.execute("COMMIT")
                cursor.close()
            except Exception:  # pragma: no cover - an interrupted query left it aborted
                pass

    def _run(self, sql: str, params: Sequence[Any] | None, fetch: str) -> Any:
        if self._pinned is not None:
            return self._once(sql, params, fetch)
        # a file merged away since the run was listed: listed again, the query run again
        return self.source.retrying(lambda: self._once(sql, params, fetch))

    def _once(self, sql: str, params: Sequence[Any] | None, fetch: str) -> Any:
        cursor = self._pinned or self.source.cursor()
        timer = threading.Timer(self.limit_ms / 1000.0, cursor.interrupt)
        timer.daemon = True
        t0 = time.perf_counter()
        timer.start()
        try:
            if fetch == "arrow":
                from ..dataset.reader import _arrow

                return _arrow(cursor.sql(sql, params=list(params)) if params else cursor.sql(sql))
            cursor.execute(sql, list(params) if params else None)
            return [d[0] for d in cursor.description], cursor.fetchall()
        except Exception as exc:
            if type(exc).__name__ == "InterruptException" or "Interrupted" in str(exc):
                raise QueryTimeout(self.limit_ms) from None
            raise
        finally:
            timer.cancel()
            self.spent_ms += (time.perf_counter() - t0) * 1000
            self.queries += 1
            if cursor is not self._pinned:
                try:
                    cursor.close()
                except Exception:  # pragma: no cover - closing never matters here
                    pass

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple]]:
        return self._run(sql, params, "rows")

    def arrow(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        return self._run(sql, params, "arrow")


@dataclass(frozen=True)
class Snapshot:
    """What the pages of one run read, as of one refresh (replaced whole, never changed)."""

    version: int = 0
    #: why there is nothing to show, in words (no dataset yet, an empty one, an error)
    problem: str | None = None
    trajectories: int = 0
    columns: tuple[Q.Column, ...] = tuple(Q.BASE_COLUMNS)
    #: the relation the views read: the flat index's table, or the run's trajectories view
    table: str = "trajectories"
    #: the step table's rows (:data:`rtrace.report.table.Row`), training then validation, steps ascending
    steps: tuple[Any, ...] = ()
    #: (validate, step) -> pass rate, mean outcome keys, mismatch (queries.step_extras)
    extras: dict[tuple[bool, int], dict[str, float]] = field(default_factory=dict)
    #: (validate, step) -> health/<check>_rate
    rates: dict[tuple[bool, int], dict[str, float]] = field(default_factory=dict)
    #: every (validate, step) with files, NULL steps included
    partitions: tuple[tuple[bool, int | None], ...] = ()
    notes: tuple[str, ...] = ()
    updated: float = 0.0
    #: the rollouts of each split of the table's switch: ``train``, ``val``, ``all``
    splits: dict[str, int] = field(default_factory=dict)


def _partition_key(part: tuple[bool, int | None]) -> tuple[bool, bool, int]:
    return part[0], part[1] is None, part[1] or 0


class JsonlIngest:
    """JSONL files copied into a dataset as they grow: each poll reads the complete lines
    written since the last one (up to the last newline) and writes their trajectories with
    the dataset's writer. A file that shrinks or is replaced is read again from its start
    (the copy is made again from every file)."""

    #: bytes read per file per poll, so one poll of a large backlog does not hold the refresh
    CHUNK = 32 * 1024 * 1024

    def __init__(self, paths: Sequence[str], folder: str, run: str) -> None:
        self.paths = [os.path.abspath(p) for p in paths]
        self.folder, self.run = folder, run
        self.offsets: dict[str, int] = {}
        self.inodes: dict[str, int] = {}
        self.bad_lines = 0
        self.lines = 0
        self.missing: list[str] = []
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from ..dataset.layout import open_store
            from ..dataset.writer import DatasetWriter

            os.makedirs(self.folder, exist_ok=True)
            self._writer = DatasetWriter(open_store(self.folder), self.run, compact_files=8, idle_s=5.0,
                                         stats_prefix="serve.jsonl_copy")
        return self._writer

    def _reset(self) -> None:
        """Start the copy again (a file shrank or was replaced)."""
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        shutil.rmtree(self.folder, ignore_errors=True)
        self.offsets.clear()
        self.inodes.clear()
        self.lines = self.bad_lines = 0

    def poll(self) -> int:
        """Copy what was appended since the last poll; returns the trajectories copied."""
        from ..report.load import _health, _loads
        from ..trajectory import Trajectory

        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if path in self.inodes and (st.st_ino != self.inodes[path] or st.st_size < self.offsets.get(path, 0)):
                logger.info("rtrace serve: %s was replaced or cut: copying every file again", path)
                self._reset()
                break
        copied = 0
        missing = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                missing.append(path)
                continue
            self.inodes[path] = st.st_ino
            start = self.offsets.get(path, 0)
            if st.st_size <= start:
                continue
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(min(self.CHUNK, st.st_size - start))
            end = data.rfind(b"\n")
            if end < 0:
                if len(data) >= self.CHUNK:  # one line longer than a chunk: skip it rather than stall
                    self.bad_lines += 1
                    self.offsets[path] = start + len(data)
                continue
            trajs, events = [], []
            for line in data[:end].split(b"\n"):
                if not line.strip():
                    continue
                self.lines += 1
                try:
                    raw = _loads(line)
                    if is_event_line(raw):  # a run event (docs/jsonl-schema.md): to the copy's events table
                        events.append(RunEvent.from_wire(raw))
                        continue
                    traj = Trajectory.from_dict(raw)
                    traj.health = _health(raw.get("health", None))
                    trajs.append(traj)
                except (ValueError, KeyError, TypeError, AttributeError):
                    self.bad_lines += 1
            self.offsets[path] = start + end + 1
            if trajs:
                self.writer.write(trajs)
                copied += len(trajs)
            if events:  # weight updates: the timeline's lines (rtrace.mark_weight_update)
                try:
                    self.writer.write_events(events)
                except Exception as exc:  # counted by the writer (write_errors); the trajectories stay
                    logger.warning("rtrace serve: could not copy %d run events: %s", len(events), exc)
        self.missing = missing
        if self._writer is not None:
            self._writer.compact(idle_only=True)
        return copied

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class FlatIndex:
    """A run's flat index: a table in a DuckDB file attached to the run's connection, with
    :func:`rtrace.report.queries.index_select`'s columns, ``_file`` (the data file a row came
    from) and ``_row`` (the file's number here, shifted 32 bits, plus the row's position in it:
    a row keeps its number when the table is built again), kept equal to the run's
    trajectories files; and the answers' words (:class:`~rtrace.serve.search.WordIndex`)."""

    def __init__(self, path: str, alias: str) -> None:
        from .search import WordIndex

        self.path, self.alias = path, alias
        self.table = f"{alias}.t"
        self.files: set[str] = set()
        self.columns: tuple[str, ...] | None = None
        #: a data file's number (new files get larger ones: rows past the word index's ``upto`` are the newest)
        self.numbers: dict[str, int] = {}
        self.words = WordIndex(alias)
        self._attached = False

    def _source(self, paths: Sequence[str]) -> str:
        from ..dataset.reader import parquet_source

        numbers = ", ".join(f"({Q._literal(p)}, {self.numbers[p]})" for p in paths)
        query = parquet_source(paths, ", filename = '_file', file_row_number = true")
        return (f"({query}) AS _rtrace_data JOIN (VALUES {numbers}) AS _rtrace_files(_file, _no) USING (_file)")

    def _select(self, columns: Sequence[Q.Column]) -> str:
        return f"{Q.index_select(columns)}, _file, (CAST(_no AS BIGINT) << 32) + file_row_number AS _row"

    def update(self, cursor: Any, paths: set[str], columns: Sequence[Q.Column]) -> None:
        """Make the index hold the rows of ``paths`` (full paths of the run's trajectories
        files) with ``columns``' outcome and annotation columns: added files read, removed
        files' rows deleted; built again when the columns changed."""
        if not self._attached:
            cursor.execute(f"ATTACH {Q._literal(self.path)} AS {self.alias}")
            self._attached = True
        for p in sorted(paths - self.numbers.keys()):
            self.numbers[p] = len(self.numbers)
        names = tuple(c.name for c in columns)
        if names != self.columns:  # an outcome key appeared: the table's columns change, build it again
            if paths:
                cursor.execute(f"CREATE OR REPLACE TABLE {self.table} AS SELECT {self._select(columns)} FROM "
                               f"{self._source(sorted(paths))} ORDER BY _row")
                cursor.execute(f"CHECKPOINT {self.alias}")  # compressed now, not when the log fills
            else:
                cursor.execute(f"DROP TABLE IF EXISTS {self.table}")
                self.words.reset(cursor)
            self.columns = names if paths else None
            self.files = set(paths)
            return
        new, gone = sorted(paths - self.files), sorted(self.files - paths)
        if not new and not gone:
            return
        cursor.execute("BEGIN TRANSACTION")
        try:  # one transaction: a reader never sees a compacted step twice, or not at all
            if gone:
                cursor.execute(f"DELETE FROM {self.table} WHERE _file IN ({', '.join(Q._literal(g) for g in gone)})")
            if new:
                cursor.execute(f"INSERT INTO {self.table} BY NAME SELECT {self._select(columns)} FROM "
                               f"{self._source(new)} ORDER BY _row")
            cursor.execute("COMMIT")
        except Exception:
            cursor.execute("ROLLBACK")
            raise
        self.files = set(paths)

    def index_words(self, cursor: Any, budget_s: float | None = None) -> int:
        """One slice of the word index's build (:meth:`~rtrace.serve.search.WordIndex.build`);
        the rows it indexed."""
        if self.columns is None:
            return 0
        n = self.words.build(cursor, self.table, budget_s)
        if not n:
            self.words.compact(cursor, self.table)
        return n


class RunSource:
    """One served run: ``dataset`` (a folder or URL) or ``jsonl`` files (copied into
    ``cache_dir``). Build with :func:`sources_from_paths`."""

    def __init__(self, name: str, dataset: str | None = None, jsonl: Sequence[str] = (),
                 cache_dir: str | None = None, index: bool = True) -> None:
        self.name = name
        self.cache_dir = cache_dir
        self.index_wanted = index
        self.index: FlatIndex | None = None
        self.jsonl = list(jsonl)
        self.ingest: JsonlIngest | None = None
        if self.jsonl:
            assert cache_dir is not None
            self.path = os.path.join(cache_dir, "copy", name)
            self.ingest = JsonlIngest(self.jsonl, self.path, name)
            self.shown_path = ", ".join(self.jsonl)
        else:
            assert dataset is not None
            self.path = dataset
            self.shown_path = dataset
        self.run: Any = None
        self.snapshot = Snapshot(problem="not read yet")
        self._lock = threading.Lock()  # the run's connection: refresh and cursor creation
        self._files: dict[tuple[bool, int | None], frozenset[str]] = {}
        self._seen: set[str] = set()
        #: (data file, (map, kind, key)) -> the file's rows carrying that outcome / annotation key
        self._keys: dict[tuple[str, tuple[str, str, str]], int] = {}
        self._steps: dict[tuple[bool, int], Any] = {}
        self._extras: dict[tuple[bool, int], dict[str, float]] = {}
        self._rates: dict[tuple[bool, int], dict[str, float]] = {}
        self._read_once = False
        self._cache: dict[Any, Any] = {}
        self._cache_version = -1

    # ----------------------------------------------------------------- queries
    def cursor(self) -> Any:
        with self._lock:
            if self.run is None:
                raise NoData(self.snapshot.problem or "no dataset")
            return self.run.cursor()

    def files_of(self, key: tuple[bool, int | None]) -> tuple[frozenset[str], int]:
        """The data files of a step, and the run's events files (what a step's timeline is built from)."""
        from ..dataset.schema import EVENTS

        events = len(self.run.files.get(EVENTS, ())) if self.run is not None else 0
        return self._files.get(key, frozenset()), events

    def db(self, limit_ms: float) -> TimedDb:
        return TimedDb(self, limit_ms, self.snapshot.table)

    def cached(self, key: Any, compute: Any) -> Any:
        """``compute()``'s result for ``key`` at the run's current version (a few dozen kept):
        the histograms of a filter do not change when the table is sorted or paged."""
        version = self.snapshot.version
        if self._cache_version != version:
            self._cache.clear()
            self._cache_version = version
        if key in self._cache:
            return self._cache[key]
        value = compute()
        if len(self._cache) >= 64:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = value
        return value

    # ----------------------------------------------------------------- refreshing
    def _open(self) -> str | None:
        """Open the run if it can be; None, or why not in words."""
        from ..dataset.layout import is_url
        from ..dataset.reader import DatasetError, open_run

        if not is_url(self.path) and not os.path.isdir(self.path):
            if self.ingest is not None:
                return ("no trajectory in " + self.shown_path + " yet (waiting for the first line)"
                        if not self.ingest.missing else f"no file {', '.join(self.ingest.missing)} yet")
            return f"no dataset at {self.path} yet: nothing written (waiting for the run's first trajectories)"
        try:
            self.run = open_run(self.path)
        except DatasetError as exc:
            return str(exc)
        except (OSError, ValueError) as exc:
            return f"cannot read {self.path}: {exc}"
        return None

    def refresh(self) -> bool:
        """List the run's files again (copy new JSONL lines first) and update the caches of
        the steps whose files changed; then index a slice of the answers' words. True when
        something changed."""
        if self.ingest is not None:
            self.ingest.poll()
        with self._lock:
            if self.run is None:
                problem = self._open()
                if problem is not None:
                    if problem != self.snapshot.problem:
                        self.snapshot = Snapshot(version=self.snapshot.version + 1, problem=problem,
                                                 updated=time.time())
                        return True
                    return False
            else:
                self.run.refresh()
        first = not self._read_once

        def update() -> bool:
            with self._lock:
                files = self._partition_files()
            changed = {p for p in set(files) | set(self._files) if files.get(p) != self._files.get(p)}
            if changed or first:
                self._update(files, changed)
            return bool(changed)

        # a file merged away between the listing and the reads: listed again, read again
        changed = self.retrying(update)
        self._read_once = True
        self.index_words()
        return changed or first

    def retrying(self, fn: Any) -> Any:
        """``fn()``, read again over a new listing when a file of the run was merged away
        meanwhile (:meth:`rtrace.dataset.Run.retrying`)."""
        run = self.run
        return run.retrying(fn) if run is not None else fn()

    def index_words(self, budget_s: float | None = None) -> int:
        """Index a slice of the answers' words not indexed yet (the text search's index, built
        on the refresh thread a slice per refresh); the rows indexed."""
        if self.index is None or self.index.columns is None or self.run is None:
            return 0
        cursor = self.run.cursor()
        try:
            return self.index.index_words(cursor, budget_s)
        finally:
            cursor.close()

    def _partition_files(self) -> dict[tuple[bool, int | None], frozenset[str]]:
        """(validate, step) -> the data files (of both tables) holding it, from the run's listing."""
        from ..dataset.schema import SPANS, TRAJECTORIES

        out: dict[tuple[bool, int | None], set[str]] = {}
        for table in (TRAJECTORIES, SPANS):
            for rel in self.run.files[table]:
                for key in self.run.file_steps(rel):
                    out.setdefault(key, set()).add(rel)
        return {k: frozenset(v) for k, v in out.items()}

    def _update(self, files: dict[tuple[bool, int | None], frozenset[str]], changed: set[Any]) -> None:
        from ..dataset.schema import TRAJECTORIES
        from ..report.queries import RelationDb

        db = RelationDb(_CursorTarget(self))
        # outcome and annotation keys and how many rows carry each: from the files not read before
        # only, counted per file (a compacted file's counts replace those of the files it merged)
        listed = set(self.run.files[TRAJECTORIES])
        new_files = [rel for rel in self.run.files[TRAJECTORIES] if rel not in self._seen]
        if new_files and self.run.store.local:
            from ..dataset.reader import parquet_source

            paths = {self.run.store.path(r): r for r in new_files}
            found = Q.discover_keys(db, f"({parquet_source(sorted(paths), ', filename = ' + Q._literal('_file'))})",
                                    by_file=True)
            self._keys.update({(paths.get(f, f), key): n for (f, key), n in found.items()})
        elif new_files:
            self._keys = {("", key): n for key, n in Q.discover_keys(db).items()}
            listed.add("")
        self._keys = {k: n for k, n in self._keys.items() if k[0] in listed}
        self._seen = set(self.run.files[TRAJECTORIES])
        # the step table, curves and health of the steps whose files changed
        steps = {k for k in changed if k in files and k[1] is not None}
        for key in changed - set(files):
            for cache in (self._steps, self._extras, self._rates):
                cache.pop(key, None)  # type: ignore[arg-type]
        if steps:
            if len(steps) > 64:
                where, params = "true", []
            else:
                where = " OR ".join("(validate = ? AND step = ?)" for _ in steps)
                params = [x for key in sorted(steps, key=_partition_key) for x in key]
            for row in Q.step_rows(db, where, params):
                self._steps[(row[0], row[1])] = row
            extras = Q.step_extras(db, where, params)
            rates = Q.step_health_rates(db, where, params)
            for key in steps:
                self._extras[key] = extras.get(key, {})
                self._rates[key] = rates.get(key, {})
        names, rows = db.rows("SELECT validate, step, count(*) FROM trajectories GROUP BY ALL")
        counts = {(bool(v), s): n for v, s, n in rows}
        total = sum(counts.values())
        carried: dict[tuple[str, str, str], int] = {}
        for (_, key), n in self._keys.items():
            carried[key] = carried.get(key, 0) + n
        columns = Q.columns_of(carried, total)
        table = "trajectories"
        if self.index_wanted and self.run.store.local and self.cache_dir is not None:
            if self.index is None:
                alias = "rtrace_idx_" + "".join(c if c.isalnum() else "_" for c in self.name)[:40] + f"_{id(self)}"
                self.index = FlatIndex(os.path.join(self.cache_dir, f"index-{id(self)}.duckdb"), alias)
            cursor = self.run.cursor()
            try:
                self.index.update(cursor, {self.run.store.path(r) for r in self.run.files[TRAJECTORIES]}, columns)
            finally:
                cursor.close()
            if self.index.columns is not None:
                table, columns = self.index.table, Q.flat_columns(columns)
        notes = [f"skipped {s.path}: {s.reason}" for s in self.run.skipped]
        if self.ingest is not None and self.ingest.bad_lines:
            notes.append(f"{self.ingest.bad_lines:,} lines of {self.shown_path} are not rtrace trajectories (skipped)")
        problem = None if total else f"{self.shown_path}: the run has no trajectory yet"
        self._files = files
        self.snapshot = Snapshot(
            version=self.snapshot.version + 1, problem=problem, trajectories=total,
            columns=tuple(columns), table=table,
            steps=tuple(self._steps[k] for k in sorted(self._steps, key=_partition_key) if k in counts),
            extras=dict(self._extras), rates=dict(self._rates),
            partitions=tuple(sorted(counts, key=_partition_key)), notes=tuple(notes), updated=time.time(),
            splits={"train": sum(n for (v, _), n in counts.items() if not v),
                    "val": sum(n for (v, _), n in counts.items() if v), "all": total})

    def close(self) -> None:
        if self.ingest is not None:
            self.ingest.close()
        with self._lock:
            if self.run is not None:
                self.run.close()
                self.run = None


class _CursorTarget:
    """``sql(query, params=...)`` on a fresh cursor (the refresh thread's queries)."""

    def __init__(self, source: RunSource) -> None:
        self.source = source

    def sql(self, query: str, params: Any = None) -> Any:
        return _Materialized(self.source.run.cursor(), query, params)


class _Materialized:
    def __init__(self, cursor: Any, query: str, params: Any) -> None:
        cursor.execute(query, params or None)
        self.columns = [d[0] for d in cursor.description]
        self._rows = cursor.fetchall()
        cursor.close()

    def fetchall(self) -> list[tuple]:
        return self._rows


class Sources:
    """Every served run, by name, refreshed on one thread every ``refresh_s`` seconds."""

    def __init__(self, runs: Sequence[RunSource], refresh_s: float = 1.0, cache_dir: str | None = None) -> None:
        self.runs = {r.name: r for r in runs}
        self.refresh_s = refresh_s
        self.cache_dir = cache_dir or tempfile.mkdtemp(prefix="rtrace-serve-")
        for run in runs:  # a run's flat index goes to the server's temporary folder
            if run.cache_dir is None:
                run.cache_dir = self.cache_dir
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    def refresh(self) -> bool:
        changed = False
        for source in self.runs.values():
            try:
                changed |= source.refresh()
            except Exception as exc:  # a bad file, a vanished folder: said on the page, never the end of the server
                if source.name not in self._warned:
                    self._warned.add(source.name)
                    logger.warning("rtrace serve: cannot refresh run %s: %s", source.name, exc)
                source.snapshot = Snapshot(version=source.snapshot.version + 1, problem=f"cannot read the run: {exc}",
                                           updated=time.time())
        return changed

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rtrace-serve-refresh", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for source in self.runs.values():
            source.close()
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def _name_of(path: str) -> str:
    from ..dataset.layout import run_name

    base = os.path.basename(path.rstrip("/").split("?")[0]) or "run"
    if base.endswith(".jsonl"):
        base = base[: -len(".jsonl")]
    return run_name(base)


def sources_from_paths(paths: Sequence[str], refresh_s: float = 1.0) -> Sources:
    """The runs of ``rtrace serve PATH ...``:

    - a folder or URL holding a run's dataset (``trajectories/``): that run;
    - a dataset root holding runs (the parquet sink's ``RTRACE_PARQUET_PATH``): each of them;
    - JSONL files: one run (several workers' files merge, as ``rtrace report`` reads them);
    - ``NAME=PATH``: names the run (JSONL files with the same name are one run);
    - a path that does not exist yet: a run that will appear there (its page says it is waiting).
    """
    from ..dataset.layout import is_url
    from ..dataset.reader import list_runs

    datasets: list[tuple[str, str]] = []
    jsonl: dict[str, list[str]] = {}
    default_jsonl: str | None = None
    for spec in paths:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name or not name or os.path.exists(spec):
            name, path = "", spec
        if path.endswith(".jsonl") or (os.path.isfile(path) and not is_url(path)):
            if not name:
                default_jsonl = default_jsonl or _name_of(path)
                name = default_jsonl
            jsonl.setdefault(name, []).append(path)
            continue
        local = not is_url(path)
        if local and os.path.isdir(path) and not os.path.isdir(os.path.join(path, "trajectories")):
            runs = list_runs(path)
            if runs:
                datasets += [(r, os.path.join(path, r)) for r in runs]
                continue
        datasets.append((name or _name_of(path), path))
    cache_dir = tempfile.mkdtemp(prefix="rtrace-serve-")  # the JSONL copies, the runs' flat indexes
    sources: list[RunSource] = []
    taken: set[str] = set()
    for name, path in datasets:
        sources.append(RunSource(_unique(name, taken), dataset=path, cache_dir=cache_dir))
    for name, files in jsonl.items():
        sources.append(RunSource(_unique(name, taken), jsonl=files, cache_dir=cache_dir))
    return Sources(sources, refresh_s=refresh_s, cache_dir=cache_dir)


def _unique(name: str, taken: set[str]) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name}-{i}", i + 1
    taken.add(out)
    return out
