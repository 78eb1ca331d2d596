"""Writing a run's dataset: one writer per sink, files per partition, compaction.

Each batch becomes one file per (table, validate, step) it touches, written whole
(:meth:`rtrace.dataset.layout.Store.write`): the spans file first, then the trajectories
file, so a trajectory row is only ever visible with its spans already there (a merge
writes the trajectories file first and keeps it if the spans file fails:
:meth:`DatasetWriter._write_pair`). A batch is
written when ``write`` returns (in place, whole: the JSONL sink's durability, see
:attr:`rtrace.dataset.layout.Store.fsync`); a failure (a full disk, a revoked bucket) loses
that batch's open files and nothing written before.

Compaction keeps a step a small set of files: a writer merges *its own* files of a
partition (numbered from one count per writer) into one (``<writer>-<first>-<last>``, which
covers every number of that writer from first to last in that folder) when it has
``compact_files`` new ones, when the partition has had no new file for ``idle_s`` seconds,
and at shutdown; a merged file
stops growing at ``target_bytes`` (the next merge starts a new one). The merged file is
renamed into place before its inputs are deleted, and readers skip a file whose numbers a
merged file of the same writer covers (:class:`~rtrace.dataset.layout.FileName`), so a
reader never counts a row twice, and a crash between the two steps leaves only files that
readers skip (the next merge of that partition, by any writer's restart, never touches
them: they belong to a writer that is gone; ``rtrace.dataset.vacuum`` removes them).
Writers never touch each other's files: no coordination, no name written twice.

Finished steps are then merged across steps: a partition merged into one file and idle for
``idle_s`` is finished; ``steps_per_file`` finished steps of one folder (``train`` or
``validate``) that no step still being written lies between are merged into one file of
``steps/`` (``<writer>-<first>-<last>.s<first step>-<last step>``, a row group per step;
it stops short at ``target_bytes``), so a run's file count grows with its steps divided
by ``steps_per_file``, not with its steps: an engine pays for each file it opens (DuckDB
about half a millisecond for this schema). Such a file covers this writer's files of those
steps whose numbers are in its range, and every one of them is in it: the writer keeps
every finished step's file until it is merged, and a step written to again (a late
trajectory) is taken out of the finished ones first; its later files have numbers past the
merged file's. A file of steps/ never covers another one (steps/ files are never merged
again), and no chunk of finished steps gets a name whose number and step ranges hold an
earlier steps/ file's (the chunk stops short): such a name would say it holds that file's
rows. Finished steps that never make a whole file (the last ones of a run) stay one file
each.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .. import _stats
from ..trajectory import Trajectory
from . import encode
from .layout import FileName, Store, partition_dir, steps_dir
from .schema import EVENTS, SELECTION_KEY, SPANS, TRAJECTORIES

__all__ = ["DatasetWriter", "WriteResult", "ROW_GROUP_ROWS"]

#: Rows per row group: large enough for scans (DuckDB and Spark split work by row group),
#: small enough that a step of a few thousand rollouts is one group read at once.
ROW_GROUP_ROWS = 65536
#: Columns worth a dictionary (few distinct values): on the others (ids, texts) Arrow would
#: try one, find it too large and fall back, which costs a fifth of the write.
DICTIONARY = {TRAJECTORIES: ["run", "name", "experiment", "group_id", "group_key", "verdict", "status", "finish_reason",
                             "kept", "health", "job_id"],
              SPANS: ["run", "name", "kind", "status_code", "group_id", "model", "tool_name", "finish_reasons"],
              EVENTS: ["run", "kind", "worker"]}
#: Columns with min/max statistics (what engines prune row groups and files by); those of
#: long texts would cost time and footer bytes for nothing.
STATISTICS = {TRAJECTORIES: ["step", "validate", "sample_index", "rollout_n", "policy_version", "reward", "advantage",
                             "start_time", "end_time", "duration_ms", "num_turns", "verdict", "group_key"],
              SPANS: ["step", "validate", "sample_index", "rollout_n", "kind", "start_time", "duration_ms"],
              EVENTS: ["time", "step", "version"]}


@dataclass
class _Partition:
    validate: bool
    step: int | None
    #: this writer's live files: (name, bytes of both tables)
    files: list[tuple[FileName, int]] = field(default_factory=list)
    last_write: float = 0.0


class _HalfMerged(Exception):
    """A merge's trajectories file is in place, its spans file failed (``cause``): the
    merged trajectories file stays (it covers its inputs), the spans inputs stay as they are."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class WriteResult:
    written: int = 0
    failed: int = 0
    degraded: int = 0
    unwritable: int = 0


class DatasetWriter:
    """Writes batches of trajectories into one run's dataset (``store``)."""

    #: finished steps per file of steps/ (the sink's; a test lowers it for a small run)
    STEPS_PER_FILE = 32

    def __init__(self, store: Store, run: str, compact_files: int = 8, idle_s: float = 30.0,
                 target_bytes: int = 256 * 1024 * 1024, stats_prefix: str = "sink.parquet",
                 cache_bytes: int = 64 * 1024 * 1024, steps_per_file: int | None = None,
                 every_rollout: bool = False, selection: dict[str, Any] | None = None) -> None:
        self.store = store
        self.run = run
        #: how the writer's process chose the trajectories it keeps (``SELECTION_KEY`` in every
        #: file's metadata): readers cut several writers' per-step samples with the same rule
        self.selection = json.dumps(selection, sort_keys=True).encode() if selection else None
        #: the run counts every rollout (a row each, summaries included): every row is in_sample
        self.every_rollout = every_rollout
        self.writer_id = os.urandom(8).hex()
        self.compact_files = max(2, compact_files)
        #: finished steps merged into one file of steps/ (0 or 1: never)
        self.steps_per_file = self.STEPS_PER_FILE if steps_per_file is None else steps_per_file
        #: validate -> step -> the finished step's one file (name, bytes of both tables), until merged into steps/
        self._finished: dict[bool, dict[int, tuple[FileName, int]]] = {False: {}, True: {}}
        #: validate -> finished steps left as they are (a step that fills a file alone, a merge
        #: that failed): like steps being written, no file of steps/ spans them (it would cover them)
        self._kept: dict[bool, set[int]] = {False: set(), True: set()}
        #: validate -> the files of steps/ this writer wrote (or tried to): no later one may hold
        #: both their number and their step ranges (earlier readers took such a file for covering
        #: the older one: they dropped its rows and their vacuum deleted it). Pruned of the files
        #: whose numbers lie before every file the writer still holds (no later name reaches them).
        self._merged: dict[bool, list[FileName]] = {False: [], True: []}
        self.idle_s = idle_s
        self.target_bytes = target_bytes
        self.prefix = stats_prefix
        self._parts: dict[tuple[bool, int | None], _Partition] = {}
        #: the number of the writer's next file: one count for all partitions, so a partition's
        #: entry can be forgotten once it is merged and idle (its numbers are never drawn again)
        self._next_seq = 0
        self._writes = 0
        #: the partitions with two files or more to merge (checked after each write)
        self._pending: set[tuple[bool, int | None]] = set()
        #: the Arrow tables of the latest files written, so a merge re-reads none of them:
        #: (partition, name) -> (trajectories, spans), at most cache_bytes of Arrow data
        self._cache: OrderedDict[tuple[tuple[bool, int | None], FileName], tuple[pa.Table, pa.Table]] = OrderedDict()
        self._cache_bytes = 0
        self.cache_limit = cache_bytes
        self._lock = threading.Lock()  # write / compact / close may come from two threads (flush, shutdown)
        #: this writer's files of the events table and their rows (a few per step: merged at close)
        self._events: list[tuple[FileName, pa.Table]] = []

    def _count(self, what: str, n: int = 1) -> None:
        _stats.incr(f"{self.prefix}.{what}", n)

    # ----------------------------------------------------------------- writing
    def write(self, trajectories: Sequence[Trajectory], rows: Sequence[encode.Rows | None] | None = None) -> WriteResult:
        """Write a batch (``rows``: each trajectory's :func:`~rtrace.dataset.encode.rows_of`
        when computed already). Returns what was written and what failed; raises nothing
        for a failed write (it is counted: ``write_errors``)."""
        result = WriteResult()
        groups: dict[tuple[bool, int | None], list[int]] = {}
        for i, traj in enumerate(trajectories):
            groups.setdefault(encode.partition_of(traj), []).append(i)
        with self._lock:
            for key, idx in groups.items():
                part_trajs = [trajectories[i] for i in idx]
                part_rows = [rows[i] if rows is not None else None for i in idx]
                self._write_partition(key, part_trajs, part_rows, result)
            now = time.monotonic()
            self._compact_due(now)
            self._writes += 1
            if self._writes % 64 == 0:  # without flush() calls too (a collector that runs for days)
                self._prune(now)
        return result

    def write_events(self, events: Sequence[Any]) -> None:
        """Write the run's events (``RunEvent``: weight updates) as one small file of
        ``events/`` (its own folder: the trajectories' and spans' compaction never sees it;
        :meth:`close` merges this writer's into one).

        Raises:
            Exception: the file could not be written (counted: ``write_errors``).
        """
        table = encode.events_table(events, self.run)
        with self._lock:
            name = FileName(self.writer_id, self._next_seq, self._next_seq)
            self._next_seq += 1
            try:
                size = self.store.write(f"{EVENTS}/{name}", lambda out: self._parquet(table, out, EVENTS, "zstd"))
            except Exception:
                self._count("write_errors")
                raise
            self._count("files_written")
            self._count("bytes_written", size)
            self._events.append((name, table))

    def _merge_events(self) -> None:
        """This writer's event files as one (``<writer>-<first>-<last>``, covering them), then
        the inputs deleted; a failure leaves them as they are (counted)."""
        if len(self._events) < 2:
            return
        names = [n for n, _ in self._events]
        merged = FileName(self.writer_id, names[0].first, names[-1].last)
        table = pa.concat_tables([t for _, t in self._events])
        try:
            size = self.store.write(f"{EVENTS}/{merged}", lambda out: self._parquet(table, out, EVENTS, "zstd"))
        except Exception:
            self._count("compaction_errors")
            return
        self._count("files_written")
        self._count("bytes_written", size)
        self._events = [(merged, table)]
        for name in names:
            self._delete(f"{EVENTS}/{name}")

    def _write_partition(self, key: tuple[bool, int | None], trajs: list[Trajectory], rows: list[Any],
                         result: WriteResult) -> None:
        ttable, stable, degraded, unwritable = self._encode(trajs, rows)
        result.degraded += degraded
        result.unwritable += unwritable
        result.failed += unwritable
        if ttable.num_rows == 0:
            return
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _Partition(*key)
            done = self._finished[key[0]].pop(key[1], None) if key[1] is not None else None
            if done is not None:  # a late trajectory of a finished step: its file is the partition's again
                part.files.append(done)
        name = FileName(self.writer_id, self._next_seq, self._next_seq)
        self._next_seq += 1  # never reused, even if this write fails: no name is written twice
        try:
            size = self._write_pair(part, name, ttable, stable)
        except Exception as exc:
            self._count("write_errors")
            _stats.warn_once(f"parquet-write-{type(exc).__name__}", "rtrace parquet sink could not write %s: %s",
                             f"{partition_dir(TRAJECTORIES, *key)}/{name}", exc)
            result.failed += ttable.num_rows
            return
        part.files.append((name, size))
        part.last_write = time.monotonic()
        result.written += ttable.num_rows
        self._remember(key, name, ttable, stable)
        if len(part.files) >= 2:
            self._pending.add(key)

    def _encode(self, trajs: list[Trajectory], rows: list[Any]) -> tuple[pa.Table, pa.Table, int, int]:
        try:
            t, s = encode.tables([r if r is not None else encode.rows_of(t, self.run, self.every_rollout)
                                  for t, r in zip(trajs, rows)])
            return t, s, 0, 0
        except Exception:  # one trajectory at a time, degrading what Arrow refuses
            return encode.encode_safely(trajs, self.run, self.every_rollout)

    def _write_pair(self, part: _Partition, name: FileName, ttable: Any, stable: Any) -> int:
        """Write a file of each table. Returns the bytes written. ``ttable`` / ``stable``: a
        table, or a list of tables each written as its own row groups (a file of steps/: a
        step per row group).

        A batch's new file (one number): the spans file, then the trajectories file (a row
        is never visible without its spans); if the second fails the first is removed (it
        covers nothing). A merged file: the trajectories file, then the spans file, and if
        the second fails the first stays (:class:`_HalfMerged`): it covers its inputs from
        the moment it is renamed into place, so a ``vacuum`` may already have deleted them;
        removing it then would lose their rows. Each table is still read once: from the
        merged file in one, from the inputs in the other."""
        if name.steps is not None:
            srel, trel = (f"{steps_dir(t, part.validate)}/{name}" for t in (SPANS, TRAJECTORIES))
        else:
            srel = f"{partition_dir(SPANS, part.validate, part.step)}/{name}"
            trel = f"{partition_dir(TRAJECTORIES, part.validate, part.step)}/{name}"
        # a batch's file is snappy (fast; most are merged soon), a merged file zstd (smaller, for keeps)
        merge = name.first != name.last or name.steps is not None
        codec = "zstd" if merge else "snappy"
        if merge:
            tsize = self.store.write(trel, lambda out: self._parquet(ttable, out, TRAJECTORIES, codec))
            try:
                ssize = self.store.write(srel, lambda out: self._parquet(stable, out, SPANS, codec))
            except Exception as exc:
                self._count("files_written")
                self._count("bytes_written", tsize)
                raise _HalfMerged(exc) from exc
        else:
            ssize = self.store.write(srel, lambda out: self._parquet(stable, out, SPANS, codec))
            try:
                tsize = self.store.write(trel, lambda out: self._parquet(ttable, out, TRAJECTORIES, codec))
            except BaseException:
                try:
                    self.store.delete(srel)
                except Exception:
                    pass
                raise
        self._count("files_written", 2)
        self._count("bytes_written", ssize + tsize)
        return ssize + tsize

    def _parquet(self, table: Any, out: Any, name: str, codec: str) -> None:
        tables = table if isinstance(table, list) else [table]
        metadata = dict(tables[0].schema.metadata or {})
        metadata[b"rtrace.writer"] = self.writer_id.encode()
        metadata[b"rtrace.run"] = self.run.encode()
        if self.selection is not None:
            metadata[SELECTION_KEY.encode()] = self.selection
        if len(tables) == 1:
            pq.write_table(tables[0].replace_schema_metadata(metadata), out, row_group_size=ROW_GROUP_ROWS,
                           compression=codec, use_dictionary=DICTIONARY[name], write_statistics=STATISTICS[name])
            return
        schema = tables[0].schema.with_metadata(metadata)
        with pq.ParquetWriter(out, schema, compression=codec, use_dictionary=DICTIONARY[name],
                              write_statistics=STATISTICS[name]) as writer:
            for t in tables:  # each its own row groups: a query on one step reads that step's
                writer.write_table(t.replace_schema_metadata(metadata), row_group_size=ROW_GROUP_ROWS)

    def _remember(self, key: tuple[bool, int | None], name: FileName, ttable: pa.Table, stable: pa.Table) -> None:
        self._cache[(key, name)] = (ttable, stable)
        self._cache_bytes += ttable.nbytes + stable.nbytes
        while self._cache_bytes > self.cache_limit and self._cache:
            _, (t, s) = self._cache.popitem(last=False)
            self._cache_bytes -= t.nbytes + s.nbytes

    def _forget(self, key: tuple[bool, int | None], name: FileName) -> None:
        tables = self._cache.pop((key, name), None)
        if tables is not None:
            self._cache_bytes -= tables[0].nbytes + tables[1].nbytes

    def _read(self, key: tuple[bool, int | None], name: FileName, table: str) -> pa.Table:
        """A file of this writer: from the cache, else read back (one file, no dataset discovery)."""
        cached = self._cache.get((key, name))
        if cached is not None:
            return cached[0] if table == TRAJECTORIES else cached[1]
        rel = f"{partition_dir(table, *key)}/{name}"
        if self.store.local:
            return pq.ParquetFile(self.store.path(rel)).read()
        with self.store.arrow_fs().open_input_file(self.store.path(rel)) as f:
            return pq.ParquetFile(f).read()

    # ----------------------------------------------------------------- compaction
    def _compact_due(self, now: float) -> None:
        for key in list(self._pending):
            part = self._parts[key]
            small = self._mergeable(part)
            if len(small) < 2:
                self._pending.discard(key)
                continue
            # new (unmerged) files count: a merged file is rewritten once per compact_files new ones
            fresh = sum(1 for f, _ in small if f.first == f.last)
            if fresh >= self.compact_files or (len(small) >= 2 and now - part.last_write >= self.idle_s):
                self._compact(part, small)

    def _prune(self, now: float, everything: bool = False) -> None:
        """Put away the partitions done with (one file, idle; ``everything``: all of them,
        the writer closes): the table stays as small as the steps in flight. A finished step
        waits in ``_finished`` to be merged into steps/ (a late trajectory of it makes it a
        partition again, its file with it); the others (a NULL or negative step) are forgotten."""
        for key, part in list(self._parts.items()):
            if len(part.files) <= 1 and (everything or now - part.last_write >= self.idle_s):
                del self._parts[key]
                if part.files and self.steps_per_file > 1 and part.step is not None and part.step >= 0 \
                        and part.step not in self._kept[part.validate]:
                    self._finished[part.validate][part.step] = part.files[0]
        self._merge_steps_due()

    def _merge_steps_due(self) -> None:
        """Merge each run of ``steps_per_file`` finished steps (or of ``target_bytes``) with no
        step being written between them into one file of steps/."""
        for validate, finished in self._finished.items():
            if len(finished) < min(2, self.steps_per_file) or self.steps_per_file <= 1:
                continue
            active = sorted({k[1] for k in self._parts if k[0] == validate and k[1] is not None} | self._kept[validate])
            self._prune_merged(validate)
            chunk: list[int] = []
            size = 0
            for step in sorted(finished):
                if chunk and active and bisect.bisect_right(active, chunk[-1]) != bisect.bisect_left(active, step):
                    chunk, size = [], 0  # a step being written lies between: its files must not be covered
                if chunk and self._would_hold_merged(validate, [finished[s][0] for s in chunk + [step]],
                                                     (chunk[0], step)):
                    chunk, size = [], 0  # the name would hold an earlier steps/ file's ranges: keep names tight
                if finished[step][1] >= self.target_bytes:
                    del finished[step]  # alone it fills a file: it stays as it is
                    self._kept[validate].add(step)
                    chunk, size = [], 0
                    continue
                chunk.append(step)
                size += finished[step][1]
                if len(chunk) >= self.steps_per_file or (size >= self.target_bytes and len(chunk) >= 2):
                    self._merge_steps(validate, chunk)
                    chunk, size = [], 0

    def _would_hold_merged(self, validate: bool, inputs: list[FileName], steps: tuple[int, int]) -> bool:
        """A file of steps/ merging ``inputs`` (of steps ``steps[0]..steps[1]``) would have
        ranges of numbers and of steps that hold those of a steps/ file written before: it
        would not hold that file's rows (steps/ files are never merged again), but its name
        would say it does."""
        first, last = min(n.first for n in inputs), max(n.last for n in inputs)
        return any(first <= m.first and m.last <= last and steps[0] <= m.steps[0] and m.steps[1] <= steps[1]
                   for m in self._merged[validate] if m.steps is not None)

    def _prune_merged(self, validate: bool) -> None:
        """Forget the steps/ files no later name can hold: a name's numbers start at its
        inputs' lowest, and every later input is a file the writer holds now or a new one."""
        held = [f.first for k, p in self._parts.items() if k[0] == validate for f, _ in p.files]
        held += [f.first for f, _ in self._finished[validate].values()]
        floor = min(held, default=self._next_seq)
        self._merged[validate] = [m for m in self._merged[validate] if m.first >= floor]

    def _merge_steps(self, validate: bool, steps: list[int]) -> None:
        finished = self._finished[validate]
        inputs = [finished[s][0] for s in steps]
        merged = FileName(self.writer_id, min(n.first for n in inputs), max(n.last for n in inputs),
                          steps=(steps[0], steps[-1]))
        self._merged[validate].append(merged)  # before writing: a failed merge may leave one table's file
        part = _Partition(validate, None)
        try:
            tables: dict[str, list[pa.Table]] = {}
            for table in (TRAJECTORIES, SPANS):
                tables[table] = [self._read((validate, s), n, table) for s, n in zip(steps, inputs)]
            self._write_pair(part, merged, tables[TRAJECTORIES], tables[SPANS])
        except Exception as exc:
            self._count("compaction_errors")
            half = isinstance(exc, _HalfMerged)
            cause = exc.cause if isinstance(exc, _HalfMerged) else exc
            _stats.warn_once(f"parquet-merge-steps-{type(cause).__name__}", "rtrace parquet sink could not merge steps "
                             "%s-%s of %s (%s): %s", steps[0], steps[-1], steps_dir(TRAJECTORIES, validate),
                             "their trajectories are merged, their spans files stay as they are" if half else
                             "their files stay as they are", cause)
            for s, name in zip(steps, inputs):  # not tried again: the step files stay, one each
                del finished[s]
                self._kept[validate].add(s)
                if half:  # the merged trajectories file holds them: the step's own are duplicates
                    self._forget((validate, s), name)
                    self._delete(f"{partition_dir(TRAJECTORIES, validate, s)}/{name}")
            return
        for s, name in zip(steps, inputs):
            del finished[s]
            self._forget((validate, s), name)
            for table in (TRAJECTORIES, SPANS):
                self._delete(f"{partition_dir(table, validate, s)}/{name}")
        self._count("compactions")
        self._count("files_compacted", 2 * len(inputs))

    def _mergeable(self, part: _Partition) -> list[tuple[FileName, int]]:
        """The files a merge would take: every file after the last merged one that is full."""
        files = part.files
        start = 0
        for i, (name, size) in enumerate(files):
            if size >= self.target_bytes and name.first != name.last:  # a full merged file stays as it is
                start = i + 1
        return files[start:]

    def compact(self, idle_only: bool = False) -> None:
        """Merge the partitions with more than one mergeable file (``idle_only``: only those
        idle for ``idle_s``, or with ``compact_files`` of them)."""
        with self._lock:
            if idle_only:
                now = time.monotonic()
                self._compact_due(now)
                self._prune(now)
                return
            for key in list(self._pending):
                small = self._mergeable(self._parts[key])
                if len(small) >= 2:
                    self._compact(self._parts[key], small)

    def _compact(self, part: _Partition, files: list[tuple[FileName, int]]) -> None:
        names = [f for f, _ in files]
        merged = FileName(self.writer_id, names[0].first, names[-1].last)
        key = (part.validate, part.step)
        try:
            tables = {}
            for table in (TRAJECTORIES, SPANS):
                parts = [self._read(key, n, table) for n in names]
                # the metadata of the files read back says who wrote them: the merged file says it anew
                tables[table] = pa.concat_tables([t.replace_schema_metadata(parts[0].schema.metadata) for t in parts],
                                                 promote_options="none")
            size = self._write_pair(part, merged, tables[TRAJECTORIES], tables[SPANS])
        except _HalfMerged as exc:
            self._count("compaction_errors")
            _stats.warn_once(f"parquet-compact-{type(exc.cause).__name__}", "rtrace parquet sink could not compact "
                             "%s (its trajectories are merged, its spans files stay as they are): %s",
                             partition_dir(TRAJECTORIES, part.validate, part.step), exc.cause)
            # the merged trajectories file is there for good: the writer leaves its inputs' numbers
            # behind (no later merge of this partition or steps/ file may take them again)
            part.files = [f for f in part.files if f[0] not in names]
            self._pending.discard(key)
            if part.step is not None and part.step >= 0:
                self._kept[part.validate].add(part.step)
            for name in names:
                self._forget(key, name)
                self._delete(f"{partition_dir(TRAJECTORIES, part.validate, part.step)}/{name}")
            return
        except Exception as exc:
            self._count("compaction_errors")
            _stats.warn_once(f"parquet-compact-{type(exc).__name__}", "rtrace parquet sink could not compact %s "
                             "(its files stay as they are): %s", partition_dir(TRAJECTORIES, part.validate, part.step),
                             exc)
            return
        # the merged file is in place: the inputs are now duplicates readers skip; delete them
        part.files = [f for f in part.files if f[0] not in names] + [(merged, size)]  # the inputs were a suffix
        self._pending.discard(key)
        for name in names:
            self._forget(key, name)
        if size < self.target_bytes:  # the next merge of this partition takes it again
            self._remember(key, merged, tables[TRAJECTORIES], tables[SPANS])
        for name in names:
            for table in (TRAJECTORIES, SPANS):
                self._delete(f"{partition_dir(table, part.validate, part.step)}/{name}")
        self._count("compactions")
        self._count("files_compacted", 2 * len(names))

    def _delete(self, rel: str) -> None:
        """Delete a merged input (a failure is counted: readers skip it, ``vacuum`` removes it)."""
        try:
            self.store.delete(rel)
        except Exception:
            self._count("delete_errors")

    def close(self) -> None:
        """Merge every partition with more than one file (the end of the run's writing), then
        every ``steps_per_file`` finished steps into steps/."""
        self.compact()
        with self._lock:
            self._merge_events()
            self._prune(time.monotonic(), everything=True)
