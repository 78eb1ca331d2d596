"""Reading a run's dataset through DuckDB: :func:`open_run` and :class:`Run`.

A :class:`Run` lists the run's files once (and again at :meth:`Run.refresh`), keeps the
ones that are data, and gives two DuckDB views over them on its own connection,
``trajectories`` and ``spans``. What it leaves out, and why:

- a hidden ``.<name>.tmp`` file: a file being written (not yet renamed into place);
- a file a compacted file of the same writer covers: its rows are in that file (the
  writer deletes it right after; a reader that lists in between must not count them twice);
- a file that is not the dataset's (another name, another folder), cut short (no Parquet
  footer) or damaged (a footer that does not parse: each file's footer is read once, when
  it is first listed): skipped with a warning naming it, counted in ``run.skipped`` and
  ``rtrace.stats()`` (``dataset.files_skipped``), never a failed query over the whole run.

A run that is being written changes under its readers: a writer's merge deletes its inputs
right after the merged file is in place, so a file listed a moment ago may be gone when
DuckDB opens it. A listing that meets a vanished file lists again; a query that fails
because a listed file is gone (:meth:`Run.retrying`) lists again and runs once more, at
most :data:`READ_ATTEMPTS` times in all (``dataset.reads_retried``). The relations
:meth:`Run.sql`, :attr:`Run.trajectories` and :attr:`Run.spans` give do so on their own: a
DuckDB relation reads the views as they are when it runs, so the same relation runs again
over the new listing.

A file written by a newer major version of the schema (``.v2.`` in its name) stops the
reader: :class:`SchemaVersionError` says which file and which version, and that a newer
rtrace reads it.

The views read local files with DuckDB's own Parquet reader: the files of ``step=N``
folders with ``hive_partitioning`` (a query on one step opens that step's files only), the
many-step files of ``steps/`` without it (the step is in the file; a query on one step
reads that step's row groups, by their statistics), the two as one ``UNION ALL BY NAME``
(:func:`parquet_source`). A run on object storage (``s3://`` ...) is read through pyarrow's
filesystem (DuckDB scans the pyarrow dataset, with projection and filters pushed down), so
no DuckDB extension is needed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from .. import _stats
from .layout import FileName, Store, is_steps_file, open_store, parse_name, parse_partition, parse_steps_dir
from .schema import EVENTS, MAJOR, SELECTION_KEY, SPANS, TRAJECTORIES, VERSION, arrow_schema

__all__ = ["open_run", "Run", "Relation", "DatasetError", "SchemaVersionError", "Skipped", "list_runs", "vacuum",
           "hf_load_kwargs", "parquet_source", "READ_ATTEMPTS"]

logger = logging.getLogger("rtrace")

#: Attempts at a listing, or at a query, when a file listed is gone (a writer's merge replaced
#: it meanwhile): each one lists again. A merge replaces a partition's files once per
#: ``compact_files`` batches, so a second attempt almost always finds the new listing whole.
READ_ATTEMPTS = 4


T = TypeVar("T")
#: :meth:`Run._check` of a file deleted since it was listed
_GONE = object()


class DatasetError(Exception):
    """The path is not an rtrace dataset (the message says what was found)."""


class SchemaVersionError(DatasetError):
    """A file of the run was written by a newer, incompatible schema version."""


@dataclass(frozen=True)
class Skipped:
    """A file the reader left out: its path (relative to the run) and why."""

    path: str
    reason: str


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise ImportError("reading an rtrace dataset needs duckdb: pip install 'rtrace[parquet]'") from None
    return duckdb


class Run:
    """One run's dataset, queried with DuckDB. Build it with :func:`open_run`.

    Attributes a program uses: :attr:`trajectories` and :attr:`spans` (DuckDB relations),
    :meth:`sql` (a query with ``$name`` / ``?`` parameters over the two views),
    :meth:`steps`, :meth:`refresh` (pick up files written since), :attr:`skipped`.
    Any other attribute is the ``trajectories`` relation's: ``run.df()``, ``run.pl()``,
    ``run.filter("step = 3")``, ``run.aggregate(...)``.

    One connection per Run: DuckDB connections are not shared between threads; a thread
    of its own calls :meth:`cursor` (a cursor sees the same views).
    """

    def __init__(self, path: str, connection: Any = None) -> None:
        duckdb = _duckdb()
        self.path = path
        self.store: Store = open_store(path)
        self.con = connection if connection is not None else duckdb.connect()
        for option in ("SET parquet_metadata_cache = true", "SET enable_object_cache = true"):
            try:  # footers read once per connection (the setting's name moved between versions)
                self.con.execute(option)
                break
            except Exception:
                continue
        self._lock = threading.Lock()
        #: Arrow objects the views read (an empty table, a remote run's pyarrow dataset): a
        #: DuckDB cursor does not see its connection's registrations, so cursor() registers them again
        self._registered: dict[str, Any] = {}
        #: files checked once: name -> size (a data file never changes once in place)
        self._checked: dict[str, int] = {}
        self._bad: dict[str, str] = {}
        self.skipped: list[Skipped] = []
        #: (table) -> the data files read, relative to the run
        self.files: dict[str, list[str]] = {TRAJECTORIES: [], SPANS: [], EVENTS: []}
        self._steps: set[tuple[bool, int | None]] = set()
        #: a data file (relative) -> the (validate, step) it holds; a steps/ file's from its footer, read once
        self._file_steps: dict[str, tuple[tuple[bool, int | None], ...]] = {}
        #: a trajectories file (relative) -> the selection its writer ran (SELECTION_KEY), read once
        self._selection: dict[str, dict[str, Any]] = {}
        #: (validate, step) written by several writers -> (its files, the cut's kept reasons by
        #: trace id, whether the run counts every rollout)
        self._cuts: dict[tuple[bool, int | None], tuple[frozenset, dict[str, list[str]], bool]] = {}
        if not self.store.exists(TRAJECTORIES):
            runs = list_runs(path)
            hint = f"; it holds runs: {', '.join(runs)} (open one: {os.path.join(path, runs[0])})" if runs else ""
            raise DatasetError(f"{path}: not an rtrace run dataset (no trajectories/ folder){hint}")
        self.refresh()

    # ----------------------------------------------------------------- files
    def refresh(self) -> "Run":
        """List the run's files again: new files are read from now on, files a compaction
        replaced are dropped. Cheap when nothing changed (each file is checked once). A file
        that vanishes while it is listed (a writer's merge replaced it) makes it list again.

        Raises:
            SchemaVersionError: a file of a newer major version appeared.
        """
        with self._lock:
            for attempt in range(READ_ATTEMPTS):
                last = attempt == READ_ATTEMPTS - 1
                if not self._list(last) and not last:
                    _stats.incr("dataset.reads_retried")
                    continue
                try:
                    self._views()  # binding a view opens a file of it
                except Exception:
                    if last or not self._vanished():
                        raise
                    _stats.incr("dataset.reads_retried")
                    continue
                break
        return self

    def _list(self, last: bool) -> bool:
        """One listing: :attr:`files`, :attr:`skipped` and the steps. False when a listed
        file vanished before it was checked (the listing may miss the file that replaced
        it); on the ``last`` attempt such files are left out and the listing kept."""
        files: dict[str, list[tuple[str, FileName]]] = {TRAJECTORIES: [], SPANS: [], EVENTS: []}
        steps: set[tuple[bool, int | None]] = set()
        skipped: list[Skipped] = []
        whole = True
        for rel, size in [f for table in (TRAJECTORIES, SPANS) for f in self.store.list(table)]:
            folder, _, name = rel.rpartition("/")
            if name.startswith("."):  # a file being written, or a hidden file: not data
                continue
            part: tuple[str, bool, int | None] | None = parse_partition(folder)
            fname = parse_name(name)
            if part is None and fname is not None and fname.steps is not None:
                many = parse_steps_dir(folder)
                part = (many[0], many[1], None) if many is not None else None
            elif fname is not None and fname.steps is not None:
                part = None  # a many-step file belongs in steps/, never in a step=N folder
            if part is None or fname is None:
                skipped.append(self._skip(rel, "not a file of an rtrace dataset (name or folder)"))
                continue
            self._readable(rel, fname)
            reason = self._check(rel, size, part[1], fname)
            if reason is _GONE:
                whole = False
                continue
            if reason is not None:
                skipped.append(self._skip(rel, reason))
                continue
            files[part[0]].append((rel, fname))
            if fname.steps is None:
                self._file_steps[rel] = ((part[1], part[2]),)
        for rel, size in self.store.list(EVENTS):
            folder, _, name = rel.rpartition("/")
            if name.startswith("."):
                continue
            fname = parse_name(name)
            if folder != EVENTS or fname is None or fname.steps is not None:
                skipped.append(self._skip(rel, "not a file of an rtrace dataset (name or folder)"))
                continue
            self._readable(rel, fname)
            reason = self._check(rel, size, False, fname)
            if reason is _GONE:
                whole = False
            elif reason is not None:
                skipped.append(self._skip(rel, reason))
            else:
                files[EVENTS].append((rel, fname))
        if not whole and not last:
            return False
        for table in files:
            self.files[table] = _uncovered(files[table])
        for rel in self.files[TRAJECTORIES]:
            steps.update(self._file_steps[rel])
        listed = set(self.files[TRAJECTORIES]) | set(self.files[SPANS]) | set(self.files[EVENTS])
        self._file_steps = {k: v for k, v in self._file_steps.items() if k in listed}
        self.skipped = skipped
        self._steps = steps
        return whole

    def _readable(self, rel: str, name: FileName) -> None:
        """Raise :class:`SchemaVersionError` for a file of a newer major version than this reader's."""
        if name.major > MAJOR:
            raise SchemaVersionError(
                f"{os.path.join(self.path, rel)} was written with rtrace dataset schema {name.major}.x; this "
                f"rtrace reads schema {VERSION} (major {MAJOR}): upgrade rtrace to read this run")

    def _vanished(self) -> bool:
        """Is a file of :attr:`files` gone (merged away since the listing)? One listing."""
        present = {rel for table in (TRAJECTORIES, SPANS, EVENTS) for rel, _ in self.store.list(table)}
        return any(rel not in present for table in (TRAJECTORIES, SPANS, EVENTS) for rel in self.files[table])

    def retrying(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a query over the views, with its fetch), run again after :meth:`refresh`
        when it failed because a file the run listed is gone (a writer's merge replaced it
        after the listing): at most :data:`READ_ATTEMPTS` times in all. Any other error is
        raised as it is.

        The relations :meth:`sql`, :attr:`trajectories` and :attr:`spans` give already run
        through it; a query on a :meth:`cursor` of another thread goes through it by hand."""
        errors = (_duckdb().Error, OSError)  # what a missing file raises (DuckDB's, pyarrow's)
        for attempt in range(READ_ATTEMPTS):
            try:
                return fn()
            except errors:
                if attempt == READ_ATTEMPTS - 1 or not self._vanished():
                    raise
                _stats.incr("dataset.reads_retried")
                self.refresh()
        raise AssertionError("unreachable")  # pragma: no cover

    def _skip(self, rel: str, reason: str) -> Skipped:
        if rel not in self._bad:
            self._bad[rel] = reason
            _stats.incr("dataset.files_skipped")
            logger.warning("rtrace dataset: skipped %s: %s", os.path.join(self.path, rel), reason)
        return Skipped(rel, reason)

    def _check(self, rel: str, size: int, validate: bool, name: FileName) -> Any:
        """None for a whole Parquet file, :data:`_GONE` for one deleted since it was listed,
        else why it is skipped. Each file's footer is read once (a data file never changes
        once in place): a file cut short has none, a damaged one does not parse (DuckDB
        would fail every query over the run on it, naming no file); a ``steps/`` file's
        steps are read from it."""
        if self._checked.get(rel) == size:
            return None
        if rel in self._bad:
            return self._bad[rel]
        if size < 12:
            return f"cut short ({size} bytes: not a whole Parquet file)"
        try:
            meta = self.store.read_metadata(rel)
        except Exception as exc:
            if not self.store.exists(rel):
                return _GONE
            try:
                tail = self.store.read_range(rel, -4, 4)
            except OSError:
                tail = b""
            if tail != b"PAR1":  # a Parquet file ends with its footer's magic: a cut file does not
                return "cut short or not Parquet (no Parquet footer)"
            return f"damaged: its Parquet footer does not parse ({type(exc).__name__}: {str(exc).strip()[:200]})"
        if name.steps is not None:
            self._file_steps[rel] = _steps_of(meta, validate, name)
        selection = (meta.metadata or {}).get(SELECTION_KEY.encode())
        if selection is not None:
            try:
                self._selection[rel] = json.loads(selection)
            except ValueError:
                pass  # a selection that does not parse: its steps are not cut (as before 1.2)
        self._checked[rel] = size
        return None

    def _views(self) -> None:
        # the run's events (1.2): one row per event id (each collector of a job writes the
        # events it got: all of them), in time order
        self.con.execute(f"CREATE OR REPLACE VIEW {EVENTS} AS SELECT * FROM (SELECT DISTINCT ON (event_id) * FROM "
                         f"({self._source(EVENTS)}) ORDER BY event_id, time) ORDER BY time, event_id")
        sources = {table: self._source(table) for table in (TRAJECTORIES, SPANS)}
        cut = self._cut(sources[TRAJECTORIES])
        if cut is None:
            for table, source in sources.items():
                self.con.execute(f"CREATE OR REPLACE VIEW {table} AS {source}")
            return
        # several collectors' samples of a step, cut to the one-collector sample (dataset/cut.py):
        # a row the cut leaves out reads as a rollout counted by its summary, its spans are not shown
        self.con.execute(
            f"CREATE OR REPLACE VIEW {TRAJECTORIES} AS SELECT t.* REPLACE ("
            "CASE WHEN c.trace_id IS NULL THEN t.kept ELSE c.kept END AS kept, "
            "CASE WHEN c.out THEN false ELSE t.recorded END AS recorded, "
            "CASE WHEN c.out AND NOT c.every THEN false ELSE t.in_sample END AS in_sample) "
            f"FROM ({sources[TRAJECTORIES]}) t LEFT JOIN {cut} c ON t.trace_id = c.trace_id")
        self.con.execute(f"CREATE OR REPLACE VIEW {SPANS} AS SELECT s.* FROM ({sources[SPANS]}) s "
                         f"ANTI JOIN (SELECT trace_id FROM {cut} WHERE out) o ON s.trace_id = o.trace_id")

    def _cut(self, source: str) -> str | None:
        """The registered table of the rows whose kept reasons the cut changes (trace_id, kept,
        out: left out, every: the run counts every rollout), or None when no step was written
        by several writers that chose by rank (dataset/cut.py). Only steps whose files changed
        are cut again."""
        writers: dict[tuple[bool, int | None], set[str]] = {}
        files: dict[tuple[bool, int | None], set[str]] = {}
        for rel in self.files[TRAJECTORIES]:
            name = parse_name(rel.rpartition("/")[2])
            for key in self._file_steps.get(rel, ()):
                if name is not None:
                    writers.setdefault(key, set()).add(name.writer)
                files.setdefault(key, set()).add(rel)
        multi = {k for k, w in writers.items() if len(w) > 1}
        self._cuts = {k: v for k, v in self._cuts.items() if k in multi}
        if not multi:
            return None
        stale = [k for k in multi if self._cuts.get(k, (None,))[0] != frozenset(files[k])]
        for key in stale:
            selection = next((self._selection[r] for r in sorted(files[key]) if r in self._selection), None)
            kept: dict[str, list[str]] = {}
            every = bool(selection and selection.get("summaries"))
            if selection is not None and (selection.get("val_cap") if key[0] else selection.get("cap")) is not None:
                from .cut import CANDIDATE_SQL, GROUPS_SQL, cut_step

                query = CANDIDATE_SQL.format(source=f"({source})", where="validate = ? AND step = ?")
                rows = [dict(zip(("validate", "step", "trace_id", "sample_index", "rollout_n", "group_id",
                                  "priority", "kept", "status", "truncated", "partial", "reward", "unhealthy",
                                  "annotations_double"), r))
                        for r in self.con.execute(query, [key[0], key[1]]).fetchall()]
                groups = None
                if rows and selection.get("keep_zero_variance"):
                    grouped = self.con.execute(GROUPS_SQL.format(source=f"({source})", where="validate = ? AND step = ?"),
                                               [key[0], key[1]])
                    names = [d[0] for d in grouped.description]
                    groups = [dict(zip(names, g)) for g in grouped.fetchall()]
                kept = cut_step(rows, selection, groups) if rows else {}
            self._cuts[key] = (frozenset(files[key]), kept, every)
        import pyarrow as pa

        ids, reasons, out, every = [], [], [], []
        for _, cut, all_rows in self._cuts.values():
            for trace_id, why in cut.items():
                ids.append(trace_id)
                reasons.append(why)
                out.append(not why)
                every.append(all_rows)
        table = pa.table({"trace_id": pa.array(ids, pa.string()), "kept": pa.array(reasons, pa.list_(pa.string())),
                          "out": pa.array(out, pa.bool_()), "every": pa.array(every, pa.bool_())})
        return self._register("_rtrace_cut", table)

    def file_steps(self, rel: str) -> tuple[tuple[bool, int | None], ...]:
        """``(validate, step)`` of what a data file of :attr:`files` holds (relative to the run):
        one for a ``step=N`` file, each of its steps for a ``steps/`` file."""
        return self._file_steps.get(rel, ())

    def _source(self, table: str) -> str:
        rels = self.files[table]
        if not rels:  # an empty table of the right columns, so queries still run
            return f"SELECT * FROM {self._register(f'_rtrace_empty_{table}', arrow_schema(table).empty_table())}"
        if self.store.local:
            if table == EVENTS:  # one folder, no partitions
                listed = ", ".join("'" + self.store.path(r).replace("'", "''") + "'" for r in rels)
                return f"SELECT * FROM read_parquet([{listed}], hive_partitioning = false, union_by_name = true)"
            return parquet_source([self.store.path(r) for r in rels])
        import pyarrow.dataset as pads

        ds = pads.dataset([self.store.path(r) for r in rels], filesystem=self.store.arrow_fs(), format="parquet",
                          schema=arrow_schema(table))
        return f"SELECT * FROM {self._register(f'_rtrace_arrow_{table}', ds)}"

    def _register(self, name: str, obj: Any) -> str:
        self.con.register(name, obj)
        self._registered[name] = obj
        return name

    # ----------------------------------------------------------------- queries
    @property
    def trajectories(self) -> Any:
        """The ``trajectories`` view as a DuckDB relation (:class:`Relation`)."""
        return Relation(self, self.retrying(lambda: self.con.table(TRAJECTORIES)))

    @property
    def spans(self) -> Any:
        """The ``spans`` view as a DuckDB relation (:class:`Relation`)."""
        return Relation(self, self.retrying(lambda: self.con.table(SPANS)))

    @property
    def events(self) -> Any:
        """The ``events`` view (the trainer's weight updates, one row per event) as a DuckDB
        relation (:class:`Relation`)."""
        return Relation(self, self.retrying(lambda: self.con.table(EVENTS)))

    def sql(self, query: str, params: Any = None) -> Any:
        """A DuckDB relation (:class:`Relation`) of ``query`` over the views ``trajectories``
        and ``spans``; ``params``: a list for ``?`` or a dict for ``$name`` placeholders
        (values are never pasted into the SQL). None for a statement without a result."""
        rel = self.retrying(lambda: self.con.sql(query) if params is None else self.con.sql(query, params=params))
        return Relation(self, rel) if rel is not None else None

    def cursor(self) -> Any:
        """A DuckDB cursor on the run's connection, for another thread (same views; call it
        again after :meth:`refresh`)."""
        cursor = self.con.cursor()
        for name, obj in self._registered.items():
            cursor.register(name, obj)
        return cursor

    def steps(self, validate: bool | None = None) -> list[tuple[bool, int | None]]:
        """``(validate, step)`` of every partition with trajectories, training first, steps
        ascending (from the file listing: no data is read)."""
        return sorted((s for s in self._steps if validate is None or s[0] == validate),
                      key=lambda s: (s[0], s[1] is None, s[1] or 0))

    def load(self, where: str = "true", params: Any = None, limit: int | None = None) -> list[Any]:
        """The :class:`~rtrace.trajectory.Trajectory` objects of the trajectories matching
        ``where`` (SQL over the trajectories view), with their spans: ``run.load("step = ?", [3])``.
        Rows of rollouts counted by their summary only (``recorded`` false) are no trajectories:
        they are left out (read them with :meth:`sql`)."""
        from .encode import to_trajectories

        limit_sql = f" LIMIT {int(limit)}" if limit is not None else ""
        traj = _arrow(self.sql(f"SELECT * FROM trajectories WHERE recorded IS NOT FALSE AND ({where}){limit_sql}",
                               params))
        traj = _ints_for_times(traj)
        ids = traj.column("trace_id").to_pylist()
        if not ids:
            return []
        steps = sorted({s for s in traj.column("step").to_pylist() if s is not None})
        step_filter = f"step IN ({', '.join(str(int(s)) for s in steps)})" if steps else "step IS NULL"
        if None in traj.column("step").to_pylist() and steps:
            step_filter = f"({step_filter} OR step IS NULL)"
        self.con.register("_rtrace_ids", _ids_table(ids))
        try:
            spans = self.retrying(lambda: _arrow(self.con.sql(
                f"SELECT s.* FROM spans s SEMI JOIN _rtrace_ids i ON s.trace_id = i.trace_id WHERE {step_filter}")))
        finally:
            self.con.unregister("_rtrace_ids")
        return to_trajectories(traj.to_pylist(), _ints_for_times(spans).to_pylist())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("con", "store", "files", "path", "skipped", "events"):
            raise AttributeError(name)
        return getattr(self.trajectories, name)

    def __repr__(self) -> str:
        return (f"<rtrace Run {self.path!r}: {len(self.files[TRAJECTORIES])} trajectory files, "
                f"{len(self._steps)} steps, {len(self.skipped)} skipped>")

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Relation:
    """A DuckDB relation over a :class:`Run`'s views that lists the run again and runs once
    more when a file it read was merged away after the listing (:meth:`Run.retrying`).
    Everything else is the DuckDB relation's own (``.df()``, ``.fetchall()``, ``.filter()``
    ...): a method that returns a relation returns one of these; :attr:`relation` is the
    DuckDB object itself (to hand to DuckDB's own functions)."""

    __slots__ = ("run", "relation")

    def __init__(self, run: Run, relation: Any) -> None:
        self.run, self.relation = run, relation

    def __getattr__(self, name: str) -> Any:
        if name in ("run", "relation") or name.startswith("__"):  # unset slots (a copy being made)
            raise AttributeError(name)
        if name == "shape":  # the one property that runs the query (its row count)
            return self.run.retrying(lambda: self.relation.shape)
        value = getattr(self.relation, name)
        if not callable(value) or _is_relation(value):
            return self._wrap(value)

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(a.relation if isinstance(a, Relation) else a for a in args)
            kwargs = {k: v.relation if isinstance(v, Relation) else v for k, v in kwargs.items()}
            # the same relation again: DuckDB binds the views anew each time it runs one
            return self._wrap(self.run.retrying(lambda: getattr(self.relation, name)(*args, **kwargs)))

        call.__name__ = name
        call.__doc__ = getattr(value, "__doc__", None)
        return call

    def _wrap(self, value: Any) -> Any:
        return Relation(self.run, value) if _is_relation(value) else value

    def __repr__(self) -> str:  # DuckDB prints the first rows: it runs the query
        return self.run.retrying(lambda: repr(self.relation))

    def __str__(self) -> str:
        return self.run.retrying(lambda: str(self.relation))

    def __len__(self) -> int:
        return self.run.retrying(lambda: len(self.relation))

    def __getitem__(self, key: Any) -> Any:
        return self._wrap(self.run.retrying(lambda: self.relation[key]))


def _is_relation(value: Any) -> bool:
    return isinstance(value, _duckdb().DuckDBPyRelation)


def parquet_source(paths: Sequence[str], options: str = "") -> str:
    """A DuckDB query (``SELECT * FROM ...``) over local data files of one table (full paths):
    the files of ``step=N`` folders read with hive partitioning (a query on a step opens its
    files only), those of ``steps/`` without (their ``step`` is the file's: DuckDB would give
    a hive value precedence), as one ``UNION ALL BY NAME``. ``options``: more
    ``read_parquet`` options (``, filename = '_file'``)."""
    single = [p for p in paths if not is_steps_file(p)]
    many = [p for p in paths if is_steps_file(p)]
    reads = []
    for group, hive in ((single, "hive_partitioning = true, hive_types = {'step': BIGINT}"),
                        (many, "hive_partitioning = false")):
        if not group:
            continue
        listed = ", ".join("'" + p.replace("'", "''") + "'" for p in group)
        # files of one version have one schema: DuckDB reads the first footer at bind time and the
        # others as it scans; a run written by two minor versions (a column added) is read by
        # name across files (union_by_name reads every footer first: 2-3x the time)
        versions = {(n.major, n.minor) for n in (parse_name(os.path.basename(p)) for p in group) if n}
        union = ", union_by_name = true" if len(versions) > 1 else ""
        reads.append(f"SELECT * FROM read_parquet([{listed}], {hive}{union}{options})")
    return " UNION ALL BY NAME ".join(reads)


def _steps_of(meta: Any, validate: bool, name: FileName) -> tuple[tuple[bool, int | None], ...]:
    """The ``(validate, step)`` a ``steps/`` file holds, from its footer: the row groups'
    statistics of ``step`` (a row group without them: every step of the name's range)."""
    assert name.steps is not None
    column = next((i for i in range(meta.num_columns) if meta.schema.column(i).path == "step"), None)
    found: set[int] = set()
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(column).statistics if column is not None else None
        if stats is not None and stats.has_min_max and meta.row_group(g).num_rows:
            found.update(range(int(stats.min), int(stats.max) + 1))
        elif meta.row_group(g).num_rows:
            found.update(range(name.steps[0], name.steps[1] + 1))
    return tuple((validate, s) for s in sorted(found))


def _uncovered(files: list[tuple[str, FileName]]) -> list[str]:
    """The files no compacted file of the same writer covers: in their folder, or (a
    ``step=N`` file) a ``steps/`` file of the same table and train/validate folder holding
    its step. A ``steps/`` file is never covered (:meth:`FileName.covers`)."""
    covered = _covering(files)
    return [rel for rel, _ in files if rel not in covered]


def _covering(files: list[tuple[str, FileName]]) -> dict[str, list[str]]:
    """Each covered file of ``files`` -> the files covering it (see :func:`_uncovered`)."""
    by_folder: dict[tuple[str, str], list[tuple[str, FileName]]] = {}
    many: dict[tuple[str, str], list[tuple[str, FileName]]] = {}
    for rel, name in files:
        folder = rel.rpartition("/")[0]
        by_folder.setdefault((folder, name.writer), []).append((rel, name))
        if name.steps is not None:
            many.setdefault((folder.rpartition("/")[0], name.writer), []).append((rel, name))
    out: dict[str, list[str]] = {}
    for rel, name in files:
        folder = rel.rpartition("/")[0]
        siblings = by_folder[(folder, name.writer)]
        by = [r for r, other in siblings if other.covers(name)] if len(siblings) > 1 else []
        span = name.steps
        if span is None:
            part = parse_partition(folder)
            span = (part[2], part[2]) if part is not None and part[2] is not None else None
        if span is not None:
            by += [r for r, m in many.get((folder.rpartition("/")[0], name.writer), ()) if m.covers(name, span)]
        if by:
            out[rel] = by
    return out


def _arrow(relation: Any) -> Any:
    """A relation's result as a pyarrow Table (``.arrow()`` is a reader in DuckDB 2)."""
    for name in ("to_arrow_table", "fetch_arrow_table"):
        fn = getattr(relation, name, None)
        if fn is not None:
            return fn()
    result = relation.arrow()
    return result.read_all() if hasattr(result, "read_all") else result


def _ints_for_times(table: Any) -> Any:
    """Timestamps as int64 nanoseconds (to_pylist would round them to microseconds), whatever
    unit the engine gave them in: DuckDB before 2.0 (the last for Python 3.10) reads the files'
    time-zoned nanosecond timestamps as microseconds (docs/dataset.md)."""
    import pyarrow as pa

    def as_ns(ts: Any) -> Any:
        return pa.timestamp("ns", tz=ts.tz)

    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(as_ns(f.type)).cast(pa.int64()))
        elif pa.types.is_list(f.type) and pa.types.is_struct(f.type.value_type) and any(
                pa.types.is_timestamp(sub.type) for sub in f.type.value_type):
            subs = list(f.type.value_type)
            in_ns = [pa.field(sub.name, as_ns(sub.type) if pa.types.is_timestamp(sub.type) else sub.type)
                     for sub in subs]
            as_int = [pa.field(sub.name, pa.int64() if pa.types.is_timestamp(sub.type) else sub.type) for sub in subs]
            column = table.column(i).cast(pa.list_(pa.struct(in_ns))).cast(pa.list_(pa.struct(as_int)))
            table = table.set_column(i, f.name, column)
    return table


def _ids_table(ids: Sequence[str]) -> Any:
    import pyarrow as pa

    return pa.table({"trace_id": pa.array(ids, pa.string())})


def open_run(path: str | os.PathLike, connection: Any = None) -> Run:
    """Open a run's dataset (a local folder, or a URL: ``s3://bucket/prefix/run-7``).

    ``open_run(path)`` is the run, and also its ``trajectories`` as a DuckDB relation:
    ``rtrace.open_run("rtrace_dataset/run-7").df()`` is a pandas DataFrame of every
    trajectory, ``.pl()`` a polars one; ``run.sql("SELECT step, avg(reward) FROM
    trajectories WHERE NOT validate GROUP BY step")`` any query over ``trajectories`` and ``spans``.

    Raises:
        DatasetError: the path holds no run (the message lists the runs under it).
        SchemaVersionError: the run has files of a newer schema version.
        ImportError: duckdb is not installed (``pip install 'rtrace[parquet]'``).
    """
    return Run(os.fspath(path), connection)


def list_runs(path: str | os.PathLike) -> list[str]:
    """The runs under a dataset root (folders holding ``trajectories/``), sorted."""
    store = open_store(os.fspath(path))
    runs = set()
    if store.local:
        try:
            entries = sorted(os.listdir(store.root))
        except OSError:
            return []
        return [e for e in entries if os.path.isdir(os.path.join(store.root, e, TRAJECTORIES))]
    for rel, _ in store.list():
        parts = rel.split("/")
        if len(parts) > 2 and parts[1] == TRAJECTORIES:
            runs.add(parts[0])
    return sorted(runs)


#: :func:`vacuum` deletes a covered file only once a file covering it is this old (seconds)
VACUUM_GRACE_S = 3600.0


def vacuum(path: str | os.PathLike, grace_s: float = VACUUM_GRACE_S) -> list[str]:
    """Delete the files of a run that compacted files cover (left behind when a writer
    stopped between writing a compacted file and deleting its inputs) and temporary files
    older than an hour. Returns what was deleted. Safe while writers run: it deletes nothing
    a reader reads.

    A covered file goes only once a file covering it is whole (it ends with a Parquet
    footer: a file cut short by a power loss covers nothing) and ``grace_s`` seconds old
    (an hour by default; a covering file whose age the store does not tell counts as
    old): a writer of an earlier rtrace removed a merged file when the merge's second
    file failed, and a vacuum in between deleted the rows it covered. A hidden temporary
    file goes once it is an hour old (a file still being written is younger)."""
    import time

    run = open_store(os.fspath(path))
    deleted = []
    now = time.time()
    trusted: dict[str, bool] = {}

    def trust(rel: str, size: int) -> bool:
        if rel not in trusted:
            trusted[rel] = size >= 12 and _tail_ok(run, rel) and now - _mtime(run, rel, now - grace_s) >= grace_s
        return trusted[rel]

    for table in (TRAJECTORIES, SPANS):
        files, sizes = [], {}
        for rel, size in run.list(table):
            name = parse_name(rel.rpartition("/")[2])
            if name is not None:
                files.append((rel, name))
                sizes[rel] = size
        for rel, by in _covering(files).items():
            if any(trust(c, sizes[c]) for c in by):
                run.delete(rel)
                deleted.append(rel)
    if run.local:
        cutoff = now - 3600
        for folder, _, names in os.walk(run.root):
            for n in names:
                full = os.path.join(folder, n)
                if n.startswith(".") and n.endswith(".tmp") and os.stat(full).st_mtime < cutoff:
                    os.unlink(full)
                    deleted.append(os.path.relpath(full, run.root))
    return deleted


def _tail_ok(store: Store, rel: str) -> bool:
    try:
        return store.read_range(rel, -4, 4) == b"PAR1"
    except OSError:
        return False


def _mtime(store: Store, rel: str, unknown: float) -> float:
    """The file's modification time (seconds since the epoch); ``unknown`` if the store has none."""
    try:
        if store.local:
            return os.stat(store.path(rel)).st_mtime
        mtime = store.fs.get_file_info(store.path(rel)).mtime
        return mtime.timestamp() if mtime is not None else unknown
    except OSError:
        return float("inf")  # gone or unreadable: never old enough


def hf_load_kwargs(table: str = TRAJECTORIES) -> dict[str, Any]:
    """Keyword arguments for ``datasets.load_dataset("parquet", data_files=..., **kwargs)``:
    the table's columns without the typed maps, and their features. Hugging Face
    ``datasets`` has no map type (it fails on the file's schema otherwise); read the maps
    with DuckDB, polars or pandas."""
    import datasets
    import pyarrow as pa

    fields = [f for f in arrow_schema(table) if not pa.types.is_map(f.type)]
    return {"columns": [f.name for f in fields], "features": datasets.Features.from_arrow_schema(pa.schema(fields))}
