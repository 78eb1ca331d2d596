"""``rtrace publish``: one trackio run and one MLflow run from a run's dataset, however many
collectors wrote it.

With N collectors (``RTRACE_COLLECTOR_ENDPOINT`` a list, docs/collector.md section 7) each
collector owns some GRPO groups and writes what it keeps, and a summary of every rollout,
into one Parquet dataset (``RTRACE_EXPORTER=parquet``). The dataset is where the job meets:
:func:`rtrace.open_run` cuts the collectors' per-step samples to the one-collector sample and
counts every rollout. This publisher reads it and writes the slow sinks, once per job:

* a step is published when it is done: the dataset holds a later step of the same stream
  (training or validation) and none of the step's files changed for ``linger_s``; or at
  once with ``final`` (the job ended: ``rtrace publish --once``);
* its kept trajectories (``recorded``) go to every sink, and its step metrics, computed over
  every rollout's row by the pipeline's own :class:`~rtrace.pipeline.metrics.StepStats`
  (rows in trace-id order: the same figures whatever the number of collectors);
* a step is published once; rows that land for it afterwards are counted
  (``publish.late_rows``), not published twice.

Why a reader of the dataset rather than the collectors writing trackio and MLflow: one
backend run needs one writer (trackio's run and MLflow's run are per process), the slow
sinks leave the collectors' path (a collector only writes Parquet, which it does at ~2,300
trajectories/s), and what is published is exactly what every other reader of the dataset
sees (``rtrace query``, ``report``, ``serve``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import _stats
from .config import ConfigError, Settings
from .exporters import create_sink
from .pipeline.metrics import StepStats, step_metrics, table_row

__all__ = ["Publisher"]

_log = logging.getLogger("rtrace")

#: the rows the step metrics read (every rollout's)
_SUMMARY_COLUMNS = ("trace_id, name, step, sample_index, rollout_n, validate, experiment, group_id, policy_version, "
                    "extra_bool, extra_int, extra_double, extra_str, extra_json, reward, outcome_bool, outcome_int, "
                    "outcome_double, outcome_str, outcome_json, annotations_bool, annotations_int, annotations_double, "
                    "annotations_str, annotations_json, status, error, partial, num_turns, num_tool_calls, "
                    "input_tokens, output_tokens, finish_reasons, finish_reason, start_time, end_time, generation_ms, "
                    "tool_ms, health, recorded, kept, priority, dropped_spans")
#: the fleet's columns (schema 1.2, issue 41), read where the run's files have them
_FLEET_COLUMNS = ("worker", "policy_version_end", "crossed_update", "wait_ms", "server_ms")


class Publisher:
    """Publishes a run's dataset to trackio / MLflow (see the module docstring).

    Args:
        path: the run's dataset (``<RTRACE_PARQUET_PATH>/<run>``).
        settings: the sinks (``exporter``: trackio, mlflow, jsonl, otlp, console; not
            parquet or collector), their project / experiment, the health checks whose
            rates the step metrics give, ``step_table_rows``.
        linger_s: how long a step's files must stay unchanged once a later step exists.
    """

    def __init__(self, path: str, settings: Settings, linger_s: float = 30.0) -> None:
        names = [n for n in settings.exporter if n not in ("none", "parquet", "collector")]
        if not names and not settings.sinks:
            raise ConfigError("rtrace publish --exporter: name at least one sink to publish to; accepted values: "
                              "comma list of console, jsonl, trackio, mlflow, otlp")
        self.path = path
        self.settings = settings
        self.linger_s = linger_s
        self.sinks = [create_sink(name, settings) for name in names] + list(settings.sinks)
        for sink in self.sinks:  # one MLflow run for the job
            ensure_run = getattr(sink, "ensure_run", None)
            if callable(ensure_run):
                ensure_run(settings.experiment, {"rtrace.published_from": str(path)})
        self._run: Any = None
        #: (validate, step) published -> rows it had then
        self.published: dict[tuple[bool, int], int] = {}
        #: (validate, step) -> (its files then, when they were first seen so)
        self._seen: dict[tuple[bool, int], tuple[frozenset, float]] = {}

    @property
    def run(self) -> Any:
        if self._run is None:
            from .dataset.reader import open_run

            self._run = open_run(self.path)
        return self._run

    def poll(self, final: bool = False) -> int:
        """Publish every step that is done (all of them with ``final``); returns how many."""
        run = self.run.refresh()
        steps = [s for s in run.steps() if s[1] is not None]
        newest: dict[bool, int] = {}
        for validate, step in steps:
            newest[validate] = max(step, newest.get(validate, -1))
        files: dict[tuple[bool, int], set] = {}
        for rel in run.files["trajectories"]:
            for key in run.file_steps(rel):
                files.setdefault(key, set()).add(rel)
        now = time.monotonic()
        done = 0
        for key in steps:
            if key in self.published:
                self._late(key)
                continue
            signature = frozenset(files.get(key, ()))
            seen = self._seen.get(key)
            if seen is None or seen[0] != signature:
                self._seen[key] = seen = (signature, now)
            if not final and (key[1] >= newest[key[0]] or now - seen[1] < self.linger_s):
                continue
            self._publish(*key)
            self._seen.pop(key, None)
            done += 1
        return done

    def _late(self, key: tuple[bool, int]) -> None:
        rows = self._count(*key)
        if rows > self.published[key]:
            _stats.incr("publish.late_rows", rows - self.published[key])
            _stats.warn_once("publish-late", "rtrace publish: rows landed for a step already published; they are "
                             "counted in publish.late_rows (raise --linger)")
            self.published[key] = rows

    def _count(self, validate: bool, step: int) -> int:
        # fetchall: DuckDB's relations (what Run.sql returns) have no fetchone()
        return self.run.sql("SELECT count(*) FROM trajectories WHERE validate = ? AND step = ?",
                            [validate, step]).fetchall()[0][0]

    def _publish(self, validate: bool, step: int) -> None:
        from .dataset.encode import summary_of_row
        from .dataset.reader import _arrow, _ints_for_times

        run = self.run
        kept = sorted(run.load("validate = ? AND step = ?", [validate, step]), key=lambda t: t.trace_id)
        have = set(run.sql("SELECT * FROM trajectories LIMIT 0").columns)
        columns = ", ".join([_SUMMARY_COLUMNS, *(c for c in _FLEET_COLUMNS if c in have)])
        table = _ints_for_times(_arrow(run.sql(f"SELECT {columns} FROM trajectories WHERE validate = ? "
                                               "AND step = ? ORDER BY trace_id", [validate, step])))
        stats = StepStats()
        for row in table.to_pylist():
            stats.add(summary_of_row(row))
        s = self.settings
        rows = [table_row(t) for t in kept[: s.step_table_rows]]
        whole = s.sample_groups or (s.max_traces_per_step is None and s.val_cap is None)
        metrics = step_metrics(validate, step, stats, rows, max(0, len(kept) - s.step_table_rows), s.health_checks,
                               whole)
        for sink in self.sinks:
            name = getattr(sink, "name", type(sink).__name__)
            size = max(1, s.max_export_batch_size)
            for i in range(0, len(kept), size):
                try:
                    sink.export(kept[i:i + size])
                    _stats.incr(f"publish.{name}.trajectories", len(kept[i:i + size]))
                except Exception:
                    _stats.incr(f"publish.{name}.failed_trajectories", len(kept[i:i + size]))
                    _log.exception("rtrace publish: sink %r failed on step %s", name, step)
            try:
                sink.export_step_metrics([metrics])
                _stats.incr(f"publish.{name}.steps")
            except Exception:
                _stats.incr(f"publish.{name}.failed_steps")
                _log.exception("rtrace publish: sink %r failed on the metrics of step %s", name, step)
        self.published[(validate, step)] = stats.n
        _stats.incr("publish.steps")
        _stats.incr("publish.rollouts", stats.n)

    def flush(self, timeout_s: float = 30.0) -> bool:
        ok = True
        for sink in self.sinks:
            try:
                ok = sink.flush(timeout_s) is not False and ok
            except Exception:
                _log.exception("rtrace publish: flushing %r", sink)
                ok = False
        return ok

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.shutdown()
            except Exception:
                _log.exception("rtrace publish: closing %r", sink)
        if self._run is not None:
            self._run.close()

    def follow(self, interval_s: float = 5.0, stop: Any = None) -> None:
        """Publish steps as they are done until ``stop()`` says so (default: never), then
        the rest (``final``)."""
        while not (stop() if stop is not None else False):
            try:
                self.poll()
            except Exception:
                _stats.incr("publish.errors")
                _log.exception("rtrace publish: a poll failed; trying again")
            time.sleep(interval_s)
        self.poll(final=True)
