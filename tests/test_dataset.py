"""The parquet sink and the dataset reader: schema, layout, compaction, many writers, faults."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
duckdb = pytest.importorskip("duckdb")

import rtrace  # noqa: E402
from rtrace.config import ConfigError  # noqa: E402
from rtrace.dataset import encode, layout, schema  # noqa: E402
from rtrace.dataset.reader import SchemaVersionError, open_run, vacuum  # noqa: E402
from rtrace.dataset.schema import VERSION  # noqa: E402
from rtrace.dataset.writer import DatasetWriter  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402
from tests.dataset_run import PROMPTS, ROLLOUTS, STEPS, as_read_back, make_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _files(run_path):
    return sorted(str(p.relative_to(run_path)) for p in Path(run_path).rglob("*") if p.is_file())


def _vacuum_during_a_failing_merge(w, run_path):
    """Make the writer's next merge fail at its second file, with a vacuum (another process,
    documented as safe while writers run) run before each of the two merged files is written.
    Returns what the vacuums deleted."""
    orig, seen, deleted = w.store.write, [], []

    def write(rel, fill):
        name = layout.parse_name(rel.rpartition("/")[2])
        if name is not None and (name.first != name.last or name.steps is not None):
            deleted.extend(vacuum(run_path, grace_s=0))
            seen.append(rel)
            if len(seen) == 2:
                w.store.write = orig
                raise OSError(28, "No space left on device")
        return orig(rel, fill)

    w.store.write = write
    return deleted


def _counts(run_path):
    """(trajectories, distinct trace ids, spans, distinct trace ids of the spans)."""
    r = open_run(run_path)
    return r.sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall()[0] + r.sql(
        "SELECT count(*), count(DISTINCT trace_id) FROM spans").fetchall()[0]


@pytest.fixture(scope="module")
def _built(tmp_path_factory):
    """One run traced once for the module (rtrace is reset around it)."""
    from rtrace.testing import reset

    reset()
    built = make_run(str(tmp_path_factory.mktemp("dataset")))
    reset()
    return built


@pytest.fixture
def run(_built, tmp_path):
    """(run path, the trajectories the sinks got, jsonl path): a copy of the module's run, each
    test free to change its files."""
    path, trajs, jsonl = _built
    copy = tmp_path / "ds" / os.path.basename(path)
    shutil.copytree(path, copy)
    shutil.copy(jsonl, tmp_path / "traces.jsonl")
    return str(copy), trajs, str(tmp_path / "traces.jsonl")


# ----------------------------------------------------------------------------- schema
class TestSchema:
    def test_written_files_have_the_documented_schema(self, run):
        """Every file of both tables has exactly docs/dataset-schema.json's columns and types, and the
        version in its metadata."""
        path, _, _ = run
        documented = json.loads((ROOT / "docs" / "dataset-schema.json").read_text())
        assert documented == schema.schema_json()
        for table in ("trajectories", "spans"):
            files = list(Path(path, table).rglob("*.parquet"))
            assert files
            for f in files:
                got = pq.read_schema(f)
                # (types compared as the docs spell them: Parquet names a list's item "element")
                assert [(c.name, schema.type_text(c.type)) for c in got] == [
                    (c["name"], c["type"]) for c in documented["tables"][table]], f
                assert got.metadata[b"rtrace.schema"] == f"rtrace.dataset/{documented['version']}".encode()
                assert got.metadata[b"rtrace.table"] == table.encode()

    def test_docs_embed_the_column_tables(self):
        """docs/dataset.md holds exactly the generated column tables (rtrace.dataset.schema.reference_markdown())."""
        text = (ROOT / "docs" / "dataset.md").read_text()
        begin = "<!-- BEGIN GENERATED: rtrace.dataset.schema.reference_markdown() -->\n"
        assert text[text.index(begin) + len(begin):text.index("<!-- END GENERATED -->")] == schema.reference_markdown()

    def test_typed_columns_need_no_cast(self, run):
        """reward, the typed maps and the coordinates compare without a cast; ints stay ints."""
        path, trajs, _ = run
        r = open_run(path)
        assert r.sql("SELECT typeof(reward), typeof(step), typeof(annotations_double['advantage']), "
                     "typeof(outcome_bool['correct']), typeof(extra_int['difficulty']) FROM trajectories LIMIT 1"
                     ).fetchall() == [("DOUBLE", "BIGINT", "DOUBLE", "BOOLEAN", "BIGINT")]
        want = sum(1 for t in trajs if t.reward is not None and t.reward > 0.5)
        assert r.sql("SELECT count(*) FROM trajectories WHERE reward > 0.5").fetchall()[0][0] == want
        assert r.sql("SELECT count(*) FROM trajectories WHERE outcome_bool['correct']").fetchall()[0][0] == want


# ----------------------------------------------------------------------------- round trip
class TestRoundTrip:
    def test_every_trajectory_reads_back_as_the_sinks_got_it(self, run):
        """run.load() rebuilds each trajectory as the sinks received it: the same to_dict(), except the
        documented differences (group_id as text)."""
        path, trajs, _ = run
        loaded = {t.trace_id: t for t in open_run(path).load()}
        assert len(loaded) == len(trajs) == STEPS * PROMPTS * ROLLOUTS + PROMPTS
        for t in as_read_back(trajs):
            want = t.to_dict()
            got = loaded[t.trace_id].to_dict()
            want["group_id"] = None if t.group_id is None else str(t.group_id)
            for s in want["spans"]:  # rl.group_id is the group_id column, its text form
                if "rl.group_id" in s["attributes"]:
                    s["attributes"]["rl.group_id"] = str(s["attributes"]["rl.group_id"])
            assert got == want

    def test_columns_hold_the_derived_values(self, run):
        """verdict, finish reason, tokens, time split, task and answer are those of the model."""
        path, trajs, _ = run
        r = open_run(path)
        rows = {row[0]: row[1:] for row in r.sql(
            "SELECT trace_id, verdict, finish_reason, truncated, num_turns, num_tool_calls, input_tokens, "
            "output_tokens, duration_ms, generation_ms, tool_ms, task, answer, in_sample, epoch_ns(start_time) "
            "FROM trajectories").fetchall()}
        for t, back in zip(trajs, as_read_back(trajs)):  # durations as written; times as read back
            gen = sum(s.duration_ms for s in t.spans if s.kind == "generation")
            tool = sum(s.duration_ms for s in t.spans if s.kind == "tool")
            task = next(m["content"] for m in t.messages if m["role"] == "user")
            answer = [m["content"] for m in t.messages if m["role"] == "assistant"][-1]
            got = rows[t.trace_id]
            assert got[:7] == (t.verdict(), t.finish_reason, t.finish_reason == "length", t.num_turns,
                               t.num_tool_calls, 11 if not t.validate else 2, 7)
            assert math.isclose(got[7], t.duration_ms) and math.isclose(got[8], gen, abs_tol=1e-9)
            assert math.isclose(got[9], tool, abs_tol=1e-9)
            assert got[10:] == (task, answer, True, back.start_ns)

    def test_spans_table_has_otel_shape_and_coordinates(self, run):
        """One row per span: ids, parent, kind, times, status, rl.* columns, GenAI columns, token ids."""
        path, trajs, _ = run
        r = open_run(path)
        assert r.sql("SELECT count(*) FROM spans").fetchall()[0][0] == sum(len(t.spans) for t in trajs)
        row = r.sql("SELECT kind, step, sample_index, rollout_n, group_id, input_tokens, output_tokens, "
                    "finish_reasons, len(prompt_ids), len(response_ids), parent_span_id IS NOT NULL "
                    "FROM spans WHERE kind = 'generation' AND step = 1 AND sample_index = 2 AND rollout_n = 3"
                    ).fetchall()
        assert row == [("generation", 1, 2, 3, "p2", 11, 7, ["stop"], 11, 7, True)]
        joined = r.sql("SELECT count(*) FROM trajectories t JOIN spans s USING (trace_id) WHERE s.kind = 'tool'"
                       ).fetchall()[0][0]
        assert joined == sum(t.num_tool_calls for t in trajs)


# ----------------------------------------------------------------------------- layout
class TestLayout:
    def test_partitions_and_names(self, run):
        """train/ and validate/ folders, step=N partitions, one writer's numbered files, both tables
        with the same names; no temporary file left."""
        path, _, _ = run
        files = _files(path)
        assert not [f for f in files if os.path.basename(f).startswith(".")]
        parts = {os.path.dirname(f) for f in files}
        assert parts == {f"{t}/train/step={s}" for t in ("trajectories", "spans") for s in range(STEPS)} | {
            "trajectories/validate/step=0", "spans/validate/step=0"}
        names = [layout.parse_name(os.path.basename(f)) for f in files]
        assert None not in names and len({n.writer for n in names}) == 1
        for part in parts:
            if part.startswith("trajectories/"):
                twin = "spans/" + part.split("/", 1)[1]
                assert sorted(os.listdir(Path(path, part))) == sorted(os.listdir(Path(path, twin)))

    def test_shutdown_compacts_each_step_to_one_file(self, tmp_path):
        """With one flush per batch, a step gets several files; shutdown merges them into one per
        partition, and no row is lost or doubled."""
        path, trajs, _ = make_run(tmp_path, max_export_batch_size=3)
        per_part = Counter(os.path.dirname(f) for f in _files(path))
        assert set(per_part.values()) == {1}
        traj_names = [os.path.basename(f) for f in _files(path) if f.startswith("trajectories/")]
        assert len(set(traj_names)) == len(traj_names)  # one count per writer: no name in two folders
        r = open_run(path)
        assert sorted(r.sql("SELECT trace_id FROM trajectories").fetchall()) == sorted((t.trace_id,) for t in trajs)
        assert rtrace.stats()["sink.parquet.compactions"] >= STEPS

    def test_run_name_and_default(self, tmp_path):
        """The run folder is the experiment with unsafe characters replaced; unset: default."""
        assert layout.run_name("exp 7/a") == "exp_7_a" and layout.run_name(None) == "default"
        rtrace.configure(exporter="parquet", parquet_path=str(tmp_path / "ds"))
        with rtrace.rollout_context(step=1):
            pass
        assert rtrace.flush(30)
        rtrace.shutdown()
        assert open_run(tmp_path / "ds" / "default").sql("SELECT run, step FROM trajectories").fetchall() == [
            ("default", 1)]


class TestCompaction:
    def _writer(self, path, **kw):
        return DatasetWriter(layout.open_store(str(path)), "r", **kw)

    def _trajs(self, step, n, start=0, blob=0):
        from rtrace.trajectory import SpanRecord, Trajectory

        return [Trajectory(trace_id=f"{step:04d}{i:028x}", name="rollout", step=step, sample_index=i,
                           spans=[SpanRecord(span_id=f"{i:016x}", parent_id=None, name="rollout", kind="rollout",
                                             start_ns=i, end_ns=i + 10)], reward=float(i),
                           outcome={"blob": os.urandom(blob).hex()} if blob else {})
                for i in range(start, start + n)]

    def test_files_of_a_partition_merge_at_compact_files(self, tmp_path):
        """At compact_files new files a partition is merged into <writer>-<first>-<last>; the next
        compact_files new files merge into it. (No cache: every merge reads its files back.)"""
        w = self._writer(tmp_path, compact_files=3, cache_bytes=0)
        for k in range(7):
            w.write(self._trajs(1, 2, start=2 * k))
        names = sorted(os.listdir(tmp_path / "trajectories/train/step=1"))
        assert names == [f"{w.writer_id}-000000-000005.v{VERSION}.parquet",
                         f"{w.writer_id}-000006.v{VERSION}.parquet"]
        w.close()
        assert os.listdir(tmp_path / "trajectories/train/step=1") == [
            f"{w.writer_id}-000000-000006.v{VERSION}.parquet"]
        assert open_run(tmp_path).sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall()[0] == (
            14, 14)

    def test_a_full_merged_file_is_not_rewritten(self, tmp_path):
        """A merged file at target_bytes stays; the next merge starts a new one (bounded rewrite)."""
        blob = 200_000  # hardly compressible: a file's size is its data's, not the footer's
        probe = self._writer(tmp_path / "probe")
        probe.write(self._trajs(1, 2, blob=blob))
        probe.write(self._trajs(1, 2, start=2, blob=blob))
        probe.close()
        merged_size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*.parquet"))  # two batches merged
        w = self._writer(tmp_path, compact_files=2, target_bytes=int(merged_size * 0.9))
        for k in range(4):
            w.write(self._trajs(1, 2, start=2 * k, blob=blob))
        w.close()
        names = sorted(os.listdir(tmp_path / "trajectories/train/step=1"))
        assert names == [f"{w.writer_id}-000000-000001.v{VERSION}.parquet",
                         f"{w.writer_id}-000002-000003.v{VERSION}.parquet"]

    def test_inputs_left_after_a_crash_are_not_counted_twice(self, tmp_path):
        """A merged file and its inputs side by side (a writer stopped between rename and delete):
        readers count each row once; vacuum deletes the covered inputs."""
        w = self._writer(tmp_path, compact_files=100)
        for k in range(3):
            w.write(self._trajs(2, 2, start=2 * k))
        folder = tmp_path / "trajectories/train/step=2"
        backup = tmp_path / "backup"
        shutil.copytree(folder, backup)
        w.close()
        for name in os.listdir(backup):
            shutil.copy(backup / name, folder / name)  # the inputs are back
        assert len(os.listdir(folder)) == 4
        assert open_run(tmp_path).sql("SELECT count(*) FROM trajectories").fetchall()[0][0] == 6
        deleted = vacuum(tmp_path, grace_s=0)
        assert sorted(deleted) == sorted(f"trajectories/train/step=2/{n}" for n in os.listdir(backup))
        assert open_run(tmp_path).sql("SELECT count(*) FROM trajectories").fetchall()[0][0] == 6

    def test_a_merge_failing_half_way_loses_nothing_to_a_vacuum(self, tmp_path):
        """A partition's merge writes its first table's file, a vacuum deletes the inputs it
        covers, the second table's file fails: the first stays (removing it lost the rows the
        vacuum deleted), counted; every trajectory and span is read once, and later merges of
        the partition never take the numbers merged half way."""
        w = self._writer(tmp_path, compact_files=100, idle_s=1000, steps_per_file=2)
        for k in range(2):
            w.write(self._trajs(1, 2, start=2 * k))
        deleted = _vacuum_during_a_failing_merge(w, tmp_path)
        before = rtrace.stats().get("sink.parquet.compaction_errors", 0)
        w.compact()
        assert rtrace.stats()["sink.parquet.compaction_errors"] == before + 1
        assert len(deleted) == 2  # the vacuum did delete the first table's inputs
        assert _counts(tmp_path) == (4, 4, 4, 4)
        assert vacuum(tmp_path, grace_s=0) == []
        for k in range(2, 4):
            w.write(self._trajs(1, 2, start=2 * k))
        w.write(self._trajs(2, 2))
        w.write(self._trajs(3, 2))
        w.close()
        assert not (tmp_path / "trajectories/train/steps").exists() or not any(
            layout.parse_name(n).steps[0] <= 1 for n in os.listdir(tmp_path / "trajectories/train/steps"))
        assert _counts(tmp_path) == (12, 12, 12, 12)
        vacuum(tmp_path, grace_s=0)
        assert _counts(tmp_path) == (12, 12, 12, 12)

    def test_a_plain_glob_counts_leftovers_twice_until_vacuum(self, tmp_path):
        """docs/dataset.md: the engines' one-liners read every file, covered ones too; open_run
        skips them, and after vacuum the two agree."""
        w = self._writer(tmp_path, compact_files=100)
        for k in range(2):
            w.write(self._trajs(2, 2, start=2 * k))
        folder = tmp_path / "trajectories/train/step=2"
        backup = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
        w.close()
        for name, data in backup.items():
            (folder / name).write_bytes(data)
        glob = f"SELECT count(*) FROM '{tmp_path}/trajectories/**/*.parquet'"
        assert duckdb.sql(glob).fetchall() == [(8,)]
        assert open_run(tmp_path).sql("SELECT count(*) FROM trajectories").fetchall() == [(4,)]
        assert len(vacuum(tmp_path, grace_s=0)) == 2
        assert duckdb.sql(glob).fetchall() == [(4,)]

    def test_vacuum_trusts_only_a_whole_covering_file_past_its_grace(self, tmp_path):
        """vacuum deletes a covered file only once a file covering it is whole and grace_s old: a
        fresh one may still be removed by a writer whose merge failed half way (an earlier
        rtrace's), one cut short by a power loss holds nothing readers read."""
        w = self._writer(tmp_path, compact_files=100)
        for k in range(2):
            w.write(self._trajs(2, 2, start=2 * k))
        folder = tmp_path / "trajectories/train/step=2"
        inputs = sorted(os.listdir(folder))
        backup = {n: (folder / n).read_bytes() for n in inputs}
        w.close()
        [merged] = os.listdir(folder)
        for name, data in backup.items():
            (folder / name).write_bytes(data)  # the inputs are back beside a fresh merged file
        assert vacuum(tmp_path) == []
        old = os.stat(folder / merged).st_mtime - 2 * 3600
        whole = (folder / merged).read_bytes()
        (folder / merged).write_bytes(whole[: len(whole) // 2])  # cut short
        os.utime(folder / merged, (old, old))
        assert vacuum(tmp_path) == []
        assert open_run(tmp_path).sql("SELECT count(*) FROM trajectories").fetchall() == [(4,)]
        (folder / merged).write_bytes(whole)
        os.utime(folder / merged, (old, old))
        assert sorted(vacuum(tmp_path)) == [f"trajectories/train/step=2/{n}" for n in inputs]
        assert open_run(tmp_path).sql("SELECT count(*) FROM trajectories").fetchall() == [(4,)]

    def test_partitions_done_with_are_put_away_and_late_rows_still_land(self, tmp_path):
        """A merged, idle partition leaves the writer's table (its step waits to be merged into
        steps/); a late trajectory of that step makes it a partition again, with its file: the
        late file (a new number: no name twice) merges with it, and readers count every row once."""
        w = self._writer(tmp_path, compact_files=100, idle_s=0.0)
        for step in range(3):
            w.write(self._trajs(step, 2))
            w.write(self._trajs(step, 2, start=2))
        w.compact(idle_only=True)
        assert w._parts == {} and sorted(w._finished[False]) == [0, 1, 2]
        [before] = os.listdir(tmp_path / "trajectories/train/step=1")
        w.write(self._trajs(1, 1, start=10))  # late; idle_s=0: merged at once with the step's file
        assert sorted(w._finished[False]) == [0, 2]
        [after] = os.listdir(tmp_path / "trajectories/train/step=1")
        old, new = layout.parse_name(before), layout.parse_name(after)
        assert (new.first, new.last) == (old.first, 6) and new.last > old.last
        assert open_run(tmp_path).sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall() == [
            (13, 13)]

    def test_idle_partitions_merge_at_flush(self, tmp_path):
        """flush() merges the partitions idle for idle_s (the step the trainer moved on from)."""
        w = self._writer(tmp_path, compact_files=100, idle_s=0.0)
        w.write(self._trajs(1, 1))
        w.write(self._trajs(1, 1, start=1))  # the write merges partitions already idle
        w.compact(idle_only=True)
        assert len(os.listdir(tmp_path / "trajectories/train/step=1")) == 1


class TestStepsFiles:
    """Finished steps merged into files of steps/: a row group per step, no row lost or doubled,
    and never a file that covers a step still being written or another step's file."""

    def _w(self, path, **kw):
        return DatasetWriter(layout.open_store(str(path)), "r", compact_files=100, idle_s=0.0, **kw)

    def _count(self, path):
        return open_run(path).sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall()[0]

    def test_finished_steps_merge_into_one_file_a_row_group_per_step(self, tmp_path):
        import pyarrow.parquet as pq

        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=4)
        for step in range(10):
            w.write(comp._trajs(step, 3))
            w.write(comp._trajs(step, 2, start=3))
        w.compact(idle_only=True)
        files = _files(tmp_path)
        folders = Counter(os.path.dirname(f) for f in files)
        assert folders == {"trajectories/train/steps": 2, "spans/train/steps": 2, "trajectories/train/step=8": 1,
                           "spans/train/step=8": 1, "trajectories/train/step=9": 1, "spans/train/step=9": 1}
        many = sorted(os.path.basename(f) for f in files if f.startswith("trajectories/train/steps/"))
        assert [layout.parse_name(n).steps for n in many] == [(0, 3), (4, 7)]
        assert many == sorted(os.listdir(tmp_path / "spans/train/steps"))  # a twin in each table
        for name in many:
            for table in ("trajectories", "spans"):
                meta = pq.read_metadata(tmp_path / table / "train" / "steps" / name)
                col = [meta.schema.column(i).path for i in range(meta.num_columns)].index("step")
                ranges = [(meta.row_group(g).column(col).statistics.min, meta.row_group(g).column(col).statistics.max)
                          for g in range(meta.num_row_groups)]
                lo = layout.parse_name(name).steps[0]
                assert ranges == [(s, s) for s in range(lo, lo + 4)]  # a query on one step prunes the others
                assert pq.read_schema(tmp_path / table / "train" / "steps" / name).remove_metadata().equals(
                    schema.arrow_schema(table).remove_metadata())
        r = open_run(tmp_path)
        assert r.steps() == [(False, s) for s in range(10)]
        assert dict(r.sql("SELECT step, count(*) FROM trajectories GROUP BY step").fetchall()) == {
            s: 5 for s in range(10)}
        assert r.sql("SELECT count(*) FROM trajectories WHERE step = 5").fetchall() == [(5,)]
        assert r.sql("SELECT count(DISTINCT trace_id) FROM spans").fetchall() == [(50,)]
        assert self._count(tmp_path) == (50, 50)
        assert len(r.load("step = ?", [6])) == 5

    def test_a_step_being_written_is_never_spanned(self, tmp_path):
        """Steps 0-2 and 4-6 are finished, step 3 still has two files: no steps/ file spans it."""
        import time

        comp = TestCompaction()
        w = DatasetWriter(layout.open_store(str(tmp_path)), "r", compact_files=100, idle_s=1000, steps_per_file=3)
        for step in range(7):
            w.write(comp._trajs(step, 2))
        w.write(comp._trajs(3, 2, start=2))
        with w._lock:
            w._prune(time.monotonic() + 2000)  # all idle, step 3's two files not merged
        many = sorted(layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps"))
        assert many == [(0, 2), (4, 6)]
        assert len(os.listdir(tmp_path / "trajectories/train/step=3")) == 2
        assert self._count(tmp_path) == (16, 16)

    def test_another_steps_file_numbered_inside_the_range_is_not_covered(self, tmp_path):
        """One count numbers a writer's files over every step: step 5's first file (number 1) lies in
        the number range of the file of steps 0-1 (0-2), and is still read."""
        import time

        comp = TestCompaction()
        w = DatasetWriter(layout.open_store(str(tmp_path)), "r", compact_files=100, idle_s=1000, steps_per_file=2)
        w.write(comp._trajs(0, 2))
        w.write(comp._trajs(5, 2))
        w.write(comp._trajs(1, 2))
        w.write(comp._trajs(5, 2, start=2))
        with w._lock:
            w._prune(time.monotonic() + 2000)
        [name] = os.listdir(tmp_path / "trajectories/train/steps")
        merged = layout.parse_name(name)
        assert (merged.first, merged.last, merged.steps) == (0, 2, (0, 1))
        assert f"{w.writer_id}-000001.v{VERSION}.parquet" in os.listdir(tmp_path / "trajectories/train/step=5")
        assert self._count(tmp_path) == (8, 8)

    def test_late_rows_of_a_merged_step_land_beside_it(self, tmp_path):
        """A trajectory of a step already in steps/ gets a file of its own in step=N, read beside the
        steps/ file; once finished it merges into a later steps/ file, which covers neither."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=3)
        for step in range(3):
            w.write(comp._trajs(step, 2))
        w.compact(idle_only=True)
        w.write(comp._trajs(1, 1, start=10))  # late
        assert self._count(tmp_path) == (7, 7)
        for step in range(3, 5):
            w.write(comp._trajs(step, 2))
        w.compact(idle_only=True)
        many = sorted(layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps"))
        assert many == [(0, 2), (1, 4)]
        assert not os.listdir(tmp_path / "trajectories/train/step=1")
        assert self._count(tmp_path) == (11, 11)

    def test_a_steps_file_never_covers_another_steps_file(self, tmp_path):
        """Two steps/ files of one writer hold different rows whatever their names' ranges: a file
        named as if it held the other (numbers 0-3, steps 0-3 around 0-1, steps 0-1) is read beside
        it, and vacuum deletes neither."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=2)
        for step in range(4):
            w.write(comp._trajs(step, 2))
            w.compact(idle_only=True)
        names = sorted(os.listdir(tmp_path / "trajectories/train/steps"))
        assert [layout.parse_name(n).steps for n in names] == [(0, 1), (2, 3)]
        wide = f"{w.writer_id}-000000-000003.s0-3.v{VERSION}.parquet"
        for table in ("trajectories", "spans"):
            os.rename(tmp_path / table / "train/steps" / names[1], tmp_path / table / "train/steps" / wide)
        assert self._count(tmp_path) == (8, 8)
        assert open_run(tmp_path).sql("SELECT count(*) FROM spans").fetchall() == [(8,)]
        assert vacuum(tmp_path, grace_s=0) == []
        assert self._count(tmp_path) == (8, 8)

    def test_a_steps_file_name_never_holds_an_earlier_ones(self, tmp_path):
        """Step 0 is still being written (two files) while steps 1-3 merge into steps/ (numbers 1-3);
        step 0 and the later steps 4, 5 are not merged into one file numbered 0-6 of steps 0-5,
        whose name would hold the first's (an earlier reader dropped that file and vacuumed it)."""
        import time

        comp = TestCompaction()
        w = DatasetWriter(layout.open_store(str(tmp_path)), "r", compact_files=100, idle_s=1000, steps_per_file=3)
        w.write(comp._trajs(0, 2))
        for step in (1, 2, 3):
            w.write(comp._trajs(step, 2))
        w.write(comp._trajs(0, 2, start=2))
        with w._lock:
            w._prune(time.monotonic() + 2000)
        assert [layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps")] == [(1, 3)]
        for step in (4, 5):
            w.write(comp._trajs(step, 2))
        w.close()
        names = [layout.parse_name(n) for n in os.listdir(tmp_path / "trajectories/train/steps")]
        for a in names:
            for b in names:
                assert a == b or not (a.first <= b.first and b.last <= a.last and a.steps[0] <= b.steps[0]
                                      and b.steps[1] <= a.steps[1]), (a, b)
        assert self._count(tmp_path) == (14, 14)
        assert open_run(tmp_path).sql("SELECT count(*) FROM spans").fetchall() == [(14,)]
        assert vacuum(tmp_path, grace_s=0) == []
        assert self._count(tmp_path) == (14, 14)

    def test_a_steps_merge_failing_half_way_loses_nothing_to_a_vacuum(self, tmp_path):
        """A steps/ merge writes its first table's file, a vacuum deletes the step files it covers,
        the second table's file fails: the first stays, counted; every trajectory and span is read
        once, and no later steps/ file spans those steps."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=2)
        for step in range(2):
            w.write(comp._trajs(step, 2))
        deleted = _vacuum_during_a_failing_merge(w, tmp_path)
        before = rtrace.stats().get("sink.parquet.compaction_errors", 0)
        w.compact(idle_only=True)
        assert rtrace.stats()["sink.parquet.compaction_errors"] == before + 1
        assert len(deleted) == 2
        assert _counts(tmp_path) == (4, 4, 4, 4)
        assert vacuum(tmp_path, grace_s=0) == []
        for step in range(2, 4):
            w.write(comp._trajs(step, 2))
        w.write(comp._trajs(1, 1, start=5))  # a late row of a step merged half way: never spanned
        w.close()
        assert sorted(layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps")) == [
            (0, 1), (2, 3)]
        assert _counts(tmp_path) == (9, 9, 9, 9)
        vacuum(tmp_path, grace_s=0)
        assert _counts(tmp_path) == (9, 9, 9, 9)

    def test_inputs_left_after_a_crash_are_skipped_and_vacuumed(self, tmp_path):
        """Step files back beside the steps/ file that holds them (a writer stopped between rename and
        delete): counted once; vacuum deletes them."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=2)
        for step in range(2):
            w.write(comp._trajs(step, 3))
        backup = tmp_path / "backup"
        for table in ("trajectories", "spans"):
            for step in range(2):
                shutil.copytree(tmp_path / table / "train" / f"step={step}", backup / table / f"step={step}")
        w.compact(idle_only=True)
        assert os.listdir(tmp_path / "trajectories/train/steps")
        for table in ("trajectories", "spans"):
            for step in range(2):
                for name in os.listdir(backup / table / f"step={step}"):
                    shutil.copy(backup / table / f"step={step}" / name, tmp_path / table / "train" / f"step={step}")
        assert self._count(tmp_path) == (6, 6)
        assert open_run(tmp_path).sql("SELECT count(*) FROM spans").fetchall() == [(6,)]
        assert len(vacuum(tmp_path, grace_s=0)) == 4
        assert self._count(tmp_path) == (6, 6)

    def test_close_merges_whole_files_only(self, tmp_path):
        """At close, every steps_per_file finished steps make a file; the last few stay one file each."""
        comp = TestCompaction()
        w = DatasetWriter(layout.open_store(str(tmp_path)), "r", steps_per_file=4)  # idle_s 30: close finishes them
        for step in range(6):
            w.write(comp._trajs(step, 2))
        w.close()
        assert [layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps")] == [(0, 3)]
        assert sorted(os.listdir(tmp_path / "trajectories/train")) == ["step=4", "step=5", "steps"] or sorted(
            d for d in os.listdir(tmp_path / "trajectories/train") if os.listdir(tmp_path / "trajectories/train" / d)
        ) == ["step=4", "step=5", "steps"]
        assert self._count(tmp_path) == (12, 12)

    def test_a_failed_merge_leaves_its_steps_as_they_are(self, tmp_path):
        """A steps/ merge that fails (an input gone) is counted; its steps stay one file each, and no
        later steps/ file spans them."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=2, cache_bytes=0)
        for step in range(2):
            w.write(comp._trajs(step, 2))
        [gone] = os.listdir(tmp_path / "spans/train/step=1")
        os.unlink(tmp_path / "spans/train/step=1" / gone)
        before = rtrace.stats().get("sink.parquet.compaction_errors", 0)
        w.compact(idle_only=True)
        assert rtrace.stats()["sink.parquet.compaction_errors"] == before + 1
        assert not (tmp_path / "trajectories/train/steps").exists()
        for step in range(2, 4):
            w.write(comp._trajs(step, 2))
        w.write(comp._trajs(0, 1, start=5))  # step 0 again: kept, never merged
        w.compact(idle_only=True)
        assert [layout.parse_name(n).steps for n in os.listdir(tmp_path / "trajectories/train/steps")] == [(2, 3)]
        assert self._count(tmp_path) == (9, 9)

    def test_a_steps_name_in_a_step_folder_is_skipped(self, tmp_path, caplog):
        """A many-step file belongs in steps/: in a step=N folder a hive engine would give it that
        step, so readers leave it out (named in a warning)."""
        comp = TestCompaction()
        w = self._w(tmp_path, steps_per_file=2)
        for step in range(2):
            w.write(comp._trajs(step, 2))
        w.compact(idle_only=True)
        [name] = os.listdir(tmp_path / "trajectories/train/steps")
        os.makedirs(tmp_path / "trajectories/train/step=7")
        shutil.copy(tmp_path / "trajectories/train/steps" / name, tmp_path / "trajectories/train/step=7" / name)
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            r = open_run(tmp_path)
        assert [s.path for s in r.skipped] == [f"trajectories/train/step=7/{name}"]
        assert self._count(tmp_path) == (4, 4)


# ----------------------------------------------------------------------------- many writers
class TestManyWriters:
    def test_two_sinks_write_one_run_without_clashing(self, tmp_path):
        """Two sinks (as two processes or collectors would) write one run: disjoint writer ids, every
        trajectory once, each partition one file per writer after shutdown."""
        from rtrace.config import load_settings
        from rtrace.exporters.parquet import ParquetSink

        settings = load_settings({"parquet_path": str(tmp_path / "ds"), "experiment": "shared"})
        sinks = [ParquetSink(settings), ParquetSink(settings)]
        comp = TestCompaction()
        for k in range(6):
            sinks[k % 2].export(comp._trajs(k % 3, 4, start=10 * k))
        for s in sinks:
            s.shutdown()
        files = _files(tmp_path / "ds" / "shared")
        writers = Counter(layout.parse_name(os.path.basename(f)).writer for f in files)
        assert set(writers) == {s.writer.writer_id for s in sinks}
        assert Counter(os.path.dirname(f) for f in files) == {
            f"{t}/train/step={s}": 2 for t in ("trajectories", "spans") for s in range(3)}
        r = open_run(tmp_path / "ds" / "shared")
        assert r.sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall()[0] == (24, 24)


    def test_each_writer_merges_its_own_steps(self, tmp_path):
        """Two writers into one run, both writing every step: each merges its own finished steps into
        its own steps/ files; readers count every trajectory once."""
        comp = TestCompaction()
        writers = [DatasetWriter(layout.open_store(str(tmp_path)), "r", compact_files=100, idle_s=0.0,
                                 steps_per_file=3) for _ in range(2)]
        for step in range(7):
            for k, w in enumerate(writers):
                w.write(comp._trajs(step, 2, start=10 * k))
        for w in writers:
            w.compact(idle_only=True)
        many = [layout.parse_name(n) for n in os.listdir(tmp_path / "trajectories/train/steps")]
        assert sorted((m.writer, m.steps) for m in many) == sorted(
            (w.writer_id, steps) for w in writers for steps in ((0, 2), (3, 5)))
        assert sorted(os.listdir(tmp_path / "trajectories/train/step=6")) == sorted(
            f"{w.writer_id}-000006.v{VERSION}.parquet" for w in writers)
        assert open_run(tmp_path).sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall() == [
            (28, 28)]


# ----------------------------------------------------------------------------- reading
class TestReader:
    def test_open_run_is_a_relation(self, run):
        """open_run(path) answers like its trajectories relation: .df(), .pl(), .filter(), .aggregate()."""
        path, trajs, _ = run
        r = rtrace.open_run(path)
        assert len(r.df()) == len(trajs)
        pytest.importorskip("polars")
        assert r.pl().height == len(trajs)
        assert r.filter("step = 1 AND NOT validate").count("*").fetchall()[0][0] == PROMPTS * ROLLOUTS
        assert r.steps() == [(False, 0), (False, 1), (False, 2), (True, 0)]

    def test_parameters_are_bound_not_pasted(self, run):
        """sql(query, params) binds $name and ? values."""
        path, _, _ = run
        r = open_run(path)
        q = "SELECT count(*) FROM trajectories WHERE step = $step AND task LIKE $text"
        assert r.sql(q, {"step": 1, "text": "%needle%"}).fetchall()[0][0] == 1
        assert r.sql("SELECT count(*) FROM trajectories WHERE task = ?", ["x' OR '1'='1"]).fetchall()[0][0] == 0

    def test_refresh_sees_new_files_and_drops_replaced_ones(self, tmp_path):
        """A Run opened while a writer writes: refresh() adds its new files and forgets compacted inputs."""
        comp = TestCompaction()
        w = comp._writer(tmp_path, compact_files=100)
        w.write(comp._trajs(1, 3))
        r = open_run(tmp_path)
        assert r.count("*").fetchall()[0][0] == 3
        w.write(comp._trajs(2, 2))
        w.write(comp._trajs(1, 2, start=3))
        assert r.count("*").fetchall()[0][0] == 3
        assert r.refresh().count("*").fetchall()[0][0] == 7 and r.steps() == [(False, 1), (False, 2)]
        w.close()
        assert r.refresh().count("*").fetchall()[0][0] == 7 and len(r.files["trajectories"]) == 2

    def test_not_a_run(self, tmp_path, run):
        """A folder of runs is refused with the runs it holds."""
        with pytest.raises(rtrace.dataset.DatasetError, match="it holds runs: run-7"):
            open_run(tmp_path / "ds")

    def test_empty_run_queries_to_nothing(self, tmp_path):
        """A run folder without data files still answers (zero rows, the documented columns)."""
        os.makedirs(tmp_path / "trajectories")
        r = open_run(tmp_path)
        assert r.sql("SELECT count(*), avg(reward) FROM trajectories").fetchall()[0] == (0, None)
        assert r.cursor().sql("SELECT count(*) FROM spans").fetchall() == [(0,)]  # a cursor sees the empty tables
        assert r.spans.columns == [c for c, _, _ in schema.TABLES["spans"]]


class TestBadFiles:
    def test_cut_short_and_foreign_files_are_skipped_named_and_counted(self, run, caplog):
        """A truncated data file, a Parquet file under another name and a stray text file: each is
        skipped with a warning naming it and counted; the query over the run still answers."""
        path, trajs, _ = run
        folder = Path(path, "trajectories/train/step=1")
        good = next(folder.iterdir())
        data = good.read_bytes()
        cut = folder / f"{'ab' * 8}-000000.v{VERSION}.parquet"
        cut.write_bytes(data[: len(data) // 2])
        (folder / "notes.parquet").write_bytes(data)
        (Path(path, "trajectories/train") / "README.txt").write_text("hello")
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            r = open_run(path)
        assert r.sql("SELECT count(*) FROM trajectories").fetchall()[0][0] == len(trajs)
        assert sorted(s.path for s in r.skipped) == sorted([
            "trajectories/train/README.txt", "trajectories/train/step=1/notes.parquet",
            f"trajectories/train/step=1/{cut.name}"])
        assert rtrace.stats()["dataset.files_skipped"] == 3
        for name in ("README.txt", "notes.parquet", cut.name):
            assert any(name in rec.getMessage() for rec in caplog.records), name
        r.refresh()  # warned and counted once per file
        assert rtrace.stats()["dataset.files_skipped"] == 3

    def test_a_damaged_file_that_ends_like_parquet_is_skipped_named_and_counted(self, run, caplog, capsys):
        """A file of a step=N folder whose footer is damaged but which still ends with PAR1: its
        footer is read once and does not parse, so it is skipped, named and counted; open_run, its
        queries and `rtrace query` answer over the rest (before: DuckDB's error, naming no file)."""
        from rtrace.cli import main

        path, trajs, _ = run
        folder = Path(path, "trajectories/train/step=1")
        data = bytearray(next(folder.iterdir()).read_bytes())
        data[4:-8] = b"A" * (len(data) - 12)  # the pages and the footer, the length and the magic kept
        damaged = folder / f"{'ab' * 8}-000000.v1.1.parquet"
        damaged.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            r = open_run(path)
            assert r.sql("SELECT count(*) FROM trajectories").fetchall()[0][0] == len(trajs)
        assert [(s.path, s.reason.split(":")[0]) for s in r.skipped] == [
            (f"trajectories/train/step=1/{damaged.name}", "damaged")]
        assert rtrace.stats()["dataset.files_skipped"] == 1
        assert [rec.getMessage() for rec in caplog.records if damaged.name in rec.getMessage()]
        assert main(["query", path, "SELECT count(*) AS n FROM trajectories", "--format", "csv"]) == 0
        assert capsys.readouterr().out.splitlines() == ["n", str(len(trajs))]

    def test_query_says_an_error_met_while_it_fetches(self, run, capsys):
        """A file whose footer is whole but whose data is not fails the query only when DuckDB reads
        it: `rtrace query` says so and exits 2, no traceback (before: the exception escaped)."""
        from rtrace.cli import main

        path, _, _ = run
        folder = Path(path, "trajectories/train/step=1")
        data = bytearray(next(folder.iterdir()).read_bytes())
        footer = int.from_bytes(data[-8:-4], "little")
        data[4:len(data) - 8 - footer] = b"\xff" * (len(data) - 12 - footer)  # every page, the footer kept
        (folder / f"{'ab' * 8}-000000.v1.1.parquet").write_bytes(bytes(data))
        for fmt in ("table", "csv"):
            assert main(["query", path, "SELECT max(task) FROM trajectories", "--format", fmt]) == 2
            out = capsys.readouterr()
            assert out.err.startswith("rtrace query: ") and "Traceback" not in out.err and out.out == ""

    def test_files_being_written_are_not_read_nor_warned_about(self, run, caplog):
        """A hidden .tmp file (a file being written) is neither data nor a skipped file."""
        path, trajs, _ = run
        folder = Path(path, "trajectories/train/step=1")
        (folder / f".{next(folder.iterdir()).name}.abcd.tmp").write_bytes(b"PAR1 half")
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            r = open_run(path)
        assert r.skipped == [] and not caplog.records
        assert r.sql("SELECT count(*) FROM trajectories").fetchall()[0][0] == len(trajs)

    def test_a_newer_minor_version_with_a_new_column_is_read(self, run):
        """A 1.x file that adds a column (as per-token arrays will) is read beside 1.0 files: the new
        column is there, NULL for the older rows (rtrace reads with union_by_name)."""
        path, trajs, _ = run
        folder = Path(path, "trajectories/train/step=1")
        old = pq.read_table(next(folder.iterdir()))
        newer = old.append_column("token_logprobs", pa.array([[-0.5, -1.0]] * old.num_rows, pa.list_(pa.float32())))
        newer = newer.replace_schema_metadata({**old.schema.metadata, b"rtrace.schema": b"rtrace.dataset/1.9"})
        newer = newer.set_column(newer.schema.get_field_index("trace_id"), "trace_id",
                                 pa.array([f"{i:032x}" for i in range(newer.num_rows)]))
        pq.write_table(newer, folder / f"{'cd' * 8}-000000.v1.9.parquet")
        r = open_run(path)
        assert r.sql("SELECT count(*), count(token_logprobs) FROM trajectories").fetchall() == [
            (len(trajs) + old.num_rows, old.num_rows)]

    def test_an_older_minor_version_is_read(self, run):
        """A 1.0 file (written before 1.1 added health_checks and token_values) is read beside
        1.1 files: those columns are NULL for its rows."""
        path, trajs, _ = run
        folder = Path(path, "trajectories/train/step=1")
        current = pq.read_table(next(folder.iterdir()))
        old = current.drop_columns(["health_checks"]).replace_schema_metadata(
            {**current.schema.metadata, b"rtrace.schema": b"rtrace.dataset/1.0"})
        old = old.set_column(old.schema.get_field_index("trace_id"), "trace_id",
                             pa.array([f"{i + 1:032x}" for i in range(old.num_rows)]))
        pq.write_table(old, folder / f"{'ce' * 8}-000000.v1.0.parquet")
        r = open_run(path)
        assert r.sql("SELECT count(*), count(health_checks) FROM trajectories").fetchall() == [
            (len(trajs) + old.num_rows, len(trajs))]

    def test_cursor_for_another_thread(self, run):
        """run.cursor() queries the same views from another thread."""
        import threading

        path, trajs, _ = run
        r = open_run(path)
        got = []
        t = threading.Thread(target=lambda: got.append(r.cursor().sql("SELECT count(*) FROM trajectories").fetchall()))
        t.start()
        t.join(30)
        assert got == [[(len(trajs),)]]

    def test_a_newer_schema_version_is_refused(self, run):
        """A file named .v2.0. stops the reader with a message naming it and the versions."""
        path, _, _ = run
        folder = Path(path, "trajectories/train/step=1")
        good = next(folder.iterdir())
        newer = folder / good.name.replace(f".v{VERSION}.", ".v2.0.").replace(good.name[:4], "ffff")
        shutil.copy(good, newer)
        expected = rf"schema 2\.x; this rtrace reads schema {re.escape(VERSION)}.*upgrade"
        with pytest.raises(SchemaVersionError, match=expected):
            open_run(path)


# ----------------------------------------------------------------------------- a run being written
class TestLiveRun:
    """A writer's merge deletes its inputs right after the merged file is in place: readers that
    listed them before list again and read again (bounded), never an error, never a row twice."""

    def _two_files(self, tmp_path):
        comp = TestCompaction()
        w = comp._writer(tmp_path, compact_files=100)
        w.write(comp._trajs(1, 3))
        w.write(comp._trajs(1, 2, start=3))
        w.write(comp._trajs(2, 2))
        assert len(os.listdir(tmp_path / "trajectories/train/step=1")) == 2
        return w

    def test_queries_of_a_run_listed_before_a_merge(self, tmp_path):
        """A Run listed, then its files merged away: its relations, load() and run.df() list again
        and answer (before: IO Error: No files found that match the pattern ...)."""
        w = self._two_files(tmp_path)
        r = open_run(tmp_path)
        rel = r.sql("SELECT step, count(*) FROM trajectories GROUP BY step ORDER BY step")
        w.compact()  # another process merges: both inputs of step 1 are gone
        assert rel.fetchall() == [(1, 5), (2, 2)]
        assert rtrace.stats()["dataset.reads_retried"] == 1
        assert len(r.files["trajectories"]) == 2 and r.skipped == []
        w.write(TestCompaction()._trajs(2, 1, start=2))
        w.write(TestCompaction()._trajs(2, 1, start=3))
        r.refresh()
        w.compact()
        assert len(r.df()) == 9
        assert r.filter("step = 2").count("*").fetchall() == [(4,)]
        w.write(TestCompaction()._trajs(2, 1, start=4))
        r.refresh()
        w.compact()
        assert sorted(t.sample_index for t in r.load("step = ?", [2])) == [0, 1, 2, 3, 4]
        assert r.spans.aggregate("count(*)").fetchall() == [(10,)]

    def test_a_merge_while_the_run_is_listed(self, tmp_path, monkeypatch):
        """Inputs listed, then merged away before they are checked: the listing starts again and finds
        the merged file (before: skipped as deleted, their rows missing from the answer)."""
        w = self._two_files(tmp_path)
        original, merged = layout.Store.list, []

        def listing(store, rel=""):
            yield from original(store, rel)
            if rel == "trajectories" and not merged:  # a merge between the two tables' listings
                merged.append(True)
                w.compact()

        monkeypatch.setattr(layout.Store, "list", listing)
        r = open_run(tmp_path)
        assert merged and r.skipped == []
        assert r.sql("SELECT count(*), count(DISTINCT trace_id) FROM trajectories").fetchall() == [(7, 7)]
        assert r.sql("SELECT count(*) FROM spans").fetchall() == [(7,)]
        assert rtrace.stats().get("dataset.files_skipped", 0) == 0

    def test_rtrace_query_lists_again(self, tmp_path, monkeypatch, capsys):
        """`rtrace query` on a run whose files are merged away between its listing and its read."""
        from rtrace.cli import main
        from rtrace.dataset import reader

        w = self._two_files(tmp_path)
        original = reader.open_run

        def open_then_merge(path, connection=None):
            run = original(path, connection)
            w.compact()
            return run

        monkeypatch.setattr(reader, "open_run", open_then_merge)
        sql = "SELECT step, count(*) AS n FROM trajectories GROUP BY step ORDER BY step"
        assert main(["query", str(tmp_path), sql, "--format", "csv"]) == 0
        assert capsys.readouterr().out.splitlines() == ["step,n", "1,5", "2,2"]

    def test_serve_lists_again(self, tmp_path, monkeypatch):
        """rtrace serve's run: a merge between its listing and its reads (the step table at start,
        a page's query later) is read again over the new listing: no error page."""
        pytest.importorskip("starlette")
        from rtrace.dataset import reader
        from rtrace.serve.sources import RunSource

        w = self._two_files(tmp_path)
        original, merged = reader.Run.file_steps, []

        def file_steps(run, rel):  # the source's first look at the listing: a merge right then
            if not merged:
                merged.append(True)
                w.compact()
            return original(run, rel)

        monkeypatch.setattr(reader.Run, "file_steps", file_steps)
        source = RunSource("live", dataset=str(tmp_path), index=False)
        source.refresh()
        assert merged and source.snapshot.problem is None and source.snapshot.trajectories == 7
        w.write(TestCompaction()._trajs(3, 2))
        w.write(TestCompaction()._trajs(3, 1, start=2))
        source.refresh()
        w.compact()
        assert source.db(30_000).rows("SELECT count(*) FROM trajectories WHERE step = 3")[1] == [(3,)]


# ----------------------------------------------------------------------------- faults while writing
_FULL_DISK = r"""
import os, resource, signal, sys
sys.path.insert(0, {root!r})
import rtrace
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk with ENOSPC
rtrace.configure(exporter="parquet", parquet_path={path!r}, experiment="r", export_interval_s=0.02)
def step(n):
    for i in range(4):
        with rtrace.rollout_context(step=n, sample_index=i):
            rtrace.record_reward(1.0)
    return rtrace.flush(30)
ok1 = step(0)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))
ok2 = step(1)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
ok3 = step(2)
rtrace.shutdown()
print({{"ok": [ok1, ok2, ok3], "stats": {{k: v for k, v in rtrace.stats().items() if "parquet" in k}}}})
"""


def test_a_full_disk_loses_only_the_open_batch(tmp_path):
    """Writes that fail at the OS (RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk) lose that batch only:
    counted as the sink's failed trajectories and write errors, flush() says so, no partial or
    temporary file is left, and the steps before and after are whole."""
    out = subprocess.run([sys.executable, "-c", _FULL_DISK.format(root=str(ROOT), path=str(tmp_path / "ds"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's printed dict
    assert result["ok"] == [True, False, True]
    stats = result["stats"]
    assert stats["sink.parquet.failed_trajectories"] == 4 and stats["sink.parquet.exported"] == 8
    assert stats["sink.parquet.write_errors"] == 1
    run_path = tmp_path / "ds" / "r"
    assert not [f for f in _files(run_path) if os.path.basename(f).startswith(".")]
    r = open_run(run_path)
    assert r.sql("SELECT step, count(*) FROM trajectories GROUP BY step ORDER BY step").fetchall() == [(0, 4), (2, 4)]
    # the failed batch left no spans either (its spans file, written first, was removed or never whole)
    assert r.sql("SELECT DISTINCT step FROM spans ORDER BY step").fetchall() == [(0,), (2,)]
    assert r.skipped == []


def test_a_final_merge_past_the_timeout_is_said_as_such(tmp_path, caplog):
    """The sink's final merge does not finish within sink_timeout_s (a large run under load): every
    trajectory was written when it was exported, so shutdown says the data is complete and the merge
    was left, counts it as sink.parquet.merge_deferred, and counts no shutdown timeout and nothing
    abandoned (before: "did not finish in time; 0 ... abandoned", a shutdown timeout)."""
    import threading

    from rtrace.exporters.parquet import ParquetSink

    sink = ParquetSink(rtrace.config.load_settings({"parquet_path": str(tmp_path), "experiment": "r"}))
    rtrace.configure(sinks=[sink], export_interval_s=0.02, sink_timeout_s=0.5)
    for batch in range(2):  # two files of step 1: the final merge has work to do
        for i in range(3):
            with rtrace.rollout_context(step=1, sample_index=3 * batch + i):
                rtrace.record_reward(1.0)
        assert rtrace.flush(30)
    go, merging = threading.Event(), threading.Event()
    store, write = sink.writer.store, sink.writer.store.write

    def slow_merge(rel, fill):
        name = layout.parse_name(rel.rpartition("/")[2])
        if name is not None and name.first != name.last:
            merging.set()
            go.wait(60)
        return write(rel, fill)

    store.write = slow_merge
    worker = next(w for w in rtrace._setup._pipeline.fanout.workers if w.sink is sink)
    try:
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            rtrace.shutdown()
        assert merging.is_set()
    finally:
        go.set()
    worker.thread.join(30)  # the merge goes on once let go
    stats = rtrace.stats()
    assert stats["sink.parquet.merge_deferred"] == 1 and stats["sink.parquet.exported"] == 6
    assert "sink.parquet.shutdown_timeouts" not in stats and "sink.parquet.abandoned_trajectories" not in stats
    (said,) = [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()]
    assert "0 trajectories abandoned" in said and "the data is complete" in said and "final merge" in said
    assert open_run(tmp_path / "r").sql("SELECT count(*) FROM trajectories").fetchall() == [(6,)]


# ----------------------------------------------------------------------------- configuration
class TestConfig:
    @pytest.mark.parametrize("value, message", [
        ("ftp2://x/y", "unknown scheme 'ftp2'"),     # a scheme neither pyarrow nor fsspec knows
        ("s3://", "names no bucket"),                # no bucket
        ("", "empty value"),
    ])
    def test_bad_paths_fail_at_configure(self, value, message):
        """RTRACE_PARQUET_PATH names the variable and the accepted values."""
        with pytest.raises(ConfigError, match=f"RTRACE_PARQUET_PATH.*{message}.*accepted values: a local folder"):
            rtrace.config.load_settings({}, environ={"RTRACE_PARQUET_PATH": value})

    def test_a_file_is_not_a_folder(self, tmp_path):
        f = tmp_path / "file"
        f.write_text("x")
        with pytest.raises(ConfigError, match="is not a folder"):
            rtrace.config.load_settings({"parquet_path": str(f)})

    def test_urls_are_accepted_without_contacting_them(self):
        """An s3:// URL with options is taken as is at configure time (no network)."""
        s = rtrace.config.load_settings({"parquet_path": "s3://bucket/runs?endpoint_override=127.0.0.1:1"})
        assert s.parquet_path == "s3://bucket/runs?endpoint_override=127.0.0.1:1"


def test_jsonl_and_dataset_hold_the_same_trajectories(run):
    """The parquet sink beside the JSONL sink: the same trajectories (they see the same sample)."""
    path, _, jsonl = run
    assert sorted(t.trace_id for t in read_jsonl(jsonl)) == sorted(
        r[0] for r in open_run(path).sql("SELECT trace_id FROM trajectories").fetchall())


def test_the_dataset_is_not_imported_by_rtrace():
    """import rtrace imports neither pyarrow nor duckdb (the extra is optional)."""
    code = "import sys, rtrace; print('pyarrow' in sys.modules, 'duckdb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_encode_degrades_a_value_arrow_refuses():
    """A lone surrogate in an attribute set as it was: that trajectory is written degraded, its batch whole."""
    from rtrace.trajectory import SpanRecord, Trajectory

    def traj(i, text):
        return Trajectory(trace_id=f"{i:032x}", name="r", step=1, spans=[SpanRecord(
            span_id=f"{i:016x}", parent_id=None, name="r", kind="rollout", start_ns=0, end_ns=1,
            attributes={"note": text})])

    t, s, degraded, unwritable = encode.encode_safely([traj(1, "ok"), traj(2, "bad \ud800")], "r")
    assert (t.num_rows, s.num_rows, degraded, unwritable) == (2, 2, 1, 0)
    assert s.column("attributes_str").to_pylist()[1] == [("note", "bad \\ud800")]


class TestQueryCli:
    def test_query_prints_a_table_csv_and_jsonl(self, run, capsys):
        """`rtrace query PATH SQL` with $params, in the three formats; `rtrace report PATH` takes the dataset."""
        from rtrace.cli import main

        path, trajs, _ = run
        sql = "SELECT step, count(*) AS n FROM trajectories WHERE NOT validate AND step >= $s GROUP BY step ORDER BY step"
        assert main(["query", path, sql, "--param", "s=1", "--format", "csv"]) == 0
        assert capsys.readouterr().out.splitlines() == ["step,n", "1,16", "2,16"]
        assert main(["query", path, sql, "--param", "s=2", "--format", "jsonl"]) == 0
        assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"step": 2, "n": 16}]
        assert main(["query", path, sql, "--param", "s=0"]) == 0
        table = capsys.readouterr().out
        assert "step" in table and "16" in table
        assert main(["report", path]) == 0
        assert capsys.readouterr().out.startswith(f"{len(trajs)} trajectories from dataset {path}")

    def test_query_errors_exit_2_with_the_reason(self, run, tmp_path, capsys):
        from rtrace.cli import main

        path, _, _ = run
        assert main(["query", path, "SELECT nope FROM trajectories"]) == 2
        assert "nope" in capsys.readouterr().err
        assert main(["query", str(tmp_path / "nothing"), "SELECT 1"]) == 2
        assert "not an rtrace run dataset" in capsys.readouterr().err
