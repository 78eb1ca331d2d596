"""The sink contract: what a backend implements to receive finished trajectories.

A sink depends on the Trajectory model only. rtrace calls it from the sink's own
thread (one per sink), with batches of up to ``max_export_batch_size`` trajectories,
never from the traced program's thread, and with OTel instrumentation suppressed so a
backend's own HTTP calls are not traced into the trajectories. Whatever ``export``
raises is counted (``sink.<name>.failed_batches``) and logged once; the next batch is
tried as usual.
"""

from __future__ import annotations

from typing import Sequence

from ..config import Settings
from ..events import RunEvent
from ..summary import RolloutSummary
from ..trajectory import StepMetrics, Trajectory

__all__ = ["Sink", "PartialExport"]


class PartialExport(Exception):
    """Raised by :meth:`Sink.export` when only part of a batch is durable: ``failed`` of its
    trajectories were not written (the rest were). rtrace counts them as
    ``sink.<name>.failed_trajectories`` and the others as exported, and the next
    ``flush()`` returns False."""

    def __init__(self, failed: int, message: str = "") -> None:
        super().__init__(message or f"{failed} trajectories were not written")
        self.failed = failed


class Sink:
    """Base class of rtrace sinks.

    Subclasses set ``name`` and implement :meth:`export`; :meth:`flush` and
    :meth:`shutdown` are optional. The constructor runs inside ``rtrace.configure()``:
    check settings and optional dependencies there (raise ``ConfigError`` for a bad
    setting) but do no slow I/O; open connections on the first export.
    """

    name = "sink"
    #: What a full queue does (the sink cannot keep up): True, the sink samples fewer
    #: trajectories of every step (the step with the most queued loses one, then the
    #: next, keeping failures and tail-kept ones longest; ``pipeline/fanout.py``); False,
    #: the incoming batch is dropped whole (the collector sink: its units are segments,
    #: which the collector assembles, not trajectories to sample). Either way every
    #: trajectory lost is counted as ``sink.<name>.dropped_trajectories``.
    sample_when_behind = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Write a batch of finished trajectories.

        Args:
            trajectories: one or more trajectories, in the order they finished.

        Returns when the batch is durable: rtrace counts it as exported then.

        Raises:
            PartialExport: some of the batch was written, ``failed`` trajectories were not.
            Exception: anything else; rtrace counts the batch as failed and goes on.
        """
        raise NotImplementedError

    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Optional: CPU work on trajectories about to be queued for this sink (encoding
        them; never I/O, never a lock another thread holds), called from the pipeline's
        worker thread as soon as it has built them, while they are in the CPU's caches.
        :meth:`export` gets the same objects later on the sink's thread, after other work
        has evicted them: JSONL lines took 2-4x as long to encode there
        (docs/architecture.md). It must not change the trajectories' data (other sinks
        read them); it may attach its result for :meth:`export` to find, and export must
        still do the work for a trajectory without it (a sink whose queue is full is not
        prepared for: it thins what it gets). Whatever it raises is counted
        (``sink.<name>.prepare_errors``) and logged once.

        Args:
            trajectories: the batch, before it is queued.
        """

    def export_step_metrics(self, metrics: Sequence[StepMetrics]) -> None:
        """Optional: write the metrics of finished RL steps (docs/metrics.md), computed by
        the pipeline over the whole job. Called from the sink's thread, in step order.

        Args:
            metrics: one entry per finished (validate, step).
        """

    def export_summaries(self, summaries: Sequence[RolloutSummary]) -> None:
        """Optional: write the summaries of finished rollouts this sink gets no trajectory
        of (sampled out, or recorded as summaries only; docs/metrics.md), so that it holds
        every rollout (the dataset's trajectories table). Called from the sink's thread;
        what it raises is counted (``sink.<name>.failed_summaries``).

        Args:
            summaries: one :class:`~rtrace.summary.RolloutSummary` per rollout.
        """

    def export_events(self, events: Sequence[RunEvent]) -> None:
        """Optional: write the run's events (the trainer's weight updates,
        ``rtrace.mark_weight_update``; docs/timeline.md): the dataset's ``events`` table, JSONL
        lines of their own schema. Called from the sink's thread, in the order they came;
        what it raises is counted (``sink.<name>.failed_events``).

        Args:
            events: one :class:`~rtrace.events.RunEvent` each (``kind``, ``time_ns``,
                ``version``, ``step``, ``worker``, ``attributes``, ``event_id``).
        """

    def flush(self, timeout_s: float) -> None:
        """Make everything exported so far durable (e.g. wait for a writer thread).

        Args:
            timeout_s: the longest this call may take.
        """

    def shutdown(self) -> None:
        """Flush and release resources; no export follows."""

    def unfinished_shutdown(self) -> str | None:
        """Optional: :meth:`shutdown` did not return within ``sink_timeout_s``, though every
        trajectory handed to the sink was exported (nothing was queued or inside
        :meth:`export`). A sink whose exported data is complete all the same says what its
        shutdown left undone (the parquet sink: its final merge), counting it itself; the
        default, None, counts a shutdown timeout (``sink.<name>.shutdown_timeouts``).
        Called from the stopping thread while the sink's own thread is still in shutdown:
        read nothing it changes.

        Returns:
            A sentence for the log, or None.
        """
        return None
