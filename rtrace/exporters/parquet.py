"""Parquet sink: the run as a dataset (``RTRACE_EXPORTER=parquet``, docs/dataset.md).

Every trajectory becomes a row of ``trajectories`` and its spans rows of ``spans``, in
``<RTRACE_PARQUET_PATH>/<run>/`` (the run is ``RTRACE_EXPERIMENT``), partitioned by
step; the layout, file names and compaction are in :mod:`rtrace.dataset.layout` and
:mod:`rtrace.dataset.writer`. Composable with the other sinks, in one process and in the
collector (several collectors and processes write one run's dataset without
coordinating: each draws its own writer id).

The rows are computed in :meth:`ParquetSink.prepare`, on the pipeline's worker thread
while the trajectories are in the CPU's caches (as the JSONL sink encodes its lines);
:meth:`ParquetSink.export` turns them into Arrow columns and writes one file per
partition of the batch. A batch is exported when its files are renamed into place (the
JSONL sink's durability: in the OS's cache, safe from the process's crash; see
:attr:`rtrace.dataset.layout.Store.fsync`): a failed write (a full disk, a revoked bucket) loses that batch only,
counted as the sink's failed trajectories and ``sink.parquet.write_errors``.
"""

from __future__ import annotations

import os
from typing import Sequence

from .. import _stats
from ..config import Settings
from ..events import RunEvent
from ..summary import RolloutSummary
from ..trajectory import Trajectory
from .base import PartialExport, Sink

__all__ = ["ParquetSink"]

#: Where :meth:`ParquetSink.prepare` keeps a trajectory's rows for export.
_ROWS = "_rtrace_parquet_rows"


class ParquetSink(Sink):
    """Writes trajectories and spans as Parquet into the run's dataset."""

    name = "parquet"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        import pyarrow  # noqa: F401  (ImportError: create_sink names the extra)
        import pyarrow.parquet  # noqa: F401

        from ..dataset import encode, layout

        self._encode = encode
        self.run = layout.run_name(settings.experiment)
        root = settings.parquet_path
        if not layout.is_url(root) or root.startswith("file://"):
            self.path = os.path.join(os.path.abspath(root[len("file://"):] if root.startswith("file://") else root),
                                     self.run)
        else:  # s3://bucket/prefix?options -> s3://bucket/prefix/<run>?options
            head, sep, query = root.partition("?")
            self.path = f"{head.rstrip('/')}/{self.run}{sep}{query}"
        self._writer = None

    @property
    def writer(self):
        """The run's :class:`~rtrace.dataset.writer.DatasetWriter`, made at the first write: a
        URL's filesystem is opened there, on the sink's thread (pyarrow's S3 may look up a
        bucket's region over the network), never in configure().

        Raises:
            ValueError: the URL opens no filesystem (the batch counts as failed).
        """
        if self._writer is None:
            from ..dataset.layout import open_store
            from ..dataset.writer import DatasetWriter

            s = self.settings
            selection = {"cap": s.max_traces_per_step, "val_cap": s.val_cap, "groups": s.sample_groups,
                         "seed": s.sample_seed, "prompts": s.sample_prompts, "keep_errors": s.keep_errors,
                         "keep_extremes": s.keep_extremes, "keep_zero_variance": s.keep_zero_variance_groups,
                         "keep_unhealthy": s.keep_unhealthy if s.health_checks else 0,
                         "keep_mismatch": s.keep_mismatch if "logprob_mismatch" in s.health_checks else 0,
                         "keep_by": s.keep_by, "summaries": s.summaries}
            self._writer = DatasetWriter(open_store(self.path), self.run, every_rollout=s.summaries,
                                         selection=selection)
        return self._writer

    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Each trajectory's rows, on the pipeline's thread (a trajectory that fails is left
        to :meth:`export`, which encodes it again and counts it)."""
        rows_of, run, every = self._encode.rows_of, self.run, self.settings.summaries
        for traj in trajectories:
            try:
                traj.__dict__[_ROWS] = rows_of(traj, run, every)
            except Exception:
                pass

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Write the batch: one file per (table, partition), each whole.

        Raises:
            PartialExport: some partitions of the batch were not written.
            OSError: nothing was written.
        """
        rows = []
        for traj in trajectories:
            own = getattr(traj, "__dict__", None)
            rows.append(own.pop(_ROWS, None) if own is not None else None)  # other sinks may keep it longer
        result = self.writer.write(trajectories, rows)
        if result.degraded:
            _stats.incr("sink.parquet.degraded_trajectories", result.degraded)
        if result.unwritable:
            _stats.incr("sink.parquet.unwritable_trajectories", result.unwritable)
        if result.failed:
            if result.written:
                raise PartialExport(result.failed, f"{result.failed} of {len(trajectories)} trajectories were not "
                                                   f"written to {self.path}")
            raise OSError(f"rtrace parquet sink: {result.failed} trajectories were not written to {self.path} "
                          "(see sink.parquet.write_errors)")

    def export_summaries(self, summaries: Sequence[RolloutSummary]) -> None:
        """Write the rows of rollouts counted by their summaries only (``recorded`` false),
        beside the trajectories' (docs/dataset.md): the table then holds every rollout.

        Raises:
            OSError: some were not written (counted: ``sink.parquet.failed_summaries``).
        """
        rows_of, run = self._encode.rows_of, self.run
        result = self.writer.write(summaries, [rows_of(s, run) for s in summaries])
        if result.failed:
            raise OSError(f"rtrace parquet sink: {result.failed} of {len(summaries)} rollout summaries were not "
                          f"written to {self.path} (see sink.parquet.write_errors)")

    def export_events(self, events: Sequence[RunEvent]) -> None:
        """Write the run's events (weight updates) into the dataset's ``events`` table: a small
        file of ``<run>/events/`` per batch (docs/dataset.md, docs/timeline.md).

        Raises:
            Exception: the file was not written (counted: ``sink.parquet.failed_events``).
        """
        self.writer.write_events(events)

    def flush(self, timeout_s: float) -> None:
        """Everything exported is durable already; merge the partitions that went idle."""
        if self._writer is not None:
            self._writer.compact(idle_only=True)

    def shutdown(self) -> None:
        """Merge each partition's files into one (a step is one file per writer)."""
        if self._writer is not None:
            self._writer.close()

    def unfinished_shutdown(self) -> str:
        """The final merge ran out of ``sink_timeout_s`` (a large run, a loaded disk): every
        batch was whole on disk when export returned, so the data is complete; the merge goes
        on in the background and stops with the process (``sink.parquet.merge_deferred``)."""
        _stats.incr("sink.parquet.merge_deferred")
        return (f"every batch it exported is whole in {self.path}, so the data is complete; its final merge was left "
                "for later (it goes on in the background until the process exits): the run keeps more files than "
                "merged, which readers read as they are (rtrace.dataset.vacuum removes what a merge cut short leaves)")
